"""The domain rules a run workflow sequences: group schedule, evaluation plan, bundle specs, promotion.

Pure functions of the typed request and of stage results — no I/O, no clock — so the workflow can
import them and they are unit-tested here (tests/unit/test_run_plan.py). The workflow only calls
them in order; it never re-derives a default or a decision itself.
"""

from __future__ import annotations

import hashlib

from pydantic import ConfigDict

from kiln.core.contracts import EpisodeSettings, RunRequest
from kiln.core.request_fields import normalize_adapter
from kiln.core.stale_pipeline import StalenessRecord
from kiln.core.training_config import EnvironmentEvalConfig
from kiln.core.tolerant import Tolerant


class _Plan(Tolerant):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RefillRound(_Plan):
    """One dynamic-sampling refill round: the groups it collected (consecutive group indexes, each
    with seed ``seed_start + group index``, as every group of a bundle)."""

    round: int  # 1-based
    group_indexes: list[int]
    seeds: list[int]


class DynamicSamplingRecord(_Plan):
    """How an iteration's groups were refilled (DAPO dynamic sampling), as its bundle records it:
    ``target_groups`` is the run's ``groups``; ``signal_groups`` how many of all the collected
    groups carry reward variation; ``capped`` that the last allowed round ended short of the target."""

    target_groups: int
    max_refill_rounds: int
    rounds: list[RefillRound] = []
    signal_groups: int = 0
    capped: bool = False

    def warning(self, label: str) -> str:
        """The run's warning when the cap was reached (``label``: "iteration 3", "the run")."""
        return (
            f"{label}: dynamic sampling reached its cap of {self.max_refill_rounds} refill rounds with "
            f"{self.signal_groups} of {self.target_groups} groups carrying reward variation; it trains on those"
        )


class BundleSpec(_Plan):
    """What a rollout bundle (rollouts.jsonl, replay.json, summary.json) records about its groups:
    the policy label, the first seed and the episode settings they were collected with, and how
    dynamic sampling refilled them (None: no refill was planned) and, in a run with
    ``max_staleness`` > 1, which adapter version sampled them (None otherwise)."""

    adapter: str | None  # None = the base model
    seed_start: int
    settings: EpisodeSettings
    dynamic_sampling: DynamicSamplingRecord | None = None
    staleness: StalenessRecord | None = None

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
    """Seeds ``seed_start…`` in order; environments round-robin over the groups."""
    return [
        GroupSlot(group_index=index, environment_index=index % environments, seed=seed_start + index)
        for index in range(groups)
    ]


# A run keeps at most this many of its groups in flight by default with the hf engine
# (``KILN_RUN_PARALLEL_GROUPS``, read by the control worker at admission and recorded in the run's
# admission result; with vllm the default is the gpu worker's activity count). It is also what a
# run recorded before the setting existed gets, so its history replays unchanged.
PARALLEL_GROUPS = 4
# The most groups one run may keep in flight.
MAX_RUN_PARALLEL_GROUPS = 256

# At most this many groups are collected inside one workflow history: a collection with more is
# cut into chunks, each its own child workflow (≈7 events per group keeps a chunk near 1,800).
CHUNK_GROUPS = 256
# An online-RL run continues as new after the iteration that takes its history past this many
# events; one iteration adds at most ≈2,000 (a chunk of groups plus its stages), so no history
# approaches 10,000 events whatever the number of iterations.
HISTORY_EVENTS_BUDGET = 4000


def should_continue_as_new(history_length: int) -> bool:
    return history_length >= HISTORY_EVENTS_BUDGET


def iteration_seed_start(request: RunRequest, iteration: int) -> int:
    """The seed plan of online RL: iteration ``k`` (1-based) collects ``groups`` fresh seeds
    ``seed_start + (k−1)·S …`` where ``S`` is ``RunRequest.seeds_per_iteration`` (``groups``, plus
    the seeds reserved for dynamic sampling's refill rounds); iteration 1 is exactly a one-iteration
    run's seeds, and the held-out seeds start after the last iteration's (``eval_seed_start``)."""
    return request.seed_start + (iteration - 1) * request.seeds_per_iteration()


def iteration_schedule(request: RunRequest, iteration: int, environments: int) -> list[GroupSlot]:
    """Iteration ``k``'s slots: group indexes 0…groups−1 (per iteration), its own seeds."""
    return group_schedule(iteration_seed_start(request, iteration), request.groups, environments)


def refill_slots(
    request: RunRequest, iteration: int, environments: int, *, collected: int, signal: int, round_: int
) -> list[GroupSlot]:
    """Refill round ``round_`` (1-based) of iteration ``iteration``'s dynamic sampling, after
    ``collected`` groups of which ``signal`` carry reward variation: one fresh slot per missing
    group, continuing the iteration's group indexes and seeds (so seed = iteration seed start +
    group index, inside the seeds the plan reserves). Empty when nothing is missing, dynamic
    sampling is off, or the round is past ``max_refill_rounds``."""
    dynamic = request.effective_training_config().dynamic_sampling
    missing = request.groups - signal
    if dynamic is None or round_ > dynamic.max_refill_rounds or missing <= 0:
        return []
    return group_schedule(iteration_seed_start(request, iteration), collected + missing, environments)[collected:]


def chunks(slots: list[GroupSlot], size: int = CHUNK_GROUPS) -> list[list[GroupSlot]]:
    """The slots cut into consecutive chunks of at most ``size`` (one chunk = one history)."""
    return [slots[start : start + size] for start in range(0, len(slots), size)]


def evaluates_after(request: RunRequest, iteration: int) -> bool:
    """Whether the paired held-out evaluation runs after ``iteration``: the last one always (the
    gate), and every ``eval_every``-th one when asked (the learning curve)."""
    if request.environment_eval is None:
        return False
    if iteration == request.iterations:
        return True
    return request.eval_every is not None and iteration % request.eval_every == 0


def behavior_lag(request: RunRequest, iteration: int) -> int:
    """How many updates older than the adapter training starts from the data of ``iteration`` is:
    0 strictly on-policy; with ``max_staleness`` N iteration k is collected with adapter
    ``max(0, k−1−N)`` (``kiln.core.stale_pipeline.sampler_version``; with N = 1 the adapter of
    iteration k−2 while iteration k−1 trains), so its lag is ``min(N, k−1)``."""
    return min(request.max_staleness, iteration - 1) if iteration >= 2 else 0


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


CHAIN_START = "sha256:" + "0" * 64


def extend_chain(chain: str | None, record_sha256: str) -> str:
    """The digest chain over an online-RL run's iteration records after one more record:
    ``sha256(chain ‖ record digest)`` (kiln.core.artifacts.iterations re-checks it at publication)."""
    digest = hashlib.sha256(f"{chain or CHAIN_START}\n{record_sha256}".encode("ascii")).hexdigest()
    return "sha256:" + digest
