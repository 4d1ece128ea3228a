"""The stages of a run after discovery: collection, revalidation, training (once, or iteration
after iteration for online RL), evaluation, post-evaluation and publication.

``RunStages`` is the base of ``OpenEnvRunWorkflow`` (workflows/openenv_run.py, which owns admission,
the queue and discovery). A one-iteration train run is one pass of ``_iterate``; with
``iterations`` > 1 each iteration collects fresh seeds (``kiln.core.run_plan.iteration_schedule``) with
the adapter the previous one trained, trains from that adapter and its optimizer state, and is
stored as an iteration record whose digest extends the run's chain. With ``max_staleness`` 1 the
next iteration's collection runs while the current one trains; with N > 1 collection runs up to N
adapter versions ahead, one iteration at a time (``kiln.core.stale_pipeline``). Whenever the history has grown
past ``HISTORY_EVENTS_BUDGET`` between iterations the run continues as new, carrying ``RunCarry``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.control import ControlActivities
    from activities.gpu import GpuActivities
    from kiln.core.records import (
        EvaluationResult,
        GroupSet,
        IterationFiles,
        IterationInput,
        PendingIteration,
        PolicyResult,
        PostEvalResult,
        PublishInput,
        PublishResult,
        RevalidationInput,
        RunCarry,
        TrainedPolicy,
        TrainInput,
        TrainResult,
    )
    from kiln.core.run_plan import (
        BundleSpec,
        EvaluationPlan,
        behavior_lag,
        evaluates_after,
        extend_chain,
        iteration_seed_start,
        promotion_decision,
        should_continue_as_new,
    )
    from kiln.core.run_status import IterationStatus, Progress, RunStatus, invalid_action_rate, training_figures
    from workflows.collection import RunContext, resolve_policy, run_policy_input
    from workflows.evaluation import candidate_ref, evaluate_adapter, post_evaluate
    from workflows.pipeline import STALE_PIPELINE_PATCH, Ahead, IterationCollection
    from workflows.status import failure_from


# Patch id: a run that fails after collecting publishes the collected bundle (not promoted) first.
KEEP_EVIDENCE_PATCH = "keep-failed-run-evidence"
# The cosine schedule's horizon fixed from the run's plan (TrainInput.lr_horizon_steps); runs started
# before it replay without the field (their trainings estimate the horizon per iteration).
RUN_LR_HORIZON_PATCH = "run-lr-horizon"


class RunStages(IterationCollection):
    """Collection → revalidation → training (per iteration) → evaluation → publication."""

    _status: RunStatus
    # The latest collection not yet published: (context, groups, the policy that sampled them,
    # iteration); a failure after it publishes them as the run's evidence.
    _collected: tuple[RunContext, GroupSet, PolicyResult, int] | None = None

    async def _keep_evidence(self, failure: Any) -> None:
        """A run failing after collection (``zero_groups`` in training, a changed identity, a
        failed evaluation …) publishes the collected bundle first: the manifest, its artifacts and
        the run status point at it and ``verify`` checks it; no adapter is published or promoted.
        Publication's own failure is not retried here (the run fails with its first error)."""
        collected, self._collected = self._collected, None
        if collected is None or failure.code == "cancelled" or not workflow.patched(KEEP_EVIDENCE_PATCH):
            return
        ctx, groups, sampler, k = collected
        try:
            published: PublishResult = await ctx.call(
                ControlActivities.publish_run,
                self._publish_input(ctx, groups, sampler, k, promote=False),
                summary="publish the collected episodes of a failed run (evidence, not promoted)",
            )
        except (ActivityError, ApplicationError) as err:
            self._status.warn(
                f"the collected episodes could not be published: {failure_from(err, 'publication').message}"
            )
            return
        self._status.record_evidence(published, failure.code)

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
        self._deep = request.max_staleness > 1 and workflow.patched(STALE_PIPELINE_PATCH)
        ahead: dict[int, Ahead] = {}
        for k in range(carry.next_iteration, total + 1):
            began = workflow.now()
            status = self._status
            status.iteration = k
            lag = behavior_lag(request, k)
            sampler = carry.previous if lag and carry.previous is not None else carry.current
            self._enter("collection")
            if self._deep:
                sampler, groups = await self._take(ctx, carry, k, ahead)
            elif pending is not None:
                status.progress = pending_progress or status.progress
                groups = await pending
            elif carry.pending is not None:
                status.progress = carry.pending_progress or status.progress
                groups = carry.pending
                if carry.pending_refill is not None:  # its warning was given before continue-as-new
                    self._refills[k] = carry.pending_refill
            else:
                status.progress = Progress.planned(request.groups, request.group_size)
                groups = await self._collect(ctx, sampler.policy, k)
            pending, carry.pending, carry.pending_progress, carry.pending_refill = None, None, None, None
            self._collected = (ctx, groups, sampler.policy, k)
            await self._revalidate(ctx)
            if self._deep:
                self._launch(ctx, carry, k, ahead)
            elif request.max_staleness and k < total:  # iteration k+1 samples while k trains
                pending_progress = Progress.planned(request.groups, request.group_size)
                pending = asyncio.create_task(self._collect(ctx, carry.current.policy, k + 1, pending_progress))
            training = await self._train(ctx, carry, sampler, groups, k, lag)
            evaluation = None
            trained_policy = carry.current  # an iteration that trained nothing changes no policy
            if training.trained:
                trained_policy = TrainedPolicy(
                    policy=await resolve_policy(
                        ctx, run_policy_input(request, adapter_ref=candidate_ref(ctx, training))
                    ),
                    state=training.final_state,
                )
                if k < total and evaluates_after(request, k):
                    evaluation = await self._evaluate(ctx, carry, training, k)
            await self._conclude(ctx, carry, k, sampler, groups, training, evaluation, began)
            carry.current = trained_policy
            carry.next_iteration = k + 1
            if k < total and should_continue_as_new(workflow.info().get_current_history_length()):
                if pending is not None:
                    carry.pending, carry.pending_progress = await pending, pending_progress
                    carry.pending_refill = self._refills.get(k + 1)
                for j in sorted(ahead):
                    task, ahead_sampler, ahead_progress = ahead.pop(j)
                    carry.pipeline.append(
                        PendingIteration(
                            iteration=j,
                            sampler=ahead_sampler,
                            groups=await task,
                            progress=ahead_progress,
                            refill=self._refills.get(j),
                        )
                    )
                carry.status = status
                workflow.continue_as_new(args=[{}, carry])
        assert carry.last_training and carry.last_groups and carry.last_sampler
        await self._evaluate_and_publish(
            ctx, carry.start, carry.last_sampler, carry.last_groups, carry.last_training, carry=carry
        )

    async def _conclude(
        self,
        ctx: RunContext,
        carry: RunCarry,
        k: int,
        sampler: TrainedPolicy,
        groups: GroupSet,
        training: TrainResult,
        evaluation: EvaluationResult | None,
        began: Any,
    ) -> None:
        """Iteration ``k``'s record: stored (with ``iterations`` > 1, extending the chain), in the
        status curve, and what the carry needs for the next iteration and for publication."""
        request = ctx.request
        lag = behavior_lag(request, k)
        record = IterationStatus(
            iteration=k,
            seed_start=iteration_seed_start(request, k),
            behavior_adapter_sha256=sampler.policy.behavior_policy.get("adapter_sha256"),
            staleness=lag,
            mean_return=self._status.progress.mean_return,
            **training_figures(training),
        )
        if request.iterations > 1:
            stored: IterationFiles = await ctx.call(
                ControlActivities.store_iteration,
                IterationInput(
                    run_id=ctx.run_id,
                    iteration=k,
                    bundle=self._bundle(ctx, sampler.policy, k),
                    environments=ctx.discovery.environments,
                    groups=groups,
                    behavior_policy=sampler.policy.behavior_policy,
                    reset_plan_sha256=ctx.admission.reset_plan_sha256,
                    training=training,
                    evaluation=evaluation,
                    staleness=lag,
                ),
                summary=f"store iteration {k}",
            )
            carry.chain = extend_chain(carry.chain, stored.record_sha256)
            record.invalid_action_rate = invalid_action_rate(stored.stats)
        if evaluation is not None:
            record.eval_mean_return = evaluation.candidate.stats.get("mean_episode_return")
            record.eval_baseline_mean_return = evaluation.baseline.stats.get("mean_episode_return")
        record.wall_ms = int((workflow.now() - began).total_seconds() * 1000)
        self._status.record_iteration(record)
        carry.previous = carry.current
        carry.last_groups, carry.last_sampler = groups, sampler.policy
        if training.trained or carry.last_training is None:
            carry.last_training = training  # publication and the gate take the latest adapter

    def _publish_input(
        self, ctx: RunContext, groups: GroupSet, sampler: PolicyResult, iteration: int, **outcome: Any
    ) -> PublishInput:
        """What ``publish_run`` gets for the groups ``sampler`` collected by ``iteration``, with the
        run's ``outcome`` (training, evaluation, promote …) where there is one."""
        request = ctx.request
        return PublishInput(
            run_id=ctx.run_id,
            kind=request.kind,
            output_adapter=request.output_adapter,
            bundle=self._bundle(ctx, sampler, iteration),
            environments=ctx.discovery.environments,
            groups=groups,
            behavior_policy=sampler.behavior_policy,
            reset_plan_sha256=ctx.admission.reset_plan_sha256,
            **outcome,
        )

    def _bundle(self, ctx: RunContext, sampler: PolicyResult, iteration: int) -> BundleSpec:
        """The bundle spec of one iteration's groups: its seeds, the adapter that sampled them."""
        request = ctx.request
        spec = BundleSpec.of_run(request, ctx.thinking)
        refill = self._refills.get(iteration)
        if refill is not None:
            spec = spec.model_copy(update={"dynamic_sampling": refill})
        if self._deep:
            spec = spec.model_copy(update={"staleness": self._stale_record(request, iteration)})
        if iteration == 1:
            return spec
        return spec.model_copy(
            update={
                "adapter": sampler.adapter_ref.name if sampler.adapter_ref else spec.adapter,
                "seed_start": iteration_seed_start(request, iteration),
            }
        )

    async def _evaluate(
        self, ctx: RunContext, carry: RunCarry, training: TrainResult, k: int
    ) -> EvaluationResult | None:
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
                iterations_total=request.iterations if multi else None,
                lr_horizon_steps=request.lr_horizon_steps() if workflow.patched(RUN_LR_HORIZON_PATCH) else None,
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
                **(self._trainer_bound(request, k) if self._deep else {}),
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
        self._collected = None  # publication publishes them (its own failure has no evidence step)
        self._enter("publication")
        multi = request.iterations > 1
        published: PublishResult = await ctx.call(
            ControlActivities.publish_run,
            self._publish_input(
                ctx,
                groups,
                sampler,
                request.iterations,
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
