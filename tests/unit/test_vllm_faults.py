"""How the vllm engine's failures are classified (kiln/core/policy/vllm_faults.py) and what the server
decides from a model folder (kiln/core/policy/vllm_server.py), without starting an engine. The log
lines are vLLM 0.32's own, as its CPU build wrote them for the faults named (the engine tests in
tests/integration/test_engine_vllm_families.py produce the start faults for real)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from kiln.core.errors import EngineFault, EngineUnavailable, ModelUnsupported, error_type
from kiln.core.policy import vllm_faults, vllm_model_kind, vllm_server

pytestmark = pytest.mark.timeout(60)

# vLLM's CPU build serving qwen3_moe with LoRA on its experts before Kiln's torch experts: the first forward
TRITON_DEATH = """\
(Worker pid=12158) INFO 12-03 09:46:04 [unquantized.py:529] Using TritonExperts MoE backend
(EngineCore pid=12145) WARNING 12-03 09:46:16 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.
(Worker pid=12158) ERROR 12-03 09:46:20 [multiproc_executor.py:1063] WorkerProc hit an exception.
(Worker pid=12158) ERROR 12-03 09:46:20 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=12158) ERROR 12-03 09:46:20 [multiproc_executor.py:1063] AttributeError: module 'triton.language' has no attribute 'float32'
(EngineCore pid=12145) ERROR 12-03 09:46:20 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=12145) ERROR 12-03 09:46:20 [core.py:1512] RuntimeError: Worker failed with error 'module 'triton.language' has no attribute 'float32'', please check the stack trace above for the root cause
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""

# the Qwen3.5 hub checkpoint on a .venv-vllm without torchvision: model inspection
INSPECTION = """\
(MainProcess pid=8603) ERROR 12-03 09:41:55 [registry.py:1120] Error in inspecting model architecture 'Qwen3_5ForConditionalGeneration'
(MainProcess pid=8603) ERROR 12-03 09:41:55 [registry.py:1120] subprocess.CalledProcessError: Command '['python', '-m', 'vllm.model_executor.models.registry']' returned non-zero exit status 1.
(MainProcess pid=8603) ERROR 12-03 09:41:55 [registry.py:1120] RuntimeError: Error raised in subprocess:
(MainProcess pid=8603) ERROR 12-03 09:41:55 [registry.py:1120] [transformers] `Qwen2VLImageProcessor` requires torchvision (not installed); falling back
(MainProcess pid=8603) ERROR 12-03 09:41:55 [registry.py:1120] ModuleNotFoundError: No module named 'torchvision'
"""


def test_the_root_cause_is_the_innermost_exception_without_its_name() -> None:
    assert vllm_faults.root_cause(TRITON_DEATH) == "module 'triton.language' has no attribute 'float32'"
    assert vllm_faults.root_cause(INSPECTION) == "No module named 'torchvision'"
    assert vllm_faults.root_cause("INFO all well\n") is None
    long = "(Worker pid=1) ERROR 12-03 09:46:20 [x.py:1] ValueError: " + "x" * 1000 + " hf_abcdefghijklmnop"
    cause = vllm_faults.root_cause(long)
    assert len(cause) == vllm_faults.CAUSE_CHARS and cause.endswith("...")
    assert "hf_abcdefghijklmnop" not in vllm_faults.root_cause("ValueError: bad token hf_abcdefghijklmnop")


def test_an_engine_core_that_died_of_its_own_error_is_a_fault_a_killed_one_is_retried() -> None:
    fault = vllm_faults.death(42, TRITON_DEATH, Path("/logs/vllm-engine.log"), "500 EngineDeadError")
    assert isinstance(fault, EngineFault) and (fault.code, fault.retryable) == ("engine_fault", False)
    assert "module 'triton.language' has no attribute 'float32'" in fault.message
    assert "Error" not in fault.message  # no Python exception name reaches the user
    killed = vllm_faults.death(42, "(EngineCore pid=1) INFO 12-03 09:46:20 [core.py:1] ready\n", None,
                               "Server disconnected without sending a response.")
    assert isinstance(killed, EngineUnavailable) and killed.retryable
    # a worker killed (the OOM killer) makes the core fail too: that is not the model's fault
    oom = ("(EngineCore pid=1) ERROR 12-03 09:46:20 [multiproc_executor.py:316] Worker proc VllmWorker-0 died "
           "unexpectedly (exit code: -9), shutting down executor.\n" + TRITON_DEATH)
    assert isinstance(vllm_faults.death(42, oom, None, "500 EngineDeadError"), EngineUnavailable)
    assert error_type("engine_fault") is EngineFault  # rebuilt from its code across processes


def _fault_line(exc: BaseException, facts: dict) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        vllm_server.report_fault(exc, facts)
    return out.getvalue()


