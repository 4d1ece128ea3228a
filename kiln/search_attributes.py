"""Kiln's Temporal search attributes: one list, used by the workflows, the dev server and workers."""

from __future__ import annotations

SEARCH_ATTRIBUTES: dict[str, str] = {
    "KilnPhase": "Keyword",
    "KilnStatus": "Keyword",
    "KilnEnvironment": "Keyword",
    "KilnOutputAdapter": "Keyword",
    "KilnRunKind": "Keyword",
}
