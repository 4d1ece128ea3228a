"""What the collector needs from a policy: the port ``kiln.core.policy.runtime.PolicyRuntime`` fills.

Kept as a Protocol so ``kiln.core.rollout`` never imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence


class SampleLike(Protocol):
    ids: list[int]
    logprobs: list[float]
    finished: bool


class PolicyPort(Protocol):
    """``identity`` and ``sample`` take ``decode_tile`` (the hf engine's tile a run was admitted
    at) only when the run's identity names one (:func:`kiln.core.policy.engine.decode_tile_of`)."""

    def identity(self, adapter_dir: Path | None = None) -> dict[str, Any]: ...

    def encode_prompt(self, messages: list[dict[str, Any]], *, thinking: bool) -> list[int]: ...

    def encode_observation_turn(self, content: str, *, thinking: bool) -> tuple[list[int], list[int], list[int]]: ...

    def sample(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        adapter_dir: Path | None = None,
        stop_after_think_budget: int | None = None,
        thinking: bool = True,
        action_schema: dict[str, Any] | None = None,
    ) -> Sequence[SampleLike]: ...

    def decode(self, ids: list[int]) -> str: ...

    def split_action(self, ids: list[int], *, thinking: bool) -> tuple[str, str | None]: ...