def test_a_server_that_cannot_build_its_engine_is_refused_or_a_fault_never_retried() -> None:
    facts = {"architectures": ["Qwen3_5ForConditionalGeneration"]}
    line = _fault_line(ValueError("Model architectures ['Qwen3_5ForConditionalGeneration'] failed to be "
                                  "inspected. Please check the logs for more details."), facts)
    assert line.startswith(vllm_server.FAULT_MARK)
    refused = vllm_faults.start_failure(Path("/m"), vllm_server.FAULT_EXIT, INSPECTION + line, Path("/l"))
    assert isinstance(refused, ModelUnsupported) and (refused.code, refused.retryable) == ("model_unsupported", False)
    assert refused.message == ("the vllm engine cannot serve Qwen3_5ForConditionalGeneration from /m: vLLM could "
                               "not load its model class for the architecture (No module named 'torchvision')")
    assert "torchvision" in refused.hint and refused.details["architectures"] == facts["architectures"]

    bad = _fault_line(RuntimeError("Error while deserializing header: incomplete metadata"), {"architectures": ["X"]})
    fault = vllm_faults.start_failure(Path("/m"), vllm_server.FAULT_EXIT, bad, None)
    assert isinstance(fault, EngineFault) and not fault.retryable
    assert fault.message == "the vllm engine cannot start on X from /m: Error while deserializing header: incomplete metadata"
    # without the fault line (killed while starting) it is retried as before, with the cause if logged
    lost = vllm_faults.start_failure(Path("/m"), -9, "(Worker pid=1) INFO 12-03 09:46:20 [a.py:1] loading\n", None)
    assert isinstance(lost, EngineUnavailable) and lost.retryable
    assert lost.message == "the vllm engine process exited with status -9 while starting"


def test_the_log_is_read_from_where_the_running_server_began(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("RuntimeError: the previous server's fault\n")
    offset = vllm_faults.log_size(log)
    with open(log, "a") as f:
        f.write("ValueError: this server's fault\n")
    assert vllm_faults.root_cause(vllm_faults.read_since(log, offset)) == "this server's fault"
    assert vllm_faults.read_since(tmp_path / "missing.log", 0) == ""


def _config(folder: Path, config: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_server_serves_vision_language_checkpoints_as_text_and_refuses_moe_on_cpu(tmp_path: Path) -> None:
    hub = vllm_model_kind.model_facts(_config(tmp_path / "q35", {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "vision_config": {"depth": 1},
        "text_config": {"layer_types": ["linear_attention"] * 3 + ["full_attention"]}}))
    assert hub == {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_only": True, "moe": False,
                   "hybrid": True}
    # its Gated DeltaNet layers on the CPU build: bfloat16 (its kernel's only dtype), no prefix
    # caching (it needs chunked prefill there)
    assert vllm_model_kind.model_settings(hub, on_cpu=True) == {"language_model_only": True, "enable_prefix_caching": False,
                                                            "dtype": "bfloat16"}
    assert vllm_model_kind.model_settings(hub, on_cpu=False) == {"language_model_only": True}
    moe = vllm_model_kind.model_facts(_config(tmp_path / "moe", {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}))
    assert moe["moe"] and not moe["text_only"]
    with pytest.raises(vllm_model_kind.Unsupported) as caught:
        vllm_model_kind.model_settings(moe, on_cpu=True, moe_lora="stock")  # without vllm_moe_lora_cpu's experts
    # Kiln's adapters hold the experts as 3-D parameters, which vLLM loads only in its mixed format
    assert vllm_model_kind.model_settings(moe, on_cpu=False) == {"enable_mixed_moe_lora_format": True}
    assert vllm_model_kind.model_settings(moe, on_cpu=True, moe_lora="torch") == {"enable_mixed_moe_lora_format": True}
    oss = vllm_model_kind.model_facts(_config(tmp_path / "oss", {"architectures": ["GptOssForCausalLM"],
                                                             "num_local_experts": 4}))
    with pytest.raises(vllm_model_kind.Unsupported) as other:
        vllm_model_kind.model_settings(oss, on_cpu=True, moe_lora="torch")  # experts it does not compute
    assert str(other.value) == ("Kiln's CPU LoRA path for mixture-of-experts layers serves Qwen3MoeForCausalLM "
                                "only, not GptOssForCausalLM (vLLM's own MoE LoRA kernel needs Triton)")
    assert vllm_model_kind.model_settings(oss, on_cpu=False) == {"enable_mixed_moe_lora_format": True}
    line = _fault_line(caught.value, moe)
    refused = vllm_faults.start_failure(Path("/m"), vllm_server.FAULT_EXIT, line, None)
    assert isinstance(refused, ModelUnsupported) and not refused.retryable
    assert refused.message == f"the vllm engine cannot serve Qwen3MoeForCausalLM from /m: {vllm_model_kind.MOE_ON_CPU}"
    assert "KILN_ENGINE=hf" in refused.hint and "CUDA" in refused.hint
    dense = vllm_model_kind.model_facts(_config(tmp_path / "dense", {
        "architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention", "full_attention"]}))
    assert not dense["hybrid"] and vllm_model_kind.model_settings(dense, on_cpu=True) == {}
    assert vllm_model_kind.model_facts(str(tmp_path / "nothing")) == {"architectures": [], "text_only": False, "moe": False,
                                                                 "hybrid": False}


def test_an_adapter_of_3d_expert_parameters_is_told_to_vllm_as_one(tmp_path: Path) -> None:
    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text(json.dumps({
        "target_modules": ["q_proj"], "target_parameters": ["experts.down_proj", "experts.gate_up_proj"]}))
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "adapter_config.json").write_text(json.dumps({"target_modules": ["q_proj"], "target_parameters": None}))
    assert vllm_model_kind.adapter_is_3d(str(experts)) is True
    assert vllm_model_kind.adapter_is_3d(str(dense)) is False
    assert vllm_model_kind.adapter_is_3d(str(tmp_path / "missing")) is False
