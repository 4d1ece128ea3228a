"""Which models a deployment serves, and the gpu task queue each one is sampled and trained on.

The workers' default model (``KILN_MODEL_PATH``) is served on the gpu task queue itself
(``kiln-gpu``) and is what a run gets when it names no ``model``. Every sub-folder of
``KILN_MODELS_DIR`` holding a ``config.json`` (hidden folders skipped) is one more served model,
named by its folder, on the queue ``<gpu task queue>.<name>`` (``kiln-gpu.qwen3-4b``).

Both worker roles read the same settings: the gpu worker polls one queue per served model, and
the control worker lists the folder names (no torch, no weights read) to admit or reject a run's
``model`` and to route it, and reads each named model's ``config.json`` to refuse an architecture
the model family table (:mod:`kiln.core.policy.families`) does not know, or one the deployment's engine
cannot serve, with ``model_unsupported`` before anything is queued. Pure functions of a path: no
Temporal, no torch.
"""

from __future__ import annotations

from pathlib import Path

from kiln.core.errors import ModelNotServed, ModelUnsupported
from kiln.core.policy.families import family_of, require_servable


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


def require_served(
    model: str | None, models_dir: Path | None, *, default: str | None = None, engine: str | None = None
) -> None:
    """``ModelNotServed`` (field ``model``, listing the served names) unless ``model`` is served;
    ``ModelUnsupported`` when its folder's architecture is not in the model family table or
    ``engine`` (the deployment's, when given) cannot serve its family.

    ``default`` names the workers' default model (what a request without ``model`` gets); when
    given, the message and ``details["default"]`` name it too."""
    if model is None:
        return
    found = served_models(models_dir)
    if model in found:
        if engine is not None:
            require_servable(found[model], engine)
        else:
            family_of(found[model])  # an unknown architecture, whatever the engine
        return
    served = list(found)
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


def servable_split(
    models: dict[str | None, Path], engine: str, *, cpu: bool | None
) -> tuple[dict[str | None, Path], dict[str | None, ModelUnsupported]]:
    """The gpu worker's served models split into those ``engine`` serves (on a CPU placement when
    ``cpu``) and the refusals of the others (a folder without ``config.json`` is kept: loading it
    reports ``model_not_found``)."""
    kept: dict[str | None, Path] = {}
    refused: dict[str | None, ModelUnsupported] = {}
    for name, path in models.items():
        if not (Path(path) / "config.json").is_file():
            kept[name] = path
            continue
        try:
            require_servable(Path(path), engine, cpu=cpu)
        except ModelUnsupported as error:
            refused[name] = error
        else:
            kept[name] = path
    return kept, refused


__all__ = ["model_task_queue", "require_served", "servable_split", "served_models"]
