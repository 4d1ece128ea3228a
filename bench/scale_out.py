"""Scale-out: the same collection-heavy run with 1 and with 2 gpu worker processes on one queue.

The production topology without Docker (tests/support/topology.py): a Temporal dev server,
SeaweedFS, a counter environment with 8 sessions, the Kiln API, one control worker, and gpu
workers as separate processes running ``python -m workers gpu``'s main (each its own ``KILN_HOME``, one torch
thread). The policy is the tiny demo model sampling few tokens (the fast policy: a group costs
~0.2 s), so the figure shows whether anything but the workers' own work bounds throughput. Each configuration first runs a warm-up (a fresh worker's first group pays its one-time
model warm-up), then ``--rounds`` measured rollout runs; the fastest is kept. groups/s is
``groups / (closed_at - started_at)`` of the run, as the workflow records it. Prints both figures
and the ratio (2 workers / 1 worker); the run's status also lists which worker collected each
group, so the split between the workers is printed too.

Run: ``python -m bench.scale_out [--groups 24] [--rounds 2] [--slots 2] [--max-steps 6]
[--max-action-tokens 32]``. Runtime: a few minutes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.topology import Topology  # noqa: E402

SHAPE = {"max_steps": 6, "max_action_tokens": 32}


def request(env_url: str, groups: int) -> dict:
    return {
        "kind": "rollout",
        "environment_urls": [env_url],
        "groups": groups,
        "group_size": 2,
        "thinking": False,
        **SHAPE,
    }


def one_run(topo: Topology, groups: int) -> tuple[float, Counter]:
    code, body = topo.api_call("POST", "/v1/openenv/runs", request(topo.env_url, groups))
    assert code == 202, body
    status = topo.wait_run(body["run_id"], timeout_s=900)
    assert status["state"] == "completed", status.get("failure")
    started = datetime.fromisoformat(status["started_at"])
    closed = datetime.fromisoformat(status["closed_at"])
    seconds = (closed - started).total_seconds()
    return groups / seconds, Counter(g["worker"] for g in status["progress"]["groups"])


def measure(topo: Topology, groups: int, rounds: int, label: str) -> float:
    one_run(topo, 4)  # warm-up
    best = 0.0
    for index in range(rounds):
        rate, split = one_run(topo, groups)
        print(f"  {label} round {index + 1}: {rate:.3f} groups/s; groups per worker {dict(split)}", flush=True)
        best = max(best, rate)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="KILN_GPU_MAX_CONCURRENT_ACTIVITIES per worker")
    parser.add_argument("--max-steps", type=int, default=SHAPE["max_steps"])
    parser.add_argument("--max-action-tokens", type=int, default=SHAPE["max_action_tokens"])
    args = parser.parse_args()
    SHAPE.update(max_steps=args.max_steps, max_action_tokens=args.max_action_tokens)
    from kiln.core.policy.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="kiln-scale-out-") as tmp:
        root = Path(tmp)
        build_tiny_model(root / "model")
        topo = Topology(root=root, model_path=root / "model", gpu_max_concurrent=args.slots, env_max_sessions=8)
        try:
            started = time.monotonic()
            topo.start_servers().start_kiln(gpu_workers=1)
            print(f"stack up in {time.monotonic() - started:.1f}s; {args.groups} groups x 2 episodes per run, "
                  f"<= {args.max_steps} steps of <= {args.max_action_tokens} tokens; {args.slots} slot(s)/worker",
                  flush=True)
            one = measure(topo, args.groups, args.rounds, "1 gpu worker ")
            topo.gpus.append(topo.start_worker("gpu", "gpu-1"))
            two = measure(topo, args.groups, args.rounds, "2 gpu workers")
        finally:
            topo.close()
    print(f"1 gpu worker : {one:.3f} groups/s")
    print(f"2 gpu workers: {two:.3f} groups/s")
    print(f"ratio (2 / 1): {two / one:.2f}x")


if __name__ == "__main__":
    main()
