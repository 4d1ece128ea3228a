"""A run's status stays one small payload at the documented maxima (issue 16's history bound).

The status is the run's workflow result and travels in its continue-as-new input, so it must stay
under the 256 KiB payload bound however many groups were collected, re-collected or trained:
16,384 groups per iteration, 1,000 iterations, every group interrupted once.
"""

from __future__ import annotations

from temporalio.contrib.pydantic import pydantic_data_converter

from kiln.core.run_status import Interruption, IterationStatus, Progress, RunStatus

MAX_PAYLOAD_BYTES = 256 * 1024
GROUPS, ITERATIONS = 16_384, 1_000


def _payload_bytes(status: RunStatus) -> int:
    return len(pydantic_data_converter.payload_converter.to_payloads([status])[0].data)


def test_status_at_the_documented_maxima_stays_under_the_payload_bound() -> None:
    status = RunStatus(run_id="r" * 64)
    for k in range(1, ITERATIONS + 1):
        if k in (1, ITERATIONS):  # the per-group folds of two whole iterations
            status.progress = Progress.planned(GROUPS, 2)
            for g in range(GROUPS):
                worker = f"{g}@gpu-host-{g % 64}"
                status.progress.add_group(2.0, 2, latency_ms=1.5, tokens=96, group_index=g, worker=worker, attempt=2)
                status.record_interruption(
                    Interruption(stage=f"iteration {k} group", group_index=g, attempts=2, code="executor_interrupted")
                )
        status.record_iteration(
            IterationStatus(
                iteration=k, seed_start=k * GROUPS, behavior_adapter_sha256="sha256:" + "a" * 64,
                staleness=1, mean_return=1.25, invalid_action_rate=0.125, trained=True, steps=64, loss=0.5,
                kl=0.01, adapter_sha256="sha256:" + "b" * 64, eval_mean_return=1.5,
                eval_baseline_mean_return=1.0, wall_ms=10**6,
            )
        )
    status.warnings = ["w" * 300] * 200  # MAX_WARNINGS long ones

    size = _payload_bytes(status)
    assert size < MAX_PAYLOAD_BYTES, size
    assert status.interruptions_total == 2 * GROUPS
    assert len(status.interruptions) == 256
    assert [i.group_index for i in status.interruptions[-2:]] == [GROUPS - 2, GROUPS - 1]
    assert status.interruptions[-1].stage == f"iteration {ITERATIONS} group"
    assert len(status.progress.groups) == 512 and status.progress.groups_completed == GROUPS
    assert [r.iteration for r in status.iterations] == list(range(ITERATIONS - 99, ITERATIONS + 1))
