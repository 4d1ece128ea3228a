"""Collection throughput: Kiln's ``EnvSession`` versus the ``openenv`` package's own client.

Both clients run identical scripted episodes (reset with a seed, ``{"amount": 1}`` until done or
8 steps, final ``state``, close) against one real counter server (``openenv==0.10.0``, 8 sessions)
at concurrency 1, 2, 4 and 8. Kiln's episode includes everything the protocol requires of it (a
status-only ``/health`` before each upgrade, reply validation, lock-step checks). Rounds alternate
the order of the two clients; the best round of each is kept. Prints episodes/s and the ratio
(target: Kiln >= 0.9x the reference). Runtime: well under two minutes.

A second table uses a **1-session** server (openenv's default): Kiln's ``GroupCollector`` runs
groups of 4 with concurrency 4 (a constant ``{"amount": 1}`` policy, no model), so it must learn
the capacity from ``CAPACITY_REACHED`` and plan waves of 1; Kiln's session layer and the reference
client run the same episodes one after another (the sequential plan a 1-session server allows).
The ratio target applies to the session layer; the collector row is informative (it adds the
per-step policy call in a worker thread that a real model needs).

Run: ``python -m bench.collection [--episodes 48] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.core.openenv import normalize_url, open_session_and_reset
from tests.support.servers import serve_example_env

MAX_STEPS = 8
CONCURRENCY = (1, 2, 4, 8)


async def kiln_episode(base_url: str, seed: int) -> int:
    url = normalize_url(base_url)
    session, result, _ = await open_session_and_reset(url, {"seed": seed}, capacity_wait_s=30)
    steps = 0
    try:
        while not result.done and steps < MAX_STEPS:
            result = await session.step({"amount": 1})
            steps += 1
        await session.state()
    finally:
        await session.close()
    return steps


async def reference_episode(base_url: str, seed: int) -> int:
    from openenv.core.generic_client import GenericEnvClient

    steps = 0
    async with GenericEnvClient(base_url=base_url) as env:
        result = await env.reset(seed=seed)
        while not result.done and steps < MAX_STEPS:
            result = await env.step({"amount": 1})
            steps += 1
        await env.state()
    return steps


async def run_batch(episode, base_url: str, episodes: int, concurrency: int) -> tuple[float, int]:
    queue = list(range(episodes))
    total_steps = 0

    async def worker() -> None:
        nonlocal total_steps
        while queue:
            seed = queue.pop()
            steps = await episode(base_url, seed)
            total_steps += steps

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return episodes / (time.perf_counter() - started), total_steps


async def main_async(base_url: str, episodes: int, rounds: int) -> list[tuple[int, float, float]]:
    await run_batch(kiln_episode, base_url, 8, 2)  # warm both paths (imports, server caches)
    await run_batch(reference_episode, base_url, 8, 2)
    rows = []
    for concurrency in CONCURRENCY:
        best = {"kiln": 0.0, "reference": 0.0}
        steps = {}
        for round_index in range(rounds):
            order = [("kiln", kiln_episode), ("reference", reference_episode)]
            if round_index % 2:
                order.reverse()
            for name, episode in order:
                rate, total = await run_batch(episode, base_url, episodes, concurrency)
                best[name] = max(best[name], rate)
                steps[name] = total
        if steps["kiln"] != steps["reference"]:
            raise SystemExit(f"episodes differ: kiln {steps['kiln']} vs reference {steps['reference']} steps")
        rows.append((concurrency, best["kiln"], best["reference"]))
    return rows


class ConstantPolicy:
    """A PolicyPort that always answers ``{"amount": 1}`` (thinking off): no model in the way."""

    ANSWER: ClassVar[list[int]] = [ord(ch) for ch in '{"amount": 1}']

    def identity(self, adapter_dir=None) -> dict:
        return {"base_model_sha256": "sha256:" + "00" * 32, "runtime": {"kind": "constant"}, "adapter_sha256": None}

    def encode_prompt(self, messages, *, thinking):
        return [1]

    def encode_observation_turn(self, content, *, thinking):
        return [1], [2], [1]

    def sample(self, prompts, seeds, **_kwargs):
        from types import SimpleNamespace

        return [SimpleNamespace(ids=self.ANSWER + [0], logprobs=[-0.1] * (len(self.ANSWER) + 1), finished=True) for _ in prompts]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)

    def split_action(self, ids, *, thinking):
        return "", self.decode(ids[:-1] if ids and ids[-1] == 0 else ids)


async def kiln_groups(base_url: str, inspection: dict, groups: int) -> tuple[float, int]:
    from kiln.core.rollout.group import EpisodeSettings, GroupCollector, GroupTask

    policy = ConstantPolicy()
    settings = EpisodeSettings(group_size=4, max_steps=MAX_STEPS, concurrency=4, thinking=False)
    started, steps = time.perf_counter(), 0
    for g in range(groups):
        task = GroupTask(group_index=g, environment_index=0, seed=g, reset_payload={"seed": g},
                         inspection=inspection, settings=settings, behavior_policy=policy.identity())
        document = await GroupCollector(task, policy).run()
        steps += sum(r["steps"] for r in document["records"])
    return groups * 4 / (time.perf_counter() - started), steps


async def reference_groups(base_url: str, groups: int) -> tuple[float, int]:
    started, steps = time.perf_counter(), 0
    for g in range(groups):
        for _ in range(4):
            steps += await reference_episode(base_url, g)
    return groups * 4 / (time.perf_counter() - started), steps


async def sequential_episodes(episode, base_url: str, groups: int) -> tuple[float, int]:
    started, steps = time.perf_counter(), 0
    for g in range(groups):
        for _ in range(4):
            steps += await episode(base_url, g)
    return groups * 4 / (time.perf_counter() - started), steps


async def single_session_async(base_url: str, groups: int, rounds: int) -> dict[str, float]:
    from kiln.core.openenv.discovery import inspect_environment

    inspection = await inspect_environment(base_url)
    await kiln_groups(base_url, inspection, 2)
    await reference_groups(base_url, 2)
    runs = {
        "collector": lambda: kiln_groups(base_url, inspection, groups),
        "session": lambda: sequential_episodes(kiln_episode, base_url, groups),
        "reference": lambda: reference_groups(base_url, groups),
    }
    best = dict.fromkeys(runs, 0.0)
    steps = {}
    for round_index in range(rounds):
        names = list(runs) if round_index % 2 == 0 else list(reversed(runs))
        for name in names:
            rate, total = await runs[name]()
            best[name] = max(best[name], rate)
            steps[name] = total
    if len(set(steps.values())) != 1:
        raise SystemExit(f"episodes differ: {steps}")
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-ratio", type=float, default=0.9)
    args = parser.parse_args(argv)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        os.environ.pop(var, None)
    started = time.perf_counter()
    with serve_example_env("counter", max_concurrent_envs=8) as base_url:
        rows = asyncio.run(main_async(base_url, args.episodes, args.rounds))
    print(f"{'concurrency':>11} {'kiln ep/s':>10} {'openenv ep/s':>13} {'ratio':>6}")
    worst = float("inf")
    for concurrency, kiln_rate, reference_rate in rows:
        ratio = kiln_rate / reference_rate
        worst = min(worst, ratio)
        print(f"{concurrency:>11} {kiln_rate:>10.1f} {reference_rate:>13.1f} {ratio:>6.2f}")
    with serve_example_env("counter", max_concurrent_envs=1) as base_url:
        best = asyncio.run(single_session_async(base_url, max(2, args.episodes // 4), args.rounds))
    ratio = best["session"] / best["reference"]
    worst = min(worst, ratio)
    print("1-session server, groups of 4, one episode at a time:")
    print(f"  kiln session layer {best['session']:.1f} ep/s, openenv client {best['reference']:.1f} ep/s, "
          f"ratio {ratio:.2f}")
    print(f"  kiln GroupCollector (concurrency 4, waves planned from CAPACITY_REACHED, constant policy) "
          f"{best['collector']:.1f} ep/s, ratio {best['collector'] / best['reference']:.2f} (informative: "
          "includes the per-step policy thread hop a real model needs)")
    print(f"worst ratio {worst:.2f} (target >= {args.min_ratio}); {time.perf_counter() - started:.1f}s total")
    return 0 if worst >= args.min_ratio else 1


if __name__ == "__main__":
    raise SystemExit(main())
