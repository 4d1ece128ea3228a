"""In-process collect → train → held-out evaluation on the counter environment (no Temporal).

The same parts a run uses (``GroupCollector`` with the real ``PolicyRuntime`` against a real
counter server, ``train_grpo``), wired directly so tests and ``bench/counter_training.py`` can
compare training settings on identical seeds in a minute or two. The demo's shape: 8 training
groups × 4 (seeds 0-7), 6 steps, 48 action tokens; held-out seeds start after the training seeds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.openenv.discovery import inspect_environment
from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask

DEMO_SETTINGS = {"max_steps": 6, "max_action_tokens": 48}


@dataclass(frozen=True)
class Outcome:
    mean_return: float
    invalid_rate: float  # model actions answered with a harness error / all model actions
    episodes: int


async def _collect_async(runtime: Any, url: str, seeds: list[int], group_size: int,
                         adapter_dir: Path | None, settings: dict[str, Any],
                         concurrency: int | None = None) -> list[dict[str, Any]]:
    from kiln.core.policy.identity import with_inference
    from kiln.core.settings import Settings

    inspection = await inspect_environment(url)
    episode = EpisodeSettings(group_size=group_size, **{**DEMO_SETTINGS, **settings})
    identity = with_inference(runtime.identity(adapter_dir), {**DEMO_SETTINGS, **settings})
    # as many groups at once as a default gpu worker runs collection activities (their turns
    # share the hf engine's decode forwards; a row's bytes do not depend on it), unless told
    slots = asyncio.Semaphore(concurrency or Settings().gpu_concurrency)

    async def group(index: int, seed: int) -> dict[str, Any]:
        task = GroupTask(group_index=index, environment_index=0, seed=seed, reset_payload={"seed": seed},
                         inspection=inspection, settings=episode, behavior_policy=identity,
                         adapter_dir=adapter_dir)
        async with slots:
            return await GroupCollector(task, runtime).run()

    return list(await asyncio.gather(*(group(index, seed) for index, seed in enumerate(seeds))))


def collect(runtime: Any, url: str, seeds: list[int], *, group_size: int, adapter_dir: Path | None = None,
            concurrency: int | None = None, **settings: Any) -> list[dict[str, Any]]:
    """One group document per seed (``document["line"]`` is the training line); ``concurrency``
    groups at once (default: a default gpu worker's collection activities)."""
    return asyncio.run(_collect_async(runtime, url, seeds, group_size, adapter_dir, settings, concurrency))


def outcome(documents: list[dict[str, Any]]) -> Outcome:
    returns: list[float] = []
    actions = invalid = 0
    for document in documents:
        for completion in document["line"]["completions"]:
            returns.append(float(completion["reward"]))
            for segment in completion["trajectory"]:
                if segment["kind"] == "action":
                    actions += 1
                elif segment.get("warning_prefix_len") == len(segment["content"].encode("utf-8")):
                    invalid += 1
    return Outcome(mean_return=sum(returns) / len(returns), invalid_rate=invalid / max(1, actions),
                   episodes=len(returns))


# A one-pass setting: TrainingConfig's defaults at 1e-3, which moves the tiny model far in a single
# collection round (held-out after one round on seed ranges 0 / 200 / 400: 3.100 / 2.175 / 5.425,
# base 2.700; bench/README.md "The demo's settings"). Tests that need a visible change from one training use
# it; the demo, the benchmark against TRL and the learning test train at the defaults.
ONE_PASS_TRAINING: dict[str, Any] = {"learning_rate": 1e-3}


def train_and_play(runtime: Any, url: str, model_path: Path, lines: list[dict[str, Any]], config: Any,
                   seeds: list[int], *, group_size: int, output_dir: Path) -> dict[str, Any]:
    """Train an adapter on ``lines`` with ``config`` and play ``seeds`` with it: the adapter's
    folder, the held-out ``Outcome`` (as a dict) and the trainer receipt's ``echo`` block."""
    from dataclasses import asdict

    from kiln.core.train.trainer import train_grpo

    trained = train_grpo(model_path=model_path, groups=lines, config=config, output_dir=output_dir)
    documents = collect(runtime, url, seeds, group_size=group_size, adapter_dir=trained.adapter_dir)
    return {"adapter_dir": str(trained.adapter_dir), "outcome": asdict(outcome(documents)),
            "echo": trained.receipt["echo"]}
