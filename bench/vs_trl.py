"""Kiln vs TRL's GRPOTrainer: wall time and mean return per collect→train iteration, same workload.

Both sides train the tiny demo model (``kiln model tiny``, built fresh here: no downloads) on the
same real counter server (``examples/envs`` counter, openenv 0.10.0, enough sessions for either
side) with the demo's shape: ``--groups`` seed groups × ``--group-size`` episodes per iteration
(fresh seeds each iteration, ``seed_start + (k-1)·groups …``), ≤ 6 steps of ≤ 48 action tokens,
thinking on, temperature 1; LoRA rank 16 / alpha 32 on every projection, AdamW 1e-3 (betas 0.9,
0.999, eps 1e-8, no weight decay, constant schedule), CISPO importance weights truncated at 5,
no KL, 4 epochs over each iteration's groups with one group (4 completions) per optimizer step
(32 steps an iteration), gradient clipping at 1.0, one torch thread per training process. The
values come from Kiln's own ``TrainingConfig``/``RunRequest`` defaults plus the demo's settings
(``tests/support/counter_loop.py``: ``DEMO_TRAINING``, ``DEMO_SETTINGS``), so they exist once.

* **TRL** (``bench/trl_side.py``, run with the separate TRL venv's python; TRL 1.16.0 with the
  torch/transformers/peft/accelerate versions of ``constraints.txt``): ``GRPOTrainer`` with a
  ``rollout_func`` that plays the episodes on the same server over WebSocket (see that file).
  Time per iteration: from the trainer step that generates (``rollout_func``) to the end of the
  iteration's 32nd optimizer step (TrainerCallback). Model loading is excluded.
* **Kiln**, on the production topology without Docker (``tests/support/topology.py``: a real
  Temporal dev server, SeaweedFS, the API, one control worker and one gpu worker process with the
  default 2 activity slots, one torch thread). After a warm-up rollout run (the worker's first
  group loads the model), ``--kiln-mode loop`` submits ONE train run with ``iterations: N`` and
  reads ``status.iterations[k].wall_ms`` / ``.mean_return`` (issue 16's contract);
  ``--kiln-mode chained`` submits N single-iteration train runs, each behaving and warm-starting
  from the previous run's output adapter (``adapter``), with a fresh optimizer each time; its
  time per iteration is the run's ``closed_at - started_at`` (submission to end: admission,
  discovery, collection, training, publication) and its return is ``status.progress.mean_return``.

Mean return of an iteration = mean episode return of the episodes collected in it (the behaviour
policy after k-1 updates); the final mean return is the last iteration's. The run prints both
sides' per-iteration rows, each side's mean time per iteration, the ratio (Kiln / TRL; target
≤ 1.0 at 8 groups × 4) and both final mean returns.

Differences that remain (TRL allows no closer match):

* ECHO: Kiln adds λ·cross-entropy on observation tokens (the demo's λ = 0.05); TRL has no such
  term (its ``env_mask`` only drops observation tokens from the loss). ``--echo-lambda 0`` turns
  ECHO off on the Kiln side for a pure-GRPO comparison.
* Advantages: Kiln divides by the population std of a group, TRL by the sample std (n-1).
* Old log-probs: both score them with the model before any update on an iteration's data; TRL
  shuffles all 32 completions across its 8 steps per epoch, Kiln steps through whole groups in a
  seeded order.
* Sampling: TRL's rollout batches the lock-step turns of all 32 episodes into one ``generate``
  per turn; Kiln samples per group (its candidates together) in its gpu worker's slots.
* An invalid action ends the episode on both sides with the protocol-error reward (-1); Kiln also
  appends the harness error as an observation turn (trained by ECHO), the TRL rollout does not.
* Kiln's iteration also stores every rollout, adapter and receipt in S3 and records each step in
  Temporal; TRL keeps everything in memory. That is the durability being paid for.

Run: ``python -m bench.vs_trl [--groups 8] [--group-size 4] [--iterations 3] [--kiln-mode
loop|chained] [--echo-lambda 0.05] [--threads 1] [--trl-python .venv-trl/bin/python]``.
Needs the TRL venv (``python3 -m venv .venv-trl && .venv-trl/bin/pip install -r
bench/requirements-trl.txt``); exits 2 with that line when it is missing. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Side:
    """One side's measurement: seconds and mean return per iteration."""

    label: str
    walls_s: list[float]
    returns: list[float]

    @property
    def mean_wall_s(self) -> float:
        return sum(self.walls_s) / len(self.walls_s)


class KilnRejected(SystemExit):
    pass


