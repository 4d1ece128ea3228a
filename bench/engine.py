"""Collection throughput of Kiln on the vllm engine versus the hf engine, measured in one run.

Both engines collect the same workload with Kiln's own ``GroupCollector`` (the code path of the
gpu worker's ``collect_group``): ``--groups`` seed groups of ``--group-size`` candidates, all groups
at once (a vllm worker runs many collection activities together; on hf their rows join the
engine's one decode loop, a tile of ``KILN_HF_DECODE_TILE`` rows per forward), on a real counter
server (``openenv``) with one session per candidate, a random model of ``--shape`` (default
qwen3-0.6b) with ``--layers`` layers and the real vocabulary, thinking off, ``--max-steps`` turns of up to
``--tokens`` tokens. Prints episodes/s and generated tokens/s of each engine and the vllm/hf
ratios. The vllm engine is started before timing (its start is reported separately), and each
engine first collects the whole workload once, untimed, on seeds of its own (vLLM's CPU build
builds its kernels per batch size on first use).

Then vLLM's own limit on the same token workload: every request the vllm collection sent (its
prompt ids, its seed, the number of tokens it produced) is replayed through one timed
``LLM.generate`` call of vLLM itself, after an untimed one at other seeds (``bench/vllm_raw.py``, in
the engine's venv, after Kiln's engine is stopped):
no environment, no HTTP, every prompt known up front. Three times: with LoRA enabled, Kiln's
grouped LoRA products and CPU reader wait (``vllm_cpu_wait``), as Kiln's server runs vLLM (it serves
adapters), which isolates Kiln's own overhead; with LoRA enabled and vLLM's own CPU LoRA products;
and without LoRA, vLLM's plain limit.
The ratios Kiln-vllm / raw say how close Kiln's collection comes to each.

``--repeats N`` (default 3) collects N times with each engine, alternating (hf, vllm, hf, vllm, ...), each
repeat on seeds of its own (so vLLM's prefix cache holds nothing of an earlier repeat's prompts),
and prints every repeat's figures and vllm/hf ratio and their median: a shared machine's speed
changes from minute to minute, and alternating exposes both engines to it alike. The raw replays
use the first repeat's requests; Kiln-vllm / raw uses the median of Kiln-vllm's tokens/s.

``--dtype`` sets ``KILN_DTYPE`` of both engines and the raw replay alike (default ``auto``: float32
on CPU), so the ratios compare engines at one precision.

``--shape qwen3.5-4b`` builds Qwen3.5-4B's text sizes in the hub's layout (a composite
vision-language checkpoint, ``--layers`` a multiple of 4: 3 Gated DeltaNet layers and 1
full-attention layer each). An engine that cannot collect on the model (the vllm engine's start
refused, or one row through the hf engine failing) is reported with its reason, and only the
ratios that were measured are printed.

Run: ``python -m bench.engine [--groups 8] [--group-size 8] [--max-steps 2] [--tokens 64] [--model DIR]
[--shape qwen3-0.6b|qwen3.5-4b] [--layers N] [--dtype auto] [--repeats 3]`` (needs
``scripts/setup.sh --engine vllm``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def collect_all(runtime, base_url: str, inspection: dict, args, *, first_seed: int) -> tuple[float, int, int]:
    """(seconds, episodes, generated tokens) of collecting every group at once (group ``g`` at seed
    ``first_seed + g``)."""
    from kiln.core.contracts import EpisodeSettings
    from kiln.core.rollout.group import GroupCollector, GroupTask

    settings = EpisodeSettings(group_size=args.group_size, max_steps=args.max_steps, concurrency=args.group_size,
                               thinking=False, max_action_tokens=args.tokens)
    identity = runtime.identity(None)

    async def one(g: int) -> dict:
        task = GroupTask(group_index=g, environment_index=0, seed=first_seed + g, reset_payload={"seed": first_seed + g},
                         inspection=inspection, settings=settings, behavior_policy=identity)
        return await GroupCollector(task, runtime).run()

    started = time.perf_counter()
    documents = await asyncio.gather(*(one(g) for g in range(args.groups)))
    elapsed = time.perf_counter() - started
    episodes = sum(len(d["records"]) for d in documents)
    tokens = sum(r["model_tokens"] for d in documents for r in d["records"])
    return elapsed, episodes, tokens


def recording_engine(config):
    """A :class:`VllmEngine` that records each request it sends: prompt ids, seed, tokens produced."""
    from kiln.core.policy.engine_vllm import VllmEngine

    class Recording(VllmEngine):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            self.workload: list[dict] = []
            self.recording = False

        def _call(self, req, prompt, max_tokens, seed, stop_ids, grammar, tag):
            out = super()._call(req, prompt, max_tokens, seed, stop_ids, grammar, tag)
            if self.recording and out["ids"]:
                self.workload.append({"prompt_ids": [int(t) for t in prompt], "max_tokens": len(out["ids"]),
                                      "seed": int(seed) % (1 << 63)})
            return out

    return Recording(config)


RAW_MODES = {
    "grouped": "LoRA enabled, Kiln's grouped LoRA products and CPU reader wait: the server's settings",
    "stock": "LoRA enabled, vLLM's own CPU LoRA products",
    "off": "LoRA off",
}


def raw_vllm(model: Path, workload: list[dict], work: Path, max_num_seqs: int, *, lora: str, dtype: str) -> dict:
    """vLLM's own generate on ``workload`` (``bench/vllm_raw.py`` in the engine's venv), LoRA as
    ``lora`` (a key of ``RAW_MODES``)."""
    import json
    import subprocess

    from kiln.core.policy.engine_vllm import default_python

    path = work / "workload.json"
    path.write_text(json.dumps(workload), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    done = subprocess.run(
        [str(default_python()), str(Path(__file__).with_name("vllm_raw.py")), "--model", str(model),
         "--workload", str(path), "--max-num-seqs", str(max_num_seqs), "--lora", lora, "--dtype", dtype],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"vllm_raw.py failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


SHAPES = ("qwen3-0.6b", "qwen3.5-4b")


def build_model(shape: str, layers: int | None, folder: Path) -> Path:
    """A random model of ``shape`` with ``layers`` layers and the real vocabulary: qwen3.5 shapes in
    the hub's layout (a composite vision-language checkpoint), their 3 linear-attention + 1
    full-attention pattern repeated ``layers / 4`` times."""
    if shape.startswith("qwen3.5"):
        from tests.support.model_builders import build_qwen35_hub_model

        layers = layers or 4
        if layers % 4:
            raise SystemExit("--layers of a qwen3.5 shape must be a multiple of 4 (3 linear + 1 full attention)")
        return build_qwen35_hub_model(folder, shape=shape, groups=layers // 4, dtype="bfloat16")
    from kiln.core.policy.random_model import build_random_model

    return build_random_model(folder, shape=shape, layers=layers or 2, dtype="bfloat16")


def unavailable(runtime, engine=None) -> str | None:
    """Why an engine cannot collect on this model (None: it can): the vllm engine's start (``engine``:
    a refusal such as ``model_unsupported``), or two rows of three tokens (prefill and decode) through
    ``runtime``'s hf engine."""
    try:
        if engine is not None:
            started = time.perf_counter()
            engine.start()
            print(f"vllm engine started in {time.perf_counter() - started:.1f}s (pid {engine.pid})", flush=True)
        else:
            runtime.sample([[runtime.stop_id]] * 2, [0, 1], max_new_tokens=3, temperature=1.0, thinking=False)
    except Exception as exc:  # noqa: BLE001 - reported as the engine's figure
        return " ".join(f"{getattr(exc, 'code', type(exc).__name__)}: {getattr(exc, 'message', exc)}".split())[:400]
    return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=SHAPES, help="the random model's shape")
    parser.add_argument("--layers", type=int, default=None, help="default 2 (qwen3), 4 (qwen3.5: 3 linear + 1 full)")
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: build a random one)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="KILN_DTYPE of both engines and the raw replay (auto: float32 on CPU)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="collections per engine, alternating hf and vllm, each on its own seeds")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        os.environ.pop(var, None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from kiln.core.openenv.discovery import inspect_environment
    from kiln.core.policy.engine_vllm import VllmConfig, default_python
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.support.servers import example_env_argv, serve_app_process

    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    tmp = tempfile.TemporaryDirectory(prefix="kiln-bench-engine-")
    model = args.model or build_model(args.shape, args.layers, Path(tmp.name) / "model")
    hf = PolicyRuntime.load(model, dtype=args.dtype)
    engine = recording_engine(VllmConfig(model_path=model, python=default_python(), dtype=hf.dtype,
                                         log_path=Path(tmp.name) / "vllm.log",
                                         max_model_len=4096, cpu_kvcache_gb=2,
                                         max_num_seqs=args.groups * args.group_size))
    results: dict[str, list[tuple[float, int, int]]] = {"hf": [], "vllm": []}
    sessions = args.groups * args.group_size
    missing = {"hf": unavailable(hf), "vllm": unavailable(None, engine)}
    sides = [("hf", hf)] if missing["hf"] is None else []
    if missing["vllm"] is None:  # a second copy of the model only where the engine serves it
        vllm = PolicyRuntime.load(model, dtype=args.dtype)
        vllm.use_engine(engine)
        sides.append(("vllm", vllm))
    raws: dict[str, dict] = {}
    try:
        with serve_app_process(lambda port: example_env_argv("counter", port, max_concurrent_envs=sessions),
                               startup_timeout_s=300.0) as base_url:
            inspection = asyncio.run(inspect_environment(base_url))
            # an untimed collection of the full workload per engine: vLLM's CPU kernels are built
            # per batch size on first use, and a collection meets every size from 1 to all rows
            for name, runtime in sides:
                asyncio.run(collect_all(runtime, base_url, inspection, args, first_seed=1))
                print(f"warm-up: {name} done", flush=True)
            for repeat in range(args.repeats):
                for name, runtime in sides:
                    engine.recording = name == "vllm" and repeat == 0
                    results[name].append(asyncio.run(collect_all(
                        runtime, base_url, inspection, args, first_seed=1000 + 1000 * repeat)))
                    engine.recording = False
                    elapsed, _, tokens = results[name][-1]
                    print(f"repeat {repeat + 1}: {name} done, {tokens / elapsed:.1f} tok/s", flush=True)
        engine.close()  # the raw engine gets the machine to itself
        if missing["vllm"] is None:
            raws = {lora: raw_vllm(model, engine.workload, Path(tmp.name), max_num_seqs=sessions, lora=lora,
                                   dtype=hf.dtype)
                    for lora in RAW_MODES}
            print("raw vllm done", flush=True)
    finally:
        engine.close()
        tmp.cleanup()
    report(args, hf, results, raws, missing)
    return 0


