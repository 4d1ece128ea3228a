"""The torchvision Kiln's vllm engine server imports, kept beside the engine's venv, not in it.

A neighbour of :mod:`vllm_server` (stdlib + torch at import; it imports nothing from Kiln's package).
vLLM's module for Qwen3.5 (``qwen3_5.py``, the text-only class too) imports its vision-language
neighbour, which imports transformers' Qwen2-VL image processor, which imports torchvision. A text
model served as its language model never runs a torchvision operator, but the import must succeed.

``scripts/setup_vllm.sh`` installs torchvision into ``<engine venv>/kiln-torchvision`` (a
``pip --target`` folder, :data:`VISION_DIR`): the ``+cpu`` build matching the engine's torch where
PyTorch's CPU index is reachable, else the registry's build of the same version. The registry's
build is compiled for CUDA: its ``_C`` extension does not load against the CPU torch, and then
``import torchvision`` fails (``operator torchvision::nms does not exist``: its fake-tensor
registrations name operators the extension would have defined). :func:`install` puts the folder on
``sys.path`` and, where the extension does not load, defines those operators' schemas itself, with
kernels that raise :data:`NO_KERNEL` (torchvision's own Python ops check for the extension first and
raise their own error). The folder is kept out of the venv's ``site-packages`` so no other program
of that venv meets a torchvision that cannot load without this module.

Every process of the engine runs :func:`install` before vLLM imports a model class: the server and
its spawned engine processes at import (``vllm_server`` runs it as ``__main__`` and
``__mp_main__``), and vLLM's model-inspection subprocess through :func:`inspection_command`.
"""

from __future__ import annotations

import glob
import os
import sys

VISION_DIR = "kiln-torchvision"  # under the engine venv's prefix (sys.prefix of its Python)
# The operators torchvision registers fakes for whether or not its extension loaded (0.28).
_UNCONDITIONAL_OPS = ("nms", "qnms")
_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
NO_KERNEL = (
    "torchvision's compiled operator torchvision::{op} is not available in Kiln's vllm engine: its "
    "torchvision build does not load against the engine's torch, so it serves models as text only "
    "(install the build matching the engine's torch with scripts/setup_vllm.sh)"
)
_LIBRARY = None  # the torch.library.Library holding the schemas: kept alive for the process


def vision_dir(prefix: str | None = None) -> str:
    """Where ``scripts/setup_vllm.sh`` installs the engine's torchvision."""
    return os.path.join(prefix or sys.prefix, VISION_DIR)


def _raiser(op: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(NO_KERNEL.format(op=op))

    return kernel


def _load_extension(folder: str) -> bool:
    import torch

    for path in sorted(glob.glob(os.path.join(folder, "torchvision", "_C*.so"))):
        try:
            torch.ops.load_library(path)
            return True
        except (OSError, RuntimeError):
            return False
    return False


def install(prefix: str | None = None) -> str:
    """Make ``import torchvision`` work in this process; what it found, as ``/health`` reports it:
    ``"compiled"`` (its extension loads), ``"text-only"`` (operator schemas defined here, kernels
    that raise) or ``"absent"`` (no torchvision folder: vLLM's Qwen3.5 classes cannot load)."""
    global _LIBRARY
    folder = vision_dir(prefix)
    if not os.path.isdir(os.path.join(folder, "torchvision")):
        return "absent"
    if folder not in sys.path:
        sys.path.append(folder)
    if _LIBRARY is not None:
        return "text-only"
    if _load_extension(folder):
        return "compiled"
    import torch

    library = torch.library.Library("torchvision", "DEF")
    for op in _UNCONDITIONAL_OPS:
        library.define(op + _SCHEMA)
        library.impl(op, _raiser(op), "CompositeExplicitAutograd")
    _LIBRARY = library
    return "text-only"


def inspection_command(here: str) -> list[str]:
    """vLLM's model-inspection subprocess (``registry._SUBPROCESS_COMMAND``), with :func:`install`
    run first; ``here`` is the folder holding this module."""
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import vllm_vision; vllm_vision.install(); "
        "from vllm.model_executor.models.registry import _run; _run()"
    )
    return [sys.executable, "-c", code]


def patch_inspection(here: str) -> None:
    """Point vLLM's model-inspection subprocess at :func:`inspection_command`."""
    from vllm.model_executor.models import registry

    registry._SUBPROCESS_COMMAND = inspection_command(here)
