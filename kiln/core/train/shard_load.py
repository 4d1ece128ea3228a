"""Shard-only loading of the base model on one training rank (a trainer across devices).

Instead of every rank loading the whole checkpoint and then sharding it
(:func:`kiln.core.train.distributed.shard_base_model`), a rank builds the model without its
weights, attaches the LoRA, shards it, and reads only its own rows of each weight from the
safetensors files:

1. :func:`weightless_model`: the family's causal LM class from its ``config.json``
   (``from_config``, the dtype and attention implementation of
   :func:`kiln.core.policy.loading.load_causal_lm`, under its ``TORCH_GLOBAL_STATE`` lock) with its
   parameters on the meta device and its buffers real (computed by each module's own init: the
   rotary ``inv_freq`` is the one ``from_pretrained`` computes); each meta parameter is then
   replaced by a zero-stride placeholder of its shape and dtype on the rank's device (one element
   of storage), tied parameters staying one tensor. A placeholder rather than meta: peft moves a
   new adapter to its base layer's device, so on a meta base the seeded LoRA init (and a
   ``base_adapter_dir``'s weights) would be discarded; on a placeholder,
   :func:`kiln.core.train.model.attach_lora` runs unchanged and draws exactly what it draws on a
   loaded model;
2. :func:`to_meta` turns the placeholders back into meta parameters, FSDP2
   (:func:`kiln.core.train.distributed.shard_base_model`) shards them (``torch.chunk``'s rows along
   dim 0, the last ranks' possibly fewer or none) and :func:`materialise` allocates only this
   rank's shards (``to_empty``);
3. :func:`fill_shards`: each shard's rows are read from the checkpoint
   (``safe_open(...).get_slice``, a single ``model.safetensors`` or the shards an
   ``model.safetensors.index.json`` names), converted to the parameter's dtype as
   ``from_pretrained`` converts them. A tied weight is one parameter, filled once. A checkpoint
   tensor the model has no parameter for, a parameter the checkpoint lacks, or a shape that differs
   is ``training_checkpoint_mismatch`` (the family's weight conversions, e.g. fused experts, are
   not applied here: such a model trains on one device).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from kiln.core.errors import TrainingFailed

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BLOCK_BYTES = 16 << 20  # rows read (and mapped) at once, at most
PLACEHOLDER = "_kiln_placeholder"  # marks a parameter :func:`weightless_model` made
ONE_DEVICE = "train this model on one device (KILN_TRAIN_DEVICES=1), or re-save the checkpoint with transformers"


def weightless_model(model_path: Path, dtype: str, device: torch.device) -> Any:
    """The causal LM of ``model_path`` in eval mode with placeholder parameters on ``device``
    (FSDP2 then allocates only this rank's shards there) and real buffers."""
    from kiln.core.policy.device import Placement
    from kiln.core.policy.loading import empty_causal_lm

    model = empty_causal_lm(Path(model_path), Placement("cpu", dtype), error=TrainingFailed)
    model.tie_weights()  # as from_pretrained ties them after loading (tied embeddings: one parameter)
    _placeholders(model, device)
    model.eval()
    return model


def _swap_parameters(model: torch.nn.Module, wanted: Callable[[torch.nn.Parameter], bool], make: Callable) -> None:
    """Each parameter ``wanted`` selects replaced by ``make(param)`` (a tensor, made a parameter
    marked :data:`PLACEHOLDER`); a parameter two modules share (tied embeddings) stays shared."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not wanted(param):
                continue
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(make(param), requires_grad=param.requires_grad)
                setattr(made[id(param)], PLACEHOLDER, True)
            module._parameters[name] = made[id(param)]


def _placeholders(model: torch.nn.Module, device: torch.device) -> None:
    """Each meta parameter replaced by a zero-stride tensor on ``device`` of its shape and dtype
    (one element of storage)."""
    _swap_parameters(
        model,
        lambda p: p.is_meta,
        lambda p: torch.zeros((), dtype=p.dtype, device=device).expand(p.shape),
    )


def to_meta(model: Any) -> None:
    """Every placeholder parameter of ``model`` (LoRA attached) replaced by a meta parameter of
    its shape and dtype, what FSDP2 shards."""
    _swap_parameters(
        model,
        lambda p: bool(getattr(p, PLACEHOLDER, False)),
        lambda p: torch.empty(p.shape, dtype=p.dtype, device="meta"),
    )


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def materialise(model: Any, device: torch.device) -> None:
    """Allocate, uninitialised on ``device``, the local shard of every meta parameter of the
    sharded ``model`` (each module's own, ``to_empty``; its real buffers are kept)."""
    for module in model.modules():
        if not any(p is not None and _local(p).is_meta for p in module._parameters.values()):
            continue
        kept = dict(module._buffers)
        module.to_empty(device=device, recurse=False)
        module._buffers.update(kept)


def checkpoint_files(model_path: Path) -> dict[str, Path]:
    """Each tensor name of the checkpoint and the safetensors file holding it."""
    model_path = Path(model_path)
    index = model_path / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return {name: model_path / file for name, file in weight_map.items()}
    single = model_path / SINGLE
    if not single.is_file():
        raise TrainingFailed(
            f"no {SINGLE} or {INDEX} in {model_path}: the ranks read their shards from safetensors files",
            code="training_checkpoint_mismatch",
            hint=ONE_DEVICE,
            details={"path": str(model_path)},
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return {name: single for name in handle.keys()}


def checkpoint_name(param_name: str) -> str:
    """The checkpoint's name of a base parameter of the LoRA-wrapped model (peft nests the
    wrapped module's own weight as ``base_layer``)."""
    return ".".join(part for part in param_name.split(".") if part != "base_layer")


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A parameter's local tensor and the rows of the whole it holds: FSDP2's ``Shard(0)``
    (``torch.chunk``'s split of dim 0), or every row of an unsharded parameter."""
    if not hasattr(param, "to_local"):
        rows = param.shape[0] if param.dim() else 0
        return param.data, 0, rows
    local = param.to_local()
    whole = param.shape[0]
    mesh = cast(Any, param).device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    start = min(whole, rank * math.ceil(whole / world))
    return local, start, start + local.shape[0]


def _made_here(param: torch.Tensor) -> bool:
    """A base parameter (FSDP2's shard of one, or a placeholder), not the LoRA's."""
    return hasattr(param, "to_local") or bool(getattr(param, PLACEHOLDER, False))


def fill_shards(model: Any, model_path: Path) -> None:
    """Fill every base parameter's local shard of the LoRA-wrapped, sharded ``model`` from the
    checkpoint at ``model_path`` (``training_checkpoint_mismatch`` when names or shapes differ)."""
    files = checkpoint_files(model_path)
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = {checkpoint_name(n): p for n, p in lm.named_parameters() if _made_here(p)}
    aliases = {checkpoint_name(n) for n, p in lm.named_parameters(remove_duplicate=False) if _made_here(p)}
    _refuse_mismatch(model_path, set(files), set(params), aliases)
    with torch.no_grad():
        for name, param in params.items():
            _fill_one(param, name, files[name], model_path)


def _fill_one(param: torch.Tensor, name: str, file: Path, model_path: Path) -> None:
    """One parameter's rows from its checkpoint tensor, in blocks of at most ``BLOCK_BYTES``, the
    file mapped for one block at a time (its pages count in the process's resident set while
    mapped), each block converted to the parameter's dtype as it is copied in."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        shape = tuple(handle.get_slice(name).get_shape())
    if shape != tuple(param.shape):
        raise TrainingFailed(
            f"checkpoint tensor {name} in {model_path} has shape {list(shape)}, the model's parameter "
            f"{list(param.shape)}",
            code="training_checkpoint_mismatch",
            hint=ONE_DEVICE,
            details={"path": str(model_path), "tensor": name},
        )
    local, start, stop = _local_rows(param)
    if not hasattr(param, "to_local"):  # a parameter FSDP2 does not manage: its whole tensor
        param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        local = param.data
    if not param.dim():
        with safe_open(str(file), framework="pt") as handle:
            local.copy_(handle.get_slice(name)[:])
        return
    row_bytes = max(1, math.prod(shape[1:]) * local.element_size())
    step = max(1, BLOCK_BYTES // row_bytes)
    for first in range(start, stop, step):
        last = min(stop, first + step)
        with safe_open(str(file), framework="pt") as handle:
            local[first - start : last - start].copy_(handle.get_slice(name)[first:last])


def _refuse_mismatch(model_path: Path, stored: set[str], wanted: set[str], aliases: set[str]) -> None:
    """``training_checkpoint_mismatch`` naming the first names that do not match (a stored alias
    of a tied weight, e.g. ``lm_head.weight`` beside ``embed_tokens.weight``, is fine)."""
    missing = sorted(wanted - stored)
    unknown = sorted(stored - aliases)
    if not missing and not unknown:
        return
    parts = []
    if missing:
        parts.append(f"the checkpoint lacks {', '.join(missing[:3])}" + (" …" if len(missing) > 3 else ""))
    if unknown:
        parts.append(f"the model has no parameter {', '.join(unknown[:3])}" + (" …" if len(unknown) > 3 else ""))
    raise TrainingFailed(
        f"the checkpoint at {model_path} does not match its model class: {'; '.join(parts)}",
        code="training_checkpoint_mismatch",
        hint=ONE_DEVICE,
        details={"path": str(model_path), "missing": missing[:20], "unknown": unknown[:20]},
    )
