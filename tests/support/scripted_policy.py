"""A model-free ``PolicyPort`` for collector tests: each candidate's turns come from a script.

Tokens are code points (``</think>`` is one token, ``<|im_end|>`` the stop token), so decoding is
exact and the collector's real bookkeeping (pieces, trajectory, harness codes) runs unchanged.
A script's turn text is looked up by the generation seed the collector derives from
``(group seed, candidate, step)``; a candidate listed in ``unfinished`` never emits the stop token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.rollout.seeds import generation_seed

STOP, THINK = 1_000_000, 1_000_001


@dataclass
class ScriptedSample:
    ids: list[int]
    logprobs: list[float]
    finished: bool


class ScriptedPolicy:
    """Turn texts ``scripts[candidate][step]`` for the groups seeded ``group_seeds``."""

    def __init__(
        self, scripts: dict[int, list[str]], group_seeds: list[int], *, unfinished: frozenset[int] = frozenset()
    ) -> None:
        self.scripts = scripts
        self.unfinished = unfinished
        self.by_seed = {
            generation_seed(seed, c, s): (c, s)
            for seed in group_seeds
            for c, script in scripts.items()
            for s in range(len(script))
        }

    def identity(self, adapter_dir: Path | None = None) -> dict[str, Any]:
        return {"base_model_sha256": "sha256:" + "ab" * 32, "runtime": {"kind": "scripted"}, "adapter_sha256": None}

    def _ids(self, text: str) -> list[int]:
        out: list[int] = []
        for part_index, part in enumerate(text.split("</think>")):
            if part_index:
                out.append(THINK)
            out.extend(ord(ch) for ch in part)
        return out

    def encode_prompt(self, messages, *, thinking):
        return self._ids("".join(m["content"] for m in messages))

    def encode_observation_turn(self, content, *, thinking):
        return [10], self._ids(content), [10]

    def sample(self, prompts, seeds, **_kwargs):
        out = []
        for seed in seeds:
            c, s = self.by_seed[seed]
            finished = c not in self.unfinished
            ids = self._ids(self.scripts[c][s]) + ([STOP] if finished else [])
            out.append(ScriptedSample(ids, [-0.5] * len(ids), finished))
        return out

    def decode(self, ids):
        return "".join("</think>" if i == THINK else "<|im_end|>" if i == STOP else chr(i) for i in ids)

    def split_action(self, ids, *, thinking):
        ids = list(ids)
        if ids and ids[-1] == STOP:
            ids = ids[:-1]
        if not thinking:
            return "", self.decode(ids).strip()
        if THINK not in ids:
            return self.decode(ids), None
        cut = ids.index(THINK)
        return self.decode(ids[:cut]), self.decode(ids[cut + 1 :]).strip()


class FixedActionPolicy(ScriptedPolicy):
    """Every turn of every candidate of every group is ``text``: a policy for any seed, at no
    model cost (the history-bound test runs thousands of real episodes with it)."""

    device, dtype = "cpu", "float32"  # what the gpu worker's trainer reads of its runtime

    def __init__(self, text: str) -> None:
        super().__init__({}, [])
        self.text = text

    def resolve_thinking(self, mode: object) -> bool:
        return mode is True or mode == "on"  # "auto": this tokenizer has no thinking template

    def sample(self, prompts, seeds, **_kwargs):
        ids = self._ids(self.text) + [STOP]
        return [ScriptedSample(list(ids), [-0.5] * len(ids), True) for _ in seeds]
