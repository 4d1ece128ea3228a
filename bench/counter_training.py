"""ECHO λ × KL coefficient on the counter environment: held-out return, invalid actions, observation CE.

One real counter server, the tiny demo model (built fresh unless ``--model``), the demo's shape:
8 training groups × 4 episodes (seeds 0-7) sampled by the base model, then one adapter per setting
trained on exactly those groups (same seeds, same LoRA init), each evaluated on the same held-out
seeds (8 … 8+N-1, 2 episodes each) against the base. Observation CE is the token-weighted
cross-entropy of the held-out base transcripts' observation tokens (``kiln.core.train.world_model``).
Prints one table row per setting. A few minutes on 1 CPU thread.

Run: ``python -m bench.counter_training [--lambdas 0 0.05] [--kl 0 0.1] [--learning-rate 1e-3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.0, 0.05])
    parser.add_argument("--kl", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--optimizer", default=None)
    parser.add_argument("--variant", action="append", default=None, metavar="JSON",
                        help='extra TrainingConfig fields per variant, e.g. \'{"is_level": "cispo"}\' '
                        "(repeatable; each variant runs every λ × kl_coeff)")
    parser.add_argument("--eval-groups", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        os.environ.pop(var, None)

    import torch

    torch.set_num_threads(args.threads)
    from kiln.core.training_config import TrainingConfig
    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.policy.tiny import build_tiny_model
    from kiln.core.train.trainer import train_grpo
    from kiln.core.train.world_model import world_model_comparison
    from tests.support.counter_loop import collect, outcome
    from tests.support.servers import serve_example_env

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kiln-counter-bench-"))
    model = args.model or build_tiny_model(work / "model")
    runtime = PolicyRuntime.load(model)
    held_out = list(range(8, 8 + args.eval_groups))
    with serve_example_env("counter", max_concurrent_envs=8) as url:
        train_docs = collect(runtime, url, list(range(8)), group_size=4)
        base_docs = collect(runtime, url, held_out, group_size=2)
        base = outcome(base_docs)
        print(f"base: mean return {base.mean_return:.3f}, invalid-action rate {100 * base.invalid_rate:.1f}%"
              f" ({base.episodes} held-out episodes)")
        held_lines = [d["line"] for d in base_docs]
        print(f"{'lambda':>6} {'kl_coeff':>8} {'return':>7} {'invalid%':>8} {'obs CE base':>11} {'obs CE':>7}")
        for lam, kl, variant in [(lam, kl, v) for v in (args.variant or ["{}"]) for lam in args.lambdas
                                 for kl in args.kl]:
            extra = json.loads(variant)
            if args.learning_rate is not None:
                extra["learning_rate"] = args.learning_rate
            if args.optimizer is not None:
                extra["optimizer"] = args.optimizer
            config = TrainingConfig(kl_coeff=kl, echo={"lambda": lam} if lam > 0 else None, **extra)
            out = work / f"adapter-{lam}-{kl}-{abs(hash(variant))}"
            result = train_grpo(model_path=model, groups=[d["line"] for d in train_docs], config=config,
                                output_dir=out)
            result_docs = collect(runtime, url, held_out, group_size=2, adapter_dir=result.adapter_dir)
            got = outcome(result_docs)
            ce_base, ce = world_model_comparison(model, held_lines, adapter_dir=result.adapter_dir)
            print(f"{lam:>6} {kl:>8} {got.mean_return:>7.3f} {100 * got.invalid_rate:>8.1f} "
                  f"{ce_base['mean_env_ce']:>11.3f} {ce['mean_env_ce']:>7.3f}  {variant}", flush=True)
    print(f"{time.perf_counter() - started:.0f}s total")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
