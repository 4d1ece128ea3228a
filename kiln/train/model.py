"""Policy model for training: load the base, attach (or warm-start) LoRA, save and hash adapters."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from kiln.canonical import pretty_json
from kiln.errors import TrainingFailed
from kiln.policy.identity import adapter_content_sha256, model_content_sha256  # noqa: F401 - one home

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


TRAIN_ADAPTER = "default"


def load_base_model(model_path: Path, device: torch.device | str, dtype: str = "float32") -> Any:
    """The base causal LM on ``device`` in ``dtype``, eval mode (no dropout), from a local folder
    only (the policy runtime's loader: SDPA attention, never downloads)."""
    from kiln.policy.device import Placement
    from kiln.policy.loading import load_causal_lm

    return load_causal_lm(Path(model_path), Placement(str(device), dtype), error=TrainingFailed)


def _lora_config(rank: int, alpha: float):
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(LORA_TARGETS),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach_lora(model: Any, *, rank: int, alpha: float, seed: int, base_adapter_dir: Path | None):
    """Wrap ``model`` with a trainable LoRA.

    ``base_adapter_dir`` warm-starts from an existing adapter
    (its own rank/alpha/targets win); otherwise a fresh adapter is seeded with ``seed``. A
    ``PeftModel`` (the policy runtime's shared base with its inference adapters) gets a new
    ``default`` adapter made active instead of a second wrapper; LoRA weights are float32 on a
    half-precision base (PEFT's adapter autocast)."""
    from peft import PeftModel, get_peft_model

    torch.manual_seed(seed)
    if isinstance(model, PeftModel):
        try:
            if base_adapter_dir is not None:
                model.load_adapter(str(base_adapter_dir), adapter_name=TRAIN_ADAPTER, is_trainable=True)
            else:
                model.add_adapter(TRAIN_ADAPTER, _lora_config(rank, alpha))
        except (OSError, ValueError) as exc:
            raise TrainingFailed(f"cannot load base adapter {base_adapter_dir}: {exc}") from exc
        model.set_adapter(TRAIN_ADAPTER)
        model.eval()
        return model
    if base_adapter_dir is not None:
        try:
            peft_model = PeftModel.from_pretrained(model, str(base_adapter_dir), is_trainable=True)
        except (OSError, ValueError) as exc:
            raise TrainingFailed(f"cannot load base adapter {base_adapter_dir}: {exc}") from exc
    else:
        peft_model = get_peft_model(model, _lora_config(rank, alpha))
    peft_model.eval()  # deterministic: no dropout anywhere
    return peft_model


def release_lora(peft_model: Any, *, shared: bool) -> None:
    """Remove the training adapter from a shared base model after training.

    ``shared``: the base was already a PeftModel (the runtime's): delete the ``default`` adapter.
    Otherwise the trainer wrapped the plain base: unload every LoRA layer, restoring the base
    modules in place (its weights were never changed)."""
    if shared:
        if TRAIN_ADAPTER in peft_model.peft_config:
            peft_model.delete_adapter(TRAIN_ADAPTER)
    else:
        peft_model.unload()
    for param in peft_model.parameters():
        param.requires_grad_(False)


def trainable_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable (LoRA) parameters in a stable order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def save_adapter(model: Any, adapter_dir: Path) -> str:
    """Write a standard PEFT adapter and return its content digest.

    ``adapter_config.json`` is rewritten in canonical pretty form with ``base_model_name_or_path``
    set to null, so the bytes do not depend on where the base model lives on this machine.
    """
    adapter_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(adapter_dir))
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = None
    if isinstance(config.get("target_modules"), list):
        # peft writes a set in hash order (PYTHONHASHSEED-dependent): sort for stable bytes.
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_bytes(pretty_json(config))
    readme = adapter_dir / "README.md"
    if readme.exists():
        readme.unlink()
    return adapter_content_sha256(adapter_dir)


def lora_delta_norms(model: Any, adapter: str = TRAIN_ADAPTER) -> tuple[float, dict[str, float]]:
    """Frobenius norm of each module's ``scale·B@A`` of the trained ``adapter`` (not of other
    adapters a shared base model holds) and the root-sum-square total."""
    from peft.tuners.lora import LoraLayer

    norms: dict[str, float] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        a = module.lora_A[adapter].weight.detach().float()
        b = module.lora_B[adapter].weight.detach().float()
        delta = (b @ a) * float(module.scaling[adapter])
        norms[f"{name}.{adapter}"] = float(torch.linalg.matrix_norm(delta).item())
    total = math.sqrt(math.fsum(v * v for v in norms.values()))
    return total, norms
