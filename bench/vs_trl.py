"""Kiln vs TRL's GRPOTrainer over several collect→train iterations and several seed ranges.

Both sides train the tiny demo model (``kiln model tiny``, built fresh here: no downloads) on the
same real counter server (``examples/envs`` counter, openenv 0.10.0) with the same budget: per seed
range, ``--iterations`` iterations of ``--groups`` fresh seed groups × ``--group-size`` episodes
(``start + (k−1)·groups …``), ≤ 6 steps of ≤ 48 action tokens, thinking on, temperature 1; LoRA
rank 16 / alpha 32 on every projection; AdamW at the same learning rate (betas 0.9, 0.999, eps
1e-8, no weight decay, constant schedule), CISPO importance weights truncated at 5, no KL, 4 epochs
over each iteration's groups with one group (4 completions) per optimizer step (32 steps an
iteration), gradient clipping at 1.0, one torch thread per training process. Kiln runs at ``TrainingConfig``'s
defaults (AdamW 3e-4, CISPO, no KL, ECHO λ 0.05, ``on_no_output: penalty``; ``docs/training.md``
"Defaults that learn" says why) and TRL at the same learning rate.

* **TRL** (``bench/trl_side.py``, run with the separate TRL venv's python; TRL 1.16 with the
  torch/transformers/peft/accelerate versions of ``constraints.txt``): ``GRPOTrainer`` with a
  ``rollout_func`` that plays the episodes on the same server over WebSocket (see that file); it
  saves its adapter after every iteration. Time per iteration: from the trainer step that
  generates to the end of the iteration's last optimizer step (model loading excluded).
* **Kiln**: the workflow's per-iteration wiring in-process (``tests/support/online_loop.py``: the
  real ``PolicyRuntime`` sampler and ``train_grpo``, each iteration continuing from the previous
  adapter and its optimizer state, as ``workflows/stages.py`` passes them), without Temporal and
  S3. Time per iteration: collection + training.

Held-out return: after every iteration, each side's adapter plays the same 20 held-out seeds × 2
episodes (``HELD_OUT_SEEDS``, disjoint from every training seed) through ONE evaluator, Kiln's
sampler, so the two sides differ only in training. The base model's held-out return is measured
once the same way. Printed: per iteration and side, the mean ± standard error over seed ranges;
each range's figures; time per iteration per side, and the ratio (Kiln / TRL) per range with its
median: the sides run back to back in each range and alternate which goes first from range to range,
so a load that comes and goes falls on both. A JSON copy of every
figure goes to ``--out`` (written after every range, so a partial run keeps what it measured).

Differences that remain: ECHO (TRL has none; ``--echo-lambda 0`` turns Kiln's off); advantages
(Kiln divides by the population std of a group, TRL by the sample std); TRL shuffles all 32
completions across its 8 steps per epoch, Kiln steps through whole groups in a seeded order; TRL's
rollout batches the lock-step turns of all 32 episodes into one ``generate`` per turn, Kiln collects
two groups at once (a default gpu worker's collection activities) and its ``hf`` engine decodes the
live rows of both in one decode tile of 8; an invalid action ends the episode on both sides with the protocol-error reward (−1)
and both train on it.

**Kiln on the vllm engine** (``--kiln-engines hf vllm``): a third side, ``kiln-vllm``, runs the same
loop with a second runtime whose engine is a vLLM server process (``.venv-vllm``): collection
through vLLM with each iteration's adapter hot-loaded by path, as many groups at once as one run's
workflow keeps in flight on a vllm deployment (``KILN_RUN_PARALLEL_GROUPS``, by default the vllm
worker's activity count), and training with the engine-mismatch correction that data from another
engine than hf gets. Its adapters are evaluated by the same hf evaluator. vLLM's CPU build refuses the demo model's 16-wide heads, so with the vllm side the tiny
model is built with heads of 32 (``--head-dim``; the same recipe, a different model) for every side.
TRL's own vLLM mode is not a side: its server mode sends weights over NCCL (CUDA only).

``--env guess`` runs the same comparison on ``examples/envs/guess`` (guess a number from 1 to 64 in
up to 8 guesses, told only "too low" / "too high"; the reward comes only at the end, out-of-range
and repeated guesses lose a turn): both sides play 8-step episodes there, on a tiny model warmed up
on that game's format instead of the counter's (``build_tiny_model(..., warmup="guess")``,
:mod:`kiln.core.policy.tiny_formats`: the same recipe, guesses uniform over 1..64 and random
feedback, 320 steps). Measured 2026-12-03 on the loaded 2-core machine (``--sides kiln --ranges 0 200
--iterations 6``): base held-out 0.253 (0.8 % of its actions invalid); after 6 iterations at the
defaults 0.116 / 0.184, KL to base at most 0.005 (no learning yet at lr 3e-4: few groups carry reward
variation).

Run: ``python -m bench.vs_trl [--env counter|guess] [--ranges 0 200 400] [--iterations 4] [--groups 8] [--group-size 4]
[--learning-rate 3e-4] [--echo-lambda 0.05] [--sides both|kiln|trl] [--kiln-engines hf [vllm]]
[--head-dim N] [--trl-python .venv-trl/bin/python] [--out vs_trl.json]``. Needs the TRL venv for the
TRL side (``python3 -m venv .venv-trl && .venv-trl/bin/pip install -r bench/requirements-trl.txt``);
exits 2 with that line when it is missing. About 3 minutes per range and side on 2 idle cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
SETUP_LINE = ("the TRL venv is missing: create it with "
              "`python3 -m venv .venv-trl && .venv-trl/bin/pip install -r bench/requirements-trl.txt` "
              "(or pass --trl-python)")


SIDES = ("kiln", "kiln-vllm", "trl")
DEMO_HEAD_DIM = 16
VLLM_HEAD_DIM = 32
VLLM_SETUP_LINE = "the vllm engine is missing: install it with `scripts/setup.sh --engine vllm`"


@dataclass
class SideRun:
    """One side on one seed range: held-out mean return and seconds per iteration."""

    held_out: list[float] = field(default_factory=list)
    walls_s: list[float] = field(default_factory=list)
    failed: str | None = None


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


# Per environment: the episode settings over the demo's (DEMO_SETTINGS) and the TRL side's action check.
ENVS: dict[str, dict[str, Any]] = {
    "counter": {"episode": {}, "action_spec": {"field": "amount", "minimum": 1, "maximum": 5}},
    "guess": {"episode": {"max_steps": 8}, "action_spec": {"field": "guess", "minimum": None, "maximum": None}},
}


def training_config(args: argparse.Namespace) -> Any:
    from kiln.core.training_config import TrainingConfig

    echo = {"lambda": args.echo_lambda} if args.echo_lambda > 0 else None
    return TrainingConfig(learning_rate=args.learning_rate, echo=echo)


def system_prompt_of(env_url: str) -> str:
    """The system prompt Kiln shows the policy for this environment (the TRL side uses it too)."""
    import asyncio

    from kiln.core.openenv.discovery import inspect_environment
    from kiln.core.openenv.schema import policy_action_schema
    from kiln.core.rollout.prompts import system_prompt

    inspection = asyncio.run(inspect_environment(env_url))
    identity = inspection["identity"]
    return system_prompt(identity.get("metadata") or {}, policy_action_schema(inspection["schema"]["action"]),
                         identity.get("tools"))


def run_trl(args: argparse.Namespace, env_url: str, model_dir: Path, work: Path, start: int,
            evaluate: Any) -> SideRun:
    from kiln.core.contracts import RunRequest
    from kiln.core.train.model import LORA_TARGETS
    from tests.support.counter_loop import DEMO_SETTINGS

    training = training_config(args)
    out = work / f"trl-{start}"
    config = {
        "model_dir": str(model_dir), "ws_url": env_url.replace("http://", "ws://") + "/ws",
        "system_prompt": system_prompt_of(env_url), "groups": args.groups, "group_size": args.group_size,
        "iterations": args.iterations, "seed_start": start, "thinking": True, "threads": args.threads,
        "protocol_error_reward": RunRequest.model_fields["protocol_error_reward"].default,
        "epochs": training.epochs, "seed": training.seed, "learning_rate": training.resolved_learning_rate(),
        "max_grad_norm": training.max_grad_norm, "clip_epsilon": training.clip_epsilon,
        "loss_type": "cispo", "epsilon_high": training.cispo_max_weight, "lora_rank": training.lora_rank,
        "lora_alpha": training.lora_alpha, "lora_targets": list(LORA_TARGETS),
        "max_completion_length": 4096, "output_dir": str(out), **DEMO_SETTINGS, **ENVS[args.env]["episode"],
        "action_spec": ENVS[args.env]["action_spec"],
    }
    config_path = work / f"trl-config-{start}.json"
    config_path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
                "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})
    proc = subprocess.run([str(args.trl_python), str(REPO / "bench" / "trl_side.py"), str(config_path)],
                          check=False, capture_output=True, text=True, env=env, cwd=work, timeout=args.timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TRL_RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return SideRun(failed=f"TRL side exited {proc.returncode}")
    result = json.loads(lines[-1][len("TRL_RESULT "):])
    run = SideRun(walls_s=list(result["iteration_wall_s"]))
    for k in range(1, args.iterations + 1):
        held = evaluate(out / f"iteration-{k}")
        run.held_out.append(sum(held.values()) / len(held))
        print(f"  TRL  range {start} iteration {k}: held-out {run.held_out[-1]:.3f}, "
              f"{run.walls_s[k - 1]:.1f} s", flush=True)
    return run


def run_kiln(args: argparse.Namespace, runtime: Any, env_url: str, model_dir: Path, work: Path, start: int,
             base: dict[int, float], *, side: str = "kiln", evaluator: Any = None,
             concurrency: int | None = None) -> SideRun:
    from tests.support.online_loop import run_online

    def show(figures: Any) -> None:
        print(f"  {side} range {start} iteration {figures.iteration}: held-out {figures.held_out_mean:.3f}, "
              f"{figures.wall_s:.1f} s, KL to previous {figures.kl_to_previous:.4f}, "
              f"KL to base {figures.kl_to_base:.4f}", flush=True)

    online = run_online(runtime, env_url, model_dir, work / f"{side}-{start}", config=training_config(args),
                        seed_start=start, iterations=args.iterations, groups=args.groups,
                        group_size=args.group_size, base_held_out=base, progress=show, evaluator=evaluator,
                        concurrency=concurrency, episode=ENVS[args.env]["episode"])
    run = SideRun(held_out=[f.held_out_mean for f in online.iterations if not f.failed],
                  walls_s=[f.wall_s for f in online.iterations if not f.failed])
    failed = [f for f in online.iterations if f.failed]
    if failed:
        run.failed = f"iteration {failed[0].iteration}: {failed[0].failed}"
    return run


def range_ratios(runs: dict[int, dict[str, SideRun]], side: str, baseline: str) -> list[float]:
    """Per seed range, ``side``'s mean seconds per iteration over ``baseline``'s, measured back to back."""
    ratios = []
    for start in sorted(runs):
        r = runs[start]
        if side in r and baseline in r and r[side].walls_s and r[baseline].walls_s:
            mine = sum(r[side].walls_s) / len(r[side].walls_s)
            theirs = sum(r[baseline].walls_s) / len(r[baseline].walls_s)
            ratios.append(mine / theirs)
    return ratios


def report(args: argparse.Namespace, base: float, runs: dict[int, dict[str, SideRun]], head_dim: int) -> None:
    sides = [s for s in SIDES if any(s in r for r in runs.values())]
    print(f"\n{args.groups} groups x {args.group_size}, {args.iterations} iterations, seed ranges "
          f"{sorted(runs)}, lr {training_config(args).resolved_learning_rate()}, {args.threads} torch thread(s), "
          f"{os.cpu_count()} cores, tiny model head_dim {head_dim}, {datetime.now(UTC):%Y-%m-%d}; "
          f"base held-out {base:.3f}")
    print("held-out mean return, mean ± SE over ranges (n ranges)")
    print("iteration" + "".join(f" | {s:>20}" for s in sides))
    for k in range(args.iterations):
        cells = []
        for side in sides:
            values = [r[side].held_out[k] for r in runs.values() if side in r and len(r[side].held_out) > k]
            cells.append(f"{mean_se(values)[0]:.3f} ± {mean_se(values)[1]:.3f} ({len(values)})" if values else "-")
        print(f"{k + 1:>9}" + "".join(f" | {c:>20}" for c in cells))
    print("per range (held-out after each iteration)")
    for start, r in sorted(runs.items()):
        for side in sides:
            if side in r:
                extra = f" FAILED {r[side].failed}" if r[side].failed else ""
                print(f"  {start:>5} {side:>9}: " + " ".join(f"{v:.3f}" for v in r[side].held_out) + extra)
    walls = {s: [w for r in runs.values() if s in r for w in r[s].walls_s] for s in sides}
    for side in sides:
        if walls[side]:
            print(f"{side}: {sum(walls[side]) / len(walls[side]):.1f} s/iteration ({len(walls[side])} iterations)")
    per_iteration = {s: sum(w) / len(w) for s, w in walls.items() if w}
    for side in ("kiln", "kiln-vllm"):
        ratios = range_ratios(runs, side, "trl")
        if ratios:
            print(f"ratio ({side} / TRL time per iteration), per range: "
                  + " ".join(f"{r:.2f}x" for r in ratios)
                  + f"; median {statistics.median(ratios):.2f}x (target <= 1.0)")
    if "kiln" in per_iteration and "kiln-vllm" in per_iteration:
        print(f"ratio (kiln-vllm / kiln time per iteration): "
              f"{per_iteration['kiln-vllm'] / per_iteration['kiln']:.2f}x")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranges", type=int, nargs="+", default=[0, 200, 400], help="seed starts")
    parser.add_argument("--env", choices=sorted(ENVS), default="counter",
                        help="the environment: counter, or guess (8 guesses, the reward only at the end)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--echo-lambda", type=float, default=0.05, help="Kiln's ECHO λ (TRL has no ECHO)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="both sides' learning rate (default: Kiln's, AdamW 3e-4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each training process")
    parser.add_argument("--sides", choices=("both", "kiln", "trl"), default="both")
    parser.add_argument("--kiln-engines", nargs="+", choices=("hf", "vllm"), default=["hf"],
                        help="Kiln's rollout engines, one Kiln side each (vllm: .venv-vllm, and heads of 32)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="the tiny model's head width (default 16, the demo model; 32 with the vllm engine)")
    parser.add_argument("--trl-python", type=Path, default=DEFAULT_TRL_PYTHON)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit of one TRL run")
    parser.add_argument("--out", type=Path, default=None, help="write every figure here as JSON")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="print the table of earlier --out files (ranges run as separate processes)")
    return parser.parse_args(argv)


def merged(paths: list[Path]) -> tuple[float, dict[int, dict[str, SideRun]], int]:
    """The base return, every range's runs and the model's head width from ``--out`` files (one
    base: the same evaluator; one model)."""
    bases, runs, widths = [], {}, set()
    for path in paths:
        data = json.loads(path.read_text())
        bases.append(data["base"])
        widths.add(int(data.get("head_dim", DEMO_HEAD_DIM)))
        for start, sides in data["runs"].items():
            runs[int(start)] = {side: SideRun(**run) for side, run in sides.items()}
    if len(widths) != 1:
        raise SystemExit(f"the --merge files come from different models (head widths {sorted(widths)})")
    return sum(bases) / len(bases), runs, widths.pop()


def head_dim_of(args: argparse.Namespace) -> int:
    """The tiny model's head width: as asked, else 32 where the vllm engine is a side (vLLM's CPU
    build refuses the demo model's 16), else the demo model's 16."""
    if args.head_dim is not None:
        return args.head_dim
    return VLLM_HEAD_DIM if "vllm" in args.kiln_engines and args.sides != "trl" else DEMO_HEAD_DIM


def vllm_runtime(model_dir: Path, work: Path) -> Any:
    """A second runtime on the same model whose engine is a vLLM server process (the vllm side)."""
    from kiln.core.policy.engine_vllm import VllmConfig, VllmEngine, default_python
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(model_dir)
    engine = VllmEngine(VllmConfig(model_path=model_dir, python=default_python(), log_path=work / "vllm.log",
                                   max_model_len=4096, cpu_kvcache_gb=1))
    runtime.use_engine(engine)
    engine.start()
    return runtime


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        report(args, *merged(args.merge))
        return 0
    if args.sides != "kiln" and not Path(args.trl_python).exists():
        print(SETUP_LINE)
        return 2
    if "vllm" in args.kiln_engines and args.sides != "trl":
        from kiln.core.policy.engine_vllm import default_python

        if not default_python().is_file():
            print(VLLM_SETUP_LINE)
            return 2
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        os.environ.pop(var, None)
    import torch

    torch.set_num_threads(args.threads)
    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.policy.tiny import build_tiny_model
    from kiln.core.settings import Settings
    from tests.support.online_loop import held_out
    from tests.support.servers import example_env_argv, serve_app_process

    runs: dict[int, dict[str, SideRun]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-vs-trl-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        head_dim = head_dim_of(args)
        model_dir = build_tiny_model(work / "model", head_dim=None if head_dim == DEMO_HEAD_DIM else head_dim,
                                     warmup=args.env)
        runtime = PolicyRuntime.load(model_dir)  # the hf engine: Kiln's side and every side's evaluator
        engines = args.kiln_engines if args.sides != "trl" else []
        served = vllm_runtime(model_dir, work) if "vllm" in engines else None
        if served is not None:
            stack.callback(served.engine.close)  # the engine process never outlives the bench
        sessions = max(8, args.groups * args.group_size)
        argv = lambda port: example_env_argv(args.env, port, max_concurrent_envs=sessions)  # noqa: E731
        episode = ENVS[args.env]["episode"]
        with serve_app_process(argv, startup_timeout_s=300) as url:
            base_seeds = held_out(runtime, url, None, episode=episode)
            base = sum(base_seeds.values()) / len(base_seeds)
            print(f"base held-out {base:.3f}", flush=True)
            for start in args.ranges:
                started = time.monotonic()
                runs[start] = {}
                # the sides alternate which goes first from range to range, so a load that comes and
                # goes falls on both; the per-range ratios and their median are what report() prints
                trl_first = args.ranges.index(start) % 2 == 0
                if trl_first and args.sides != "kiln":
                    runs[start]["trl"] = run_trl(args, url, model_dir, work, start,
                                                 lambda adapter: held_out(runtime, url, adapter, episode=episode))
                if "hf" in engines:
                    runs[start]["kiln"] = run_kiln(args, runtime, url, model_dir, work, start, base_seeds)
                if not trl_first and args.sides != "kiln":
                    runs[start]["trl"] = run_trl(args, url, model_dir, work, start,
                                                 lambda adapter: held_out(runtime, url, adapter, episode=episode))
                if served is not None:
                    # a run's collection as a vllm deployment admits it: its default groups in flight
                    # (KILN_RUN_PARALLEL_GROUPS, or the vllm worker's activity count)
                    runs[start]["kiln-vllm"] = run_kiln(args, served, url, model_dir, work, start, base_seeds,
                                                        side="kiln-vllm", evaluator=runtime,
                                                        concurrency=Settings(engine="vllm").parallel_groups_per_run)
                print(f"range {start} done in {time.monotonic() - started:.0f} s", flush=True)
                if args.out is not None:
                    args.out.write_text(json.dumps({"base": base, "head_dim": head_dim, "runs": {
                        str(s): {side: vars(run) for side, run in r.items()} for s, r in runs.items()}}, indent=1))
                report(args, base, runs, head_dim)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
