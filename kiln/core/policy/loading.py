"""Load a local Hugging Face model folder on a resolved placement (one loader for policy and trainer).

Never downloads (``local_files_only`` and ``HF_HUB_OFFLINE=1``); the weights are loaded directly in
the placement's dtype and moved to its device once. The folder's model family
(:mod:`kiln.core.policy.families`, read from its ``config.json``) decides the attention implementation
(``sdpa``, or ``eager`` for gpt-oss's attention sinks) and, for a vision-language checkpoint, that
only its language model loads (the family's text-only causal LM class: no vision tower in memory).
An architecture the family table does not know is refused with ``model_unsupported`` before any
weight is read. A user with real weights just points at the folder (or at one folder under a
models directory).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from kiln.core.errors import ModelNotFound
from kiln.core.policy.device import Placement
from kiln.core.policy.families import family_of

MODEL_HINT = (
    "point KILN_MODEL_PATH at a local Hugging Face model directory, or build one with "
    "`kiln model tiny DIR` / `kiln model random --shape qwen3-0.6b DIR`"
)


def check_model_dir(path: Path) -> Path:
    """The folder, or ModelNotFound naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ModelNotFound(f"model directory not found: {path}", hint=MODEL_HINT, details={"path": str(path)})
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"not a model directory (no config.json): {path}", hint=MODEL_HINT, details={"path": str(path)}
        )
    return path


def load_tokenizer(path: Path) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelNotFound(
            f"could not load the tokenizer at {path}: {exc}", hint=MODEL_HINT, details={"path": str(path)}
        ) from exc


# Torch's process-wide state: the default random generator, and what model construction sets for
# the whole process (the default device and dtype, the meta-device initialisation context). A
# worker runs activities in threads, so every use of that state holds this lock: a model load (two
# at once gave one of them meta weights), the seeded LoRA init of a training, and each adapter load
# (which draws random initial weights before it overwrites them). A training's LoRA init then
# depends on its seed alone, whatever the worker's other threads do meanwhile.
TORCH_GLOBAL_STATE = threading.RLock()


def _model_class(shape: Any) -> Any:
    """``AutoModelForCausalLM``, or the family's text-only class for a composite checkpoint."""
    import transformers

    if shape.composite:
        return getattr(transformers, shape.family.composite_text_class)
    return transformers.AutoModelForCausalLM


def load_causal_lm(path: Path, placement: Placement, *, error: type = ModelNotFound) -> Any:
    """The causal LM at ``path`` in eval mode on ``placement``, with its family's attention
    implementation (``model_unsupported`` for an architecture the family table does not know)."""
    model = _build(path, placement, error, weights=True)
    model.to(placement.torch_device)
    model.eval()
    return model


def empty_causal_lm(path: Path, placement: Placement, *, error: type = ModelNotFound) -> Any:
    """The causal LM of ``path``'s config as :func:`load_causal_lm` builds it (class, dtype,
    attention implementation), its parameters on the meta device and its buffers real (each
    module's own init), no weights read: what a training rank shards before it reads its rows."""
    return _build(path, placement, error, weights=False)


def _build(path: Path, placement: Placement, error: type, *, weights: bool) -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = check_model_dir(path)
    shape = family_of(path)
    options = {"dtype": placement.torch_dtype, "attn_implementation": shape.family.attn_implementation}
    try:
        with TORCH_GLOBAL_STATE:
            if weights:
                return _model_class(shape).from_pretrained(str(path), local_files_only=True, **options)
            from accelerate import init_empty_weights
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
            if shape.composite:
                config = config.get_text_config()
            with init_empty_weights(include_buffers=False):
                return _model_class(shape).from_config(config, **options)
    except (OSError, ValueError) as exc:
        raise error(f"could not load the model at {path}: {exc}", hint=MODEL_HINT, details={"path": str(path)}) from exc


__all__ = ["MODEL_HINT", "TORCH_GLOBAL_STATE", "check_model_dir", "empty_causal_lm", "load_causal_lm", "load_tokenizer"]
