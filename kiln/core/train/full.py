"""Full fine-tuning (``training_config.adapter: full``): every base parameter is trained, no peft.

The trainer loads its own copy of the weights — from the base model folder, or in a later
iteration of an online run from the previous iteration's full-weights folder — never the policy
runtime's shared base model (``KILN_SHARE_BASE_MODEL``), so sampling never sees a half-trained
model. The output is a model folder (``config.json`` + ``model.safetensors``, as
``save_pretrained`` writes them, without ``generation_config.json``) that travels as the run's
adapter files; its digest is :func:`kiln.core.policy.identity.adapter_content_sha256` (a model
folder's content digest). The receipt's ``weights_delta_norm(s)`` are the Frobenius norms of
``W_new − W_start`` per parameter (the full-training counterpart of ``lora_delta_norm(s)``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from kiln.core.errors import FullTrainingUnsupported
from kiln.core.policy.identity import adapter_content_sha256, is_full_weights

FULL = "full"
# written by save_pretrained but not part of the weights (sampling settings are the run's own)
_DROPPED = ("generation_config.json", "README.md")


def is_full(config: Any) -> bool:
    """Whether ``config`` (a TrainingConfig) trains every parameter."""
    return getattr(config, "adapter", "lora") == FULL


def weights_source(model_path: Path, base_adapter_dir: Path | None) -> Path:
    """Where full training starts: the previous iteration's full weights, else the base model.
    A LoRA adapter as the start of a full training is refused (``training_failed``)."""
    if base_adapter_dir is None:
        return Path(model_path)
    if not is_full_weights(Path(base_adapter_dir)):
        raise FullTrainingUnsupported(
            f"training_config.adapter full cannot start from the LoRA adapter at {base_adapter_dir}",
            hint="train adapter full from the base model (adapter base) or from a full-weights adapter",
        )
    return Path(base_adapter_dir)


def load_full_model(source: Path, device: torch.device | str, dtype: str, *, trainable: bool) -> Any:
    """Its own copy of the model at ``source`` (eval mode: no dropout), every parameter trainable
    (``trainable``) or frozen."""
    from kiln.core.train.model import load_base_model

    model = load_base_model(source, device, dtype)
    model.requires_grad_(trainable)
    model.eval()
    return model


def save_full(model: Any, out_dir: Path) -> str:
    """Write the trained weights as a model folder and return its content digest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    for name in _DROPPED:
        (out_dir / name).unlink(missing_ok=True)
    return adapter_content_sha256(out_dir)


def folder_bytes(folder: Path) -> int:
    """Bytes of every file in ``folder`` (what the full weights add to the retained budget)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())


@torch.no_grad()
def weights_delta_norms(model: Any, start: Any) -> tuple[float, dict[str, float]]:
    """Frobenius norm of ``W_new − W_start`` per parameter of ``model`` against the frozen
    ``start`` model, and the root-sum-square total."""
    before = dict(start.named_parameters())
    norms: dict[str, float] = {}
    for name, param in model.named_parameters():
        delta = param.detach().float() - before[name].detach().float().to(param.device)
        norms[name] = float(torch.linalg.vector_norm(delta).item())
    total = math.sqrt(math.fsum(v * v for v in norms.values()))
    return total, norms
