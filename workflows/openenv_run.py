"""``OpenEnvRunWorkflow``: admission → discovery → collection → revalidation → training → publication.

One workflow per run; the workflow id is the run id. History carries only small records (see
``kiln.records``); every stage's work happens in an activity. The ``status`` query is the single
source of a run's progress for the API, the CLI and the Web UI.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.workflow import ActivityCancellationType
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from kiln.records import (
        AdapterRef,
        AdmissionInput,
        AdmissionResult,
        CollectGroupInput,
        CollectGroupResult,
        DiscoveryInput,
        DiscoveryResult,
        EvaluateInput,
        EvaluationResult,
        PolicyInput,
        PolicyResult,
        PostEvalInput,
        PostEvalResult,
        PublishInput,
        PublishResult,
        RevalidationInput,
        SideBundle,
        SideBundleInput,
        StoredObject,
        TrainInput,
        TrainResult,
        WorldModelInput,
        WorldModelResult,
    )
    from workflows import options
    from workflows.capacity import capacity_failure, capacity_wait_for
    from workflows.failures import failure_from, training_status
    from workflows.run_queue import SlotReply, SlotRequest

KILN_PHASE = SearchAttributeKey.for_keyword("KilnPhase")
KILN_STATUS = SearchAttributeKey.for_keyword("KilnStatus")
KILN_ENVIRONMENT = SearchAttributeKey.for_keyword("KilnEnvironment")
KILN_OUTPUT_ADAPTER = SearchAttributeKey.for_keyword("KilnOutputAdapter")
KILN_RUN_KIND = SearchAttributeKey.for_keyword("KilnRunKind")

STATUS_SCHEMA = "kiln.run-status.v1"
TERMINAL_PHASES = frozenset({"completed", "failed", "cancelled"})


def _stage_of(phase: str) -> str:
    return {
        "admitting": "admission",
        "queued": "admission",
        "discovering": "discovery",
        "collecting": "collection",
        "revalidating": "identity_verification",
        "training": "training",
        "evaluating": "environment_evaluation",
        "post_evaluating": "post_evaluation",
        "publishing": "artifact_publication",
    }.get(phase, "orchestration")


@workflow.defn(name=options.WORKFLOW_NAME)
class OpenEnvRunWorkflow:
    def __init__(self) -> None:
        self._status: dict[str, Any] = {
            "schema": STATUS_SCHEMA,
            "run_id": "",
            "kind": None,
            "phase": "admitting",
            "state": "running",
            "progress": {
                "groups_completed": 0,
                "groups_total": 0,
                "rollouts_completed": 0,
                "rollouts_total": 0,
            },
            "mean_return": None,
            "environments": [],
            "training": None,
            "environment_evaluation": None,
            "post_evaluation": None,
            "manifest": None,
            "artifacts": [],
            "warnings": [],
            "interruptions": [],
            "failure": None,
            "admission": None,
        }
        self._granted = False
        self._queue_id: str | None = None
        self._heartbeat = options.GROUP_HEARTBEAT

    @workflow.query
    def status(self) -> dict[str, Any]:
        return self._status

    @workflow.signal
    def slot_granted(self) -> None:
        self._granted = True

    @workflow.signal
    def queue_position(self, position: int) -> None:
        admission = self._status.get("admission")
        if admission is not None and not self._granted:
            admission["queue_position"] = position

    # ------------------------------------------------------------------ helpers
    def _phase(self, phase: str) -> None:
        self._status["phase"] = phase
        workflow.upsert_search_attributes([KILN_PHASE.value_set(phase)])

    def _finish(self, state: str) -> None:
        self._status["state"] = state
        if state in TERMINAL_PHASES:
            self._status["phase"] = state
        workflow.upsert_search_attributes(
            [KILN_STATUS.value_set(state), KILN_PHASE.value_set(self._status["phase"])]
        )

    # ------------------------------------------------------------------ run
    @workflow.run
    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        run_id = workflow.info().workflow_id
        self._status["run_id"] = run_id
        workflow.upsert_search_attributes([KILN_STATUS.value_set("running"), KILN_PHASE.value_set("admitting")])
        try:
            await self._execute(run_id, request)
        except asyncio.CancelledError:
            await self._cancelled(run_id)
            raise
        except (ActivityError, ApplicationError) as err:
            if is_cancelled_exception(err):
                # An activity cancelled because the run was cancelled: the run ends cancelled.
                await self._cancelled(run_id)
                raise
            await self._release(run_id)
            failure = self._failure_from(err)
            self._status["failure"] = failure
            self._finish("failed")
            raise ApplicationError(
                f"{failure['code']}: {failure['message']}",
                failure,
                type=failure["code"],
                non_retryable=True,
            ) from None
        await self._release(run_id)
        return self._status

    async def _cancelled(self, run_id: str) -> None:
        await self._release(run_id)
        stage = _stage_of(self._status["phase"])
        self._status["warnings"].append(
            "cancelled while queued (no environment was contacted)"
            if self._status["phase"] == "queued"
            else f"cancelled during {self._status['phase']}; nothing was published"
        )
        self._status["cancelled_stage"] = stage
        self._finish("cancelled")

    async def _release(self, run_id: str) -> None:
        """Give the run's queue slot back (also when it never got one); never fails the run."""
        if self._queue_id is None:
            return
        queue_id, self._queue_id = self._queue_id, None
        try:
            await workflow.get_external_workflow_handle(queue_id).signal("release_slot", run_id)
        except Exception:  # the queue is gone: nothing holds the slot any more
            workflow.logger.warning("could not release the queue slot of %s", run_id)

    def _failure_from(self, err: BaseException) -> dict[str, Any]:
        return failure_from(err, _stage_of(self._status["phase"]))

    async def _execute(self, run_id: str, raw_request: dict[str, Any]) -> None:
        # 1. admission: validate before any environment is contacted.
        admission: AdmissionResult = await workflow.execute_activity(
            "admit_run",
            AdmissionInput(run_id=run_id, request=raw_request),
            result_type=AdmissionResult,
            task_queue=workflow.info().task_queue,
            start_to_close_timeout=options.ADMISSION_TIMEOUT,
            retry_policy=options.CONTROL_RETRY,
            summary="validate the run request",
        )
        request = admission.request
        gpu_queue = admission.gpu_task_queue
        self._heartbeat = timedelta(seconds=admission.heartbeat_timeout_s)
        control_queue = workflow.info().task_queue
        self._status["kind"] = request["kind"]
        self._status["request_sha256"] = admission.request_sha256
        self._status["reset_plan_sha256"] = admission.reset_plan_sha256
        self._status["warnings"].extend(admission.warnings)
        groups_total = request["groups"]
        self._status["progress"]["groups_total"] = groups_total
        self._status["progress"]["rollouts_total"] = groups_total * request["group_size"]
        attrs = [KILN_RUN_KIND.value_set(request["kind"])]
        attrs.append(KILN_ENVIRONMENT.value_set(request["environment_urls"][0]))
        if request.get("output_adapter"):
            attrs.append(KILN_OUTPUT_ADAPTER.value_set(request["output_adapter"]))
        workflow.upsert_search_attributes(attrs)

        # FIFO admission: wait for a slot before any environment or model capacity is used.
        self._phase("queued")
        self._queue_id = admission.queue_workflow_id
        slot: SlotReply = await workflow.execute_activity(
            "enqueue_run",
            SlotRequest(run_id=run_id),
            result_type=SlotReply,
            task_queue=control_queue,
            start_to_close_timeout=options.ADMISSION_TIMEOUT,
            retry_policy=options.CONTROL_RETRY,
            summary="join the FIFO run queue",
        )
        self._status["admission"] = {
            "sequence": slot.sequence,
            "queue_position": slot.position or None,
            "submitted_at": workflow.info().start_time.isoformat(),
        }
        await workflow.wait_condition(lambda: self._granted)
        admitted = workflow.now()
        self._status["admission"].update(
            {
                "queue_position": None,
                "admitted_at": admitted.isoformat(),
                "queue_wait_ms": int((admitted - workflow.info().start_time).total_seconds() * 1000),
            }
        )

        # 2. discovery.
        self._phase("discovering")
        discovery: DiscoveryResult = await workflow.execute_activity(
            "discover_environments",
            DiscoveryInput(
                run_id=run_id,
                environment_urls=request["environment_urls"],
                credential_ids=request.get("credential_ids") or [],
            ),
            result_type=DiscoveryResult,
            task_queue=control_queue,
            start_to_close_timeout=options.DISCOVERY_TIMEOUT,
            retry_policy=options.CONTROL_RETRY,
            summary=f"discover {len(request['environment_urls'])} environment(s)",
        )
        self._status["environments"] = [
            {
                "base_url": env.base_url,
                "name": env.name,
                "discovery_sha256": env.discovery_sha256,
                "schema_sha256": env.schema_sha256,
            }
            for env in discovery.environments
        ]

        # 3. collection: one activity per seed group on the gpu queue.
        self._phase("collecting")
        adapter = request.get("adapter")
        adapter = None if adapter in (None, "base") else adapter
        contract = request.get("training_contract")
        policy = await self._resolve_policy(
            gpu_queue,
            PolicyInput(adapter=adapter, expected=contract["behavior_policy"] if contract else None),
        )
        self._status["behavior_policy"] = policy.behavior_policy
        group_refs = await self._collect(
            run_id,
            request,
            admission,
            discovery,
            policy,
            gpu_queue,
            seed_start=request["seed_start"],
            groups=request["groups"],
            group_size=request["group_size"],
            progress=self._status["progress"],
            label="group",
        )

        # 4. identity revalidation before any artifact is derived.
        self._phase("revalidating")
        await workflow.execute_activity(
            "revalidate_environments",
            RevalidationInput(
                run_id=run_id,
                environments=discovery.environments,
                credential_ids=request.get("credential_ids") or [],
            ),
            task_queue=control_queue,
            start_to_close_timeout=options.DISCOVERY_TIMEOUT,
            retry_policy=options.CONTROL_RETRY,
            summary="re-inspect environments and compare identities",
        )

        # 5. training.
        training: TrainResult | None = None
        if request["kind"] == "train":
            self._phase("training")
            training = await workflow.execute_activity(
                "train_adapter",
                TrainInput(
                    run_id=run_id,
                    groups=group_refs,
                    training_config=(contract or {}).get("effective_config")
                    or request.get("training_config")
                    or {},
                    output_adapter=request["output_adapter"],
                    behavior_policy=policy.behavior_policy,
                    base_adapter=policy.adapter_ref,
                    allow_empty_training=bool(request.get("allow_empty_training", False)),
                ),
                result_type=TrainResult,
                task_queue=gpu_queue,
                start_to_close_timeout=options.TRAIN_TIMEOUT,
                heartbeat_timeout=self._heartbeat,
                retry_policy=options.TRAIN_RETRY,
                summary=f"GRPO+ECHO training of {request['output_adapter']}",
            )
            self._status["training"] = training_status(training)
            self._status["warnings"].extend(training.selection.get("warnings", []))

        # 6. paired held-out evaluation and the promotion gate.
        evaluation: EvaluationResult | None = None
        if training is not None and training.trained and request.get("environment_eval"):
            self._phase("evaluating")
            evaluation = await self._evaluate(
                run_id, request, admission, discovery, policy, training, gpu_queue, control_queue
            )
        post_eval: PostEvalResult | None = None
        if training is not None and training.trained and request.get("post_eval"):
            self._phase("post_evaluating")
            post_eval = await self._post_evaluate(request, policy, training, gpu_queue)
        decision = evaluation.decision if evaluation is not None else None
        post_ok = post_eval is None or (request["post_eval"].get("min_accuracy") is None) or (
            post_eval.gate_outcome == "promoted"
        )
        promote = bool(
            training is not None
            and training.trained
            and request.get("auto_load", True)
            and decision in (None, "diagnostic", "passed")
            and post_ok
        )

        # 7. publication: manifest written last; the adapter name is promoted only if allowed.
        self._phase("publishing")
        published: PublishResult = await workflow.execute_activity(
            "publish_run",
            PublishInput(
                run_id=run_id,
                request=request,
                environments=discovery.environments,
                groups=group_refs,
                behavior_policy=policy.behavior_policy,
                reset_plan_sha256=admission.reset_plan_sha256,
                training=training,
                evaluation=evaluation,
                post_eval=post_eval,
                promote=promote,
            ),
            result_type=PublishResult,
            task_queue=control_queue,
            schedule_to_close_timeout=options.PUBLISH_TIMEOUT,
            heartbeat_timeout=self._heartbeat,
            retry_policy=options.PUBLISH_RETRY,
            # A cancel before the manifest is written stops publication (nothing visible); a
            # cancel that arrives after the commit point lets the run finish completed.
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary="publish artifacts and manifest",
        )
        self._status["manifest"] = {"uri": published.manifest_uri, "sha256": published.manifest_sha256}
        self._status["artifacts"] = [a.model_dump() for a in published.artifacts]
        self._status["rollout_stats"] = published.stats
        self._status["promoted"] = promote
        self._finish("completed")

    async def _post_evaluate(
        self, request: dict[str, Any], baseline: PolicyResult, training: TrainResult, gpu_queue: str
    ) -> PostEvalResult:
        config = request["post_eval"]
        result: PostEvalResult = await workflow.execute_activity(
            "post_evaluate",
            PostEvalInput(
                suite=config["suite"],
                min_accuracy=config.get("min_accuracy"),
                include_baseline=config.get("include_baseline", True),
                owns_promotion=config.get("min_accuracy") is not None,
                thinking=request["thinking"],
                candidate=AdapterRef(
                    name=request["output_adapter"],
                    adapter_sha256=training.adapter_sha256 or "",
                    files=training.adapter_files,
                ),
                baseline=baseline.adapter_ref,
            ),
            result_type=PostEvalResult,
            task_queue=gpu_queue,
            start_to_close_timeout=options.TRAIN_TIMEOUT,
            retry_policy=options.TRAIN_RETRY,
            summary=f"static suite {config['suite']} on the trained adapter",
        )
        self._status["post_evaluation"] = {
            "suite": config["suite"],
            "candidate_accuracy": result.candidate_accuracy,
            "baseline_accuracy": result.baseline_accuracy,
            "gate_outcome": result.gate_outcome,
            "reason": result.reason,
        }
        return result

    async def _resolve_policy(self, gpu_queue: str, inp: PolicyInput) -> PolicyResult:
        label = inp.adapter_ref.name if inp.adapter_ref else (inp.adapter or "base")
        return await workflow.execute_activity(
            "resolve_policy",
            inp,
            result_type=PolicyResult,
            task_queue=gpu_queue,
            start_to_close_timeout=options.POLICY_TIMEOUT,
            retry_policy=options.CONTROL_RETRY,
            summary=f"resolve policy identity ({label})",
        )

    async def _evaluate(
        self,
        run_id: str,
        request: dict[str, Any],
        admission: AdmissionResult,
        discovery: DiscoveryResult,
        baseline_policy: PolicyResult,
        training: TrainResult,
        gpu_queue: str,
        control_queue: str,
    ) -> EvaluationResult:
        """Baseline (behaviour policy) then candidate (trained adapter) on identical held-out seeds."""
        config = request["environment_eval"]
        seed_start = config.get("seed_start")
        if seed_start is None:
            seed_start = request["seed_start"] + request["groups"]
        groups, group_size = config["groups"], config["group_size"]
        block: dict[str, Any] = {
            "state": "collecting_baseline",
            "seed_start": seed_start,
            "groups": groups,
            "group_size": group_size,
            "progress": {
                "groups_completed": 0,
                "groups_total": 2 * groups,
                "rollouts_completed": 0,
                "rollouts_total": 2 * groups * group_size,
            },
        }
        self._status["environment_evaluation"] = block
        candidate_ref = AdapterRef(
            name=request["output_adapter"],
            adapter_sha256=training.adapter_sha256 or "",
            files=training.adapter_files,
        )
        candidate_policy = await self._resolve_policy(gpu_queue, PolicyInput(adapter_ref=candidate_ref))
        sides: dict[str, SideBundle] = {}
        side_groups: dict[str, list[StoredObject]] = {}
        for side, policy in (("baseline", baseline_policy), ("candidate", candidate_policy)):
            block["state"] = f"collecting_{side}"
            refs = await self._collect(
                run_id,
                {**request, "concurrency": min(request["concurrency"], group_size)},
                admission,
                discovery,
                policy,
                gpu_queue,
                seed_start=seed_start,
                groups=groups,
                group_size=group_size,
                progress=block["progress"],
                label=f"eval {side}",
            )
            side_groups[side] = refs
            sides[side] = await workflow.execute_activity(
                "store_side_bundle",
                SideBundleInput(
                    run_id=run_id,
                    side=side,
                    request={
                        **request,
                        "groups": groups,
                        "group_size": group_size,
                        "seed_start": seed_start,
                        "adapter": policy.adapter_ref.name if policy.adapter_ref else "base",
                    },
                    environments=discovery.environments,
                    groups=refs,
                    behavior_policy=policy.behavior_policy,
                    reset_plan_sha256=admission.reset_plan_sha256,
                ),
                result_type=SideBundle,
                task_queue=control_queue,
                schedule_to_close_timeout=options.PUBLISH_TIMEOUT,
                retry_policy=options.PUBLISH_RETRY,
                summary=f"store the {side} evaluation bundle",
            )
            block[f"{side}_stats"] = sides[side].stats
        world: WorldModelResult = await workflow.execute_activity(
            "world_model_gain",
            WorldModelInput(groups=side_groups["candidate"], adapter_ref=candidate_ref),
            result_type=WorldModelResult,
            task_queue=gpu_queue,
            start_to_close_timeout=options.TRAIN_TIMEOUT,
            retry_policy=options.TRAIN_RETRY,
            summary="observation cross-entropy: base vs candidate",
        )
        result: EvaluationResult = await workflow.execute_activity(
            "evaluate_run",
            EvaluateInput(
                run_id=run_id,
                config=config,
                seed_start=seed_start,
                auto_load=request.get("auto_load", True),
                baseline=sides["baseline"],
                candidate=sides["candidate"],
                baseline_adapter=baseline_policy.adapter_ref.name if baseline_policy.adapter_ref else None,
                candidate_adapter=candidate_ref.name,
                candidate_adapter_sha256=candidate_ref.adapter_sha256 or None,
                world_model=world.block,
            ),
            result_type=EvaluationResult,
            task_queue=control_queue,
            schedule_to_close_timeout=options.PUBLISH_TIMEOUT,
            retry_policy=options.PUBLISH_RETRY,
            summary="paired sign test and promotion gate",
        )
        block.update(
            {
                "state": "completed",
                "decision": result.decision,
                "outcome": result.outcome,
                "verdict": result.verdict,
                "evidence": result.evidence,
                "world_model": world.block,
            }
        )
        return result

    async def _collect(
        self,
        run_id: str,
        request: dict[str, Any],
        admission: AdmissionResult,
        discovery: DiscoveryResult,
        policy: PolicyResult,
        gpu_queue: str,
        *,
        seed_start: int,
        groups: int,
        group_size: int,
        progress: dict[str, Any],
        label: str,
    ) -> list[StoredObject]:
        environments = discovery.environments
        settings = {
            key: request[key]
            for key in (
                "max_steps",
                "concurrency",
                "max_action_tokens",
                "thinking",
                "thinking_budget_tokens",
                "temperature",
                "protocol_error_reward",
                "max_recoverable_errors",
                "capacity_wait_seconds",
                "constrained_actions",
            )
        }
        settings["group_size"] = group_size
        if request.get("reset_determinism", "strict") != "strict":
            settings["reset_determinism"] = request["reset_determinism"]
        credential_ids = request.get("credential_ids") or []
        gate = asyncio.Semaphore(options.MAX_PARALLEL_GROUPS)
        returns: list[float] = []
        results: list[CollectGroupResult] = []

        async def one(group_index: int) -> None:
            env_index = group_index % len(environments)
            seed = seed_start + group_index
            payload = dict(admission.reset_templates[env_index])
            payload["seed"] = seed
            # Capacity wait (issue 14): an attempt at a full environment ends within seconds;
            # the wait happens here, in a timer, outside the gate (no gpu slot held).
            waited_from = None
            capacity_retries = 0
            while True:
                try:
                    async with gate:
                        result = await self._collect_attempt(
                            run_id, group_index, env_index, seed, payload, environments,
                            settings, policy, credential_ids, request, gpu_queue, label,
                        )
                    break
                except ActivityError as err:
                    waited_from = waited_from or workflow.now()  # the first refusal starts the wait
                    waited = (workflow.now() - waited_from).total_seconds()
                    pause = capacity_wait_for(err, waited, request["capacity_wait_seconds"], capacity_retries)
                    if pause is None:
                        raise capacity_failure(err, group_index, group_size, waited) or err
                    capacity_retries += 1
                    await workflow.sleep(pause)
            if result.capacity is not None:
                self._status.setdefault("environment_capacity", {})[environments[env_index].base_url] = result.capacity
            results.append(result)
            if result.attempt > 1:
                self._status["interruptions"].append(
                    {
                        "stage": label,
                        "group_index": group_index,
                        "attempts": result.attempt,
                        "code": result.interruption_code,
                        "recovered": "re-collected from reset with the same seed",
                    }
                )
            returns.extend(result.returns)
            progress["groups_completed"] += 1
            progress["rollouts_completed"] += len(result.returns)
            progress["mean_return"] = sum(returns) / len(returns)
            # Wall-clock figures live here, never in the (reproducible) artifacts.
            progress["model_latency_ms"] = round(progress.get("model_latency_ms", 0.0) + result.model_latency_ms, 3)
            progress["model_tokens"] = progress.get("model_tokens", 0) + result.model_tokens
            if progress is self._status["progress"]:
                self._status["mean_return"] = progress["mean_return"]

        await asyncio.gather(*(one(index) for index in range(groups)))
        return [r.group for r in sorted(results, key=lambda r: r.group_index)]

    async def _collect_attempt(
        self, run_id, group_index, env_index, seed, payload, environments, settings, policy,
        credential_ids, request, gpu_queue, label,
    ) -> CollectGroupResult:
        """One ``collect_group`` activity (its own retry policy covers worker interruptions)."""
        return await workflow.execute_activity(
            "collect_group",
            CollectGroupInput(
                run_id=run_id,
                group_index=group_index,
                environment_index=env_index,
                seed=seed,
                reset_payload=payload,
                inspection=environments[env_index].inspection,
                settings=settings,
                behavior_policy=policy.behavior_policy,
                adapter_ref=policy.adapter_ref,
                credential_id=credential_ids[env_index] if credential_ids else None,
                on_interrupt=request.get("on_interrupt", "resume"),
            ),
            result_type=CollectGroupResult,
            task_queue=gpu_queue,
            start_to_close_timeout=options.GROUP_TIMEOUT,
            heartbeat_timeout=self._heartbeat,
            retry_policy=options.GROUP_RETRY,
            summary=f"{label} {group_index} seed {seed} on {environments[env_index].base_url}",
        )
