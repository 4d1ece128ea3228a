"""What a vllm engine failure means: retried, or the same on every attempt (read from its log).

The engine server (:mod:`kiln.core.policy.vllm_server`) logs to one file per worker. When it dies, the
part of that file written since it was started says why:

- The server could not build its engine and said so in its fault line (``FAULT_MARK``): the model
  and the engine build fail the same way on every start. An architecture vLLM cannot inspect or
  does not support is :class:`~kiln.core.errors.ModelUnsupported`; anything else (weights that do not
  load, a configuration vLLM refuses) is :class:`~kiln.core.errors.EngineFault`. Neither is retried.
- vLLM's engine core died of an exception raised in a step (``EngineCore encountered a fatal
  error``: a kernel the build lacks, a layer it cannot run), no engine process having been killed
  before (``Worker proc ... died unexpectedly``): :class:`~kiln.core.errors.EngineFault`.
- Anything else (a process was killed, by a signal or the kernel's OOM killer, or vanished):
  :class:`~kiln.core.errors.EngineUnavailable`, retryable; the next request starts a fresh server.

The message carries the root cause the engine logged (the innermost exception line, not vLLM's
wrappers around it), cut to :data:`CAUSE_CHARS` characters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kiln.core.errors import EngineFault, EngineUnavailable, KilnError, ModelUnsupported
from kiln.core.policy.vllm_server import FAULT_EXIT, FAULT_MARK  # stdlib-only at import

CAUSE_CHARS = 300
_TAIL_BYTES = 512 * 1024
# vLLM's marker for an engine core that stopped on an exception of its own (not a kill)
CORE_FATAL = "EngineCore encountered a fatal error"
# ...unless one of its processes was killed first: the core then fails because its worker is gone
PROCESS_DIED = "died unexpectedly"
# "(Worker pid=1) ERROR 12-03 09:46:20 [file.py:10] " before a logged line
_PREFIX = re.compile(r"^(?:\([\w:-]+ pid=\d+\)\s+)?(?:[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]*\]\s?)?")
_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (.+)$")
# vLLM's exceptions that wrap the cause logged before or after them
_WRAPPERS = (
    "EngineDeadError",
    "CalledProcessError",
    "Engine core initialization failed",
    "Worker failed with error",
    "Error raised in subprocess",
    "failed to be inspected",
    "See stack trace",
    "See root cause",
)
_TOKENS = re.compile(r"\b(?:hf_|sk-|ghp_)[A-Za-z0-9_-]{8,}")


def log_size(path: Path | None) -> int:
    """The log's current size: where the next server's lines begin."""
    try:
        return Path(path).stat().st_size if path is not None else 0
    except OSError:
        return 0


def read_since(path: Path | None, offset: int) -> str:
    """The log written since ``offset`` (its last :data:`_TAIL_BYTES` at most)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, log_size(path) - _TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _bounded(text: str) -> str:
    text = _TOKENS.sub("[redacted]", " ".join(text.split()))
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."


def root_cause(log: str) -> str | None:
    """The message of the first exception line in ``log`` that is not one of vLLM's wrappers (else
    of the first), without the exception's name."""
    found = []
    for raw in log.splitlines():
        match = _EXCEPTION.match(_PREFIX.sub("", raw).strip())
        if match:
            found.append((match.group(1), match.group(2)))
    inner = [m for m in found if not any(w in f"{m[0]}: {m[1]}" for w in _WRAPPERS)]
    chosen = (inner or found)[0] if (inner or found) else None
    return _bounded(chosen[1]) if chosen else None


def _fault_line(log: str) -> dict | None:
    for raw in reversed(log.splitlines()):
        at = raw.find(FAULT_MARK)
        if at >= 0:
            try:
                return json.loads(raw[at + len(FAULT_MARK) :])
            except ValueError:
                return None
    return None


def start_failure(model: Path, status: int | None, log: str, log_path: Path | None) -> KilnError:
    """The error for a server that exited with ``status`` before it answered ``/health``."""
    cause = root_cause(log)
    fault = _fault_line(log) if status == FAULT_EXIT else None
    where = f"see the engine log {log_path}" if log_path else "set a log path to see why"
    if fault is None:
        return EngineUnavailable(
            f"the vllm engine process exited with status {status} while starting" + (f": {cause}" if cause else ""),
            hint=where,
            details={"log": str(log_path) if log_path else None, "cause": cause},
        )
    archs = ", ".join(fault.get("architectures") or []) or "unknown"
    summary = _bounded(str(fault.get("error") or ""))
    details = {
        "model": str(model),
        "architectures": fault.get("architectures") or [],
        "cause": cause,
        "log": str(log_path) if log_path else None,
    }
    if fault.get("kind") == "model_unsupported":
        return ModelUnsupported(
            f"the vllm engine cannot serve {archs} from {model}: {summary}" + (f" ({cause})" if cause else ""),
            hint=_unsupported_hint(f"{summary} {cause or ''}") + f"; {where}",
            details=details,
        )
    return EngineFault(
        f"the vllm engine cannot start on {archs} from {model}: {cause or summary}",
        hint=f"the same model and engine build fail the same way on every start; {where}",
        details=details,
    )


def _unsupported_hint(cause: str) -> str:
    if "mixture-of-experts" in cause:
        return (
            "serve this model with KILN_ENGINE=hf, or with the vllm engine on a CUDA box (vLLM's "
            "GPU build has the kernel)"
        )
    if "torchvision" in cause:
        return (
            "vLLM's classes for this family import torchvision: run scripts/setup_vllm.sh, which "
            "installs it into .venv-vllm/kiln-torchvision, or serve it with KILN_ENGINE=hf"
        )
    return "serve this model with KILN_ENGINE=hf, or choose an architecture the engine supports"


def death(pid: int | None, log: str, log_path: Path | None, error: str) -> KilnError:
    """The error for a request the server could not answer (``error``): :class:`EngineFault` when
    its engine core stopped on an exception of its own, else the retryable
    :class:`EngineUnavailable` (the next request restarts the server)."""
    if CORE_FATAL in log and PROCESS_DIED not in log:
        cause = root_cause(log)
        return EngineFault(
            f"the vllm engine's core stopped on an error of its own: {cause or 'unknown'}",
            hint="it fails the same way on every attempt (a kernel or layer this engine build cannot "
            f"run); serve this model with KILN_ENGINE=hf; see the engine log {log_path}",
            details={"pid": pid, "cause": cause, "log": str(log_path) if log_path else None},
        )
    return EngineUnavailable(
        f"the vllm engine (pid {pid}) did not answer: {_bounded(error)}",
        hint="the engine is restarted on the next request; the group is retried",
        details={"pid": pid},
    )


__all__ = ["CAUSE_CHARS", "CORE_FATAL", "death", "log_size", "read_since", "root_cause", "start_failure"]
