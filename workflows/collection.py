"""Collection inside a run workflow: one ``collect_group`` activity per scheduled seed group.

Used for the run's own groups (every iteration's) and for both sides of the paired evaluation.
The schedule (which seed on which environment) comes from ``kiln.core.run_plan``; this module fans the
activities out (at most the plan's ``parallel_groups`` in flight: the ``KILN_RUN_PARALLEL_GROUPS``
setting the run was admitted with) and folds their outcomes into the run's
status. A collection of more than ``CHUNK_GROUPS`` groups runs chunk by chunk in child workflows
(``workflows/chunk.py``), so no history grows with the number of groups; either way the groups
end up in S3 group indexes and only a ``GroupSet`` reference travels on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.control import ControlActivities
    from activities.gpu import GpuActivities
    from kiln.core.contracts import EpisodeFields, EpisodeSettings, RunRequest, reset_payload
    from kiln.core.records import (
        AdapterRef,
        AdmissionResult,
        ChunkResult,
        CollectGroupInput,
        CollectGroupResult,
        CollectionPlan,
        DiscoveryResult,
        GroupIndexInput,
        GroupOutcome,
        GroupSet,
        PolicyInput,
        PolicyResult,
        StoredObject,
    )
    from kiln.core.run_plan import CHUNK_GROUPS, GroupSlot, chunks
    from kiln.core.run_status import Interruption, Progress, RunStatus, reset_warning
    from kiln.core.unfinished_thinking import unfinished_thinking_message
    from workflows import ui
    from kiln.core.openenv.capacity import merge_capacity
    from workflows.capacity import capacity_failure, capacity_refusals, capacity_wait_for
    from workflows.names import CHUNK_WORKFLOW
    from workflows.options import ActivityCaller


@dataclass
class RunContext:
    """What every stage of one run needs: its id, typed request, admission and discovery results."""

    run_id: str
    request: RunRequest
    admission: AdmissionResult
    discovery: DiscoveryResult
    call: ActivityCaller
    status: RunStatus
    thinking: bool | None = None  # the run's thinking mode, resolved against the model


def run_policy_input(
    request: RunRequest,
    *,
    adapter: str | None = None,
    adapter_ref: AdapterRef | None = None,
    expected: dict[str, Any] | None = None,
) -> PolicyInput:
    """What resolves a policy that collects this run's groups (the starting one, and each online-RL
    iteration's adapter): the run's sampling settings and its thinking mode, which the gpu worker
    resolves against the model's chat template exactly as for ``collect_group``."""
    return PolicyInput(
        inference=request.model_dump(mode="json", include=set(EpisodeFields.model_fields)),
        thinking=request.thinking,
        adapter=adapter,
        adapter_ref=adapter_ref,
        expected=expected,
    )


async def resolve_policy(ctx: RunContext, inp: PolicyInput) -> PolicyResult:
    label = inp.adapter_ref.name if inp.adapter_ref else (inp.adapter or "base")
    return await ctx.call(GpuActivities.resolve_policy, inp, summary=f"resolve policy identity ({label})")


def caller_for(plan: CollectionPlan) -> ActivityCaller:
    return ActivityCaller(
        control_queue=plan.control_queue, gpu_queue=plan.gpu_queue, heartbeat=timedelta(seconds=plan.heartbeat_s)
    )


async def _collect_waiting_for_capacity(
    call: ActivityCaller, plan: CollectionPlan, inp: CollectGroupInput, gate: asyncio.Semaphore, *, summary: str
) -> CollectGroupResult:
    """One group's ``collect_group`` activity; a refusal for capacity waits in a workflow timer.

    An attempt at a full environment ends within seconds (``environment_at_capacity``); the wait
    happens here, outside ``gate``, so it holds no gpu slot. It is bounded by the request's
    ``capacity_wait_seconds`` counted from the first refusal (``kiln.core.openenv.capacity``).
    """
    waited_from = None
    retries = 0
    refused = 0  # refusals met by the attempts that ended for capacity (counted in the result)
    while True:
        try:
            async with gate:
                result: CollectGroupResult = await call(GpuActivities.collect_group, inp, summary=summary)
            if refused and result.capacity is not None:
                refusals = int(result.capacity.get("refusals") or 0) + refused
                result = result.model_copy(update={"capacity": {**result.capacity, "refusals": refusals}})
            return result
        except ActivityError as err:
            refused += capacity_refusals(err)
            waited_from = waited_from or workflow.now()  # the first refusal starts the wait
            waited = (workflow.now() - waited_from).total_seconds()
            pause = capacity_wait_for(err, waited, plan.capacity_wait_seconds, retries)
            if pause is None:
                raise capacity_failure(err, inp.group_index, inp.settings.group_size, waited) or err  # noqa: B904 - the failure names err's details; a cause would change what history records
            retries += 1
            await workflow.sleep(pause)


