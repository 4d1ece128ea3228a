"""``lora_delta_norm`` covers the trained adapter only: a shared base model that also holds other
adapters (a gpu worker that served evaluations) gives the same figure as a fresh one, and the
figure equals the weight change measured by running each LoRA layer with and without it."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kiln.core.policy.families import FAMILIES  # noqa: E402 - after the torch skip
from kiln.core.train.model import TRAIN_ADAPTER, _lora_config, lora_delta_norms  # noqa: E402 - after the torch skip
from tests.unit.test_train_support import build_tiny_qwen3  # noqa: E402


def _measured_delta_norms(model, adapter: str) -> dict[str, float]:
    """Per LoRA layer: ||W_with_adapter - W_base||_F, from forwards on the identity matrix."""
    from peft.tuners.lora import LoraLayer

    norms = {}
    model.set_adapter(adapter)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                continue
            eye = torch.eye(module.in_features)
            full = module(eye)
            base = module.base_layer(eye)
            norms[f"{name}.{adapter}"] = float(torch.linalg.matrix_norm((full - base).double()))
    return norms


@pytest.mark.timeout(60)
def test_delta_norm_counts_only_the_trained_adapter(tmp_path):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = build_tiny_qwen3(tmp_path / "model")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(),
                           _lora_config(4, 8.0, FAMILIES["qwen3"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)  # a trained adapter's B is not zero
    alone_total, alone = lora_delta_norms(model)
    measured = _measured_delta_norms(model, TRAIN_ADAPTER)
    assert set(alone) == set(measured) and len(alone) > 0
    for key, value in measured.items():
        assert alone[key] == pytest.approx(value, rel=1e-4, abs=1e-6)
    assert alone_total == pytest.approx(math.sqrt(sum(v * v for v in measured.values())), rel=1e-4)

    # An evaluation adapter loaded beside it, with weights of its own: the figure is unchanged.
    model.add_adapter("served-eval", _lora_config(4, 8.0, FAMILIES["qwen3"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "served-eval" in name and "lora_B" in name:
                param.normal_(0, 0.5)
    model.set_adapter(TRAIN_ADAPTER)
    total, norms = lora_delta_norms(model)
    assert (total, norms) == (alone_total, alone)
    other_total, _ = lora_delta_norms(model, "served-eval")
    assert other_total > 0 and other_total != alone_total
