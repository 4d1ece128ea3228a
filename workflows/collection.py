"""Collection inside a run workflow: one ``collect_group`` activity per scheduled seed group.

Used for the run's own groups and for both sides of the paired evaluation. The schedule (which
seed on which environment) comes from ``kiln.run_plan``; this module only fans the activities out
(at most ``MAX_PARALLEL_GROUPS`` in flight) and folds their results into the run's status.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.gpu import GpuActivities
    from kiln.contracts import EpisodeSettings, RunRequest, reset_payload
    from kiln.records import (
        AdmissionResult,
        CollectGroupInput,
        CollectGroupResult,
        DiscoveryResult,
        PolicyInput,
        PolicyResult,
        StoredObject,
    )
    from kiln.run_plan import GroupSlot
    from kiln.run_status import Interruption, Progress, RunStatus
    from workflows import ui
    from workflows.capacity import capacity_failure, capacity_wait_for
    from workflows.options import MAX_PARALLEL_GROUPS, ActivityCaller


@dataclass
class RunContext:
    """What every stage of one run needs: its id, typed request, admission and discovery results."""

    run_id: str
    request: RunRequest
    admission: AdmissionResult
    discovery: DiscoveryResult
    call: ActivityCaller
    status: RunStatus


async def resolve_policy(ctx: RunContext, inp: PolicyInput) -> PolicyResult:
    label = inp.adapter_ref.name if inp.adapter_ref else (inp.adapter or "base")
    return await ctx.call(GpuActivities.resolve_policy, inp, summary=f"resolve policy identity ({label})")


async def _collect_waiting_for_capacity(
    ctx: RunContext, inp: CollectGroupInput, gate: asyncio.Semaphore, *, summary: str
) -> CollectGroupResult:
    """One group's ``collect_group`` activity; a refusal for capacity waits in a workflow timer.

    An attempt at a full environment ends within seconds (``environment_at_capacity``); the wait
    happens here, outside ``gate``, so it holds no gpu slot. It is bounded by the request's
    ``capacity_wait_seconds`` counted from the first refusal (``kiln.openenv.capacity``).
    """
    waited_from = None
    retries = 0
    while True:
        try:
            async with gate:
                return await ctx.call(GpuActivities.collect_group, inp, summary=summary)
        except ActivityError as err:
            waited_from = waited_from or workflow.now()  # the first refusal starts the wait
            waited = (workflow.now() - waited_from).total_seconds()
            pause = capacity_wait_for(err, waited, ctx.request.capacity_wait_seconds, retries)
            if pause is None:
                raise capacity_failure(err, inp.group_index, inp.settings.group_size, waited) or err
            retries += 1
            await workflow.sleep(pause)


async def collect_groups(
    ctx: RunContext,
    policy: PolicyResult,
    *,
    slots: list[GroupSlot],
    settings: EpisodeSettings,
    progress: Progress,
    label: str,
) -> list[StoredObject]:
    """Collect every slot with ``policy``; the stored groups in group order."""
    environments = ctx.discovery.environments
    credential_ids = ctx.request.credential_ids
    gate = asyncio.Semaphore(MAX_PARALLEL_GROUPS)
    results: list[CollectGroupResult] = []

    async def one(slot: GroupSlot) -> None:
        env = environments[slot.environment_index]
        inp = CollectGroupInput(
            run_id=ctx.run_id,
            group_index=slot.group_index,
            environment_index=slot.environment_index,
            seed=slot.seed,
            reset_payload=reset_payload(ctx.admission.reset_templates[slot.environment_index], slot.seed),
            inspection=env.inspection,
            settings=settings,
            behavior_policy=policy.behavior_policy,
            adapter_ref=policy.adapter_ref,
            credential_id=credential_ids[slot.environment_index] if credential_ids else None,
            on_interrupt=ctx.request.on_interrupt,
            label=label,
        )
        result = await _collect_waiting_for_capacity(
            ctx, inp, gate, summary=f"{label} {slot.group_index} seed {slot.seed} on {env.base_url}"
        )
        if result.capacity is not None:
            ctx.status.environment_capacity[env.base_url] = result.capacity
        results.append(result)
        if result.attempt > 1:
            ctx.status.interruptions.append(
                Interruption(
                    stage=label, group_index=slot.group_index, attempts=result.attempt, code=result.interruption_code
                )
            )
        progress.add_group(
            result.returns,
            latency_ms=result.model_latency_ms,
            tokens=result.model_tokens,
            group_index=slot.group_index,
            worker=result.worker,
            attempt=result.attempt,
        )
        if progress is ctx.status.progress:
            ctx.status.mean_return = progress.mean_return
        ui.show_progress(ctx.status)

    await asyncio.gather(*(one(slot) for slot in slots))
    return [r.group for r in sorted(results, key=lambda r: r.group_index)]
