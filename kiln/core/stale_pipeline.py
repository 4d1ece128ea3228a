"""Online runs with ``max_staleness`` N > 1: the collection pipeline and its version bound.

Adapter versions count iterations: version 0 is the run's starting policy, version v the adapter
iteration v trained (an iteration that trained nothing leaves the previous adapter in place under
its number). Iteration k trains from version k−1 on groups sampled by version
``max(0, k−1−N)`` (:func:`sampler_version`), so collection runs up to N versions ahead of
training; the lag of its data is ``k−1`` minus that version (``kiln.core.run_plan.behavior_lag``).
The workflow starts each collection as soon as its sampler exists (:func:`pipeline_starts`) and
runs them one at a time, in iteration order; the bundle of each iteration records its
:class:`StalenessRecord`. The trainer keeps only groups whose lag is at most N
(:func:`bound_groups`): the rest are dropped, counted and warned about, and the kept ones are
corrected against the behaviour adapter that sampled them (``kiln.core.train.staleness``).

Pure (no I/O): the workflow imports it through ``kiln.core.records``.
"""

from __future__ import annotations

from pydantic import ConfigDict

from kiln.core.errors import TrainingFailed
from kiln.core.tolerant import Tolerant


class StalenessRecord(Tolerant):
    """What an iteration's bundle records about the age of its data (``summary.json``
    ``staleness``): the run's bound, the adapter version that sampled the groups, and their lag
    behind the version training started from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_staleness: int
    behavior_version: int
    lag: int


class StaleBound(Tolerant):
    """The trainer's version bound over one training's groups: how many groups were seen at each
    lag, and which (by position) were dropped for exceeding ``max_staleness``, at what lag."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_staleness: int
    trained_from: int
    lags: dict[str, int]  # lag (as a string: a JSON key) → groups seen at that lag
    dropped_at: dict[int, int]  # position → its lag, for every group dropped

    def block(self) -> dict[str, object]:
        """The selection's ``stale`` block (in the receipt and the iteration's ``training_selection``)."""
        return {
            "max_staleness": self.max_staleness,
            "trained_from_version": self.trained_from,
            "lags": dict(self.lags),
            "dropped_groups": len(self.dropped_at),
        }

    def warnings(self) -> dict[int, str]:
        """The warning of each dropped group, by position."""
        return {
            position: f"group {position} was sampled {lag} adapter versions behind version {self.trained_from}, "
            f"past max_staleness {self.max_staleness}; dropped before training"
            for position, lag in self.dropped_at.items()
        }


def sampler_version(max_staleness: int, iteration: int) -> int:
    """The adapter version that samples ``iteration`` (1-based) in a run with ``max_staleness``."""
    return max(0, iteration - 1 - max_staleness)


def pipeline_starts(max_staleness: int, iteration: int, total: int) -> list[int]:
    """The iterations whose collection starts when ``iteration`` begins training: every later
    iteration whose sampler (:func:`sampler_version`) is the adapter ``iteration`` trains from and
    that no earlier iteration started — 2 … N+1 at iteration 1, then iteration k+N at k."""
    if max_staleness < 1:
        return []
    first = 2 if iteration == 1 else iteration + max_staleness
    return list(range(first, min(iteration + max_staleness, total) + 1))


def bound_groups(versions: list[int], trained_from: int, max_staleness: int) -> StaleBound:
    """Keep the groups (``versions``: the adapter version that sampled each) whose lag behind
    ``trained_from`` is at most ``max_staleness``; refuse data from a version training has not
    reached (it cannot have been sampled by an adapter that does not exist yet)."""
    lags: dict[str, int] = {}
    dropped_at: dict[int, int] = {}
    for position, version in enumerate(versions):
        lag = trained_from - version
        if lag < 0:
            raise TrainingFailed(
                f"group {position} names adapter version {version}, newer than version {trained_from} "
                "that training starts from",
                code="staleness_invalid",
                hint="the groups' behaviour version must be at most the iteration's starting version",
            )
        lags[str(lag)] = lags.get(str(lag), 0) + 1
        if lag > max_staleness:
            dropped_at[position] = lag
    ordered = {key: lags[key] for key in sorted(lags, key=int)}
    return StaleBound(max_staleness=max_staleness, trained_from=trained_from, lags=ordered, dropped_at=dropped_at)