async def collect_slots(plan: CollectionPlan, on_group: Callable[[GroupOutcome], None]) -> list[StoredObject]:
    """Collect every slot of ``plan`` in this workflow; the stored groups in group order."""
    call = caller_for(plan)
    gate = asyncio.Semaphore(plan.parallel_groups)
    results: list[CollectGroupResult] = []

    async def one(slot: GroupSlot) -> None:
        env = plan.environments[slot.environment_index]
        inp = CollectGroupInput(
            run_id=plan.run_id,
            group_index=slot.group_index,
            environment_index=slot.environment_index,
            seed=slot.seed,
            reset_payload=reset_payload(plan.reset_templates[slot.environment_index], slot.seed),
            inspection=env.inspection,
            settings=plan.settings,
            behavior_policy=plan.behavior_policy,
            adapter_ref=plan.adapter_ref,
            credential_id=plan.credential_ids[slot.environment_index] if plan.credential_ids else None,
            on_interrupt=plan.on_interrupt,
            label=plan.label,
            signal_on_no_output=plan.signal_on_no_output,
        )
        result = await _collect_waiting_for_capacity(
            call, plan, inp, gate, summary=f"{plan.label} {slot.group_index} seed {slot.seed} on {env.base_url}"
        )
        results.append(result)
        on_group(
            GroupOutcome(
                group_index=result.group_index,
                environment_index=slot.environment_index,
                return_sum=sum(result.returns),
                rollouts=len(result.returns),
                latency_ms=result.model_latency_ms,
                tokens=result.model_tokens,
                worker=result.worker,
                attempt=result.attempt,
                interruption_code=result.interruption_code,
                capacity=result.capacity,
                reset_differences=result.reset_differences,
                unfinished_thinking=result.unfinished_thinking,
                signal=result.signal,
            )
        )

    await asyncio.gather(*(one(slot) for slot in plan.slots))
    return [r.group for r in sorted(results, key=lambda r: r.group_index)]


def fold_outcome(
    status: RunStatus, progress: Progress, outcome: GroupOutcome, label: str, environment_url: str
) -> None:
    """One collected group (from the environment at ``environment_url``) into the run's status
    (progress, capacity, interruptions)."""
    if outcome.capacity is not None:  # per run: summed over its groups (kiln.core.openenv.capacity)
        status.environment_capacity[environment_url] = merge_capacity(
            status.environment_capacity.get(environment_url), outcome.capacity
        )
    if outcome.reset_differences:
        status.warn(reset_warning(label, outcome.group_index, outcome.reset_differences))
    if outcome.unfinished_thinking:
        status.warn(unfinished_thinking_message(f"{label} {outcome.group_index}"))
    if outcome.attempt > 1:
        status.record_interruption(
            Interruption(
                stage=label, group_index=outcome.group_index, attempts=outcome.attempt, code=outcome.interruption_code
            )
        )
    progress.add_group(
        outcome.return_sum,
        outcome.rollouts,
        latency_ms=outcome.latency_ms,
        tokens=outcome.tokens,
        group_index=outcome.group_index,
        worker=outcome.worker,
        attempt=outcome.attempt,
    )
    if progress is status.progress:
        status.mean_return = progress.mean_return
    ui.show_progress(status)


async def collect_groups(
    ctx: RunContext,
    policy: PolicyResult,
    *,
    slots: list[GroupSlot],
    settings: EpisodeSettings,
    progress: Progress,
    label: str,
    scope: str,
    signals: list[int] | None = None,
) -> GroupSet:
    """Collect every slot with ``policy``; the stored groups as a ``GroupSet``.

    ``scope`` names this collection within the run (``collection``, ``iteration-3``, ``eval-1-
    baseline`` …): chunk child workflows are ``<run id>.<scope>.chunk-<n>``. With ``signals``
    (dynamic sampling), each group asks its worker whether training keeps it, and the indexes of
    those that carry reward variation are appended to ``signals``.
    """
    plan = CollectionPlan(
        run_id=ctx.run_id,
        label=label,
        slots=slots,
        environments=ctx.discovery.environments,
        reset_templates=ctx.admission.reset_templates,
        credential_ids=ctx.request.credential_ids,
        settings=settings,
        behavior_policy=policy.behavior_policy,
        adapter_ref=policy.adapter_ref,
        on_interrupt=ctx.request.on_interrupt,
        capacity_wait_seconds=ctx.request.capacity_wait_seconds,
        control_queue=ctx.call.queues["control"],
        gpu_queue=ctx.call.queues["gpu"],
        heartbeat_s=ctx.call.heartbeat.total_seconds(),
        parallel_groups=ctx.admission.parallel_groups,
        signal_on_no_output=ctx.request.effective_training_config().on_no_output if signals is not None else None,
    )

    def fold(outcome: GroupOutcome) -> None:
        url = ctx.discovery.environments[outcome.environment_index].base_url
        fold_outcome(ctx.status, progress, outcome, label, url)
        if signals is not None and outcome.signal:
            signals.append(outcome.group_index)

    parts = chunks(slots, CHUNK_GROUPS)
    if len(parts) == 1:
        refs = await collect_slots(plan, fold)
        return await ctx.call(
            ControlActivities.index_groups, GroupIndexInput(groups=refs), summary=f"index {len(refs)} {label}s"
        )
    sets: list[GroupSet] = []
    for number, part in enumerate(parts):
        result: ChunkResult = await workflow.execute_child_workflow(
            CHUNK_WORKFLOW,
            plan.chunk(part),
            id=f"{ctx.run_id}.{scope}.chunk-{number}",
            task_queue=plan.control_queue,
            result_type=ChunkResult,
            static_summary=f"{label}s {part[0].group_index}…{part[-1].group_index}",
        )
        for outcome in result.outcomes:
            fold(outcome)
        sets.append(result.groups)
    return GroupSet.join(sets)
