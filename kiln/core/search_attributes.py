"""Kiln's Temporal search attributes: one list, used by the workflows, the dev server and workers."""

from __future__ import annotations

PHASE = "KilnPhase"
STATUS = "KilnStatus"
ENVIRONMENT = "KilnEnvironment"
OUTPUT_ADAPTER = "KilnOutputAdapter"
RUN_KIND = "KilnRunKind"

SEARCH_ATTRIBUTES: dict[str, str] = {
    PHASE: "Keyword",
    STATUS: "Keyword",
    ENVIRONMENT: "Keyword",
    OUTPUT_ADAPTER: "Keyword",
    RUN_KIND: "Keyword",
}
