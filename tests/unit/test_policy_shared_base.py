"""One base model on the gpu worker: the trainer borrows the runtime's model (no second copy),
produces the same adapter bytes as a standalone training, and leaves sampling unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.contracts import TrainingConfig
from kiln.policy.identity import ADAPTER_FILES
from tests.support.models import make_lora_adapter, shared_tiny_model
from tests.unit.test_train_support import bandit_groups

MESSAGES = [{"role": "user", "content": "Count is 2. Target is 10."}]
CONFIG = TrainingConfig(echo=None, seed=3, epochs=1, learning_rate=2e-3, lora_rank=4, lora_alpha=8)


def _bytes(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in ADAPTER_FILES}


def _sample(rt, adapter_dir=None):
    prompt = rt.encode_prompt(MESSAGES, thinking=True)
    return [(s.ids, s.logprobs) for s in rt.sample([prompt, prompt], [5, 6], max_new_tokens=12,
                                                   temperature=1.0, adapter_dir=adapter_dir)]


@pytest.mark.timeout(300)
def test_training_on_the_shared_base_matches_standalone_and_restores_it(tmp_path, tmp_path_factory) -> None:
    from peft.tuners.lora import LoraLayer

    from kiln.policy.runtime import PolicyRuntime
    from kiln.train.trainer import train_grpo

    model_dir = shared_tiny_model(tmp_path_factory)
    groups = bandit_groups(2)
    standalone = train_grpo(model_path=model_dir, groups=groups, config=CONFIG, output_dir=tmp_path / "alone")

    rt = PolicyRuntime.load(model_dir, device="cpu", dtype="auto")
    assert (rt.device, rt.dtype) == ("cpu", "float32")
    before = _sample(rt)
    weights = {id(p) for p in rt.model.parameters()}
    with rt.training_lease() as lease:
        assert lease.model is rt.model  # the runtime's own base, not a copy
        shared = train_grpo(model_path=model_dir, groups=groups, config=CONFIG, output_dir=tmp_path / "plain",
                            shared_base=lease, device=rt.device, dtype=rt.dtype)
    assert _bytes(shared.adapter_dir) == _bytes(standalone.adapter_dir)
    assert shared.receipt["runtime"]["dtype"] == "float32" and shared.receipt["runtime"]["device"] == "cpu"
    assert not any(isinstance(m, LoraLayer) for m in rt.model.modules())  # LoRA unloaded again
    assert {id(p) for p in rt.model.parameters()} == weights
    assert _sample(rt) == before

    # With inference adapters loaded, the trainer adds its adapter to the runtime's PeftModel.
    adapter = make_lora_adapter(model_dir, tmp_path / "inference", seed=1)
    with_adapter = _sample(rt, adapter)
    with rt.training_lease() as lease:
        assert lease.model is rt._peft
        again = train_grpo(model_path=model_dir, groups=groups, config=CONFIG, output_dir=tmp_path / "peft",
                           shared_base=lease, device=rt.device, dtype=rt.dtype)
    assert _bytes(again.adapter_dir) == _bytes(standalone.adapter_dir)
    assert "default" not in rt._peft.peft_config
    assert _sample(rt, adapter) == with_adapter
    assert _sample(rt) == before
