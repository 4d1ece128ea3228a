"""Two vllm engine servers behind one gpu worker (``KILN_VLLM_ENGINES=2``), for real, on the CPU.

A multi-turn rollout (4 seed groups x 2 episodes, up to 3 turns each) is served by a
:class:`kiln.core.policy.vllm_router.VllmRouter` over two engine processes, each bound to its own
share of the cores. From what the engines themselves report (each server counts the requests it
served per route, the route being one seed-group attempt): both engines served groups, no group was
served by both, and each group's requests are exactly its episodes' turns. The same rollout is then
served by one of the two engines alone: the same action ids, and log-probs within the engine's
tolerance (vLLM's CPU build is not batch-invariant: the rows it decodes beside each other differ).

Skipped, as tests/integration/test_engine_vllm.py is, where the engine is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from kiln.core.policy.engine_vllm import default_python
from tests.integration.test_engine_vllm import LOGPROB_TOLERANCE

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.slow,
    pytest.mark.skipif(not default_python().is_file() and os.environ.get("KILN_REQUIRE_VLLM") != "1",
                       reason="the vllm engine is not installed (scripts/setup.sh --engine vllm)"),
]

ROLLOUT = {"kind": "rollout", "groups": 4, "group_size": 2, "max_steps": 3, "max_action_tokens": 12,
           "thinking": False, "constrained_actions": True, "seed_start": 70}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.support.models import shared_random_qwen

    return shared_random_qwen(tmp_path_factory, shape="qwen3-0.6b", layers=2)


async def _rollout(kiln_settings, env_url: str, model: Path, router) -> dict:
    from activities.gpu import GpuActivities, LockedPolicy
    from api.runs import RunService
    from kiln.core.contracts import parse_run_request
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.support.kiln_workers import running_workers
    from tests.support.waiting import workflow_result

    def factory(settings, store, path):
        acts = GpuActivities(settings, store, path)
        runtime = PolicyRuntime.load(path, device=settings.device, dtype=settings.dtype)
        runtime.use_engine(router)  # the worker's engine is the router over the test's engines
        acts._policy = LockedPolicy(runtime)
        return acts

    settings = kiln_settings(model_path=model, device="cpu", dtype="auto", engine="vllm",
                             vllm_cpu_kvcache_gb=1, vllm_max_model_len=2048)
    request = parse_run_request({**ROLLOUT, "environment_urls": [env_url]})
    async with running_workers(settings, gpu_factory=factory) as client:
        run_id = (await RunService(client, settings).submit(request))[0].run_id
        status = await asyncio.wait_for(workflow_result(client.get_workflow_handle(run_id), timeout_s=900), 960)
    assert status["state"] == "completed", status.get("failure")
    artifacts = {a["name"]: a for a in status["artifacts"]}
    from tests.integration.test_real_shape_run import _fetch

    lines = [json.loads(x) for x in _fetch(settings, artifacts["rollouts.jsonl"]["uri"]).decode().splitlines()]
    return {"run_id": run_id, "groups": lines}


def _group_index(group: dict) -> int:
    """A rollout line's seed group (group ``g`` is reset at seed ``seed_start + g``)."""
    (seed,) = {c["openenv"]["seed"] for c in group["completions"]}
    return seed - ROLLOUT["seed_start"]


def _actions(group: dict) -> list[list[tuple[list[int], list[float]]]]:
    """Each episode's actions: (ids, behaviour log-probs) per turn, in candidate order."""
    out = []
    for completion in group["completions"]:
        pieces = completion["tokens"]["pieces"]
        out.append([(list(p["ids"]), list(p["logprobs"])) for p in pieces if p["kind"] == "action"])
    return out


@pytest.mark.asyncio
@pytest.mark.timeout(1800)
async def test_two_engines_serve_each_seed_group_on_one_engine_and_match_one_engine(
    kiln_settings, counter_env_url: str, model_dir: Path, tmp_path: Path
) -> None:
    from kiln.core.policy.engine_vllm import VllmConfig, VllmEngine
    from kiln.core.policy.vllm_router import VllmRouter
    from kiln.core.policy.vllm_topology import engine_envs

    envs = engine_envs(1, 2, on_cuda=False, gpus=[], cores=sorted(os.sched_getaffinity(0)))
    engines = [VllmEngine(VllmConfig(model_path=model_dir, python=default_python(), log_path=tmp_path / f"engine-{i}.log",
                                     max_model_len=2048, cpu_kvcache_gb=1, max_num_seqs=64, extra_env=env))
               for i, env in enumerate(envs)]
    try:
        both = VllmRouter(engines)
        both.start()
        assert len(set(both.pids)) == 2
        two = await _rollout(kiln_settings, counter_env_url, model_dir, both)
        served = [engine.stats()["routes"] for engine in engines]
        one = await _rollout(kiln_settings, counter_env_url, model_dir, VllmRouter(engines[:1]))
    finally:
        for engine in engines:
            engine.close()
    print(f"requests per route on each engine: {served}")
    mine = [{r: n for r, n in routes.items() if r.startswith(two["run_id"] + "/")} for routes in served]
    assert all(mine), mine  # both engines served groups of the rollout
    assert not set(mine[0]) & set(mine[1])  # no group attempt was served by both engines
    per_group: dict[int, int] = {}
    for routes in mine:
        for route, count in routes.items():
            group = int(route.split("/")[1])
            per_group[group] = per_group.get(group, 0) + count
    by_index = {_group_index(g): g for g in two["groups"]}
    assert sorted(per_group) == sorted(by_index) == [0, 1, 2, 3]
    for index, group in by_index.items():  # one request per turn of each episode (no thinking)
        assert per_group[index] == sum(len(turns) for turns in _actions(group)), index
    assert sum(per_group.values()) > 4 * 2  # multi-turn: some episodes took more than one turn
    # the same rollout on one engine: the same actions
    alone = {_group_index(g): g for g in one["groups"]}
    gap = 0.0
    for index, group in by_index.items():
        mine_actions, its_actions = _actions(group), _actions(alone[index])
        assert [[ids for ids, _ in turns] for turns in mine_actions] == \
            [[ids for ids, _ in turns] for turns in its_actions], index
        for turns, others in zip(mine_actions, its_actions):
            for (_, lps), (_, other) in zip(turns, others):
                gap = max([gap] + [abs(a - b) for a, b in zip(lps, other)])
    print(f"largest log-prob gap, two engines vs one: {gap:.2e}")
    assert gap <= LOGPROB_TOLERANCE
