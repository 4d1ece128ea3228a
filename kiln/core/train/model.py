"""Policy model for training: load the base, attach (or warm-start) LoRA, save and hash adapters.

The LoRA targets are the model family's (:mod:`kiln.core.policy.families`): its ``nn.Linear`` names as
peft ``target_modules`` and its 3-D expert weights as ``target_parameters``. What was actually
adapted is resolved against the wrapped model (:func:`adapted_targets`): a family target that should
match and matches nothing is ``model_unsupported``, never a silently smaller adapter, and
``adapter_config.json`` (:func:`save_adapter`) and the train receipt name the resolved set only."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import torch

from kiln.core.canonical import pretty_json
from kiln.core.errors import ModelUnsupported, TrainingFailed
from kiln.core.policy.families import FAMILIES, Family, family_named
from kiln.core.policy.loading import TORCH_GLOBAL_STATE
from kiln.core.policy.identity import adapter_content_sha256, model_content_sha256  # noqa: F401 - one home

# The qwen3 family's targets (the benches build qwen3-shaped peft models by hand).
LORA_TARGETS = list(FAMILIES["qwen3"].lora_modules)

TRAIN_ADAPTER = "default"


def load_base_model(model_path: Path, device: torch.device | str, dtype: str = "float32") -> Any:
    """The base causal LM on ``device`` in ``dtype``, eval mode (no dropout), from a local folder
    only (the policy runtime's loader: SDPA attention, never downloads)."""
    from kiln.core.policy.device import Placement
    from kiln.core.policy.loading import load_causal_lm

    return load_causal_lm(Path(model_path), Placement(str(device), dtype), error=TrainingFailed)


def model_family(model: Any) -> Family:
    """The family of a loaded (or peft-wrapped) model, from its config's ``model_type``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return family_named(str(getattr(base.config, "model_type", "")))


def _lora_config(rank: int, alpha: float, family: Family):
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        # peft annotates lora_alpha as an int but only scales by alpha/rank: Kiln's alpha is a float
        lora_alpha=cast(Any, alpha),
        target_modules=list(family.lora_modules),
        target_parameters=list(family.lora_parameters) or None,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _owner(name: str) -> str:
    """A LoRA layer's own module name (peft nests a second parameter's wrapper as ``base_layer``)."""
    parts = name.split(".")
    while parts and parts[-1] == "base_layer":
        parts.pop()
    return parts[-1] if parts else name


def adapted_targets(model: Any, adapter: str = "default") -> dict[str, list[str]]:
    """What ``adapter`` actually adapts in ``model``: ``modules`` (leaf names of the LoRA-wrapped
    modules) and ``parameters`` (``<module>.<parameter>`` of LoRA-wrapped 3-D weights), sorted."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    modules: set[str] = set()
    parameters: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        if isinstance(module, ParamWrapper):
            parameters.add(f"{_owner(name)}.{module.parameter_name}")
        else:
            modules.add(_owner(name))
    return {"modules": sorted(modules), "parameters": sorted(parameters)}


def check_coverage(model: Any, adapter: str = "default") -> dict[str, list[str]]:
    """:func:`adapted_targets`, or ``model_unsupported`` naming the family targets that matched
    nothing (a fresh adapter must cover every non-optional target of its family)."""
    family = model_family(model)
    adapted = adapted_targets(model, adapter)
    found = set(adapted["modules"]) | set(adapted["parameters"])
    missing = sorted(set(family.lora_targets) - set(family.lora_optional) - found)
    if missing:
        raise ModelUnsupported(
            f"LoRA for the {family.name} family matched no {', '.join(missing)} in this model "
            f"(adapted: {', '.join(sorted(found)) or 'nothing'})",
            hint="the model's modules differ from its family entry: fix the entry in kiln/core/policy/families.py",
            details={"family": family.name, "missing": missing, "adapted": sorted(found)},
        )
    return adapted


def attach_lora(model: Any, *, rank: int, alpha: float, seed: int, base_adapter_dir: Path | None):
    """Wrap ``model`` with a trainable LoRA.

    ``base_adapter_dir`` warm-starts from an existing adapter
    (its own rank/alpha/targets win); otherwise a fresh adapter is seeded with ``seed``. A
    ``PeftModel`` (the policy runtime's shared base with its inference adapters) gets a new
    ``default`` adapter made active instead of a second wrapper; LoRA weights are float32 on a
    half-precision base (PEFT's adapter autocast)."""
    with TORCH_GLOBAL_STATE:  # the init draws from torch's one generator: no other thread meanwhile
        torch.manual_seed(seed)
        return _attach(model, rank=rank, alpha=alpha, base_adapter_dir=base_adapter_dir)


def _attach(model: Any, *, rank: int, alpha: float, base_adapter_dir: Path | None) -> Any:
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        try:
            if base_adapter_dir is not None:
                model.load_adapter(str(base_adapter_dir), adapter_name=TRAIN_ADAPTER, is_trainable=True)
            else:
                model.add_adapter(TRAIN_ADAPTER, _lora_config(rank, alpha, model_family(model)))
        except (OSError, ValueError) as exc:
            raise TrainingFailed(f"cannot load base adapter {base_adapter_dir}: {exc}") from exc
        if base_adapter_dir is None:
            check_coverage(model, TRAIN_ADAPTER)
        model.set_adapter(TRAIN_ADAPTER)
        model.eval()
        return model
    if base_adapter_dir is not None:
        try:
            peft_model = PeftModel.from_pretrained(model, str(base_adapter_dir), is_trainable=True)
        except (OSError, ValueError) as exc:
            raise TrainingFailed(f"cannot load base adapter {base_adapter_dir}: {exc}") from exc
    else:
        peft_model = get_peft_model(model, _lora_config(rank, alpha, model_family(model)))
        check_coverage(peft_model, TRAIN_ADAPTER)
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
    set to null, so the bytes do not depend on where the base model lives on this machine, and
    with ``target_modules`` / ``target_parameters`` the names actually adapted (sorted; a
    requested name that matched nothing is not listed).
    """
    adapter_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(adapter_dir))
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = None
    adapted = adapted_targets(model, TRAIN_ADAPTER)
    config["target_modules"] = adapted["modules"]
    if config.get("target_parameters") or adapted["parameters"]:
        config["target_parameters"] = adapted["parameters"]
    config_path.write_bytes(pretty_json(config))
    readme = adapter_dir / "README.md"
    if readme.exists():
        readme.unlink()
    return adapter_content_sha256(adapter_dir)


def _factor(factors: Any, adapter: str) -> torch.Tensor:
    """One adapter's LoRA factor weight, detached in float32 (``factors``: a layer's lora_A or lora_B)."""
    return factors[adapter].weight.detach().float()


def lora_delta_norms(model: Any, adapter: str = TRAIN_ADAPTER) -> tuple[float, dict[str, float]]:
    """Frobenius norm of each module's ``scale·B@A`` of the trained ``adapter`` (not of other
    adapters a shared base model holds) and the root-sum-square total."""
    from peft.tuners.lora import LoraLayer

    norms: dict[str, float] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        a, b = _factor(module.lora_A, adapter), _factor(module.lora_B, adapter)
        delta = (b @ a) * float(module.scaling[adapter])
        norms[f"{name}.{adapter}"] = float(torch.linalg.matrix_norm(delta).item())
    total = math.sqrt(math.fsum(v * v for v in norms.values()))
    return total, norms
