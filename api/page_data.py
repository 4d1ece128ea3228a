"""The run page's data: live metric events and a pageable table of sampled episodes.

Episodes come from the run's published ``rollouts.jsonl`` (reasoning and action text per turn)
and ``replay.json`` (observation and reward per turn), both verified against the manifest.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kiln.core.canonical import compact_json

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
MAX_CELL_CHARS = 2000


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else compact_json(value).decode("utf-8")
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 1] + "…"


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, action) of one assistant turn: ``<think>…</think>`` is the reasoning."""
    reasoning = "\n".join(part.strip() for part in _THINK.findall(text))
    return reasoning, _THINK.sub("", text).strip()


def episode_rows(rollouts: bytes, replay: bytes) -> list[dict[str, Any]]:
    """One row per episode: group, candidate, seed, the reset observation, return, termination,
    and its turns in the order they happened (reasoning, action, then the observation and reward
    the action got)."""
    lines = [json.loads(line) for line in rollouts.splitlines() if line.strip()]
    groups = json.loads(replay)["groups"]
    rows: list[dict[str, Any]] = []
    for line, group in zip(lines, groups):
        for completion, candidate in zip(line["completions"], group["candidates"]):
            actions = [seg["content"] for seg in completion["trajectory"] if seg["kind"] == "action"]
            turns = []
            for index, exchange in enumerate(candidate["exchanges"]):
                reasoning, action = split_reasoning(actions[index]) if index < len(actions) else ("", "")
                result = exchange["result"]
                wire = result.get("observation") or {}
                turns.append(
                    {
                        "turn": index + 1,
                        "observation": _cell(wire.get("observation", result.get("error"))),
                        "reasoning": _cell(reasoning),
                        "action": _cell(exchange.get("action") if exchange.get("action") is not None else action),
                        "reward": wire.get("reward") if result["kind"] == "observation" else None,
                    }
                )
            # A candidate's own reset (warn-mode reset determinism) wins over the group's.
            reset = candidate.get("reset_observation") or group.get("reset_observation") or {}
            rows.append(
                {
                    "group_index": group["group_index"],
                    "candidate_index": candidate["candidate_index"],
                    "seed": group["seed"],
                    "reset_observation": _cell(reset.get("observation", reset)),
                    "episode_return": candidate["episode_return"],
                    "termination": candidate["termination"],
                    "turns": turns,
                }
            )
    return rows


def page(rows: list[dict[str, Any]], offset: int, limit: int) -> dict[str, Any]:
    return {"total": len(rows), "offset": offset, "limit": limit, "episodes": rows[offset : offset + limit]}
