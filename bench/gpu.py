"""GPU benchmark: Kiln's policy runtime and trainer on a qwen3-0.6b-shaped bf16 model vs baselines.

Runs only where CUDA exists (``--smoke`` runs a reduced version on CPU to prove the script works).
Everything is measured in this process on ONE random-init model of Qwen3-0.6B's architecture with
Qwen's real 151k vocabulary (weights random: throughput and memory are real, quality is not):

1. sampling, one group of 8 candidates: :meth:`PolicyRuntime.sample` (one batched KV-cache loop,
   shared prefill) vs the baseline ``model.generate`` one sequence at a time;
2. sampling, 4 concurrent groups: four threads each sampling a group of 8 through the runtime
   (what four collection activities on one gpu worker do; the hf engine decodes their rows in one
   loop) and the same 32 rows as one batch, vs the baseline generating the 32 sequences one at a time;
3. the engines (``--engines``, default hf plus vllm where ``.venv-vllm`` is installed): ``--engine-groups``
   concurrent groups of 8 (threads, as collection activities) sampled through the engine port of
   each engine, tokens/s and the vllm/hf ratio. With vllm on CUDA the engine keeps its share of GPU
   memory (``KILN_VLLM_GPU_MEMORY_UTILIZATION``, 0.5) while the training step of 4 runs next to it:
   the memory the engine took and the trainer's peak beside it are the measured memory split. A box
   without vLLM gives the hf rows only and says so;
4. a training step at 8 × 2048 tokens: Kiln's ``train_step`` (GRPO surrogate + ECHO, LoRA r16 on
   the runtime's shared base via ``training_lease``) vs a bare PEFT loop (forward, advantage-
   weighted action log-prob, backward, clip, AdamW step) — tokens/s and peak CUDA memory.

5. the trainer across GPUs (``--distributed``, on by default on CUDA): the same training (``--train-rows``
   rows of ``--train-tokens`` tokens a step, 3 steps, LoRA r16, AdamW) through the ranks launcher
   (:func:`kiln.core.train.launch.train_across`, FSDP2 + NCCL) on N = 1, 2 and all GPUs
   (``bench/distributed.py``): trainer tokens/s, seconds per step, the resident base weights per
   rank and the peak memory in use per GPU, and the adapter's largest relative difference from
   N = 1. The reference point: prime-rl publishes 13.3k tok/s (Qwen3-0.6B) and 6.2k tok/s
   (Qwen3-4B) for LoRA r16 at 16k-token sequences on 1×H100. These rows have not been run (no GPU
   where they were written): they are correct by reading, and ``--smoke`` runs them on the CPU
   with 2 gloo ranks.

Sampling rows never stop early (random weights; the baseline uses ``min_new_tokens``), so both
sides produce the same number of tokens. Prepared to finish in under 5 minutes on one H100/H200
(plus the vllm engine's start).

    python bench/gpu.py [--prompt-tokens 512] [--new-tokens 256] [--train-rows 8] [--train-tokens 2048]
    python bench/gpu.py --smoke      # CPU, small sizes (a 1-layer qwen3-0.6b shape when vllm runs)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(device: str, fn):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def build_runtime(folder: Path, shape: str, layers: int | None, device: str, dtype: str):
    """The runtime over an in-memory random model (tokenizer + config on disk for its identity)."""
    from transformers import Qwen3ForCausalLM

    from kiln.core.policy.device import TORCH_DTYPES
    from kiln.core.policy.qwen_vocab import build_qwen_tokenizer
    from kiln.core.policy.random_model import shape_config
    from kiln.core.policy.runtime import PolicyRuntime

    tok = build_qwen_tokenizer()
    tok.save_pretrained(str(folder))
    config = shape_config(shape, layers=layers)
    config.save_pretrained(str(folder))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(TORCH_DTYPES[dtype])
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    return PolicyRuntime(model, tok, model_path=folder, device=device, dtype=dtype, max_adapters=4)


def _prompt(rt, tokens: int, salt: int) -> list[int]:
    text = " ".join(f"word{(i * 7919 + salt) % 1000}" for i in range(tokens))
    ids = rt.encode_prompt([{"role": "user", "content": text}], thinking=False)
    return ids[-tokens:]


def bench_sampling(rt, *, prompt_tokens: int, new_tokens: int, group: int, device: str) -> dict:
    prompts = [_prompt(rt, prompt_tokens, g) for g in range(4)]
    sample = lambda rows, seeds: rt.sample(rows, seeds, max_new_tokens=new_tokens, temperature=1.0,  # noqa: E731
                                           thinking=False)
    sample([prompts[0]] * 2, [0, 1])  # warm-up (kernels, allocator)
    one, t_one = _timed(device, lambda: sample([prompts[0]] * group, list(range(group))))
    produced_one = sum(len(s.ids) for s in one)

    results: list[int] = []

    def worker(g: int) -> None:
        out = sample([prompts[g]] * group, [100 * g + i for i in range(group)])
        results.append(sum(len(s.ids) for s in out))

    def four_threads() -> None:
        threads = [threading.Thread(target=worker, args=(g,)) for g in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    _, t_threads = _timed(device, four_threads)
    rows = [p for p in prompts for _ in range(group)]
    batched, t_batch = _timed(device, lambda: sample(rows, list(range(len(rows)))))

    model = rt.model
    gen_kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, pad_token_id=rt.pad_id, eos_token_id=rt.stop_id)

    def generate(prompt: list[int]) -> int:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen_kwargs)
        return int(out.shape[1] - ids.shape[1])

    generate(prompts[0][:8])  # warm-up
    base_one, t_base_one = _timed(device, lambda: sum(generate(prompts[0]) for _ in range(group)))
    # The 32-sequence baseline is 4 × the 8-sequence one (same work, one sequence at a time).
    t_base_four = 4 * t_base_one
    return {
        "group_of_8": {"kiln_tokens_per_s": produced_one / t_one, "baseline_tokens_per_s": base_one / t_base_one,
                       "speedup": (produced_one / t_one) / (base_one / t_base_one), "tokens": produced_one},
        "four_groups_threads": {"kiln_tokens_per_s": sum(results) / t_threads,
                                "baseline_tokens_per_s": 4 * base_one / t_base_four,
                                "speedup": (sum(results) / t_threads) / (4 * base_one / t_base_four)},
        "four_groups_one_batch": {"kiln_tokens_per_s": sum(len(s.ids) for s in batched) / t_batch,
                                  "speedup": (sum(len(s.ids) for s in batched) / t_batch) / (4 * base_one / t_base_four)},
    }


def bench_engines(rt, folder: Path, engines: list[str], *, groups: int, prompt_tokens: int, new_tokens: int,
                  device: str) -> dict:
    """``groups`` concurrent groups of 8 rows through each engine of the port (see the docstring).
    Leaves the vllm engine running (returned under ``"_engine"``) so training can be measured beside it."""
    from kiln.core.policy.runtime import PolicyRuntime

    prompts = [_prompt(rt, prompt_tokens, 10 + g) for g in range(groups)]
    out: dict = {"groups": groups, "rows": 8 * groups, "new_tokens": new_tokens}

    def collect(runtime) -> tuple[int, float]:
        produced: list[int] = []

        def group(g: int) -> None:
            rows = runtime.sample([prompts[g]] * 8, [1000 * g + i for i in range(8)], max_new_tokens=new_tokens,
                                  temperature=1.0, thinking=False)
            produced.append(sum(len(r.ids) for r in rows))

        def all_groups() -> None:
            threads = [threading.Thread(target=group, args=(g,)) for g in range(groups)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        _, seconds = _timed(device, all_groups)
        return sum(produced), seconds

    for name in engines:
        if name == "hf":
            tokens, seconds = collect(rt)
            out["hf"] = {"tokens_per_s": tokens / seconds, "tokens": tokens}
            continue
        from kiln.core.policy.engine_vllm import VllmConfig, VllmEngine, default_python
        from kiln.core.settings import Settings

        settings = Settings()
        rt.model.save_pretrained(str(folder))  # vLLM loads the same weights from disk
        free_before = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else None
        engine = VllmEngine(VllmConfig(model_path=folder, python=default_python(), dtype=rt.dtype,
                                       log_path=folder / "vllm-engine.log",
                                       max_model_len=prompt_tokens + new_tokens + 64,
                                       max_num_seqs=max(64, 8 * groups), cpu_kvcache_gb=2,
                                       gpu_memory_utilization=settings.vllm_gpu_memory_utilization))
        started = time.perf_counter()
        engine.start()
        served = PolicyRuntime(rt.model, rt.tokenizer, model_path=folder, device=device, dtype=rt.dtype,
                               max_adapters=4)
        served.use_engine(engine)
        entry: dict = {"start_s": time.perf_counter() - started, "version": engine.identity()["version"]}
        served.sample([prompts[0]] * 2, [0, 1], max_new_tokens=4, temperature=1.0, thinking=False)  # warm-up
        tokens, seconds = collect(served)
        entry.update(tokens_per_s=tokens / seconds, tokens=tokens)
        if free_before is not None:
            entry["engine_gib"] = (free_before - torch.cuda.mem_get_info()[0]) / 2**30
            entry["gpu_memory_utilization"] = settings.vllm_gpu_memory_utilization
        out["vllm"] = entry
        out["_engine"] = engine
    if "hf" in out and "vllm" in out:
        out["vllm_over_hf"] = out["vllm"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    return out


def _synthetic_rows(rows: int, tokens: int, vocab: int):
    """``rows`` completions of ``tokens`` tokens with alternating observation/action spans."""
    from kiln.core.train.batches import Row

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        ids = torch.randint(0, vocab, (tokens,), generator=gen)
        action = torch.zeros(tokens - 1)
        env = torch.zeros(tokens - 1)
        for start in range(tokens // 8, tokens - 1, tokens // 4):
            env[start : start + tokens // 8] = 1.0
            action[start + tokens // 8 : start + tokens // 4] = 1.0
        reward = float(i % 2)
        out.append(Row(key=(0, i), ids=ids, action=action, env=env, obs_length=float(env.sum()),
                       behavior=None, advantage=1.0 if reward else -1.0, reward=reward))
    return out


def _peak(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def bench_training(rt, *, rows: int, tokens: int, repeats: int, device: str) -> dict:
    from kiln.core.train.batches import collate
    from kiln.core.train.losses import token_logprobs
    from kiln.core.train.model import attach_lora, trainable_parameters
    from kiln.core.train.step import LogprobCache, StepSettings, train_step

    vocab = int(rt.model.get_input_embeddings().weight.shape[0])
    step_rows = _synthetic_rows(rows, tokens, vocab)
    batch = collate(step_rows).to(torch.device(device))
    settings = StepSettings(clip_epsilon=0.2, kl_coeff=0.0, echo_lambda=0.05, max_grad_norm=1.0, recorded=False)
    cache = LogprobCache()
    dev = torch.device(device)
    out: dict = {"rows": rows, "tokens_per_row": tokens}
    with rt.training_lease() as lease:
        model = attach_lora(lease.model, rank=16, alpha=32.0, seed=0, base_adapter_dir=None)
        lease.trained = model
        params = [p for _, p in trainable_parameters(model)]
        opt = torch.optim.AdamW(params, lr=1e-5)
        train_step(model, step_rows, opt, params, settings, cache, dev)  # warm-up
        _reset_peak(device)
        times = [_timed(device, lambda: train_step(model, step_rows, opt, params, settings, cache, dev))[1]
                 for _ in range(repeats)]
        out["kiln"] = {"tokens_per_s": batch.tokens / min(times), "peak_gib": _peak(device)}

        def bare() -> None:
            opt.zero_grad(set_to_none=True)
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            lp = token_logprobs(logits, batch.labels)
            loss = -(lp * batch.action_mask * batch.advantages[:, None]).sum() / batch.action_mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        bare()
        _reset_peak(device)
        times = [_timed(device, bare)[1] for _ in range(repeats)]
        out["bare_peft"] = {"tokens_per_s": batch.tokens / min(times), "peak_gib": _peak(device)}
    out["kiln_over_bare_time"] = out["bare_peft"]["tokens_per_s"] / out["kiln"]["tokens_per_s"]
    return out


def bench_distributed(folder: Path, shape: str, layers: int | None, *, device: str, dtype: str, rows: int,
                      tokens: int, repeats: int) -> dict:
    """Rows of the trainer across devices: N = 1, 2 and every GPU (CPU: 1 and 2 gloo ranks)."""
    from bench.distributed import compare, synthetic_groups
    from kiln.core.training_config import TrainingConfig
    from kiln.core.policy.random_model import build_random_model

    on_cuda = device.startswith("cuda")
    gpus = torch.cuda.device_count() if on_cuda else 2
    worlds = sorted({1, min(2, gpus), gpus})
    model = build_random_model(folder / "distributed-model", shape=shape, layers=layers,
                               dtype="bfloat16" if on_cuda else "float32")
    per_group = max(2, rows // 2)  # rewards vary within a group of two or more
    groups = synthetic_groups(2, per_group, tokens, vocab=151_000 if shape != "tiny" else 150_000)
    config = TrainingConfig(seed=0, optimizer="adamw", learning_rate=1e-4, echo=None, epochs=3,
                            groups_per_step=2, lora_rank=16, lora_alpha=32,
                            max_tokens_per_microbatch=max(tokens, 16384))
    measured = compare(worlds, model=model, groups=groups, config=config, device="cuda" if on_cuda else "cpu",
                       dtype=dtype, repeats=repeats, work=folder)
    return {"rows": 2 * per_group, "tokens_per_row": tokens, "worlds": measured,
            "reference_tokens_per_s": {"prime-rl qwen3-0.6b lora r16 16k 1xH100": 13_300,
                                       "prime-rl qwen3-4b lora r16 16k 1xH100": 6_200}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="reduced sizes on CPU (proves the script runs)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--train-rows", type=int, default=8)
    parser.add_argument("--train-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--engines", default=None,
                        help="comma-separated engines to compare (default: hf, plus vllm where .venv-vllm exists)")
    parser.add_argument("--engine-groups", type=int, default=8, help="concurrent groups of 8 in the engine rows")
    parser.add_argument("--distributed", action=argparse.BooleanOptionalAction, default=True,
                        help="the trainer-across-GPUs rows (N = 1, 2, all GPUs)")
    args = parser.parse_args(argv)
    from kiln.core.policy.engine_vllm import default_python

    vllm_installed = default_python().is_file()
    engines = args.engines.split(",") if args.engines else ["hf"] + (["vllm"] if vllm_installed else [])
    if "vllm" in engines and not vllm_installed:
        print(f"--engines names vllm, but its Python {default_python()} does not exist: install it with "
              "`KILN_VLLM_BUILD=cuda scripts/setup.sh --engine vllm`", file=sys.stderr)
        return 2
    if args.smoke:
        # vLLM refuses the tiny shape's head size: the smoke runs a 1-layer qwen3-0.6b shape with vllm
        device, dtype = "cpu", "float32"
        shape, layers = ("qwen3-0.6b", 1) if "vllm" in engines else ("tiny", None)
        args.prompt_tokens, args.new_tokens, args.train_rows, args.train_tokens, args.repeats = 32, 8, 2, 64, 1
        args.engine_groups = min(args.engine_groups, 2)
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print(f"bench/gpu.py needs a CUDA device: torch {torch.__version__} (CUDA build: "
                  f"{torch.version.cuda}) sees none. Run it on a GPU machine, or use --smoke for a "
                  "reduced CPU check.", file=sys.stderr)
            return 2
        device, dtype, shape, layers = "cuda:0", "bfloat16", "qwen3-0.6b", None
        # Determinism settings documented in docs/models.md.
        torch.backends.cuda.matmul.allow_tf32 = False
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-gpu-") as tmp:
        rt = build_runtime(Path(tmp), shape, layers, device, dtype)
        report = {
            "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
            "model": f"{shape} random ({dtype})", "torch": torch.__version__,
            "sampling": bench_sampling(rt, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                       group=8, device=device),
        }
        report["engines"] = bench_engines(rt, Path(tmp), engines, groups=args.engine_groups,
                                          prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, device=device)
        engine = report["engines"].pop("_engine", None)
        try:  # with vllm on CUDA, the trainer runs beside the engine's share of GPU memory
            report["training"] = bench_training(rt, rows=args.train_rows, tokens=args.train_tokens,
                                                repeats=args.repeats, device=device)
        finally:
            if engine is not None:
                engine.close()
        if args.distributed:  # the ranks take the GPUs: this process's runtime goes first
            del rt
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            report["distributed"] = bench_distributed(Path(tmp), shape, layers, device=device, dtype=dtype,
                                                      rows=args.train_rows, tokens=args.train_tokens,
                                                      repeats=1 if args.smoke else args.repeats)
    report["wall_s"] = time.perf_counter() - started
    s, t = report["sampling"], report["training"]
    print(f"{report['model']} on {report['device']} (prompt {args.prompt_tokens}, {args.new_tokens} new tokens)")
    print(f"sampling, 1 group of 8: kiln {s['group_of_8']['kiln_tokens_per_s']:.1f} tok/s vs generate one at a "
          f"time {s['group_of_8']['baseline_tokens_per_s']:.1f} tok/s = {s['group_of_8']['speedup']:.2f}x")
    print(f"sampling, 4 groups (4 threads): kiln {s['four_groups_threads']['kiln_tokens_per_s']:.1f} tok/s = "
          f"{s['four_groups_threads']['speedup']:.2f}x; as one batch of 32: "
          f"{s['four_groups_one_batch']['kiln_tokens_per_s']:.1f} tok/s = {s['four_groups_one_batch']['speedup']:.2f}x")
    e = report["engines"]
    for name in ("hf", "vllm"):
        if name in e:
            extra = ""
            if name == "vllm":
                extra = f" (vllm {e['vllm']['version']}, started in {e['vllm']['start_s']:.1f} s"
                if "engine_gib" in e["vllm"]:
                    extra += (f", took {e['vllm']['engine_gib']:.1f} GiB of GPU memory at utilization "
                              f"{e['vllm']['gpu_memory_utilization']}")
                extra += ")"
            print(f"engine {name}, {e['groups']} groups of 8 at once: {e[name]['tokens_per_s']:.1f} tok/s{extra}")
    if "vllm_over_hf" in e:
        print(f"engine ratio vllm/hf tokens/s: {e['vllm_over_hf']:.2f}x")
    if "vllm" not in e:
        print("engine vllm: not measured (not installed here: `KILN_VLLM_BUILD=cuda scripts/setup.sh --engine vllm`)")
    peak = lambda v: "n/a" if v is None else f"{v:.1f} GiB"  # noqa: E731
    beside = " (beside the vllm engine)" if "vllm" in e and device.startswith("cuda") else ""
    print(f"training step{beside} {t['rows']}x{t['tokens_per_row']}: kiln {t['kiln']['tokens_per_s']:.0f} tok/s, peak "
          f"{peak(t['kiln']['peak_gib'])} vs bare peft {t['bare_peft']['tokens_per_s']:.0f} tok/s, peak "
          f"{peak(t['bare_peft']['peak_gib'])}; kiln/bare time = {t['kiln_over_bare_time']:.2f}x")
    if "distributed" in report:
        d = report["distributed"]
        gib = lambda v: "n/a" if v is None else f"{v / 2**30:.2f} GiB"  # noqa: E731
        for row in d["worlds"]:
            print(f"trainer across {row['world_size']} device(s), {d['rows']}x{d['tokens_per_row']} a step: "
                  f"{row['tokens_per_s']:.0f} tok/s, {row['step_s']:.2f} s/step, base weights per rank "
                  f"{gib(row['base_weight_bytes'])}, peak per GPU {gib(row['peak_device_bytes'])}, peak RSS "
                  f"per rank {gib(row['peak_rss_bytes'])}, adapter vs N=1 {row['adapter_rel_diff']:.1e}")
        print("reference trainer tok/s (prime-rl, LoRA r16, 16k sequences, 1xH100): Qwen3-0.6B 13.3k, Qwen3-4B 6.2k")
    print(f"total {report['wall_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
