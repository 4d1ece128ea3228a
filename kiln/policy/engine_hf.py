"""The ``hf`` engine: Kiln's batch-invariant sampler (:mod:`kiln.policy.sampling`) behind the port.

It runs in the worker process on the :class:`kiln.policy.runtime.PolicyRuntime`'s own model and
adapter LRU, under the runtime's lock (adapters switch in place, so one call at a time). It
decodes the rows of a call ``decode_tile`` at a time (``KILN_HF_DECODE_TILE``); a row's ids and
log-probs depend only on its prompt, seed, settings, adapter and the tile size, never on which
rows share its call, so splitting a call into runs of rows with equal settings changes no byte.
This is the reference engine: byte-reproducible on one machine and configuration.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from kiln.policy.engine import DEFAULT_DECODE_TILE, AdapterHandle, Generation, GenerationRequest
from kiln.policy.sampling import sample_batch

if TYPE_CHECKING:  # pragma: no cover
    from kiln.policy.runtime import PolicyRuntime


class HfEngine:
    """The in-process engine of a :class:`PolicyRuntime` (see the module docstring)."""

    name = "hf"
    concurrent = False

    def __init__(self, runtime: "PolicyRuntime", decode_tile: int = DEFAULT_DECODE_TILE) -> None:
        if decode_tile < 1:
            raise ValueError("decode_tile must be at least 1")
        self._runtime = runtime
        self.decode_tile = decode_tile

    def identity(self) -> dict[str, Any]:
        import kiln

        return {"name": self.name, "version": kiln.__version__, "decode_tile": self.decode_tile}

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        out: list[Generation | None] = [None] * len(requests)
        for indices in _runs_of_equal_settings(requests):
            first = requests[indices[0]]
            if first.top_p != 1.0:
                raise ValueError("the hf engine samples the full distribution: top_p must be 1.0")
            extra = {}
            if first.grammar is not None:
                extra["constraints"] = [first.grammar.row(thinking=first.thinking) for _ in indices]
            adapter = first.adapter
            rt = self._runtime
            with rt.lock, rt._activate(*((adapter.path, adapter.sha256) if adapter is not None else (None,))):
                samples = sample_batch(
                    rt.model,
                    [list(requests[i].prompt_ids) for i in indices],
                    [requests[i].seed for i in indices],
                    max_new_tokens=first.max_tokens,
                    temperature=first.temperature,
                    stop_id=first.stop_id,
                    think_close_id=first.think_close_id,
                    think_budget=first.budget,
                    device=rt.device,
                    tile=self.decode_tile,
                    **extra,
                )
            for i, sample in zip(indices, samples):
                out[i] = Generation(
                    ids=sample.ids, logprobs=sample.logprobs, finished=sample.finished,
                    adapter_sha256=adapter.sha256 if adapter is not None else None,
                )
        return [g for g in out if g is not None]

    def load_adapter(self, adapter: AdapterHandle) -> None:
        rt = self._runtime
        with rt.lock, rt._activate(adapter.path, adapter.sha256):
            pass

    def unload_adapter(self, sha256: str) -> None:
        self._runtime._forget_adapter(sha256)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._runtime.lock:
            yield

    def close(self) -> None:
        return None


def _settings_key(req: GenerationRequest) -> tuple:
    return (
        req.adapter, req.max_tokens, req.temperature, req.top_p, req.stop_id, req.think_close_id,
        req.budget, req.thinking, id(req.grammar) if req.grammar is not None else None,
    )


def _runs_of_equal_settings(requests: Sequence[GenerationRequest]) -> list[list[int]]:
    """Indices of requests grouped by identical settings (first-seen order; one call per group)."""
    groups: dict[tuple, list[int]] = {}
    for i, req in enumerate(requests):
        groups.setdefault(_settings_key(req), []).append(i)
    return list(groups.values())


__all__ = ["HfEngine"]
