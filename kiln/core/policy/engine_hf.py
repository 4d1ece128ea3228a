"""The ``hf`` engine: Kiln's batch-invariant sampler (:mod:`kiln.core.policy.sampling`) behind the port.

It runs in the worker process on the :class:`kiln.core.policy.runtime.PolicyRuntime`'s own model and
adapter LRU. It decodes rows ``decode_tile`` at a time (``KILN_HF_DECODE_TILE``); a row's ids and
log-probs depend only on its prompt, seed, settings, adapter and the tile size, never on which
rows share its forward. That is what lets the engine batch **across calls**: the rows of every
``generate`` call in flight with the same adapter (concurrent collection activities, evaluation)
join one decode loop, each taking a free slot of the tile as soon as one opens, and no byte
changes. One thread drives the loop at a time, under the runtime's lock with the adapter active
(adapters switch in place); calls with another adapter or tile wait until it ends (so a caller
must not hold the runtime's lock itself while another thread may drive). A request may name its
tile (a run is served at the tile its behaviour identity names), else the engine's own. This is
the reference engine: byte-reproducible on one machine and configuration.

A hybrid model (linear-attention, Mamba or convolution layers) is prefilled in canonical chunks
and each adapter's row states at chunk boundaries are kept, so a multi-turn episode's later turns
prefill only what was appended (:mod:`kiln.core.policy.prefix_states`; ``prefill_chunk`` joins the
identity, ``prefill_figures`` counts the tokens). An exception from inside the model's forward is
a non-retryable ``model_fault`` (:mod:`kiln.core.policy.faults`).
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from kiln.core.policy.engine import DEFAULT_DECODE_TILE, AdapterHandle, Generation, GenerationRequest, request_tag
from kiln.core.policy.sampling import RowSpec, Sample, decode_rows

if TYPE_CHECKING:  # pragma: no cover
    from kiln.core.policy.runtime import PolicyRuntime


class _Call:
    """The rows of one ``generate`` call that share an adapter and a tile, and what became of them."""

    def __init__(self, loop: tuple[AdapterHandle | None, int], specs: list[RowSpec]) -> None:
        self.tag = request_tag.get()  # who the rows belong to (the run), for the batching figures
        self.loop = loop  # the adapter and decode tile its rows are decoded with
        self.specs = specs
        self.taken = 0
        self.samples: list[Sample | None] = [None] * len(specs)
        self.left = len(specs)
        self.error: BaseException | None = None


class _Feed:
    """The decode loop's view of the waiting calls with the driver's adapter and tile (FIFO)."""

    def __init__(self, engine: "HfEngine", loop: tuple[AdapterHandle | None, int]) -> None:
        self.engine, self.loop = engine, loop

    def next_row(self) -> tuple[Any, RowSpec] | None:
        with self.engine._cond:
            for call in self.engine._waiting:
                if call.loop == self.loop and call.error is None and call.taken < len(call.specs):
                    call.taken += 1
                    return (call, call.taken - 1), call.specs[call.taken - 1]
        return None

    def row_done(self, key: Any, sample: Sample) -> None:
        call, i = key
        with self.engine._cond:
            call.samples[i] = sample
            call.left -= 1
            if call.left == 0:
                self.engine._waiting.remove(call)
                self.engine._cond.notify_all()

    def stepped(self, keys: list[Any]) -> None:
        calls = {id(call): call for call, _ in keys}
        figures = self.engine.batching
        figures["forwards"] += 1
        figures["rows"] += len(keys)
        figures["forwards_with_several_calls"] += int(len(calls) > 1)
        figures["forwards_with_several_tags"] += int(len({c.tag for c in calls.values()}) > 1)


class HfEngine:
    """The in-process engine of a :class:`PolicyRuntime` (see the module docstring)."""

    name = "hf"
    concurrent = True  # concurrent calls join one decode loop (see the module docstring)

    def __init__(
        self,
        runtime: "PolicyRuntime",
        decode_tile: int = DEFAULT_DECODE_TILE,
        prefill_chunk: int | None = None,
        kept_states: int | None = None,
    ) -> None:
        from kiln.core.policy.prefix_states import KEPT_STATES, PREFILL_CHUNK, is_hybrid

        if decode_tile < 1:
            raise ValueError("decode_tile must be at least 1")
        self._runtime = runtime
        self.decode_tile = decode_tile
        # A hybrid model is prefilled in canonical chunks, and each adapter's row states at chunk
        # boundaries are kept for the next turn (kiln.core.policy.prefix_states); None for dense models.
        self.prefill_chunk = (prefill_chunk or PREFILL_CHUNK) if is_hybrid(runtime.model) else None
        self.kept_states = KEPT_STATES if kept_states is None else kept_states  # per adapter; speed only
        self._states: dict[str | None, Any] = {}
        self._cond = threading.Condition()
        self._waiting: deque[_Call] = deque()
        self._driving = False
        # Decode forwards so far, the rows they ran, and how many mixed the rows of several calls /
        # of several request tags (runs): the evidence that concurrent callers share batches.
        self.batching = {"forwards": 0, "rows": 0, "forwards_with_several_calls": 0, "forwards_with_several_tags": 0}

    @property
    def batch_invariant(self) -> bool:
        """A row's ids and log-probs do not depend on which rows share its tile, for this model
        (:func:`kiln.core.policy.row_attention.batch_invariant`); at a fixed tile, on one machine and
        configuration. Not part of the identity (it follows from the engine, tile and model)."""
        from kiln.core.policy.row_attention import batch_invariant

        return batch_invariant(self._runtime.model.config)

    def identity(self) -> dict[str, Any]:
        import kiln

        fields: dict[str, Any] = {"name": self.name, "version": kiln.__version__, "decode_tile": self.decode_tile}
        if self.prefill_chunk is not None:
            fields["prefill_chunk"] = self.prefill_chunk  # a hybrid model's bytes depend on it
        return fields

    @property
    def prefill_figures(self) -> dict[str, int]:
        """Prompt tokens prefilled so far, and those taken from kept row states instead (hybrid
        models: multi-turn state reuse); zeros for a dense model."""
        out = {"prefill_tokens": 0, "prefill_tokens_reused": 0}
        for states in self._states.values():
            for key in out:
                out[key] += states.figures[key]
        return out

    def _states_for(self, adapter: AdapterHandle | None) -> Any:
        from kiln.core.policy.prefix_states import PrefixStates

        if self.prefill_chunk is None:
            return None
        key = adapter.sha256 if adapter is not None else None
        if key not in self._states:
            self._states[key] = PrefixStates(self.kept_states)
        return self._states[key]

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        by_loop: dict[tuple[AdapterHandle | None, int], list[int]] = {}
        for i, req in enumerate(requests):
            if req.top_p != 1.0:
                raise ValueError("the hf engine samples the full distribution: top_p must be 1.0")
            by_loop.setdefault((req.adapter, req.decode_tile or self.decode_tile), []).append(i)
        out: list[Generation | None] = [None] * len(requests)
        for (adapter, tile), indices in by_loop.items():
            call = _Call((adapter, tile), [_spec(requests[i]) for i in indices])
            self._serve(call)
            for i, sample in zip(indices, call.samples):
                assert sample is not None
                out[i] = Generation(
                    ids=sample.ids,
                    logprobs=sample.logprobs,
                    finished=sample.finished,
                    adapter_sha256=adapter.sha256 if adapter is not None else None,
                )
        return [g for g in out if g is not None]

    def _serve(self, call: _Call) -> None:
        """Queue ``call`` and wait for its rows; drive the decode loop when nobody else does."""
        with self._cond:
            self._waiting.append(call)
            while call.left and call.error is None and self._driving:
                self._cond.wait()
            if call.error is not None:
                raise call.error
            if not call.left:
                return
            self._driving = True
        try:
            rt = self._runtime
            adapter, tile = call.loop
            with rt.lock, rt._activate(*((adapter.path, adapter.sha256) if adapter is not None else (None,))):
                decode_rows(
                    rt.model,
                    _Feed(self, call.loop),
                    tile=tile,
                    device=rt.device,
                    prefill_chunk=self.prefill_chunk,
                    states=self._states_for(adapter),
                )
        except BaseException as exc:
            with self._cond:  # the calls whose rows were in the loop fail with it; queued ones wait on
                for failed in [c for c in self._waiting if c is call or (c.loop == call.loop and c.taken)]:
                    failed.error = exc
                    self._waiting.remove(failed)
            raise
        finally:
            with self._cond:
                self._driving = False
                self._cond.notify_all()

    def load_adapter(self, adapter: AdapterHandle) -> None:
        rt = self._runtime
        with rt.lock, rt._activate(adapter.path, adapter.sha256):
            pass

    def unload_adapter(self, sha256: str) -> None:
        self._runtime._forget_adapter(sha256)
        self._states.pop(sha256, None)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._runtime.lock:
            yield

    def close(self) -> None:
        return None


def _spec(req: GenerationRequest) -> RowSpec:
    return RowSpec(
        prompt=tuple(req.prompt_ids),
        seed=req.seed,
        max_new_tokens=req.max_tokens,
        temperature=req.temperature,
        stop_id=req.stop_id,
        think_close_id=req.think_close_id,
        budget=req.budget,
        constraint=req.grammar.row(thinking=req.thinking) if req.grammar is not None else None,
        extra_stop_ids=tuple(req.extra_stop_ids),
    )


__all__ = ["HfEngine"]
