"""The retained-byte budget: a cap on how many bytes one run may keep in storage.

This module owns the accounting only (pure, no I/O): every artifact a run retains is charged
before it is written, and going over the limit raises
:class:`~kiln.core.errors.RetainedBudgetExceeded` naming the artifact and the limit.
"""

from __future__ import annotations

from kiln.core.errors import RetainedBudgetExceeded

__all__ = ["DEFAULT_RETAINED_LIMIT_BYTES", "RetainedBudget"]

DEFAULT_RETAINED_LIMIT_BYTES = 512 * 1024 * 1024


class RetainedBudget:
    """Counts retained bytes against ``limit_bytes``."""

    def __init__(self, limit_bytes: int = DEFAULT_RETAINED_LIMIT_BYTES) -> None:
        if not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise ValueError(f"limit_bytes must be a non-negative int, got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self.used = 0

    @property
    def remaining(self) -> int:
        return self.limit_bytes - self.used

    def charge(self, n: int, what: str) -> None:
        """Charge ``n`` bytes for ``what``; over the limit nothing is charged and it raises."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"cannot charge {n!r} bytes for {what}")
        if self.used + n > self.limit_bytes:
            raise RetainedBudgetExceeded(
                f"retaining {what} ({n} bytes) would exceed the retained-byte budget of "
                f"{self.limit_bytes} bytes ({self.used} already used)",
                hint="raise the run's retained-byte limit or retain fewer artifacts",
                details={"what": what, "bytes": n, "used": self.used, "limit": self.limit_bytes},
            )
        self.used += n

    def __repr__(self) -> str:
        return f"RetainedBudget(used={self.used}, limit_bytes={self.limit_bytes})"
