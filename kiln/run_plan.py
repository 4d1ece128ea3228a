"""The domain rules a run workflow sequences: group schedule, evaluation plan, bundle specs, promotion.

Pure functions of the typed request and of stage results — no I/O, no clock — so the workflow can
import them and they are unit-tested here (tests/unit/test_run_plan.py). The workflow only calls
them in order; it never re-derives a default or a decision itself.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kiln.contracts import EnvironmentEvalConfig, EpisodeSettings, RunRequest, normalize_adapter


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BundleSpec(_Plan):
    """What a rollout bundle (rollouts.jsonl, replay.json, summary.json) records about its groups:
    the policy label, the first seed and the episode settings they were collected with."""

    adapter: str | None  # None = the base model
    seed_start: int
    settings: EpisodeSettings

    @classmethod
    def of_run(cls, request: RunRequest, thinking: bool | None = None) -> "BundleSpec":
        """The published bundle of a run: its own seeds, policy and settings (``thinking`` as
        resolved for the model; see ``RunRequest.episode_settings``)."""
        return cls(
            adapter=normalize_adapter(request.adapter),
            seed_start=request.seed_start,
            settings=request.episode_settings(thinking),
        )


class GroupSlot(_Plan):
    """One seed group to collect: its index, the environment that serves it and its seed."""

    group_index: int
    environment_index: int
    seed: int


def group_schedule(seed_start: int, groups: int, environments: int) -> list[GroupSlot]:
    """Seeds ``seed_start…`` in order; environments round-robin over the groups (R3.3)."""
    return [
        GroupSlot(group_index=index, environment_index=index % environments, seed=seed_start + index)
        for index in range(groups)
    ]


class EvaluationPlan(_Plan):
    """The paired held-out evaluation of a train run: identical seeds for baseline and candidate."""

    config: EnvironmentEvalConfig
    seed_start: int
    groups: int
    settings: EpisodeSettings

    @classmethod
    def of(cls, request: RunRequest, thinking: bool | None = None) -> "EvaluationPlan | None":
        config = request.environment_eval
        if config is None:
            return None
        return cls(
            config=config,
            seed_start=request.eval_seed_start(),
            groups=config.groups,
            settings=request.episode_settings(thinking).for_group_size(config.group_size),
        )

    def bundle(self, adapter: str | None) -> BundleSpec:
        """The bundle spec of one side (``adapter`` None = the base model)."""
        return BundleSpec(adapter=adapter, seed_start=self.seed_start, settings=self.settings)

    def schedule(self, environments: int) -> list[GroupSlot]:
        return group_schedule(self.seed_start, self.groups, environments)


def promotion_decision(
    request: RunRequest,
    *,
    trained: bool,
    evaluation_decision: str | None,
    post_eval_outcome: str | None,
) -> bool:
    """Promote the trained adapter's name only when: it trained, auto_load holds, the paired gate
    (if any) passed or was diagnostic, and a post-eval that owns promotion promoted it."""
    if not trained or not request.auto_load:
        return False
    if evaluation_decision not in (None, "diagnostic", "passed"):
        return False
    post = request.post_eval
    if post is not None and post.min_accuracy is not None and post_eval_outcome != "promoted":
        return False
    return True
