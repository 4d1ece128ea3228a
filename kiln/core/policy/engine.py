"""The inference-engine port: the one interface every rollout engine implements (no torch).

An engine turns token ids into token ids. A :class:`GenerationRequest` carries one row: its prompt
ids, its seed, its sampling settings (temperature, top-p, max tokens, stop ids), the thinking
budget, an optional action grammar (a :class:`kiln.core.policy.constrained.ActionGrammar`, whose
tightened schema is the single source of the grammar) and the adapter it is drawn with (a local
PEFT folder and its content digest, None = the base model). A :class:`Generation` is what came
back: the ids, the behaviour log-prob of each id, whether the stop id ended the row, and the digest
of the adapter the engine actually served it with.

Engines never apply a chat template and never re-tokenize: prompts are ids rendered once by
:class:`kiln.core.policy.runtime.PolicyRuntime`, and outputs are ids.

Two engines implement the port:

- ``hf`` (:mod:`kiln.core.policy.engine_hf`): Kiln's batch-invariant sampler in the worker process,
  byte-reproducible (the reference engine, the default);
- ``vllm`` (:mod:`kiln.core.policy.engine_vllm`): a vLLM server process in its own virtual
  environment, spoken to over loopback HTTP, with continuous batching across every request the
  worker has in flight.

Which one a worker uses is the ``KILN_ENGINE`` setting (:class:`kiln.core.settings.Settings`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Protocol, Sequence

EngineName = Literal["hf", "vllm"]

# Who the rows generated in this context belong to (the gpu worker sets the run id):
# a batching engine reports which callers' requests it ran together.
request_tag: ContextVar[str | None] = ContextVar("kiln_engine_request_tag", default=None)
# Which episodes the rows generated in this context belong to (the gpu worker sets one per seed
# group attempt): an engine of several servers sends every turn of them to the same one.
request_route: ContextVar[str | None] = ContextVar("kiln_engine_request_route", default=None)
ENGINE_NAMES: tuple[str, ...] = ("hf", "vllm")
# Rows the hf engine decodes per forward (its tile, :mod:`kiln.core.policy.sampling`). A row's bytes
# depend on the tile size (never on its tile-mates), so it is part of the hf engine's identity.
DEFAULT_DECODE_TILE = 8


@dataclass(frozen=True)
class AdapterHandle:
    """A LoRA adapter as an engine sees it: a local PEFT folder and its content digest."""

    path: Path
    sha256: str


@dataclass(frozen=True)
class GenerationRequest:
    """One row to generate. ``think_close_id`` is the ``</think>`` id (None: no thinking support);
    ``thinking_budget`` stops a row that has not closed its reasoning within that many tokens
    (unfinished, never force-closed); ``grammar`` constrains the final answer, free while
    ``thinking`` and ``</think>`` has not been produced yet."""

    prompt_ids: tuple[int, ...]
    seed: int
    max_tokens: int
    temperature: float
    stop_id: int
    top_p: float = 1.0
    extra_stop_ids: tuple[int, ...] = ()  # more ids that end the row (harmony's <|call|>)
    think_close_id: int | None = None
    thinking_budget: int | None = None
    thinking: bool = False
    grammar: Any = None  # kiln.core.policy.constrained.ActionGrammar (typed loosely: no torch here)
    adapter: AdapterHandle | None = None
    decode_tile: int | None = None  # the hf engine's tile for this row (None: the engine's own)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("empty prompt")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.decode_tile is not None and self.decode_tile < 1:
            raise ValueError("decode_tile must be at least 1")

    @property
    def stop_ids(self) -> list[int]:
        """Every id that ends the row: the stop token, then the extra ones."""
        return [self.stop_id, *self.extra_stop_ids]

    @property
    def budget(self) -> int | None:
        """The thinking budget that applies (only while thinking, with a ``</think>`` token)."""
        if self.thinking and self.think_close_id is not None and self.thinking_budget is not None:
            return int(self.thinking_budget)
        return None


@dataclass
class Generation:
    """One generated row (the ``Sample`` shape collection records)."""

    ids: list[int]  # generated ids, including the stop token when produced
    logprobs: list[float]  # behaviour log-prob of each id under the distribution sampled from
    finished: bool  # the stop token was produced within the limits
    adapter_sha256: str | None = None  # the adapter the engine served this row with (None: base)


class Engine(Protocol):
    """What collection, evaluation and the gpu worker need from a rollout engine."""

    name: str
    # True when many callers may generate at once (the engine batches them itself).
    concurrent: bool

    def identity(self) -> dict[str, Any]:
        """``{"name", "version", …}`` of the engine (see :func:`engine_identity_fields`)."""
        ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Generate every request; the result is in request order."""
        ...

    def load_adapter(self, adapter: AdapterHandle) -> None:
        """Make ``adapter`` servable (hot-loaded by path, never merged into the base)."""
        ...

    def unload_adapter(self, sha256: str) -> None:
        """Forget an adapter (no-op when it is not loaded)."""
        ...

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """No generation runs while the context is held (training on the same device)."""
        ...

    def close(self) -> None:
        """Release the engine's resources (stops an engine process)."""
        ...


def engine_identity_fields(engine: Engine, decode_tile: int | None = None) -> dict[str, Any]:
    """What a behaviour identity's ``runtime`` block adds for ``engine`` (for the hf engine, at
    ``decode_tile``, default its own).

    The ``hf`` engine with a decode tile of 1 adds nothing: it samples exactly as Kiln did before
    the port and the tile existed, so those identities (and their digests) stay valid. Any other
    engine or tile adds ``{"engine": engine.identity()}`` (name, version, and the hf engine's
    ``decode_tile``), so a change of engine, version or tile changes the identity digest."""
    fields = dict(engine.identity())
    if engine.name != "hf":
        return {"engine": fields}
    if decode_tile is not None:
        fields["decode_tile"] = decode_tile
    # (a hybrid model's ``prefill_chunk`` is kept at a tile of 1 too: its identities are new)
    return {} if fields.get("decode_tile") == 1 and "prefill_chunk" not in fields else {"engine": fields}


def decode_tile_of(identity: Mapping[str, Any] | None) -> int | None:
    """The hf decode tile a behaviour identity was sampled at, so a worker serves a run at the tile
    it was admitted with (also one admitted before an upgrade changed the worker's default):
    ``runtime.engine.decode_tile``; 1 for a Kiln runtime block without an engine (identities from
    before the tile, and tile 1); None when the identity names another engine or is not a Kiln
    runtime's (the worker's own setting applies)."""
    runtime = (identity or {}).get("runtime")
    if not isinstance(runtime, Mapping) or "kiln" not in runtime:
        return None
    engine = runtime.get("engine")
    if engine is None:
        return 1
    if isinstance(engine, Mapping) and engine.get("name") == "hf" and isinstance(engine.get("decode_tile"), int):
        return int(engine["decode_tile"])
    return None


__all__ = [
    "AdapterHandle",
    "DEFAULT_DECODE_TILE",
    "ENGINE_NAMES",
    "Engine",
    "EngineName",
    "Generation",
    "GenerationRequest",
    "decode_tile_of",
    "engine_identity_fields",
    "request_route",
    "request_tag",
]
