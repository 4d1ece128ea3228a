"""The paired held-out evaluation stage of a train run, and the static post-evaluation.

Baseline (the behavior policy) then candidate (the trained adapter) are collected on the seeds of
the ``EvaluationPlan`` (kiln.core.run_plan); each side's bundle is stored, the world-model gain is
measured, and ``evaluate_run`` pairs the sides and applies the gate. Sequencing only.
"""

from __future__ import annotations

from typing import Literal

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.control import ControlActivities
    from activities.gpu import GpuActivities
    from kiln.core.records import (
        AdapterRef,
        EvaluateInput,
        EvaluationResult,
        GroupSet,
        PolicyInput,
        PolicyResult,
        PostEvalInput,
        PostEvalResult,
        SideBundle,
        SideBundleInput,
        TrainResult,
        WorldModelInput,
        WorldModelResult,
    )
    from kiln.core.run_plan import EvaluationPlan
    from kiln.core.run_status import EvaluationStatus, PostEvaluationStatus, Progress
    from workflows.collection import RunContext, collect_groups, resolve_policy


def candidate_ref(ctx: RunContext, training: TrainResult) -> AdapterRef:
    return AdapterRef(
        name=ctx.request.output_adapter or "",
        adapter_sha256=training.adapter_sha256 or "",
        files=training.adapter_files,
    )


async def evaluate_adapter(
    ctx: RunContext,
    plan: EvaluationPlan,
    baseline: PolicyResult,
    training: TrainResult,
    *,
    scope: str = "evaluation",
    baseline_cache: SideBundle | None = None,
) -> EvaluationResult:
    """Baseline then candidate on identical held-out seeds; pair, gate, write the receipt.

    ``baseline_cache``: the baseline side of an earlier evaluation in the same run (same policy,
    same seeds, so the same bundle): reused instead of collected again.
    """
    block = EvaluationStatus(
        seed_start=plan.seed_start,
        groups=plan.groups,
        group_size=plan.settings.group_size,
        progress=Progress.planned(2 * plan.groups, plan.settings.group_size),
    )
    ctx.status.environment_evaluation = block
    candidate = candidate_ref(ctx, training)
    candidate_policy = await resolve_policy(
        ctx, PolicyInput(adapter_ref=candidate, inference=plan.settings.model_dump(mode="json"))
    )
    slots = plan.schedule(len(ctx.discovery.environments))
    sides: dict[str, SideBundle] = {}
    side_groups: dict[str, GroupSet] = {}
    if baseline_cache is not None:
        sides["baseline"] = baseline_cache
        block.baseline_stats = baseline_cache.stats
        block.progress.groups_total = plan.groups
        block.progress.rollouts_total = plan.groups * plan.settings.group_size
    order: tuple[tuple[Literal["baseline", "candidate"], PolicyResult], ...] = (
        ("baseline", baseline),
        ("candidate", candidate_policy),
    )
    for side, policy in order:
        if side in sides:
            continue
        block.state = f"collecting_{side}"
        refs = await collect_groups(
            ctx,
            policy,
            slots=slots,
            settings=plan.settings,
            progress=block.progress,
            label=f"eval {side}",
            scope=f"{scope}-{side}",
        )
        side_groups[side] = refs
        sides[side] = await ctx.call(
            ControlActivities.store_side_bundle,
            SideBundleInput(
                run_id=ctx.run_id,
                side=side,
                bundle=plan.bundle(policy.adapter_ref.name if policy.adapter_ref else None),
                environments=ctx.discovery.environments,
                groups=refs,
                behavior_policy=policy.behavior_policy,
                reset_plan_sha256=ctx.admission.reset_plan_sha256,
            ),
            summary=f"store the {side} evaluation bundle",
        )
        setattr(block, f"{side}_stats", sides[side].stats)
    world: WorldModelResult = await ctx.call(
        GpuActivities.world_model_gain,
        WorldModelInput(groups=side_groups["candidate"], adapter_ref=candidate),
        summary="observation cross-entropy: base vs candidate",
    )
    result: EvaluationResult = await ctx.call(
        ControlActivities.evaluate_run,
        EvaluateInput(
            run_id=ctx.run_id,
            config=plan.config,
            seed_start=plan.seed_start,
            auto_load=ctx.request.auto_load,
            baseline=sides["baseline"],
            candidate=sides["candidate"],
            baseline_adapter=baseline.adapter_ref.name if baseline.adapter_ref else None,
            candidate_adapter=candidate.name,
            candidate_adapter_sha256=candidate.adapter_sha256 or None,
            world_model=world.block,
        ),
        summary="paired sign test and promotion gate",
    )
    block.state = "completed"
    block.decision, block.outcome, block.verdict = result.decision, result.outcome, result.verdict
    block.evidence, block.world_model = result.evidence, world.block
    return result


async def post_evaluate(ctx: RunContext, baseline: PolicyResult, training: TrainResult) -> PostEvalResult:
    """The installed static suite on the trained adapter (and the baseline)."""
    config = ctx.request.post_eval
    assert config is not None
    result: PostEvalResult = await ctx.call(
        GpuActivities.post_evaluate,
        PostEvalInput(
            suite=config.suite,
            min_accuracy=config.min_accuracy,
            include_baseline=config.include_baseline,
            owns_promotion=config.min_accuracy is not None,
            thinking=ctx.request.episode_settings(baseline.thinking).thinking,
            candidate=candidate_ref(ctx, training),
            baseline=baseline.adapter_ref,
        ),
        summary=f"static suite {config.suite} on the trained adapter",
    )
    ctx.status.post_evaluation = PostEvaluationStatus(
        suite=config.suite,
        candidate_accuracy=result.candidate_accuracy,
        baseline_accuracy=result.baseline_accuracy,
        gate_outcome=result.gate_outcome,
        reason=result.reason,
    )
    return result