def report(args: argparse.Namespace, hf, results: dict, raws: dict, missing: dict) -> None:
    """Print each engine's figures, the raw replays and the ratios that could be measured."""
    print(f"{args.groups} groups x {args.group_size}, {args.max_steps} turns of <= {args.tokens} tokens, "
          f"{args.model or args.shape}, {args.layers or 'default'} layers, {hf.dtype} on {hf.device}")
    for name, why in missing.items():
        if why:
            print(f"{name}: unavailable on this model: {why}")
    print(f"{'engine':>11} {'seconds':>6} {'episodes/s':>11} {'tokens/s':>9}")
    for name in ("hf", "vllm"):
        for repeat, (elapsed, episodes, tokens) in enumerate(results[name]):
            label = name if args.repeats == 1 else f"{name} #{repeat + 1}"
            print(f"{label:>11} {elapsed:>6.1f} {episodes / elapsed:>11.2f} {tokens / elapsed:>9.1f}")
    rate = {lora: raw["tokens"] / raw["seconds"] for lora, raw in raws.items()}
    for lora, raw in raws.items():
        print(f"{'raw-' + lora:>11} {raw['seconds']:>6.1f} {'-':>11} {rate[lora]:>9.1f}   (vLLM's generate, "
              f"{RAW_MODES[lora]}: the vllm rows' {raw['requests']} requests, same prompts, lengths and seeds, "
              "no environment)")
    median = "" if args.repeats == 1 else f" (median of {args.repeats})"
    if results["hf"] and results["vllm"]:
        ratios = [((vn / ve) / (hn / he), (vt / ve) / (ht / he))
                  for (he, hn, ht), (ve, vn, vt) in zip(results["hf"], results["vllm"])]
        if args.repeats > 1:
            print("ratio vllm/hf per repeat (tokens/s): " + ", ".join(f"{t:.2f}x" for _, t in ratios))
        episodes_ratio, tokens_ratio = (statistics.median(r[i] for r in ratios) for i in (0, 1))
        print(f"ratio vllm/hf{median}: episodes/s {episodes_ratio:.2f}x, tokens/s {tokens_ratio:.2f}x")
    else:
        print("ratio vllm/hf: not measured (an engine is unavailable on this model, above)")
    if rate:
        vllm_rate = statistics.median(t / e for e, _, t in results["vllm"])
        print(f"ratio Kiln-vllm / raw vLLM with the server's settings{median}: {vllm_rate / rate['grouped']:.2f}x; "
              f"/ raw vLLM without LoRA: {vllm_rate / rate['off']:.2f}x; / raw vLLM with its own CPU LoRA "
              f"products: {vllm_rate / rate['stock']:.2f}x")
    if rate and results["hf"]:
        hf_rate = statistics.median(t / e for e, _, t in results["hf"])
        print(f"ratio raw vLLM without LoRA / Kiln-hf: {rate['off'] / hf_rate:.2f}x (the most any collection "
              "on this engine could reach here)")


if __name__ == "__main__":
    raise SystemExit(main())
