"""Which models a deployment serves, and the gpu task queue each one is sampled and trained on.

The workers' default model (``KILN_MODEL_PATH``) is served on the gpu task queue itself
(``kiln-gpu``) and is what a run gets when it names no ``model``. Every sub-folder of
``KILN_MODELS_DIR`` holding a ``config.json`` (hidden folders skipped) is one more served model,
named by its folder, on the queue ``<gpu task queue>.<name>`` (``kiln-gpu.qwen3-4b``).

Both worker roles read the same settings: the gpu worker polls one queue per served model, and
the control worker lists the folder names (no torch, no weights read) to admit or reject a run's
``model`` and to route it. Pure functions of a path: no Temporal, no torch.
"""

from __future__ import annotations

from pathlib import Path

from kiln.errors import ModelNotServed


def served_models(models_dir: Path | None) -> dict[str, Path]:
    """``{name: folder}`` of the models under ``models_dir``, sorted by name (empty when unset)."""
    if models_dir is None:
        return {}
    root = Path(models_dir)
    if not root.is_dir():
        return {}
    found = {
        entry.name: entry
        for entry in root.iterdir()
        if not entry.name.startswith(".") and entry.is_dir() and (entry / "config.json").is_file()
    }
    return dict(sorted(found.items()))


def model_task_queue(gpu_task_queue: str, model: str | None) -> str:
    """The gpu task queue serving ``model`` (``None`` = the default model's queue)."""
    return gpu_task_queue if model is None else f"{gpu_task_queue}.{model}"


def require_served(model: str | None, models_dir: Path | None, *, default: str | None = None) -> None:
    """``ModelNotServed`` (field ``model``, listing the served names) unless ``model`` is served.

    ``default`` names the workers' default model (what a request without ``model`` gets); when
    given, the message and ``details["default"]`` name it too."""
    if model is None:
        return
    served = list(served_models(models_dir))
    if model in served:
        return
    listed = ", ".join(served) if served else "none besides the default"
    details: dict[str, object] = {"field": "model", "model": model, "served": served}
    message = f"invalid run request: model: {model!r} is not served by these workers; served models: {listed}"
    if default is not None:
        details["default"] = default
        message += f"; default model: {default} (used when model is omitted)"
    raise ModelNotServed(
        message,
        hint="name one of the served models, or omit model for the workers' default model "
        "(models are the sub-folders of KILN_MODELS_DIR)",
        details=details,
    )


__all__ = ["model_task_queue", "require_served", "served_models"]
