"""One base model on the gpu worker: the trainer borrows the runtime's model (no second copy),
produces the same adapter bytes as a standalone training, and leaves sampling unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.training_config import TrainingConfig
from kiln.core.policy.identity import ADAPTER_FILES
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

    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.train.trainer import train_grpo

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


def _bits(rt, prompts, seeds):
    """Ids, float32 log-prob bytes and one-pass log-prob bytes of base-policy samples, and the
    logits bytes of one stacked 2-row forward of the runtime's model (the kernels a batched
    forward picks depend on module state such as ``requires_grad``, even under inference mode)."""
    import torch

    samples = rt.sample(prompts, seeds, max_new_tokens=24, temperature=1.0, thinking=False)
    scored = rt.logprobs_of(prompts[0], samples[0].ids, temperature=1.0)
    width = min(len(p) for p in prompts)
    with torch.inference_mode(), rt._activate(None):  # the base policy, as sample() computes it
        stacked = rt.model(input_ids=torch.tensor([p[-width:] for p in prompts[:2]]), use_cache=False).logits
    return [(s.ids, torch.tensor(s.logprobs, dtype=torch.float32).numpy().tobytes()) for s in samples] + [
        torch.tensor(scored, dtype=torch.float32).numpy().tobytes(),
        stacked.numpy().tobytes(),
        [name for name, param in rt.model.named_parameters() if param.requires_grad],
    ]


@pytest.mark.timeout(300)
def test_a_worker_that_served_adapters_and_training_samples_the_base_like_a_fresh_one(
    tmp_path, tmp_path_factory
) -> None:
    """Issue 15: the base policy's ids AND log-probs (bitwise) after the runtime served adapters
    (load, switch, LRU eviction = delete_adapter), trained on its shared base (plain and PeftModel
    paths, gradient checkpointing on) and trained a standalone copy in the same process equal those
    of a freshly loaded runtime, step by step.

    Root cause found with this test: a freshly loaded model's weights had ``requires_grad=True``,
    and PEFT (adapter load, training lease) leaves them ``False``; ATen's matmul decomposes a
    stacked (batch > 1) input differently depending on that flag, even under inference mode, so
    the same rows rounded differently afterwards. The runtime freezes its model at load."""
    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.train.trainer import train_grpo

    model_dir = shared_tiny_model(tmp_path_factory)
    config = CONFIG.model_copy(update={"gradient_checkpointing": True})
    fresh = PolicyRuntime.load(model_dir, device="cpu", dtype="float32")
    prompt = fresh.encode_prompt(MESSAGES, thinking=False)
    longer = fresh.encode_prompt([{"role": "system", "content": "Play well. " * 5}, *MESSAGES], thinking=False)
    batches = [([prompt, prompt], [5, 6]), ([prompt, longer, prompt], [7, 8, 9]), ([longer, prompt], [10, 11])]
    expected = [_bits(fresh, p, s) for p, s in batches]

    rt = PolicyRuntime.load(model_dir, device="cpu", dtype="float32", max_adapters=1)
    first, second = (make_lora_adapter(model_dir, tmp_path / f"a{i}", seed=i) for i in (1, 2))
    trained: list[Path] = []

    def shared_training(name: str) -> None:
        with rt.training_lease() as lease:
            result = train_grpo(model_path=model_dir, groups=bandit_groups(2), config=config,
                                output_dir=tmp_path / name, shared_base=lease, device=rt.device, dtype=rt.dtype)
        trained.append(result.adapter_dir)

    steps = [
        ("fresh", lambda: None),
        ("shared-base training on the plain model (LoRA injected, then unloaded)", lambda: shared_training("plain")),
        ("adapter loaded and sampled (PeftModel wraps the base)", lambda: rt.sample([prompt], [1], max_new_tokens=8, temperature=1.0, adapter_dir=first)),
        ("second adapter: LRU evicts the first (delete_adapter)", lambda: rt.sample([prompt], [1], max_new_tokens=8, temperature=1.0, adapter_dir=second)),
        ("shared-base training on the PeftModel (adapter added, then deleted)", lambda: shared_training("peft")),
        ("trained adapter evaluated", lambda: rt.sample([prompt, prompt], [3, 4], max_new_tokens=8, temperature=1.0, adapter_dir=trained[-1])),
        ("standalone training in the same process", lambda: train_grpo(model_path=model_dir, groups=bandit_groups(2), config=config, output_dir=tmp_path / "alone")),
    ]
    differing = []
    for name, step in steps:
        step()
        if [_bits(rt, p, s) for p, s in batches] != expected:
            differing.append(name)
    assert differing == []
    assert rt.loaded_adapters and "default" not in rt._peft.peft_config
