"""The vllm engine (CPU build, for real) on newer families and on faults that repeat:

- a mixture of experts (``Qwen3MoeForCausalLM``, random weights), served through the torch experts
  the server installs on the CPU build (kiln/core/policy/vllm_moe_lora_cpu.py; vLLM's own need
  Triton): the trainer's log-prob gap with an adapter on the experts, rows with and without it in
  one batch, and two train iterations, iteration 2 sampling with iteration 1's adapter (one engine
  for both); an MoE architecture those experts do not compute (gpt-oss) is refused when the engine
  starts, with ``model_unsupported`` naming what is served;
- the Qwen3.5 checkpoint in the hub's layout (``Qwen3_5ForConditionalGeneration``, a composite
  vision-language config, 3 Gated DeltaNet layers and 1 full-attention layer): served as its
  language model only, two train iterations, where the engine has a torchvision
  (``scripts/setup_vllm.sh`` installs one; its compiled operators need not load: text serving
  never runs them); else refused when the engine starts, ``model_unsupported`` naming torchvision;
- a model folder whose weights cannot load: the run ends on its first attempt with
  ``engine_fault`` and the engine log's cause, and the engine is started exactly once.

Each case starts its own engine process (the MoE cases share one), which (but for the Qwen3.5 run
with torchvision and the MoE cases) exits while starting. Skipped, as tests/integration/test_engine_vllm.py is, where the engine is not
installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kiln.core.policy.engine_vllm import default_python

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.slow,
    pytest.mark.skipif(not default_python().is_file(), reason="the vllm engine is not installed "
                       "(scripts/setup.sh --engine vllm)"),
]


def _engine_has_torchvision() -> bool:
    """Whether the engine's processes import a torchvision, as its server installs it (its venv's
    own, or scripts/setup_vllm.sh's ``.venv-vllm/kiln-torchvision``: kiln/core/policy/vllm_vision.py)."""
    if not default_python().is_file():
        return False
    here = str(Path(__file__).resolve().parents[2] / "kiln" / "core" / "policy")
    code = f"import sys; sys.path.insert(0, {here!r}); import vllm_vision; vllm_vision.install(); import torchvision.ops"
    probe = subprocess.run([str(default_python()), "-c", code], capture_output=True, timeout=120)
    return probe.returncode == 0


TORCHVISION = _engine_has_torchvision()


@pytest.fixture(scope="module")
def tokenizer():
    from kiln.core.policy.qwen_vocab import build_qwen_tokenizer

    return build_qwen_tokenizer()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer) -> Path:
    from tests.support.model_builders import build_qwen3_moe_model

    return build_qwen3_moe_model(Path(tmp_path_factory.mktemp("moe")), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, tokenizer) -> Path:
    from tests.support.model_builders import build_qwen3_dense_model

    return build_qwen3_dense_model(Path(tmp_path_factory.mktemp("dense")), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory, tokenizer) -> Path:
    from tests.support.model_builders import build_qwen35_hub_model

    return build_qwen35_hub_model(Path(tmp_path_factory.mktemp("qwen35")), tokenizer=tokenizer)


def _engine(model: Path, log: Path):
    from kiln.core.policy.engine_vllm import VllmConfig, VllmEngine

    return VllmEngine(VllmConfig(model_path=model, python=default_python(), log_path=log, max_model_len=2048,
                                 cpu_kvcache_gb=1, max_num_seqs=64))


