"""Faults raised from inside the policy model's forward pass, as :class:`kiln.core.errors.ModelFault`.

A forward that raises (an unsupported layer, a config that does not match its architecture)
raises the same way on every attempt, so :func:`model_forward` turns it into a non-retryable
``model_fault`` naming the model's family (``model_type``), its architecture, where in the model
code it failed and the message, never the Python exception's class name. Running out of device
memory is not deterministic (it depends on what else runs) and keeps its own type; a
:class:`kiln.core.errors.KilnError` passes through unchanged.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from kiln.core.errors import KilnError, ModelFault


def model_description(model: Any) -> dict[str, str]:
    """The ``model_type`` and architecture of ``model`` (a PEFT wrapper is looked through)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    architectures = getattr(config, "architectures", None) or [type(base).__name__]
    return {"model_type": str(getattr(config, "model_type", "unknown")), "architecture": str(architectures[0])}


def _where(exc: BaseException) -> str:
    """``package/path.py:line (function)`` of the innermost frame of ``exc``'s traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "the model's forward"
    frame = frames[-1]
    path = frame.filename.replace("\\", "/")
    for anchor in ("site-packages/", "/kiln/"):
        if anchor in path:
            path = ("kiln/" if anchor == "/kiln/" else "") + path.split(anchor, 1)[1]
            break
    return f"{path}:{frame.lineno} ({frame.name})"


def fault_of(model: Any, exc: BaseException) -> ModelFault:
    """The ``model_fault`` of ``exc``, raised from inside ``model``'s forward."""
    described = model_description(model)
    where = _where(exc)
    cause = str(exc).strip() or "no message"
    return ModelFault(
        f"the {described['model_type']} model ({described['architecture']}) fails inside its forward "
        f"pass at {where}: {cause}; it fails the same way on every attempt, so the run ends here",
        hint="check that the model folder's config.json matches its architecture (layer_types, head "
        "sizes), or serve a model family Kiln supports (docs/models.md)",
        details={**described, "where": where},
    )


@contextmanager
def model_forward(model: Any) -> Iterator[None]:
    """Run a forward of ``model``: an exception it raises becomes a :class:`ModelFault`."""
    try:
        yield
    except (KilnError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise fault_of(model, exc) from exc


__all__ = ["fault_of", "model_description", "model_forward"]