# ----------------------------------------------------------------------------- shared settings
def workload(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """(episode shape, TrainingConfig) of both sides, from Kiln's own defaults and the demo's."""
    from kiln.contracts import TrainingConfig
    from tests.support.counter_loop import DEMO_SETTINGS, DEMO_TRAINING

    echo = {"lambda": args.echo_lambda} if args.echo_lambda > 0 else None
    rate = args.learning_rate if args.learning_rate is not None else DEMO_TRAINING["learning_rate"]
    return dict(DEMO_SETTINGS), TrainingConfig(**{**DEMO_TRAINING, "learning_rate": rate}, echo=echo)


def system_prompt_of(env_url: str) -> str:
    """The system prompt Kiln shows the policy for this environment (the TRL side uses it too)."""
    from kiln.openenv.discovery import inspect_environment
    from kiln.openenv.schema import policy_action_schema
    from kiln.rollout.prompts import system_prompt

    inspection = asyncio.run(inspect_environment(env_url))
    identity = inspection["identity"]
    return system_prompt(identity.get("metadata") or {}, policy_action_schema(inspection["schema"]["action"]),
                         identity.get("tools"))


# ----------------------------------------------------------------------------- TRL side
def run_trl(args: argparse.Namespace, env_url: str, model_dir: Path, work: Path) -> Side:
    from kiln.contracts import RunRequest
    from kiln.train.model import LORA_TARGETS

    shape, training = workload(args)
    config = {
        "model_dir": str(model_dir), "ws_url": env_url.replace("http://", "ws://") + "/ws",
        "system_prompt": system_prompt_of(env_url), "groups": args.groups, "group_size": args.group_size,
        "iterations": args.iterations, "seed_start": args.seed_start, "thinking": True, "threads": args.threads,
        "protocol_error_reward": RunRequest.model_fields["protocol_error_reward"].default,
        "epochs": training.epochs, "seed": training.seed, "learning_rate": training.resolved_learning_rate(),
        "max_grad_norm": training.max_grad_norm, "clip_epsilon": training.clip_epsilon,
        "cispo_max_weight": training.cispo_max_weight, "lora_rank": training.lora_rank,
        "lora_alpha": training.lora_alpha, "lora_targets": list(LORA_TARGETS),
        "max_completion_length": 4096, "output_dir": str(work / "trl-out"), **shape,
    }
    config_path = work / "trl-config.json"
    config_path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
                "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)})
    proc = subprocess.run([str(args.trl_python), str(REPO / "bench" / "trl_side.py"), str(config_path)],
                          check=False, capture_output=True, text=True, env=env, cwd=work,
                          timeout=args.timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TRL_RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the TRL side failed (exit {proc.returncode}); its output is above")
    result = json.loads(lines[-1][len("TRL_RESULT "):])
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    print(f"TRL side: {versions}; setup (model load, trainer) {result['setup_s']:.1f}s, not counted", flush=True)
    return Side(f"TRL {result['versions']['trl']} GRPOTrainer", result["iteration_wall_s"], result["mean_returns"])


# ----------------------------------------------------------------------------- Kiln side
def train_request(args: argparse.Namespace, env_url: str, *, seed_start: int, adapter: str, output: str,
                  iterations: int | None) -> dict[str, Any]:
    """A train run of the benchmark's workload; ``iterations`` None leaves the field out (chained)."""
    shape, training = workload(args)
    request = {
        "kind": "train", "environments": [env_url], "groups": args.groups, "group_size": args.group_size,
        "seed_start": seed_start, "thinking": True, "adapter": adapter, "output_adapter": output,
        "training_config": training.model_dump(mode="json", by_alias=True, exclude_unset=True), **shape,
    }
    if iterations is not None:
        request["iterations"] = iterations
    return request


def submit_and_wait(topo: Any, request: dict[str, Any], *, mode: str) -> dict[str, Any]:
    code, body = topo.api_call("POST", "/v1/openenv/runs", request)
    if code != 202:
        if mode == "loop" and "iterations" in json.dumps(body):
            raise KilnRejected(f"the Kiln API rejected `iterations` ({code}: {json.dumps(body)[:400]}): this "
                               "Kiln predates multi-iteration runs (issue 16); rerun with --kiln-mode chained")
        raise SystemExit(f"the Kiln API refused the run ({code}): {json.dumps(body)[:800]}")
    status = topo.wait_run(body["run_id"], timeout_s=run_timeout_s(request))
    if status["state"] != "completed":
        raise SystemExit(f"Kiln run {body['run_id']} ended {status['state']}: {json.dumps(status.get('failure'))}")
    return status


def run_timeout_s(request: dict[str, Any]) -> float:
    return 600.0 * request.get("iterations", 1)


def run_seconds(status: dict[str, Any]) -> float:
    started = datetime.fromisoformat(status["started_at"])
    closed = datetime.fromisoformat(status["closed_at"])
    return (closed - started).total_seconds()


def kiln_loop(args: argparse.Namespace, topo: Any, suffix: str) -> Side:
    """One run with ``iterations: N``; reads ``status.iterations[]`` (issue 16's contract)."""
    request = train_request(args, topo.env_url, seed_start=args.seed_start, adapter="base",
                            output=f"vs-trl-{suffix}", iterations=args.iterations)
    status = submit_and_wait(topo, request, mode="loop")
    records = sorted(status.get("iterations") or [], key=lambda r: r["iteration"])
    if [r["iteration"] for r in records] != list(range(1, args.iterations + 1)):
        raise SystemExit(f"status.iterations lists {[r['iteration'] for r in records]}, expected 1..{args.iterations}")
    print(f"Kiln loop run: {run_seconds(status):.1f}s from submission to close", flush=True)
    return Side("Kiln, one run, iterations: N", [r["wall_ms"] / 1000.0 for r in records],
                [float(r["mean_return"]) for r in records])


def kiln_chained(args: argparse.Namespace, topo: Any, suffix: str) -> Side:
    """N single-iteration runs, each from the previous run's adapter (no optimizer state carried)."""
    walls, returns, adapter = [], [], "base"
    for k in range(1, args.iterations + 1):
        output = f"vs-trl-{suffix}-{k}"
        request = train_request(args, topo.env_url, seed_start=args.seed_start + (k - 1) * args.groups,
                                adapter=adapter, output=output, iterations=None)
        status = submit_and_wait(topo, request, mode="chained")
        walls.append(run_seconds(status))
        returns.append(float(status["progress"]["mean_return"]))
        adapter = output
    return Side("Kiln, chained single runs", walls, returns)


def run_kiln(args: argparse.Namespace, topo: Any) -> Side:
    started = time.monotonic()
    topo.start_kiln(gpu_workers=1)
    warm = {"kind": "rollout", "environments": [topo.env_url], "groups": 1, "group_size": 2, "thinking": True,
            "seed_start": 10**6, **workload(args)[0]}
    submit_and_wait(topo, warm, mode="chained")
    print(f"Kiln side: workers up and warmed up in {time.monotonic() - started:.1f}s, not counted", flush=True)
    suffix = uuid.uuid4().hex[:6]
    return kiln_loop(args, topo, suffix) if args.kiln_mode == "loop" else kiln_chained(args, topo, suffix)


# ----------------------------------------------------------------------------- report
def report(args: argparse.Namespace, trl: Side | None, kiln: Side | None) -> None:
    sides = [s for s in (trl, kiln) if s is not None]
    print(f"\n{args.groups} groups x {args.group_size}, {args.iterations} iterations, {args.threads} torch "
          f"thread(s) per side, {os.cpu_count()} cores, {datetime.now(UTC):%Y-%m-%d}")
    for index, s in enumerate(sides):
        print(f"side {index + 1}: {s.label}")
    print("iteration" + "".join(f" | side {i + 1} s/it  return" for i in range(len(sides))))
    for k in range(args.iterations):
        print(f"{k + 1:>9}" + "".join(f" | {s.walls_s[k]:>11.2f} {s.returns[k]:>7.3f}" for s in sides))
    for s in sides:
        print(f"{s.label}: {s.mean_wall_s:.2f} s/iteration, final mean return {s.returns[-1]:.3f}")
    if trl is not None and kiln is not None:
        print(f"ratio (Kiln / TRL time per iteration): {kiln.mean_wall_s / trl.mean_wall_s:.2f}x (target <= 1.0)")
        print(f"final mean return: Kiln {kiln.returns[-1]:.3f} vs TRL {trl.returns[-1]:.3f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--seed-start", type=int, default=0)
    parser.add_argument("--kiln-mode", choices=("loop", "chained"), default="loop")
    parser.add_argument("--echo-lambda", type=float, default=0.05, help="Kiln's ECHO λ (TRL has no ECHO)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="both sides' learning rate (default: the demo's 1e-3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each training process")
    parser.add_argument("--sides", choices=("both", "kiln", "trl"), default="both")
    parser.add_argument("--trl-python", type=Path, default=DEFAULT_TRL_PYTHON)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit of the TRL side")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sides != "kiln" and not Path(args.trl_python).exists():
        print(SETUP_LINE)
        return 2
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        os.environ.pop(var, None)
    import torch

    torch.set_num_threads(args.threads)
    from kiln.policy.tiny import build_tiny_model
    from kiln.settings import Settings
    from tests.support.topology import Topology

    with tempfile.TemporaryDirectory(prefix="kiln-vs-trl-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "model")
        sessions = max(8, args.groups * args.group_size)
        slots = Settings.model_fields["gpu_max_concurrent_activities"].default  # the product default
        topo = Topology(root=work, model_path=model_dir, gpu_max_concurrent=slots, env_max_sessions=sessions)
        trl = kiln = None
        try:
            topo.start_servers()
            if args.sides != "kiln":
                trl = run_trl(args, topo.env_url, model_dir, work)
            if args.sides != "trl":
                kiln = run_kiln(args, topo)
        except KilnRejected as rejected:
            print(rejected.code)
            return 3
        finally:
            topo.close()
        report(args, trl, kiln)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
