"""World-model probe: how well a policy predicts the environment's observations (torch).

ECHO trains the adapter to predict observation tokens as well as to act; this module measures that
on held-out transcripts (the environment-evaluation ``rollouts.jsonl``). For every completion of
every line it runs ONE forward pass over the concatenated piece ids (CPU, float32, eval mode, no
grad) and sums the next-token cross-entropy over the ECHO targets — observation tokens, warning
pieces (harness/protocol-error text) excluded — exactly the masks the trainer uses
(``kiln.core.train.tokens.tokenize_completion`` with the warning filter on, shifted as in
``kiln.core.train.batches``: a token is scored from the logits at the position before it, so a first
token of a sequence is never a target).

``mean_env_ce`` is the token-weighted mean (Σ CE / Σ tokens over all completions), unlike the
training ECHO loss, which normalises per sequence. It is ``None`` when no token qualified.
Comparing the base model with the trained adapter on the same transcripts gives the "world-model
gain" ``base CE − candidate CE`` (``kiln.core.evaluation.receipt.world_model_block``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

import torch

from kiln.core.errors import AdapterNotFound, TrainingFailed
from kiln.core.policy.loading import TORCH_GLOBAL_STATE
from kiln.core.policy.identity import is_full_weights
from kiln.core.train.losses import sequence_logprobs
from kiln.core.train.model import load_base_model
from kiln.core.train.tokens import tokenize_completion


def _completions(lines: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for index, line in enumerate(lines):
        completions = line.get("completions") if isinstance(line, dict) else None
        if not isinstance(completions, list):
            raise TrainingFailed(f"line {index} has no completions list", code="invalid_training_data")
        yield from completions


def _vocab_size(model: Any) -> int:
    return int(model.get_input_embeddings().num_embeddings)


@torch.no_grad()
def observation_cross_entropy_with_model(model: Any, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Observation CE of an already-loaded causal LM (use ``model.disable_adapter()`` for base)."""
    device = next(model.parameters()).device
    vocab = _vocab_size(model)
    total = 0.0
    env_tokens = 0
    sequences = 0
    for completion in _completions(lines):
        row = tokenize_completion(completion, warning_filter=True, vocab_size=vocab)
        sequences += 1
        targets = row.is_env_target[1:]
        count = sum(targets)
        if count == 0 or len(row.ids) < 2:
            continue
        ids = torch.tensor([row.ids], dtype=torch.long, device=device)
        logprobs = sequence_logprobs(model, ids, torch.ones_like(ids), ids[:, 1:])[0]
        mask = torch.tensor(targets, dtype=torch.bool, device=device)
        ce = float(-logprobs[mask].double().sum().item())
        if not math.isfinite(ce):
            raise TrainingFailed("observation cross-entropy is not finite", code="nan_loss")
        total += ce
        env_tokens += count
    return {
        "mean_env_ce": (total / env_tokens) if env_tokens else None,
        "env_tokens": env_tokens,
        "sequences": sequences,
    }


def _load(model_path: Path, adapter_dir: Path | None) -> Any:
    if adapter_dir is not None and is_full_weights(Path(adapter_dir)):  # adapter: full: the weights themselves
        return load_base_model(Path(adapter_dir), torch.device("cpu"))
    model = load_base_model(Path(model_path), torch.device("cpu"))
    if adapter_dir is None:
        return model
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise AdapterNotFound(f"adapter not found: {adapter_dir}")
    try:
        with TORCH_GLOBAL_STATE, torch.random.fork_rng(devices=[]):
            peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    except (OSError, ValueError) as exc:
        raise TrainingFailed(f"cannot load adapter {adapter_dir}: {exc}", code="adapter_load_failed") from exc
    peft_model.eval()
    return peft_model


def observation_cross_entropy(
    model_path: Path, lines: list[dict[str, Any]], *, adapter_dir: Path | None = None
) -> dict[str, Any]:
    """``{"mean_env_ce", "env_tokens", "sequences"}`` of the base model (or base + ``adapter_dir``)
    over every completion of ``lines`` (``rollouts.jsonl`` records)."""
    model = _load(model_path, adapter_dir)
    return observation_cross_entropy_with_model(model, lines)


def world_model_comparison(
    model_path: Path, lines: list[dict[str, Any]], *, adapter_dir: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(base, candidate)`` observation CE with one model load (adapter disabled, then enabled);
    full weights (``adapter: full``) are a second model beside the base."""
    if is_full_weights(Path(adapter_dir)):
        base = observation_cross_entropy(model_path, lines)
        return base, observation_cross_entropy(model_path, lines, adapter_dir=adapter_dir)
    model = _load(model_path, adapter_dir)
    with model.disable_adapter():
        base = observation_cross_entropy_with_model(model, lines)
    candidate = observation_cross_entropy_with_model(model, lines)
    return base, candidate


__all__ = [
    "observation_cross_entropy",
    "observation_cross_entropy_with_model",
    "world_model_comparison",
]
