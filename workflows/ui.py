"""What the Temporal Web UI shows of a run: static summary, live current details, outcome memo.

Pure helpers (no I/O): ``start_summary``/``start_details`` are computed by whoever starts a run
(the API); ``show_progress`` and ``record_outcome`` are called from workflow code.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

OUTCOME_MEMO_PATCH = "kiln-outcome-memo-v1"


def start_summary(kind: str, environment: str, adapter: str | None) -> str:
    """One line for the workflow list: kind, environment, adapter."""
    target = f" → {adapter}" if adapter else ""
    return f"{kind} on {environment}{target}"


def start_details(request: dict[str, Any]) -> str:
    """Markdown shown on the workflow page: the request's shape (no secrets: ids only)."""
    lines = [
        f"**kind** {request.get('kind')}",
        f"**environments** {', '.join(request.get('environment_urls') or [])}",
        f"**adapter** {request.get('adapter') or 'base'} → **output** {request.get('output_adapter') or '-'}",
        f"**groups** {request.get('groups')} × {request.get('group_size')} seeds from {request.get('seed_start')}",
    ]
    if request.get("report_to") not in (None, "none"):
        lines.append(f"**report_to** {request['report_to']}")
    return "  \n".join(lines)


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def show_progress(status: dict[str, Any]) -> None:
    """``current_details``: the live phase and progress (Markdown)."""
    progress = status.get("progress") or {}
    parts = [f"**phase** {status.get('phase')}"]
    if progress.get("groups_total"):
        parts.append(f"**groups** {progress.get('groups_completed', 0)}/{progress['groups_total']}")
        parts.append(f"**rollouts** {progress.get('rollouts_completed', 0)}/{progress.get('rollouts_total', 0)}")
    if status.get("mean_return") is not None:
        parts.append(f"**mean return** {_number(status['mean_return'])}")
    workflow.set_current_details(" · ".join(parts))


def record_outcome(status: dict[str, Any]) -> None:
    """Memo the outcome (state, mean return, promoted) so list views show results."""
    show_progress(status)
    if workflow.patched(OUTCOME_MEMO_PATCH):
        workflow.upsert_memo(
            {
                "state": status.get("state"),
                "mean_return": status.get("mean_return"),
                "promoted": status.get("promoted"),
            }
        )
