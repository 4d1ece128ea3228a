"""The static summary and details a run is started with (what the Temporal Web UI lists)."""

from __future__ import annotations

from typing import Any


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
