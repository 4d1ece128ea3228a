"""``KilnRunQueue``: the FIFO admission queue, one long-lived workflow per control task queue.

Runs ask for a slot with an update (``request_slot``: answers their sequence number and position,
or rejects with ``openenv_run_capacity_full`` beyond ``max_tracked_runs``); the queue grants up to
``max_active_runs`` slots in arrival order by signalling ``slot_granted`` to the run, keeps queued
runs informed of their position, and takes slots back on ``release_slot`` (a run ending in any way,
or withdrawn while queued). History stays bounded through continue-as-new.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from kiln.core.side_records import QueueState, SlotReply, SlotRequest
    from workflows.names import QUEUE_WORKFLOW, queue_workflow_id  # noqa: F401  (queue_workflow_id re-exported)


# Patch id: a round's signals are sent together (before it, one at a time, each awaited).
SIGNALS_AT_ONCE = "queue-signals-at-once"


@workflow.defn(name=QUEUE_WORKFLOW)
class RunQueueWorkflow:
    @workflow.init
    def __init__(self, state: QueueState) -> None:
        # Taking the input here (not in run) means an update delivered with the start (update-
        # with-start) already sees the state it must modify.
        self.state = state
        self._dirty = True
        self._told: dict[str, int] = {}

    @workflow.run
    async def run(self, state: QueueState) -> None:
        while True:
            await workflow.wait_condition(lambda: self._dirty or workflow.info().is_continue_as_new_suggested())
            self._dirty = False
            await self._grant()
            if workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(self.state)

    async def _grant(self) -> None:
        if not workflow.patched(SIGNALS_AT_ONCE):
            await self._grant_one_by_one()  # histories recorded before the patch replay this way
            return
        state = self.state
        granted: list[str] = []
        while state.waiting and len(state.active) < state.max_active_runs:
            run_id = state.waiting.pop(0)
            state.active.append(run_id)
            self._told.pop(run_id, None)
            granted.append(run_id)
        told: list[tuple[str, int]] = []
        for index, run_id in enumerate(state.waiting):
            if self._told.get(run_id) != index + 1:
                self._told[run_id] = index + 1
                told.append((run_id, index + 1))
        # Every signal of one round leaves in one workflow task: under a burst of submissions the
        # queue answers in a few round trips, not one per waiting run.
        delivered = await asyncio.gather(
            *(self._signal(run_id, "slot_granted", None) for run_id in granted),
            *(self._signal(run_id, "queue_position", position) for run_id, position in told),
        )
        for run_id, ok in zip(granted, delivered):
            if not ok and run_id in state.active:
                state.active.remove(run_id)
                state.sequences.pop(run_id, None)
                self._dirty = True  # its slot goes to the next waiting run

    async def _grant_one_by_one(self) -> None:
        state = self.state
        while state.waiting and len(state.active) < state.max_active_runs:
            run_id = state.waiting.pop(0)
            state.active.append(run_id)
            self._told.pop(run_id, None)
            if not await self._signal(run_id, "slot_granted", None):
                state.active.remove(run_id)
                state.sequences.pop(run_id, None)
        for index, run_id in enumerate(list(state.waiting)):
            position = index + 1
            if self._told.get(run_id) != position:
                self._told[run_id] = position
                await self._signal(run_id, "queue_position", position)

    async def _signal(self, run_id: str, name: str, arg: Any) -> bool:
        try:
            handle = workflow.get_external_workflow_handle(run_id)
            if arg is None:
                await handle.signal(name)
            else:
                await handle.signal(name, arg)
            return True
        except Exception:  # noqa: BLE001 - the run is gone (terminated or reset): drop it
            workflow.logger.warning("run %s no longer exists; dropping it from the queue", run_id)
            return False

    @workflow.update(description="Join the FIFO queue: returns the run's sequence and position.")
    def request_slot(self, request: SlotRequest) -> SlotReply:
        state = self.state
        run_id = request.run_id
        if run_id in state.active:
            return SlotReply(sequence=state.sequences.get(run_id, 0), position=0)
        if run_id in state.waiting:
            return SlotReply(sequence=state.sequences[run_id], position=state.waiting.index(run_id) + 1)
        tracked = len(state.active) + len(state.waiting)
        if tracked >= state.max_tracked_runs:
            raise ApplicationError(
                f"Kiln is tracking {tracked} runs (max_tracked_runs={state.max_tracked_runs}); "
                "wait for runs to finish or raise KILN_MAX_TRACKED_RUNS",
                {"code": "openenv_run_capacity_full", "retryable": True, "stage": "admission"},
                type="openenv_run_capacity_full",
                non_retryable=True,
            )
        state.sequence += 1
        state.sequences[run_id] = state.sequence
        state.waiting.append(run_id)
        self._dirty = True
        return SlotReply(sequence=state.sequence, position=len(state.waiting))

    @workflow.signal(description="A run ended: free its slot (or drop it from the waiting list).")
    def release_slot(self, run_id: str) -> None:
        state = self.state
        if run_id in state.active:
            state.active.remove(run_id)
        if run_id in state.waiting:
            state.waiting.remove(run_id)
        state.sequences.pop(run_id, None)
        self._told.pop(run_id, None)
        self._dirty = True

    @workflow.query(description="The queue: active runs, waiting runs in order, sequences.")
    def snapshot(self) -> dict[str, Any]:
        return self.state.model_dump()
