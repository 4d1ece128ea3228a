"""Whether a retried training may resume from a checkpoint, and which trainer wrote what.

**The checkpoint identity** (``plan.identity``) covers what changes the trained result: the
training data (``training_data_sha256``), the adapter training starts from
(``base_adapter_sha256``; an online run's ``init_state_sha256``, stale data's behaviour adapter),
the step count, the iteration, and the settings in force (``settings_sha256``).
``settings_sha256`` digests the effective training config **without the fields whose value equals
their declared default** (:func:`settings_digest`, recursively into nested settings): a release
that adds a setting whose default keeps the old behaviour leaves every earlier checkpoint usable,
while any setting given another value than its default changes the digest. (A release that
changes a default makes checkpoints of configs that hold the old default explicitly look
different: such a training restarts its iteration, it does not resume on guessed settings.)
Checkpoints written before this rule carry only ``config_sha256``, the digest of the whole config
dump; they are compared that way (:func:`resume_refusal`).

**A checkpoint that cannot be used never fails the run**: the training restarts its iteration
from its start, and the receipt's ``checkpoint`` block says so (``used: false`` and the
``reason``). A used one is ``used: true`` with the step it resumed at.

**The trainer's version** (:func:`trainer_version`): Kiln's version, the SHA-256 of the training
code (every ``kiln/core/train`` source file, by relative name) and the git commit when the code runs
from a checkout. Every checkpoint records the version that wrote it and every receipt the version
that finished the training, so an adapter trained across an upgrade names both.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any, Iterable

import torch

from kiln.core.canonical import digest_json, sha256_bytes

# Identity keys present only for an online run's training (continuation state, stale data): a
# checkpoint must agree on them too, present or absent.
ONLINE_IDENTITY_KEYS = ("init_state_sha256", "staleness", "behavior_adapter_sha256")
SETTINGS_KEY = "settings_sha256"
LEGACY_CONFIG_KEY = "config_sha256"


def settings_digest(config: Any, left_out: Iterable[str] = ()) -> str:
    """``sha256:`` of the config's JSON dump without its default-valued fields (and without the
    top-level keys ``left_out``: knobs that do not act on this training)."""
    settings = config.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    for key in left_out:
        settings.pop(key, None)
    return digest_json(settings)


def resume_refusal(state: dict[str, Any], identity: dict[str, Any], effective_config: dict[str, Any]) -> str | None:
    """Why the checkpoint ``state`` (its ``state.json``) cannot resume the training of
    ``identity``; None when it can. ``effective_config`` (the whole dump the receipt records)
    checks a checkpoint written before ``settings_sha256`` existed."""
    keys = [*identity, *(k for k in ONLINE_IDENTITY_KEYS if k not in identity)]
    for key in keys:
        if key == SETTINGS_KEY and SETTINGS_KEY not in state:
            if state.get(LEGACY_CONFIG_KEY) != digest_json(effective_config):
                return (
                    "the checkpoint was written by an earlier release for a training config "
                    "that differs from this one (config_sha256)"
                )
            continue
        if state.get(key) != identity.get(key):
            return f"the checkpoint's {key} differs from this training's"
    return None


def checkpoint_extras(effective_config: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's ``state.json`` holds beside the identity: the trainer that wrote it,
    and the whole-dump ``config_sha256`` by which releases before ``settings_sha256`` match a
    checkpoint (so rolling back to one keeps checkpoints of unchanged settings usable)."""
    return {LEGACY_CONFIG_KEY: digest_json(effective_config), "trainer": trainer_version()}


@functools.lru_cache(maxsize=1)
def trainer_version() -> dict[str, Any]:
    """``{"kiln", "train_code_sha256", "commit"}`` of the code running now (commit: None outside
    a git checkout)."""
    import kiln

    root = Path(__file__).resolve().parent
    return {"kiln": kiln.__version__, "train_code_sha256": code_digest(root), "commit": _git_commit(root)}


def code_digest(root: Path) -> str:
    """``sha256:`` over every ``*.py`` file under ``root``: its relative name, a NUL, its bytes, a
    NUL, in sorted name order (other files do not count)."""
    parts = []
    for path in sorted(Path(root).rglob("*.py")):
        parts.append(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return sha256_bytes(b"".join(parts))


def _git_commit(folder: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


def try_resume(
    folder: Path | None,
    *,
    identity: dict[str, Any],
    effective_config: dict[str, Any],
    restore: Any,
    params: list[tuple[str, torch.nn.Parameter]],
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Resume from the checkpoint ``folder`` when it fits: ``(state, block)`` with the receipt's
    ``checkpoint`` block. ``restore(folder)`` loads it into ``params``/``optimizer`` (and RNG);
    when it fails half-way, the live weights, optimizer and RNG are put back as they were, so
    the training restarts from its start exactly as a fresh one (state None)."""
    from kiln.core.errors import TrainingFailed
    from kiln.core.train.checkpoints import read_checkpoint_state

    if folder is None:
        return None, {"used": False, "step": None, "reason": "the checkpoint could not be read"}
    try:
        state = read_checkpoint_state(Path(folder))
    except TrainingFailed as exc:
        return None, {"used": False, "step": None, "reason": exc.message}
    written_by = state.get("trainer")
    step = state.get("step") if isinstance(state.get("step"), int) else None
    refusal = resume_refusal(state, identity, effective_config)
    if refusal is None:
        weights = [p.detach().clone() for _, p in params]
        opt_state = optimizer.state_dict()
        rng = torch.get_rng_state()
        try:
            restore(Path(folder))
        except Exception as exc:  # noqa: BLE001 - any unusable checkpoint restarts the iteration
            with torch.no_grad():
                for (_, param), saved in zip(params, weights):
                    param.copy_(saved)
            optimizer.load_state_dict(opt_state)
            torch.set_rng_state(rng)
            refusal = getattr(exc, "message", None) or "the checkpoint's tensors could not be loaded"
    block = {
        "used": refusal is None,
        "step": step,
        "reason": refusal,
        "written_by": written_by if isinstance(written_by, dict) else None,
    }
    return (state if refusal is None else None), block
