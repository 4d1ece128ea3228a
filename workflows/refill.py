"""Dynamic sampling inside a run workflow: an iteration's collection, then its refill rounds.

With ``training_config.dynamic_sampling`` (DAPO; verl's ``filter_groups``) every collected group
reports whether training keeps it (reward variation, the trainer's own selection); while fewer
than ``groups`` do, and ``max_refill_rounds`` allows, one more round collects a fresh seed per
missing group, continuing the iteration's group indexes and seeds (``kiln.core.run_plan.refill_slots``).
The rounds are recorded (``DynamicSamplingRecord``) in the iteration's bundle summary, which
``verify`` checks against the bundle's groups and seeds. Runs started before this existed never
call ``workflow.patched`` (they cannot hold the setting), so their histories replay unchanged.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from kiln.core.contracts import EpisodeSettings
    from kiln.core.records import GroupSet, PolicyResult
    from kiln.core.run_plan import DynamicSamplingRecord, GroupSlot, RefillRound, refill_slots
    from kiln.core.run_status import Progress
    from workflows.collection import RunContext, collect_groups

# Patch id: an iteration with dynamic sampling collects refill rounds after its groups.
DYNAMIC_SAMPLING_PATCH = "dynamic-sampling"


async def collect_refilled(
    ctx: RunContext,
    policy: PolicyResult,
    *,
    iteration: int,
    slots: list[GroupSlot],
    settings: EpisodeSettings,
    progress: Progress,
    label: str,
    scope: str,
) -> tuple[GroupSet, DynamicSamplingRecord | None]:
    """Iteration ``iteration``'s groups (``slots``), refilled when the run asks for dynamic
    sampling; the record is None when it does not."""
    request = ctx.request
    dynamic = request.effective_training_config().dynamic_sampling if request.kind == "train" else None

    async def collect(part: list[GroupSlot], part_scope: str, signals: list[int] | None) -> GroupSet:
        return await collect_groups(
            ctx,
            policy,
            slots=part,
            settings=settings,
            progress=progress,
            label=label,
            scope=part_scope,
            signals=signals,
        )

    if dynamic is None or not workflow.patched(DYNAMIC_SAMPLING_PATCH):
        return await collect(slots, scope, None), None
    signals: list[int] = []
    sets = [await collect(slots, scope, signals)]
    collected, rounds = len(slots), []
    environments = len(ctx.discovery.environments)
    for number in range(1, dynamic.max_refill_rounds + 1):
        more = refill_slots(request, iteration, environments, collected=collected, signal=len(signals), round_=number)
        if not more:
            break
        progress.plan_more(len(more), settings.group_size)
        sets.append(await collect(more, f"{scope}-refill-{number}", signals))
        rounds.append(
            RefillRound(round=number, group_indexes=[s.group_index for s in more], seeds=[s.seed for s in more])
        )
        collected += len(more)
    record = DynamicSamplingRecord(
        target_groups=request.groups,
        max_refill_rounds=dynamic.max_refill_rounds,
        rounds=rounds,
        signal_groups=len(signals),
        capped=len(signals) < request.groups,
    )
    return GroupSet.join(sets), record
