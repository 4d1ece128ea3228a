"""``KilnCollectChunkWorkflow``: one chunk of a large collection, in its own bounded history.

A run collecting more than ``CHUNK_GROUPS`` groups (kiln.core.run_plan) starts one of these per chunk,
as a child workflow ``<run id>.<scope>.chunk-<n>``; it collects the chunk's slots with the same
code as an unchunked run, stores their references as one group index and returns the index and
the groups' outcomes for the run's status. Cancelling the run cancels it; a failure fails the run
with the failing group's Kiln code.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.control import ControlActivities
    from kiln.core.records import ChunkResult, CollectionPlan, GroupIndexInput, GroupOutcome
    from workflows.collection import caller_for, collect_slots
    from workflows.names import CHUNK_WORKFLOW


@workflow.defn(name=CHUNK_WORKFLOW)
class CollectChunkWorkflow:
    def __init__(self) -> None:
        self._done = 0

    @workflow.query(description="Groups of this chunk collected so far.")
    def groups_completed(self) -> int:
        return self._done

    @workflow.run
    async def run(self, plan: CollectionPlan) -> ChunkResult:
        outcomes: list[GroupOutcome] = []

        def keep(outcome: GroupOutcome) -> None:
            outcomes.append(outcome)
            self._done += 1
            workflow.set_current_details(f"**{plan.label}s** {self._done}/{len(plan.slots)}")

        refs = await collect_slots(plan, keep)
        groups = await caller_for(plan)(
            ControlActivities.index_groups, GroupIndexInput(groups=refs), summary=f"index {len(refs)} {plan.label}s"
        )
        return ChunkResult(groups=groups, outcomes=sorted(outcomes, key=lambda o: o.group_index))
