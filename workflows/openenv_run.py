"""``OpenEnvRunWorkflow``: admission → queue → discovery → collection → revalidation → training →
evaluation → post_evaluation → publication.

One workflow per run; the workflow id is the run id. History carries only small typed records
(``kiln.records``); every stage's work happens in an activity, every rule (seed schedule,
evaluation plan, bundle specs, promotion) in ``kiln.run_plan``. The workflow only sequences them
and keeps the ``RunStatus`` its ``status`` query returns to the API, the CLI and the Web UI.

Its input is the submission as given (a JSON object): the admission activity validates it — the
one validation — so a bad request started with ``temporal workflow start`` still ends with
``openenv_invalid_request`` naming the field, before any environment is contacted.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.control import ControlActivities
    from activities.gpu import GpuActivities
    from kiln.contracts import EpisodeFields, RunRequest
    from kiln.records import (
        AdmissionInput,
        AdmissionResult,
        DiscoveryInput,
        DiscoveryResult,
        EvaluationResult,
        GroupSet,
        IterationFiles,
        IterationInput,
        PolicyInput,
        PolicyResult,
        PostEvalResult,
        PublishInput,
        PublishResult,
        RevalidationInput,
        RunCarry,
        SlotReply,
        SlotRequest,
        TrainedPolicy,
        TrainInput,
        TrainResult,
    )
    from kiln.run_plan import (
        BundleSpec,
        EvaluationPlan,
        behavior_lag,
        evaluates_after,
        extend_chain,
        iteration_schedule,
        iteration_seed_start,
        promotion_decision,
        should_continue_as_new,
    )
    from kiln.run_status import (
        Admission,
        EnvironmentStatus,
        IterationStatus,
        Progress,
        RunStatus,
        invalid_action_rate,
    )
    from workflows.collection import RunContext, collect_groups, resolve_policy
    from workflows.evaluation import candidate_ref, evaluate_adapter, post_evaluate
    from workflows.names import WORKFLOW_NAME
    from workflows.options import ActivityCaller
    from workflows.status import (
        KILN_ENVIRONMENT,
        KILN_OUTPUT_ADAPTER,
        KILN_RUN_KIND,
        StatusKeeper,
    )


def _gpu_caller(admission: AdmissionResult) -> ActivityCaller:
    """The run's activity caller once admitted: its control queue and its model's gpu queue."""
    return ActivityCaller(
        control_queue=workflow.info().task_queue,
        gpu_queue=admission.gpu_task_queue,
        heartbeat=timedelta(seconds=admission.heartbeat_timeout_s),
    )


@workflow.defn(name=WORKFLOW_NAME)
class OpenEnvRunWorkflow(StatusKeeper):
    def __init__(self) -> None:
        self._status = RunStatus()
        self._granted = False
        self._queue_id: str | None = None

    @workflow.query(description="The run's status: phase, progress, returns, training, manifest, failure.")
    def status(self) -> RunStatus:
        return self._status

    @workflow.signal(description="The run queue granted this run a slot: admission may proceed.")
    def slot_granted(self) -> None:
        self._granted = True

    @workflow.signal(description="The run's 1-based position in the FIFO run queue while it waits.")
    def queue_position(self, position: int) -> None:
        if self._status.admission is not None and not self._granted:
            self._status.admission.queue_position = position

    @workflow.run
    async def run(self, submission: dict[str, Any], carry: RunCarry | None = None) -> RunStatus:
        """``carry`` is only given by the run itself when it continues as new (online RL)."""
        return await self._guarded(lambda: self._execute(submission, carry))

    async def _release(self) -> None:
        """Give the run's queue slot back (also when it never got one); never fails the run."""
        if self._queue_id is None:
            return
        queue_id, self._queue_id = self._queue_id, None
        try:
            await workflow.get_external_workflow_handle(queue_id).signal("release_slot", self._status.run_id)
        except Exception:  # the queue is gone: nothing holds the slot any more
            workflow.logger.warning("could not release the queue slot of %s", self._status.run_id)

    async def _admit(self, submission: dict[str, Any]) -> tuple[AdmissionResult, ActivityCaller]:
        """Validate before any environment is contacted; then wait for a FIFO slot."""
        info = workflow.info()
        call = ActivityCaller(control_queue=info.task_queue)
        admission: AdmissionResult = await call(
            ControlActivities.admit_run,
            AdmissionInput(run_id=self._status.run_id, submission=submission),
            summary="validate the run request",
        )
        request = admission.request
        status = self._status
        status.kind = request.kind
        status.request_sha256 = admission.request_sha256
        status.reset_plan_sha256 = admission.reset_plan_sha256
        status.warnings.extend(admission.warnings)
        status.progress = Progress.planned(request.groups, request.group_size)
        attrs = [KILN_RUN_KIND.value_set(request.kind), KILN_ENVIRONMENT.value_set(request.environment_urls[0])]
        if request.output_adapter:
            attrs.append(KILN_OUTPUT_ADAPTER.value_set(request.output_adapter))
        workflow.upsert_search_attributes(attrs)

        self._enter("queue")
        self._queue_id = admission.queue_workflow_id
        slot: SlotReply = await call(
            ControlActivities.enqueue_run, SlotRequest(run_id=status.run_id), summary="join the FIFO run queue"
        )
        status.admission = Admission(
            sequence=slot.sequence, queue_position=slot.position or None, submitted_at=info.start_time.isoformat()
        )
        await workflow.wait_condition(lambda: self._granted)
        admitted = workflow.now()
        status.admission.queue_position = None
        status.admission.admitted_at = admitted.isoformat()
        status.admission.queue_wait_ms = int((admitted - info.start_time).total_seconds() * 1000)
        return admission, _gpu_caller(admission)

    async def _execute(self, submission: dict[str, Any], carry: RunCarry | None) -> None:
        if carry is not None:  # continued as new: admitted, discovered, part-way through
            self._granted = True
            self._queue_id = carry.admission.queue_workflow_id
            self._status = carry.status
            ctx = RunContext(self._status.run_id, carry.admission.request, carry.admission, carry.discovery,
                             _gpu_caller(carry.admission), self._status)
            await self._iterate(ctx, carry)
            return
        admission, call = await self._admit(submission)
        request = admission.request
        discovery = await self._discover(request, call)
        ctx = RunContext(self._status.run_id, request, admission, discovery, call, self._status)

        self._enter("collection")
        contract = request.training_contract
        start = await resolve_policy(
            ctx,
            PolicyInput(
                adapter=request.behavior_adapter(),
                expected=contract.behavior_policy if contract else None,
                inference=request.model_dump(mode="json", include=set(EpisodeFields.model_fields)),
                thinking=request.thinking,
            ),
        )
        self._status.behavior_policy = start.behavior_policy
        ctx.thinking = start.thinking
        if request.kind == "rollout":
            groups = await self._collect(ctx, start, 1)
            await self._revalidate(ctx)
            await self._evaluate_and_publish(ctx, start, start, groups, None)
            return
        self._status.iterations_total = request.iterations
        await self._iterate(
            ctx,
            RunCarry(
                admission=admission, discovery=discovery, status=self._status, start=start,
                current=TrainedPolicy(policy=start), next_iteration=1,
            ),
        )

    async def _collect(self, ctx: RunContext, policy: PolicyResult, iteration: int,
                       progress: Progress | None = None) -> GroupSet:
        """One iteration's groups (a one-iteration run's are iteration 1's), sampled by ``policy``."""
        request = ctx.request
        single = request.iterations == 1
        return await collect_groups(
            ctx,
            policy,
            slots=iteration_schedule(request, iteration, len(ctx.discovery.environments)),
            settings=request.episode_settings(ctx.thinking),
            progress=progress or self._status.progress,
            label="group" if single else f"iteration {iteration} group",
            scope="collection" if single else f"iteration-{iteration}",
        )

    async def _revalidate(self, ctx: RunContext) -> None:
        """Identity revalidation before any artifact is derived."""
        self._enter("revalidation")
        await ctx.call(
            ControlActivities.revalidate_environments,
            RevalidationInput(
                run_id=ctx.run_id, environments=ctx.discovery.environments, credential_ids=ctx.request.credential_ids
            ),
            summary="re-inspect environments and compare identities",
        )

    async def _iterate(self, ctx: RunContext, carry: RunCarry) -> None:
        """Iterations ``carry.next_iteration`` … N: collect with the latest policy, revalidate, train
        from its adapter and optimizer state, store the iteration; then the gate and publication.
        Continues as new whenever the history has grown past ``HISTORY_EVENTS_BUDGET``."""
        request = ctx.request
        total = request.iterations
        ctx.thinking = carry.start.thinking
        pending: asyncio.Task[GroupSet] | None = None
        pending_progress: Progress | None = None
        for k in range(carry.next_iteration, total + 1):
            began = workflow.now()
            status = self._status
            status.iteration = k
            lag = behavior_lag(request, k)
            sampler = carry.previous if lag and carry.previous is not None else carry.current
            self._enter("collection")
            if pending is not None:
                status.progress = pending_progress or status.progress
                groups = await pending
            elif carry.pending is not None:
                groups = carry.pending
            else:
                status.progress = Progress.planned(request.groups, request.group_size)
                groups = await self._collect(ctx, sampler.policy, k)
            pending, carry.pending = None, None
            await self._revalidate(ctx)
            if request.max_staleness and k < total:  # iteration k+1 samples while k trains
                pending_progress = Progress.planned(request.groups, request.group_size)
                pending = asyncio.create_task(self._collect(ctx, carry.current.policy, k + 1, pending_progress))
            training = await self._train(ctx, carry, sampler, groups, k, lag)
            evaluation = None
            trained_policy = carry.current
            if training.trained:
                trained_policy = TrainedPolicy(
                    policy=await resolve_policy(
                        ctx,
                        PolicyInput(
                            adapter_ref=candidate_ref(ctx, training),
                            inference=request.model_dump(mode="json", include=set(EpisodeFields.model_fields)),
                        ),
                    ),
                    state=training.final_state,
                )
                if k < total and evaluates_after(request, k):
                    evaluation = await self._evaluate(ctx, carry, training, k)
            record = IterationStatus(
                iteration=k,
                seed_start=iteration_seed_start(request, k),
                behavior_adapter_sha256=sampler.policy.behavior_policy.get("adapter_sha256"),
                staleness=lag,
                mean_return=status.progress.mean_return,
                trained=training.trained,
                steps=training.steps,
                loss=training.final_loss,
                kl=training.kl,
                adapter_sha256=training.adapter_sha256,
            )
            if total > 1:
                stored: IterationFiles = await ctx.call(
                    ControlActivities.store_iteration,
                    IterationInput(
                        run_id=ctx.run_id, iteration=k, bundle=self._bundle(ctx, sampler.policy, k),
                        environments=ctx.discovery.environments, groups=groups,
                        behavior_policy=sampler.policy.behavior_policy,
                        reset_plan_sha256=ctx.admission.reset_plan_sha256,
                        training=training, evaluation=evaluation, staleness=lag,
                    ),
                    summary=f"store iteration {k}",
                )
                carry.chain = extend_chain(carry.chain, stored.record_sha256)
                record.invalid_action_rate = invalid_action_rate(stored.stats)
            if evaluation is not None:
                record.eval_mean_return = evaluation.candidate.stats.get("mean_episode_return")
                record.eval_baseline_mean_return = evaluation.baseline.stats.get("mean_episode_return")
            record.wall_ms = int((workflow.now() - began).total_seconds() * 1000)
            status.record_iteration(record)
            carry.previous, carry.current = carry.current, trained_policy
            carry.last_groups, carry.last_sampler = groups, sampler.policy
            if training.trained or carry.last_training is None:
                carry.last_training = training  # publication and the gate take the latest adapter
            carry.next_iteration = k + 1
            if k < total and should_continue_as_new(workflow.info().get_current_history_length()):
                if pending is not None:
                    carry.pending = await pending
                carry.status = status
                workflow.continue_as_new(args=[{}, carry])
        assert carry.last_training and carry.last_groups and carry.last_sampler
        await self._evaluate_and_publish(
            ctx, carry.start, carry.last_sampler, carry.last_groups, carry.last_training, carry=carry
        )

    def _bundle(self, ctx: RunContext, sampler: PolicyResult, iteration: int) -> BundleSpec:
        """The bundle spec of one iteration's groups: its seeds, the adapter that sampled them."""
        request = ctx.request
        spec = BundleSpec.of_run(request, ctx.thinking)
        if iteration == 1:
            return spec
        return spec.model_copy(
            update={
                "adapter": sampler.adapter_ref.name if sampler.adapter_ref else spec.adapter,
                "seed_start": iteration_seed_start(request, iteration),
            }
        )

    async def _evaluate(self, ctx: RunContext, carry: RunCarry, training: TrainResult, k: int) -> EvaluationResult | None:
        """A scheduled held-out evaluation of iteration ``k``'s adapter against the starting policy."""
        plan = EvaluationPlan.of(ctx.request, carry.start.thinking)
        if plan is None:
            return None
        self._enter("evaluation")
        result = await evaluate_adapter(
            ctx, plan, carry.start, training, scope=f"iteration-{k}-eval", baseline_cache=carry.baseline
        )
        carry.baseline = result.baseline
        return result

    async def _discover(self, request: RunRequest, call: ActivityCaller) -> DiscoveryResult:
        self._enter("discovery")
        discovery: DiscoveryResult = await call(
            ControlActivities.discover_environments,
            DiscoveryInput(
                run_id=self._status.run_id, environment_urls=request.environment_urls, credential_ids=request.credential_ids
            ),
            summary=f"discover {len(request.environment_urls)} environment(s)",
        )
        self._status.environments = [
            EnvironmentStatus.model_validate(env.model_dump(exclude={"inspection"})) for env in discovery.environments
        ]
        return discovery

    async def _train(
        self, ctx: RunContext, carry: RunCarry, sampler: TrainedPolicy, groups: GroupSet, k: int, lag: int
    ) -> TrainResult:
        """Train iteration ``k`` from the current adapter and optimizer state on groups ``sampler``
        collected (``lag`` updates older than the current adapter)."""
        request = ctx.request
        multi = request.iterations > 1
        self._enter("training")
        training: TrainResult = await ctx.call(
            GpuActivities.train_adapter,
            TrainInput(
                run_id=ctx.run_id,
                iteration=k if multi else None,
                groups=groups,
                training_config=request.effective_training_config(),
                allow_empty_training=request.allow_empty_training,
                output_adapter=request.output_adapter or "",
                behavior_policy=sampler.policy.behavior_policy,
                base_adapter=carry.current.policy.adapter_ref,
                init_state=carry.current.state,
                keep_state=multi and k < request.iterations,
                behavior_adapter=sampler.policy.adapter_ref if lag else None,
                staleness=lag,
                report_to=request.report_to,
            ),
            summary=f"GRPO+ECHO training of {request.output_adapter}" + (f" (iteration {k})" if multi else ""),
        )
        self._status.record_training(training)
        return training

    async def _evaluate_and_publish(
        self,
        ctx: RunContext,
        start: PolicyResult,
        sampler: PolicyResult,
        groups: GroupSet,
        training: TrainResult | None,
        carry: RunCarry | None = None,
    ) -> None:
        """Evaluation (``training``'s adapter against ``start``) and post-evaluation of a trained
        adapter, the promotion rule, publication of ``groups`` (sampled by ``sampler``)."""
        request = ctx.request
        trained = training is not None and training.trained
        evaluation: EvaluationResult | None = None
        plan = EvaluationPlan.of(request, start.thinking)
        if trained and plan is not None:
            assert training is not None
            self._enter("evaluation")
            evaluation = await evaluate_adapter(
                ctx, plan, start, training, baseline_cache=carry.baseline if carry is not None else None
            )
            if request.iterations > 1 and self._status.iterations:
                last = self._status.iterations[-1]
                last.eval_mean_return = evaluation.candidate.stats.get("mean_episode_return")
                last.eval_baseline_mean_return = evaluation.baseline.stats.get("mean_episode_return")
        post_eval: PostEvalResult | None = None
        if trained and request.post_eval is not None:
            assert training is not None
            self._enter("post_evaluation")
            post_eval = await post_evaluate(ctx, start, training)
        promote = promotion_decision(
            request,
            trained=trained,
            evaluation_decision=evaluation.decision if evaluation is not None else None,
            post_eval_outcome=post_eval.gate_outcome if post_eval is not None else None,
        )
        # Publication: manifest written last; the adapter name is promoted only if allowed.
        self._enter("publication")
        multi = request.iterations > 1
        published: PublishResult = await ctx.call(
            ControlActivities.publish_run,
            PublishInput(
                run_id=ctx.run_id,
                kind=request.kind,
                output_adapter=request.output_adapter,
                bundle=self._bundle(ctx, sampler, request.iterations),
                environments=ctx.discovery.environments,
                groups=groups,
                behavior_policy=sampler.behavior_policy,
                reset_plan_sha256=ctx.admission.reset_plan_sha256,
                training=training,
                evaluation=evaluation,
                post_eval=post_eval,
                promote=promote,
                iterations=request.iterations if multi else 0,
                iteration_chain=carry.chain if carry is not None and multi else None,
            ),
            summary="publish artifacts and manifest",
        )
        self._status.rollout_stats = published.stats
        if not multi and self._status.iterations:
            self._status.iterations[-1].invalid_action_rate = invalid_action_rate(published.stats)
        self._status.record_publication(published, promoted=promote)
