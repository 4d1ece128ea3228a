"""Content digests of model and adapter directories (pure: no torch).

``model_content_sha256``: ``digest_json`` of the sorted list of ``[relative_posix_path,
sha256_of_file_bytes]`` over every regular file below the directory, skipping only hidden entries
(any path component starting with ``.``). Renaming, adding, removing or changing a byte of any file
changes the digest; modification times and directory order do not.

``adapter_content_sha256``: the same construction over exactly ``adapter_config.json`` and
``adapter_model.safetensors`` (the two files PEFT needs to load a LoRA adapter); a full-weights
folder (``adapter: full`` training's output) digests as a model folder.

``inference_config``: every setting that changes the sampling distribution of an action
(temperature, top-p, thinking, thinking budget, max action tokens, constrained decoding), in a fixed
key order; ``inference_config_sha256`` is its ``digest_json``. A behaviour-policy identity carries
both (:func:`with_inference`), so the trainer scores actions under the distribution that sampled them
and the on-policy proof fails when the sampling settings differ.

``model_part_of``: which part of a checkpoint the policy ran (``whole``, or ``language_model`` for a
vision-language checkpoint served as text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from kiln.core.canonical import digest_json, file_sha256
from kiln.core.errors import AdapterNotFound, ModelNotFound

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _is_hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def model_content_sha256(model_dir: Path) -> str:
    """Digest over the sorted relative paths and byte digests of all non-hidden files
    (``model_not_found`` when ``model_dir`` is not a folder)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelNotFound(f"model directory not found: {root}")
    entries = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if _is_hidden(rel) or not path.is_file():
            continue
        entries.append([rel.as_posix(), file_sha256(path)])
    entries.sort()
    return digest_json({"files": entries})


def is_full_weights(adapter_dir: Path) -> bool:
    """Whether ``adapter_dir`` holds full model weights (``adapter: full``: a model folder with a
    ``config.json`` and no ``adapter_config.json``) rather than a LoRA adapter."""
    root = Path(adapter_dir)
    return (root / "config.json").is_file() and not (root / ADAPTER_FILES[0]).exists()


def adapter_content_sha256(adapter_dir: Path) -> str:
    """Digest over ``adapter_config.json`` and ``adapter_model.safetensors`` of ``adapter_dir``
    (``adapter_not_found`` when either is missing); for a full-weights folder
    (:func:`is_full_weights`) its :func:`model_content_sha256`, over every file it holds."""
    root = Path(adapter_dir)
    if is_full_weights(root):
        return model_content_sha256(root)
    entries = []
    for name in ADAPTER_FILES:
        path = root / name
        if not path.is_file():
            raise AdapterNotFound(f"adapter file missing: {path}")
        entries.append([name, file_sha256(path)])
    return digest_json({"files": entries})


INFERENCE_KEYS = (
    "temperature",
    "top_p",
    "thinking",
    "thinking_budget_tokens",
    "max_action_tokens",
    "constrained_actions",
)
_INFERENCE_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "thinking": True,
    "thinking_budget_tokens": None,
    "max_action_tokens": 256,
    "constrained_actions": False,
}


def inference_config(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling settings of ``settings`` (a run request or episode settings), normalised.

    Kiln's sampler has no top-p (full-distribution sampling): it is recorded as 1.0."""
    out: dict[str, Any] = {}
    for key in INFERENCE_KEYS:
        value = settings.get(key, _INFERENCE_DEFAULTS[key])
        if key in ("temperature", "top_p"):
            value = float(value)
        elif key in ("thinking", "constrained_actions"):
            value = bool(value)
        elif value is not None:
            value = int(value)
        out[key] = value
    return out


def inference_config_sha256(config: Mapping[str, Any]) -> str:
    return digest_json(dict(config))


def with_inference(identity: Mapping[str, Any], settings: Mapping[str, Any] | None) -> dict[str, Any]:
    """``identity`` plus ``inference`` and ``inference_config_sha256`` (unchanged when None)."""
    out = dict(identity)
    if settings is not None:
        config = inference_config(settings)
        out["inference"] = config
        out["inference_config_sha256"] = inference_config_sha256(config)
    return out


def sampling_of(identity: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The verified ``inference`` block of a behaviour identity (None for identities from before it
    existed). Raises ValueError when the block does not match its recorded digest."""
    if not identity or "inference" not in identity:
        return None
    config = identity["inference"]
    if not isinstance(config, dict) or set(config) != set(INFERENCE_KEYS):
        raise ValueError("behavior_policy.inference must hold exactly " + ", ".join(INFERENCE_KEYS))
    if identity.get("inference_config_sha256") != inference_config_sha256(config):
        raise ValueError("behavior_policy.inference_config_sha256 does not match behavior_policy.inference")
    return dict(config)


def model_part_of(identity: Mapping[str, Any] | None) -> str:
    """Which part of its checkpoint a behaviour identity's policy ran: ``language_model`` for a
    vision-language checkpoint served as text (``runtime.model_part``, written by
    :func:`kiln.core.policy.families.load_identity_fields`); ``whole`` by default, which is also what an
    identity recorded before the field existed means (old payloads and histories stay valid)."""
    runtime = (identity or {}).get("runtime")
    if isinstance(runtime, Mapping) and runtime.get("model_part"):
        return str(runtime["model_part"])
    return "whole"


__all__ = [
    "adapter_content_sha256",
    "file_sha256",
    "inference_config",
    "inference_config_sha256",
    "model_content_sha256",
    "model_part_of",
    "sampling_of",
    "with_inference",
]
