"""The engine port: the hf engine behind PolicyRuntime, identities, the training gate, settings."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from kiln.core.policy.engine import GenerationRequest, engine_identity_fields
from kiln.core.settings import Settings
from tests.support.models import shared_tiny_model

MESSAGES = [{"role": "user", "content": 'Count is 0. Reply with {"amount": N}.'}]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    import torch

    from kiln.core.policy.runtime import PolicyRuntime

    torch.set_num_threads(1)
    return PolicyRuntime.load(shared_tiny_model(tmp_path_factory))


def test_runtime_samples_through_the_hf_engine_with_the_samplers_bytes(rt) -> None:
    from kiln.core.policy.sampling import sample_batch

    prompt = rt.encode_prompt(MESSAGES, thinking=False)
    other = prompt + rt.encode_observation_turn("Count is 3.", thinking=False)[1]
    prompts, seeds = [prompt, other, prompt], [11, 12, 13]
    via_port = rt.sample(prompts, seeds, max_new_tokens=12, temperature=1.0, thinking=False)
    direct = sample_batch(rt.model, prompts, seeds, max_new_tokens=12, temperature=1.0,
                          stop_id=rt.stop_id, think_close_id=rt.think_close_id, device=rt.device)
    assert [g.ids for g in via_port] == [s.ids for s in direct]
    assert [g.logprobs for g in via_port] == [s.logprobs for s in direct]
    assert [g.adapter_sha256 for g in via_port] == [None, None, None]
    # rows with different settings in one engine call: each run of equal settings is one sampler
    # call, and a row's bytes do not depend on the rows beside it
    mixed = rt.engine.generate([
        GenerationRequest(prompt_ids=tuple(prompt), seed=11, max_tokens=12, temperature=1.0, stop_id=rt.stop_id,
                          think_close_id=rt.think_close_id),
        GenerationRequest(prompt_ids=tuple(other), seed=12, max_tokens=5, temperature=0.0, stop_id=rt.stop_id,
                          think_close_id=rt.think_close_id),
    ])
    assert mixed[0].ids == direct[0].ids and mixed[0].logprobs == direct[0].logprobs
    greedy = sample_batch(rt.model, [other], [12], max_new_tokens=5, temperature=0.0, stop_id=rt.stop_id,
                          think_close_id=rt.think_close_id, device=rt.device)
    assert mixed[1].ids == greedy[0].ids


def test_concurrent_calls_share_decode_forwards_and_keep_their_bytes(rt) -> None:
    """Two callers (two runs) sample at once: their rows join one decode loop, forwards run rows
    of both, and every row's bytes equal those of the same call made alone."""
    import torch

    from kiln.core.policy.engine import request_tag

    prompt = rt.encode_prompt(MESSAGES, thinking=True)
    turns = [prompt + rt.encode_observation_turn(f"Count is {k}.", thinking=True)[1] for k in range(4)]
    calls = {"run-a": ([prompt] * 4, [41, 42, 43, 44]), "run-b": (turns, [51, 52, 53, 54])}

    def bits(samples) -> list:
        return [(s.ids, torch.tensor(s.logprobs).numpy().tobytes(), s.finished) for s in samples]

    alone = {tag: bits(rt.sample(p, seeds, max_new_tokens=24, temperature=1.0)) for tag, (p, seeds) in calls.items()}
    before = dict(rt.engine.batching)
    together: dict[str, list] = {}

    def call(tag: str) -> None:
        request_tag.set(tag)
        together[tag] = bits(rt.sample(*calls[tag], max_new_tokens=24, temperature=1.0))

    threads = [threading.Thread(target=call, args=(tag,)) for tag in calls]
    with rt.lock:  # the first caller drives the loop only once both calls are queued
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(rt.engine._waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(rt.engine._waiting) == 2
    for thread in threads:
        thread.join(timeout=60)
    assert together == alone
    mixed = rt.engine.batching["forwards_with_several_tags"] - before["forwards_with_several_tags"]
    forwards = rt.engine.batching["forwards"] - before["forwards"]
    assert mixed > 0 and rt.engine.batching["forwards_with_several_calls"] > before["forwards_with_several_calls"]
    # all 8 rows took a slot of the tile at once: the longest row's forwards are all there were
    assert forwards == max(len(ids) for rows in together.values() for ids, _, _ in rows) - 1


def test_hf_identity_names_its_decode_tile_and_other_engines_add_name_and_version(rt) -> None:
    import kiln
    from kiln.core.policy.engine_hf import HfEngine

    assert rt.engine.name == "hf"
    hf = {"name": "hf", "version": kiln.__version__, "decode_tile": 8}
    assert rt.runtime_identity()["engine"] == hf
    assert engine_identity_fields(rt.engine) == {"engine": hf}
    # a tile of 1 decodes exactly as Kiln did before the tile: identities recorded then stay valid
    assert engine_identity_fields(HfEngine(rt, decode_tile=1)) == {}
    assert engine_identity_fields(HfEngine(rt, decode_tile=3))["engine"]["decode_tile"] == 3
    with pytest.raises(ValueError, match="decode_tile"):
        HfEngine(rt, decode_tile=0)

    class Named:
        name = "vllm"

        def identity(self) -> dict:
            return {"name": "vllm", "version": "0.32.0"}

    assert engine_identity_fields(Named()) == {"engine": {"name": "vllm", "version": "0.32.0"}}


def test_a_run_is_served_at_the_decode_tile_its_identity_names(rt) -> None:
    """An identity recorded at tile 1 (or before the tile existed: no engine block) is served at
    tile 1 by a worker whose default is 8: the same identity, and the bytes of a tile-1 engine."""
    from kiln.core.policy.engine import decode_tile_of
    from kiln.core.policy.engine_hf import HfEngine
    from kiln.core.policy.sampling import sample_batch
    from kiln.core.stages.collection import behavior_policy_of

    assert rt.engine.decode_tile == 8
    admitted_now = rt.identity()
    assert decode_tile_of(admitted_now) == 8
    before_the_tile = {**admitted_now, "runtime": {k: v for k, v in admitted_now["runtime"].items() if k != "engine"}}
    assert decode_tile_of(before_the_tile) == 1
    assert behavior_policy_of(rt, None, None, None, decode_tile_of(before_the_tile)) == {**before_the_tile,
                                                                                        "adapter": None}
    assert behavior_policy_of(rt, None, None)["runtime"]["engine"]["decode_tile"] == 8
    vllm = {**admitted_now, "runtime": {**admitted_now["runtime"], "engine": {"name": "vllm", "version": "0.32.0"}}}
    scripted = {"base_model_sha256": "sha256:" + "ab" * 32, "runtime": {"kind": "scripted"}, "adapter_sha256": None}
    assert decode_tile_of(vllm) is None and decode_tile_of(scripted) is None and decode_tile_of(None) is None
    assert engine_identity_fields(HfEngine(rt, decode_tile=8), 1) == {}

    prompt = rt.encode_prompt(MESSAGES, thinking=True)
    served = rt.sample([prompt] * 3, [61, 62, 63], max_new_tokens=20, temperature=1.0, decode_tile=1)
    tile_one = sample_batch(rt.model, [prompt] * 3, [61, 62, 63], max_new_tokens=20, temperature=1.0,
                            stop_id=rt.stop_id, think_close_id=rt.think_close_id, device=rt.device, tile=1)
    assert [(g.ids, g.logprobs) for g in served] == [(s.ids, s.logprobs) for s in tile_one]
    with pytest.raises(ValueError, match="decode_tile"):
        GenerationRequest(prompt_ids=(1,), seed=1, max_tokens=2, temperature=1.0, stop_id=2, decode_tile=0)


def test_hf_engine_refuses_top_p(rt) -> None:
    prompt = tuple(rt.encode_prompt(MESSAGES, thinking=False))
    with pytest.raises(ValueError, match="top_p must be 1.0"):
        rt.engine.generate([GenerationRequest(prompt_ids=prompt, seed=1, max_tokens=2, temperature=1.0,
                                              stop_id=rt.stop_id, top_p=0.9)])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"prompt_ids": ()}, "empty prompt"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p")],
)
def test_generation_request_rejects_bad_values(kwargs, message) -> None:
    values = {"prompt_ids": (1, 2), "seed": 0, "max_tokens": 4, "temperature": 1.0, "stop_id": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        GenerationRequest(**values)


def test_training_gate_waits_for_rows_in_flight_and_blocks_new_ones() -> None:
    from kiln.core.policy.engine_vllm import _Gate

    gate, events = _Gate(), []
    release = threading.Event()

    def row() -> None:
        with gate.shared():
            events.append("row-start")
            release.wait(5)
            events.append("row-end")

    def train() -> None:
        with gate.exclusive():
            events.append("train")

    t_row = threading.Thread(target=row)
    t_row.start()
    while "row-start" not in events:
        time.sleep(0.01)
    t_train = threading.Thread(target=train)
    t_train.start()
    time.sleep(0.2)
    assert events == ["row-start"]  # training waits for the row in flight
    release.set()
    t_row.join(5)
    t_train.join(5)
    assert events == ["row-start", "row-end", "train"]


def test_engine_setting_sizes_the_gpu_worker() -> None:
    assert Settings(engine="hf").gpu_concurrency == 2
    assert Settings(engine="vllm").gpu_concurrency == 32
    assert Settings(engine="vllm", vllm_max_concurrent_activities=7).gpu_concurrency == 7
    with pytest.raises(ValueError):
        Settings(engine="sglang")
    assert Settings().hf_decode_tile == 8 and Settings(hf_decode_tile=1).hf_decode_tile == 1
    for bad in (0, 257):
        with pytest.raises(ValueError, match="hf_decode_tile"):
            Settings(hf_decode_tile=bad)


def test_a_vllm_worker_configures_its_engine_from_its_settings(tmp_path: Path) -> None:
    from kiln.core.policy.engine_vllm import default_python
    from kiln.core.policy.vllm_router import engine_for

    settings = Settings(home=tmp_path / "home", engine="vllm", vllm_max_concurrent_activities=12,
                        vllm_gpu_memory_utilization=0.35, vllm_cpu_kvcache_gb=3, vllm_max_model_len=1536)
    engine = engine_for(settings, tmp_path / "model", dtype="bfloat16")
    try:
        cfg = engine.config
        assert (cfg.model_path, cfg.dtype, cfg.python) == (tmp_path / "model", "bfloat16", default_python())
        assert (cfg.gpu_memory_utilization, cfg.cpu_kvcache_gb, cfg.max_model_len) == (0.35, 3, 1536)
        assert cfg.max_num_seqs == 96  # 12 activities x 8 rows
        assert cfg.log_path == tmp_path / "home" / "logs" / "vllm-engine.log" and cfg.log_path.parent.is_dir()
        assert engine.pid is None  # nothing starts until the first request
    finally:
        engine.close()
    python = tmp_path / "py"
    own = engine_for(Settings(home=tmp_path / "home", engine="vllm", vllm_python=python), tmp_path, dtype="float32")
    own.close()
    assert own.config.python == python and own.config.max_num_seqs == 256


def test_a_missing_engine_python_is_a_clear_non_retryable_error(tmp_path: Path) -> None:
    from kiln.core.errors import EngineUnavailable
    from kiln.core.policy.engine_vllm import VllmConfig, VllmEngine

    engine = VllmEngine(VllmConfig(model_path=tmp_path, python=tmp_path / "no-python"))
    with pytest.raises(EngineUnavailable) as err:
        engine.start()
    assert err.value.code == "engine_unavailable" and err.value.retryable is False
    assert "setup.sh --engine vllm" in (err.value.hint or "")
    engine.close()


def test_setup_rejects_an_unknown_engine() -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(["bash", str(root / "scripts/setup.sh"), "--engine", "sglang"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "--engine must be hf or vllm" in out.stderr