@pytest.fixture(scope="module")
def moe_engine(moe_dir: Path, tmp_path_factory):
    """One engine process serving the MoE model for the module's MoE cases."""
    engine = _engine(moe_dir, Path(tmp_path_factory.mktemp("moe-engine")) / "engine.log")
    try:
        engine.start()
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def moe_adapter(moe_dir: Path, tmp_path_factory) -> Path:
    """Kiln's own adapter for the MoE model (its family's targets: attention and the experts'
    3-D parameters), the experts' factors given random non-zero weights; the attention factors keep
    peft's zero ``B``, so whatever the adapter changes, the experts' LoRA changes."""
    import torch

    from kiln.core.train.model import adapted_targets, attach_lora, load_base_model, save_adapter

    model = attach_lora(load_base_model(moe_dir, "cpu"), rank=4, alpha=8, seed=3, base_adapter_dir=None)
    assert adapted_targets(model)["parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name and "experts" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    out = Path(tmp_path_factory.mktemp("moe-lora")) / "a"
    save_adapter(model, out)
    return out


MOE_LOGPROB_TOLERANCE = 1e-4  # as tests/integration/test_engine_vllm.py's, the measure in docs/engines.md


@pytest.mark.timeout(900)  # pays for the module's model builds and the engine start
def test_moe_rows_with_and_without_an_expert_adapter_match_the_trainers_logprobs(
    moe_engine, moe_dir: Path, moe_adapter: Path
) -> None:
    import torch

    from kiln.core.policy.engine import GenerationRequest
    from kiln.core.policy.runtime import PolicyRuntime

    torch.set_num_threads(1)
    assert moe_engine.moe_lora == "torch"  # vllm_moe_lora_cpu's experts are in place
    rt = PolicyRuntime.load(moe_dir)
    rt.use_engine(moe_engine)
    prompt = rt.encode_prompt([{"role": "user", "content": "Count is 0. Reply with JSON."}], thinking=False)
    handle = rt.adapter_handle(moe_adapter)
    adapters = [None, handle] * 3
    rows = moe_engine.generate([
        GenerationRequest(prompt_ids=tuple(prompt), seed=11 + i, max_tokens=16, temperature=1.0, stop_id=rt.stop_id,
                          adapter=a)
        for i, a in enumerate(adapters)
    ])
    assert [r.adapter_sha256 for r in rows] == [None if a is None else handle.sha256 for a in adapters]
    worst, moved = 0.0, 0.0
    for row, a in zip(rows, adapters):
        assert len(row.ids) == len(row.logprobs) > 0
        trainer = rt.logprobs_of(prompt, row.ids, temperature=1.0, adapter_dir=None if a is None else moe_adapter)
        worst = max(worst, max(abs(x - y) for x, y in zip(trainer, row.logprobs)))
        # the other side's log-probs of the same ids: what serving the wrong adapter would show
        other = rt.logprobs_of(prompt, row.ids, temperature=1.0, adapter_dir=moe_adapter if a is None else None)
        moved = max(moved, max(abs(x - y) for x, y in zip(other, row.logprobs)))
    print(f"moe: max |vLLM - trainer| log-prob: {worst:.3e}; with the other adapter choice: {moved:.3e}")
    assert worst < MOE_LOGPROB_TOLERANCE
    assert moved > 100 * MOE_LOGPROB_TOLERANCE  # the experts' LoRA is served, not dropped


@pytest.mark.asyncio
@pytest.mark.timeout(900)
async def test_moe_trains_two_iterations_with_iteration_ones_adapter_behind_iteration_two(
    kiln_settings, counter_env_url: str, moe_engine, moe_dir: Path
) -> None:
    status = await _train_two_iterations(kiln_settings, counter_env_url, moe_dir, moe_engine, "vllm-moe")
    _assert_on_policy(status)


@pytest.mark.timeout(300)
def test_an_moe_architecture_the_cpu_experts_do_not_compute_is_refused_naming_what_is_served(tmp_path: Path) -> None:
    """gpt-oss experts (interleaved SwiGLU with biases) are not what vllm_moe_lora_cpu computes: the
    server refuses the model before vLLM reads any weight (the folder holds a config only)."""
    import json

    from kiln.core.errors import ModelUnsupported
    from kiln.core.policy.vllm_model_kind import moe_refusal
    from kiln.core.policy.vllm_server import FAULT_MARK

    folder = tmp_path / "gpt-oss"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
                                                    "num_local_experts": 4}))
    engine = _engine(folder, tmp_path / "engine.log")
    try:
        with pytest.raises(ModelUnsupported) as caught:
            engine.start()
    finally:
        engine.close()
    error = caught.value
    assert (error.code, error.retryable) == ("model_unsupported", False)
    assert error.message == f"the vllm engine cannot serve GptOssForCausalLM from {folder}: " + moe_refusal(
        ["GptOssForCausalLM"])
    assert "Qwen3MoeForCausalLM only" in error.message and "KILN_ENGINE=hf" in error.hint
    assert (tmp_path / "engine.log").read_text().count(FAULT_MARK) == 1 and engine.restarts == 0


async def _train_two_iterations(kiln_settings, env_url: str, model: Path, engine, name: str) -> dict:
    """A two-iteration train run (3 groups x 2) on one gpu worker whose engine is ``engine``."""
    import asyncio

    from activities.gpu import GpuActivities, LockedPolicy
    from api.runs import RunService
    from kiln.core.contracts import parse_run_request
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.integration.test_real_shape_run import RUN
    from tests.support.kiln_workers import running_workers
    from tests.support.waiting import workflow_result

    def factory(settings, store, path):
        acts = GpuActivities(settings, store, path)
        runtime = PolicyRuntime.load(path, device=settings.device, dtype=settings.dtype)
        runtime.use_engine(engine)
        acts._policy = LockedPolicy(runtime)
        return acts

    settings = kiln_settings(model_path=model, device="cpu", dtype="auto", engine="vllm",
                             vllm_cpu_kvcache_gb=1, vllm_max_model_len=2048)
    request = parse_run_request({**RUN, "groups": 3, "group_size": 2, "iterations": 2,
                                 "environment_urls": [env_url], "output_adapter": name,
                                 "training_config": {**RUN["training_config"], "learning_rate": 3e-3}})
    async with running_workers(settings, gpu_factory=factory) as client:
        run_id = (await RunService(client, settings).submit(request))[0].run_id
        return await asyncio.wait_for(workflow_result(client.get_workflow_handle(run_id), timeout_s=900), 960)


