"""Collecting an online run's iterations: one iteration's groups (refilled when dynamic sampling
asks), and — with ``max_staleness`` > 1 — the pipeline that collects later iterations up to N
adapter versions ahead of training, one collection at a time, in iteration order
(``kiln.core.stale_pipeline`` plans it; ``workflows.stages`` drives it).

``IterationCollection`` is the base of ``workflows.stages.RunStages``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from kiln.core.records import GroupSet, PolicyResult, RunCarry, TrainedPolicy
    from kiln.core.run_plan import DynamicSamplingRecord, behavior_lag, iteration_schedule
    from kiln.core.run_status import Progress
    from kiln.core.stale_pipeline import StalenessRecord, pipeline_starts, sampler_version
    from workflows.collection import RunContext
    from workflows.refill import collect_refilled
    from workflows.status import StatusKeeper

# max_staleness > 1 (runs that could not be admitted before it): collection pipelined up to N
# adapter versions ahead. Runs with max_staleness 0 or 1 never call it, so their commands are unchanged.
STALE_PIPELINE_PATCH = "stale-pipeline"
# A later iteration being collected ahead (max_staleness > 1): its task, sampler and progress.
Ahead = tuple["asyncio.Task[GroupSet]", TrainedPolicy, Progress]


class IterationCollection(StatusKeeper):
    """An iteration's collection, and the collection pipeline of a run with ``max_staleness`` > 1."""

    # How dynamic sampling refilled each iteration's groups in this history (by iteration).
    _refills: dict[int, DynamicSamplingRecord | None]  # set by the workflow's __init__
    _deep: bool = False  # max_staleness > 1: the pipelined collection (kiln.core.stale_pipeline)

    async def _collect(
        self, ctx: RunContext, policy: PolicyResult, iteration: int, progress: Progress | None = None
    ) -> GroupSet:
        """One iteration's groups (a one-iteration run's are iteration 1's), sampled by ``policy``."""
        request = ctx.request
        single = request.iterations == 1
        groups, refill = await collect_refilled(
            ctx,
            policy,
            iteration=iteration,
            slots=iteration_schedule(request, iteration, len(ctx.discovery.environments)),
            settings=request.episode_settings(ctx.thinking),
            progress=progress or self._status.progress,
            label="group" if single else f"iteration {iteration} group",
            scope="collection" if single else f"iteration-{iteration}",
        )
        self._refilled(iteration, refill)
        return groups

    def _refilled(self, iteration: int, refill: DynamicSamplingRecord | None) -> None:
        """Keep iteration ``iteration``'s refill record for its bundle; warn when it hit the cap."""
        self._refills[iteration] = refill
        if refill is not None and refill.capped:
            self._status.warn(refill.warning(f"iteration {iteration}"))

    async def _take(
        self, ctx: RunContext, carry: RunCarry, k: int, ahead: dict[int, Ahead]
    ) -> tuple[TrainedPolicy, GroupSet]:
        """Iteration ``k``'s sampler and groups in a pipelined run: collected ahead (in this history,
        or carried across continue-as-new), or now with the current policy (iteration 1)."""
        if k in ahead:
            task, sampler, progress = ahead.pop(k)
            self._status.progress = progress
            return sampler, await task
        for item in carry.pipeline:
            if item.iteration == k:
                carry.pipeline.remove(item)
                self._status.progress = item.progress or self._status.progress
                if item.refill is not None:  # its warning was given before continue-as-new
                    self._refills[k] = item.refill
                return item.sampler, item.groups
        self._status.progress = Progress.planned(ctx.request.groups, ctx.request.group_size)
        return carry.current, await self._collect(ctx, carry.current.policy, k)

    def _launch(self, ctx: RunContext, carry: RunCarry, k: int, ahead: dict[int, Ahead]) -> None:
        """Start the collections that may begin while iteration ``k`` trains, each sampled by the
        adapter ``k`` trains from and queued behind the one before it (one collection at a time)."""
        request = ctx.request
        for j in pipeline_starts(request.max_staleness, k, request.iterations):
            before = ahead[max(ahead)][0] if ahead else None
            progress = Progress.planned(request.groups, request.group_size)
            task = asyncio.create_task(self._collect_after(before, ctx, carry.current.policy, j, progress))
            ahead[j] = (task, carry.current, progress)

    async def _collect_after(
        self, before: "asyncio.Task[GroupSet] | None", ctx: RunContext, policy: PolicyResult, j: int, progress: Progress
    ) -> GroupSet:
        """Iteration ``j``'s groups, collected once the collection queued before it has finished."""
        if before is not None:
            await before
        return await self._collect(ctx, policy, j, progress)

    def _stale_record(self, request: Any, iteration: int) -> StalenessRecord:
        """The age of ``iteration``'s data in a pipelined run (its bundle's ``staleness``)."""
        bound = request.max_staleness
        return StalenessRecord(
            max_staleness=bound,
            behavior_version=sampler_version(bound, iteration),
            lag=behavior_lag(request, iteration),
        )

    def _trainer_bound(self, request: Any, k: int) -> dict[str, int]:
        """The version bound the trainer of iteration ``k`` applies in a pipelined run."""
        record = self._stale_record(request, k)
        return {"max_staleness": record.max_staleness, "behavior_version": record.behavior_version}
