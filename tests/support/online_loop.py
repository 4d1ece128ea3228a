"""In-process online RL on the counter environment: the workflow's per-iteration wiring, no Temporal.

Iteration k samples ``groups`` fresh seed groups (``seed_start + (k−1)·groups …``) with the adapter
iteration k−1 trained (the base model first), trains from that adapter and its continuation state
(``init_state`` → ``keep_state``, ``iteration``/``iterations_total`` as ``workflows/stages.py``
passes them), then plays the held-out seeds with the new adapter. Used by the learning test
(``tests/integration/test_online_learning.py``) and the Kiln side of ``bench/vs_trl.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.counter_loop import collect

HELD_OUT_SEEDS = list(range(100_000, 100_020))  # 20 seeds × 2 episodes, disjoint from training seeds
HELD_OUT_GROUP_SIZE = 2


@dataclass
class IterationFigures:
    iteration: int
    train_return: float  # mean return of the episodes collected in it (the sampling policy's)
    held_out: dict[int, float]  # per held-out seed: mean return of the new adapter
    wall_s: float  # collection + training (held-out evaluation excluded)
    kl_to_previous: float | None = None
    kl_to_base: float | None = None
    steps: int = 0
    failed: str | None = None  # a training that could not run (e.g. zero_groups)

    @property
    def held_out_mean(self) -> float | None:
        return sum(self.held_out.values()) / len(self.held_out) if self.held_out else None


@dataclass
class OnlineRun:
    base_held_out: dict[int, float]
    iterations: list[IterationFigures] = field(default_factory=list)


def held_out(runtime: Any, url: str, adapter_dir: Path | None, seeds: list[int] | None = None,
             episode: dict[str, Any] | None = None) -> dict[int, float]:
    """Per held-out seed, the mean return of ``adapter_dir`` (``episode``: settings over the demo's)."""
    seeds = seeds or HELD_OUT_SEEDS
    documents = collect(runtime, url, seeds, group_size=HELD_OUT_GROUP_SIZE, adapter_dir=adapter_dir,
                        **(episode or {}))
    means = [sum(float(c["reward"]) for c in d["line"]["completions"]) / len(d["line"]["completions"])
             for d in documents]
    return dict(zip(seeds, means))


def run_online(runtime: Any, url: str, model_path: Path, work: Path, *, config: Any, seed_start: int,
               iterations: int, groups: int = 8, group_size: int = 4,
               base_held_out: dict[int, float] | None = None, progress: Any = None,
               evaluate_from: int = 1, evaluator: Any = None, concurrency: int | None = None,
               episode: dict[str, Any] | None = None) -> OnlineRun:
    """``iterations`` collect→train→held-out rounds (see the module docstring); iterations before
    ``evaluate_from`` skip the held-out play (their ``held_out`` is empty); ``episode`` overrides the
    demo's episode settings (e.g. ``max_steps``) for collection and held-out play. ``runtime`` collects
    (``concurrency`` groups at once, default a default gpu worker's) and trains; ``evaluator`` (a
    runtime, default ``runtime``) plays the held-out seeds."""
    from kiln.core.errors import TrainingFailed
    from kiln.core.train.trainer import train_grpo

    evaluator = evaluator or runtime
    episode = episode or {}
    run = OnlineRun(base_held_out=base_held_out if base_held_out is not None
                    else held_out(evaluator, url, None, episode=episode))
    adapter, state = None, None
    for k in range(1, iterations + 1):
        t0 = time.perf_counter()
        seeds = list(range(seed_start + (k - 1) * groups, seed_start + k * groups))
        documents = collect(runtime, url, seeds, group_size=group_size, adapter_dir=adapter,
                            concurrency=concurrency, **episode)
        lines = [d["line"] for d in documents]
        rewards = [float(c["reward"]) for line in lines for c in line["completions"]]
        identity = lines[0]["completions"][0]["openenv"]["behavior_policy"]
        try:  # on the runtime's own base model, as a gpu worker trains (``share_base_model``)
            with runtime.training_lease() as lease:
                result = train_grpo(model_path=model_path, groups=lines, config=config, output_dir=work / f"it{k}",
                                    base_adapter_dir=adapter, init_state=state, keep_state=k < iterations,
                                    expected_behavior_policy=identity, iteration=k if iterations > 1 else None,
                                    iterations_total=iterations if iterations > 1 else None,
                                    lr_horizon_steps=iterations * config.epochs * -(-groups // config.groups_per_step),
                                    device=runtime.device, dtype=runtime.dtype, shared_base=lease)
        except TrainingFailed as exc:
            run.iterations.append(IterationFigures(k, sum(rewards) / len(rewards), {}, time.perf_counter() - t0,
                                                   failed=exc.code))
            break
        wall = time.perf_counter() - t0
        adapter, state = result.adapter_dir, result.final_state
        scores = held_out(evaluator, url, adapter, episode=episode) if k >= evaluate_from else {}
        figures = IterationFigures(k, sum(rewards) / len(rewards), scores, wall,
                                   kl_to_previous=result.kl_to_previous, kl_to_base=result.kl_to_base,
                                   steps=result.steps)
        run.iterations.append(figures)
        if progress is not None:
            progress(figures)
    return run


def learning_ranges(url: str, model_path: str, work: str, seed_starts: list[int], iterations: int,
                    evaluate_from: int) -> dict[str, Any]:
    """The base model's held-out play, then ``run_online`` at ``TrainingConfig``'s defaults on each
    seed range in turn, with a runtime of its own (``tests.support.background``): the base's
    per-seed returns and each range's iterations' figures, as JSON."""
    from dataclasses import asdict

    from kiln.core.training_config import TrainingConfig
    from kiln.core.policy.runtime import PolicyRuntime

    runtime = PolicyRuntime.load(Path(model_path))
    base = held_out(runtime, url, None)
    ranges = {}
    for start in seed_starts:
        run = run_online(runtime, url, Path(model_path), Path(work) / f"range-{start}", config=TrainingConfig(),
                         seed_start=start, iterations=iterations, base_held_out=base, evaluate_from=evaluate_from)
        ranges[str(start)] = [asdict(figures) for figures in run.iterations]
    return {"base": base, "ranges": ranges}


def figures_from_json(rows: list[dict[str, Any]]) -> list[IterationFigures]:
    """``learning_ranges``'s figures back as ``IterationFigures`` (held-out seeds as ints)."""
    return [IterationFigures(**{**row, "held_out": {int(seed): v for seed, v in row["held_out"].items()}})
            for row in rows]
