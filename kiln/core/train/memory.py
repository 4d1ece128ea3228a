"""A training process's memory as the kernel counts it (the receipt's ``runtime.process_memory``).

Each training process (one rank, or the single process of a one-device training) reads its own
``/proc/self/status`` three times: ``VmRSS`` before the base model loads, and ``VmHWM`` (the
resident set's high-water mark) after the model is loaded (and sharded, across ranks) and at the
end of training. Before the first reading it resets the high-water mark to the current resident
set (``/proc/self/clear_refs``, value ``5``) when the kernel allows it, so the marks count this
training only, not what the process held before (a worker's earlier trainings); ``peak_reset``
says whether it could. The figures:

- ``base_load_peak_bytes``: ``VmHWM`` after loading minus ``VmRSS`` before: the most memory the
  base weights (and the LoRA) took while loading;
- ``training_peak_bytes``: ``VmHWM`` at the end minus ``VmRSS`` before: the most the whole
  training took on top of what the process held before it (weights, gathered units, activations,
  optimizer state).

Across ranks every figure is the largest of any rank's (:func:`reduce_max`). Without
``/proc/self/status`` (not Linux) the figures are None.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
FIGURES = (
    "rss_before_load_bytes",
    "hwm_after_load_bytes",
    "hwm_end_bytes",
    "base_load_peak_bytes",
    "training_peak_bytes",
)


def read_status(path: Path = STATUS) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of a ``/proc/<pid>/status`` file in bytes ({} when unreadable)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number, _, unit = rest.strip().partition(" ")
            values[key] = int(number) * (1024 if unit.strip() == "kB" else 1)
    return values


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current resident set; whether the kernel allowed it."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@dataclass
class MemoryMarks:
    """One process's readings over one training."""

    peak_reset: bool = False
    rss_before_load: int | None = None
    hwm_after_load: int | None = None
    hwm_end: int | None = None

    @classmethod
    def before_load(cls) -> MemoryMarks:
        """Reset the high-water mark, then read the resident set (before the base model loads)."""
        reset = reset_peak()
        return cls(peak_reset=reset, rss_before_load=read_status().get("VmRSS"))

    def loaded(self) -> None:
        """The high-water mark once the model is loaded (and sharded)."""
        self.hwm_after_load = read_status().get("VmHWM")

    def ended(self) -> None:
        """The high-water mark at the end of training."""
        self.hwm_end = read_status().get("VmHWM")

    def figures(self) -> dict[str, int | None]:
        """This process's figures (:data:`FIGURES`)."""
        before = self.rss_before_load

        def above(mark: int | None) -> int | None:
            return mark - before if mark is not None and before is not None else None

        return {
            "rss_before_load_bytes": before,
            "hwm_after_load_bytes": self.hwm_after_load,
            "hwm_end_bytes": self.hwm_end,
            "base_load_peak_bytes": above(self.hwm_after_load),
            "training_peak_bytes": above(self.hwm_end),
        }


def process_memory(marks: MemoryMarks | None, ranks: Any) -> dict[str, Any] | None:
    """The receipt's ``runtime.process_memory``: :meth:`MemoryMarks.figures`, each the largest of
    any rank's across ranks (every rank calls it), or None when nothing was measured."""
    if marks is None:
        return None
    figures = marks.figures()
    reset = marks.peak_reset
    if ranks is not None:
        figures, reset = reduce_max(figures, reset, ranks)
    return {"source": "/proc/self/status", "over": "max over ranks", "peak_reset": reset, **figures}


def reduce_max(figures: dict[str, int | None], reset: bool, ranks: Any) -> tuple[dict[str, int | None], bool]:
    """Each figure's largest value over the ranks (None if any rank lacks it); ``peak_reset``
    only if every rank could reset."""
    import torch
    import torch.distributed as dist

    missing = -1
    values = [missing if figures[k] is None else int(figures[k] or 0) for k in FIGURES]
    flags = torch.tensor([missing in values, not reset], dtype=torch.int64, device=ranks._device())
    tensor = torch.tensor(values, dtype=torch.int64, device=flags.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if int(flags[0]):
        return {k: None for k in FIGURES}, not bool(int(flags[1]))
    return dict(zip(FIGURES, (int(v) for v in tensor.tolist()))), not bool(int(flags[1]))
