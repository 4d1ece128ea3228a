"""Where a worker's vllm engines run (kiln/core/policy/vllm_topology.py), how the settings reach
them, and the router's sticky choice of engine (kiln/core/policy/vllm_router.py). No engine
process starts here: tests/integration/test_engine_vllm_router.py serves through two for real."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.core.errors import EngineSettingsInvalid
from kiln.core.policy.vllm_topology import engine_envs
from kiln.core.settings import Settings


@pytest.mark.timeout(30)
def test_each_engine_gets_gpus_of_its_own_and_one_engine_keeps_todays_environment() -> None:
    gpus = ["0", "1", "2", "3"]
    assert engine_envs(1, 1, on_cuda=True, gpus=gpus, cores=[0]) == [{}]
    assert engine_envs(1, 4, on_cuda=True, gpus=gpus, cores=[0]) == [
        {"CUDA_VISIBLE_DEVICES": g} for g in gpus]
    assert engine_envs(2, 2, on_cuda=True, gpus=gpus, cores=[0]) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    # the worker's own CUDA_VISIBLE_DEVICES names are passed on, not renumbered
    assert engine_envs(2, 1, on_cuda=True, gpus=["5", "7"], cores=[0]) == [{"CUDA_VISIBLE_DEVICES": "5,7"}]


@pytest.mark.timeout(30)
def test_engines_on_a_cpu_share_its_cores_in_slices() -> None:
    # engine_envs(tensor_parallel, engines, ...)
    assert engine_envs(1, 1, on_cuda=False, gpus=[], cores=[0, 1]) == [{}]
    assert engine_envs(1, 2, on_cuda=False, gpus=[], cores=[0, 1]) == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    # one engine of 2 ranks: a slice per rank (vLLM's own binding wants a NUMA node per rank)
    assert engine_envs(2, 1, on_cuda=False, gpus=[], cores=list(range(8))) == [{"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}]
    assert engine_envs(2, 1, on_cuda=False, gpus=[], cores=[0]) == [{}]
    assert engine_envs(2, 2, on_cuda=False, gpus=[], cores=list(range(9))) == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0-2|3-4"}, {"VLLM_CPU_OMP_THREADS_BIND": "5-6|7-8"}]
    assert engine_envs(1, 2, on_cuda=False, gpus=[], cores=[0, 2, 4, 6]) == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,2"}, {"VLLM_CPU_OMP_THREADS_BIND": "4,6"}]
    # fewer cores than ranks: each engine binds as it would alone
    assert engine_envs(1, 3, on_cuda=False, gpus=[], cores=[0, 1]) == [{}, {}, {}]


@pytest.mark.timeout(30)
def test_a_topology_this_machine_cannot_provide_is_refused_naming_the_setting() -> None:
    with pytest.raises(EngineSettingsInvalid) as caught:
        engine_envs(4, 1, on_cuda=True, gpus=["0", "1"], cores=[0])
    error = caught.value
    assert (error.code, error.retryable, error.http_status) == ("engine_settings_invalid", False, 400)
    assert error.message == ("KILN_VLLM_ENGINES=1 x KILN_VLLM_TENSOR_PARALLEL=4 asks for 4 GPUs but 2 are "
                             "visible (0, 1)")
    assert "CUDA_VISIBLE_DEVICES" in error.hint and error.details["visible_gpus"] == 2
    with pytest.raises(EngineSettingsInvalid) as caught:
        engine_envs(1, 3, on_cuda=True, gpus=["0", "1"], cores=[0])
    assert "asks for 3 GPUs but 2 are visible" in caught.value.message
    for tp, engines, name in ((0, 1, "KILN_VLLM_TENSOR_PARALLEL"), (1, -2, "KILN_VLLM_ENGINES")):
        with pytest.raises(EngineSettingsInvalid) as caught:
            engine_envs(tp, engines, on_cuda=False, gpus=[], cores=[0, 1])
        value = tp if name.endswith("PARALLEL") else engines
        assert caught.value.message == f"{name}={value}: the vllm engine needs at least 1"
        assert caught.value.details == {"field": name, "value": value}


def _cores_of(bind: str) -> list[int]:
    out: list[int] = []
    for part in bind.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


@pytest.mark.timeout(60)
def test_a_worker_with_two_engines_builds_a_router_whose_routes_stick(tmp_path: Path, monkeypatch) -> None:
    from kiln.core.policy.engine_vllm import VllmEngine
    from kiln.core.policy.vllm_router import engine_for
    from kiln.core.policy.vllm_router import MAX_ROUTES, VllmRouter

    monkeypatch.setenv("KILN_VLLM_ENGINES", "2")
    monkeypatch.setenv("KILN_VLLM_TENSOR_PARALLEL", "1")
    settings = Settings(home=tmp_path / "home", engine="vllm", device="cpu")
    assert (settings.vllm_engines, settings.vllm_tensor_parallel) == (2, 1)
    router = engine_for(settings, tmp_path / "model", dtype="float32")
    try:
        assert isinstance(router, VllmRouter) and len(router.engines) == 2
        logs = [e.config.log_path for e in router.engines]
        assert logs == [tmp_path / "home" / "logs" / "vllm-engine.log", tmp_path / "home" / "logs" / "vllm-engine-1.log"]
        cores = sorted(os.sched_getaffinity(0))
        binds = [e.config.extra_env.get("VLLM_CPU_OMP_THREADS_BIND") for e in router.engines]
        half = (len(cores) + 1) // 2
        expected = [cores[:half], cores[half:]] if len(cores) >= 2 else []
        assert len(binds) == 2 and all(binds) == bool(expected)
        for bind, own in zip(binds, expected):  # each engine's slice of the worker's cores
            assert sorted(_cores_of(bind)) == own
        assert router.pids == [None, None] and router.config is router.engines[0].config
        # routes alternate between the engines as they arrive, then stick; unrouted calls balance
        picks = [router.engine_index(r) for r in ("a", "b", "a", "c", "b", "a", None, "d")]
        assert picks == [0, 1, 0, 0, 1, 0, 1, 0]
        for i in range(MAX_ROUTES):
            router.engine_index(f"r{i}")
        assert "a" not in router._routes and len(router._routes) == MAX_ROUTES  # least recently used out
    finally:
        router.close()
    one = engine_for(Settings(home=tmp_path / "home", engine="vllm", device="cpu", vllm_engines=1, vllm_tensor_parallel=2),
                     tmp_path / "model", dtype="float32")
    one.close()
    assert isinstance(one, VllmEngine) and one.config.tensor_parallel == 2
    with pytest.raises(EngineSettingsInvalid):
        engine_for(Settings(home=tmp_path / "home", engine="vllm", device="cpu", vllm_engines=0), tmp_path, dtype="float32")