def _assert_on_policy(status: dict) -> None:  # as tests/integration/test_engine_vllm.py checks it
    assert status["state"] == "completed", status.get("failure")
    first, second = status["iterations"]
    assert first["trained"] and second["trained"]
    assert first["behavior_adapter_sha256"] is None
    assert second["behavior_adapter_sha256"] == first["adapter_sha256"]  # iteration 1's adapter


@pytest.mark.skipif(TORCHVISION, reason="the engine has a torchvision: the model is served (next test)")
@pytest.mark.timeout(900)
def test_qwen35_hub_checkpoint_is_refused_at_engine_start_naming_what_is_missing(qwen35_dir: Path, tmp_path) -> None:
    from kiln.core.errors import ModelUnsupported

    engine = _engine(qwen35_dir, tmp_path / "engine.log")
    try:
        with pytest.raises(ModelUnsupported) as caught:
            engine.start()
    finally:
        engine.close()
    error = caught.value
    assert (error.code, error.retryable) == ("model_unsupported", False)
    assert error.message == (f"the vllm engine cannot serve Qwen3_5ForConditionalGeneration from {qwen35_dir}: "
                             "vLLM could not load its model class for the architecture "
                             "(No module named 'torchvision')")
    assert "torchvision" in error.hint and "KILN_ENGINE=hf" in error.hint


@pytest.mark.skipif(not TORCHVISION, reason="the engine has no torchvision (scripts/setup_vllm.sh installs one "
                    "into .venv-vllm/kiln-torchvision)")
@pytest.mark.asyncio
@pytest.mark.timeout(1500)
async def test_qwen35_hub_checkpoint_trains_two_iterations_as_text_only(
    kiln_settings, counter_env_url: str, qwen35_dir: Path, tmp_path
) -> None:
    engine = _engine(qwen35_dir, tmp_path / "engine.log")
    try:
        engine.start()
        assert engine.text_only and engine.identity()["text_only"] is True
        assert engine.torchvision in ("compiled", "text-only")  # "text-only" here: the registry's build
        assert engine.identity()["dtype"] == "bfloat16"  # the CPU build's Gated DeltaNet kernel's only dtype
        status = await _train_two_iterations(kiln_settings, counter_env_url, qwen35_dir, engine, "vllm-qwen35")
    finally:
        engine.close()
    _assert_on_policy(status)


@pytest.mark.asyncio
@pytest.mark.timeout(900)
async def test_weights_that_cannot_load_end_the_run_on_its_first_attempt_with_engine_fault(
    kiln_settings, counter_env_url: str, dense_dir: Path, tmp_path: Path
) -> None:
    """A planted deterministic fault: the model folder's weights file is cut short, so vLLM fails
    to load it on every start. The run fails at once with ``engine_fault`` and the cause from the
    engine's log; the engine was started once (a retry would have started it again)."""
    import asyncio

    from temporalio.client import WorkflowFailureError

    from activities.gpu import GpuActivities, LockedPolicy
    from api.runs import RunService
    from kiln.core.contracts import parse_run_request
    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.policy.vllm_server import FAULT_MARK
    from tests.support.kiln_workers import running_workers
    from tests.support.waiting import workflow_result

    broken = tmp_path / "broken"
    broken.mkdir()
    for item in dense_dir.iterdir():
        if item.suffix == ".json":
            shutil.copy(item, broken / item.name)
    with open(dense_dir / "model.safetensors", "rb") as src:
        (broken / "model.safetensors").write_bytes(src.read(4_000_000))
    log = tmp_path / "engine.log"
    engine = _engine(broken, log)

    def factory(settings, store, path):
        acts = GpuActivities(settings, store, path)
        runtime = PolicyRuntime.load(path, device=settings.device, dtype=settings.dtype)
        runtime.use_engine(engine)  # the worker's model loads; its engine's copy does not
        acts._policy = LockedPolicy(runtime)
        return acts

    settings = kiln_settings(model_path=dense_dir, device="cpu", dtype="auto", engine="vllm",
                             vllm_cpu_kvcache_gb=1, vllm_max_model_len=2048)
    request = parse_run_request({"kind": "rollout", "groups": 1, "group_size": 2, "max_steps": 1,
                                 "max_action_tokens": 8, "thinking": False, "environment_urls": [counter_env_url]})
    try:
        async with running_workers(settings, gpu_factory=factory) as client:
            run_id = (await RunService(client, settings).submit(request))[0].run_id
            handle = client.get_workflow_handle(run_id)
            with pytest.raises(WorkflowFailureError) as failed:
                await asyncio.wait_for(workflow_result(handle, timeout_s=600), 660)
            status = await handle.query("status")
    finally:
        engine.close()
    assert failed.value.cause.type == "engine_fault"
    assert status["state"] == "failed"
    failure = status["failure"]
    assert (failure["code"], failure["retryable"]) == ("engine_fault", False)
    assert failure["message"] == (f"the vllm engine cannot start on Qwen3ForCausalLM from {broken}: Error while "
                                  "deserializing header: incomplete metadata, file not fully covered")
    assert log.read_text().count(FAULT_MARK) == 1  # one start: the fault was not retried
