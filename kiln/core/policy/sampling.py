"""Seeded, batch-invariant KV-cache sampling with exact behaviour log-probs (torch).

**Batch-invariant:** a row's ids *and* log-probs are bit-identical whichever rows share the call
(a wave of 1 on a 1-session server, a group of 8 in one call, any order, rows of concurrent
calls joining through a :class:`RowFeed`):

* every row's prompt gets one unpadded prefill forward of its own (consecutive rows with the same
  prompt, e.g. a group's candidates on their first turn, share it: decoding never writes into the
  prefilled cache);
* the rows are then decoded in the slots of a tile of ``tile`` rows: one forward of ``(tile, 1)``
  tokens per step, ``position_ids`` continuing each row's prompt. A row takes a free slot with its
  prefilled cache and frees it when it ends; idle slots compute a dummy token nobody reads, so
  every decode forward has exactly ``tile`` rows;
* attention runs per row on the row's own keys and values, every other layer kind (linear
  attention, Mamba, convolution) keeps each row's own states, and a mixture-of-experts layer runs
  each row's token alone (:mod:`kiln.core.policy.row_attention`).

Batched matrix kernels round a row differently for different row counts, but with the count fixed
a row's result depends only on the row, not on its tile-mates or its slot. So a row's bytes depend
on its prompt, its seed, the model/adapter, the placement and the tile size. A tile of 1 is one
batch-of-one forward per token. Each row owns a ``torch.Generator`` seeded with its u64 seed; all
the uniforms a row may need are drawn up front (one call per row, none per token) and a token is
picked by inverse-CDF sampling.

Temperature 0 means greedy; its recorded log-probs are those of the untempered (temperature 1)
distribution, and :func:`completion_logprobs` follows the same rule.

Optional constrained decoding (``constraints=``, one :class:`kiln.core.policy.constrained.RowConstraint`
or None per row): at each step the logits of a row whose constraint is active are masked (``-inf``)
to the tokens its grammar allows *before* the log-softmax, so the token is drawn from the masked,
renormalised distribution and its recorded log-prob is the log-prob under that distribution;
every produced token is then fed to the row's constraint. ``completion_logprobs(constraint=...)``
applies the same masks teacher-forced. Without constraints nothing changes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kiln.core.policy.engine import DEFAULT_DECODE_TILE
from kiln.core.policy.faults import model_forward

if TYPE_CHECKING:  # imported where used: the constrained path loads xgrammar
    from kiln.core.policy.constrained import RowConstraint

U64 = 1 << 64


@dataclass
class Sample:
    """One sampled completion."""

    ids: list[int]  # generated ids, including the stop token when produced
    logprobs: list[float]  # behaviour log-prob of each id under the sampling distribution used
    finished: bool  # the stop token was produced within the limits


def torch_seed(seed: int) -> int:
    """Map any integer seed deterministically into ``torch.Generator.manual_seed``'s u64 range."""
    return int(seed) % U64


def cache_kwarg(model) -> str:
    """The forward kwarg carrying the KV cache (``cache`` in transformers 5.24, else the old name)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def _check_inputs(prompts, seeds, constraints, temperature) -> bool:
    """Raise ValueError on malformed inputs; False when there is nothing to sample."""
    if len(prompts) != len(seeds):
        raise ValueError("prompts and seeds must have the same length")
    if constraints is not None and len(constraints) != len(prompts):
        raise ValueError("constraints and prompts must have the same length")
    if not prompts:
        return False
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    return True


def _row_uniforms(seed: int, steps: int, device) -> torch.Tensor:
    """All the uniforms one row may need, one seeded generator call (float64, shape ``(1, steps)``)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(torch_seed(seed))
    return torch.rand(steps, generator=gen, dtype=torch.float64).unsqueeze(0).to(device)


def _prefill(model, prompt: list[int], device):
    """One unpadded forward over ``prompt`` (batch of 1): ``(cache, last_logits)``."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    positions = torch.arange(len(prompt), dtype=torch.long, device=device).unsqueeze(0)
    with model_forward(model):
        out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1)
    return _out_cache(out), out.logits[:, -1, :]


def _pick(lp: torch.Tensor, uniforms: torch.Tensor | None, t: int) -> torch.Tensor:
    """Greedy (no uniforms) or inverse-CDF sampling with the row's t-th uniform."""
    if uniforms is None:
        return lp.argmax(dim=-1)
    cdf = lp.double().exp().cumsum(dim=-1)
    u = uniforms[:, t : t + 1] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


@dataclass(frozen=True)
class RowSpec:
    """One row to sample and the settings it is sampled with."""

    prompt: tuple[int, ...]
    seed: int
    max_new_tokens: int
    temperature: float
    stop_id: int
    think_close_id: int | None = None
    budget: int | None = None  # stop a row that has not closed its thinking after this many tokens
    constraint: RowConstraint | None = None
    extra_stop_ids: tuple[int, ...] = ()  # more ids that end the row (harmony's <|call|>)


class RowFeed(Protocol):
    """Where :func:`decode_rows` takes rows from and hands their samples to."""

    def next_row(self) -> tuple[Any, RowSpec] | None:
        """The next row waiting to be decoded (a key and its spec), None when none waits now."""
        ...

    def row_done(self, key: Any, sample: Sample) -> None:
        """The row of ``key`` has ended with ``sample``."""
        ...

    def stepped(self, keys: list[Any]) -> None:
        """One decode forward ran the rows of ``keys``."""
        ...


@dataclass
class _Row:
    """One row being decoded: its spec, what it produced so far and its last logits."""

    key: Any
    spec: RowSpec
    uniforms: torch.Tensor | None
    logits: torch.Tensor
    ids: list[int]
    lps: list[torch.Tensor]
    closed: bool = False


def _step(row: _Row, device: str) -> Sample | None:
    """Pick the row's next token from its logits; the row's Sample when it has ended."""
    spec = row.spec
    logits = row.logits
    allowed = _allowed(spec.constraint, logits.shape[-1], device) if spec.constraint is not None else None
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    lp = _log_probs(logits, spec.temperature)
    tok = _pick(lp, row.uniforms, len(row.ids))
    if allowed is not None:
        tok = _keep_allowed(tok, allowed)
    token = int(tok.item())
    if spec.constraint is not None and not spec.constraint.advance(token):
        raise RuntimeError(f"the sampled token {token} was rejected by its row's grammar")
    row.ids.append(token)
    row.lps.append(lp[0, token])
    finished = token == spec.stop_id or token in spec.extra_stop_ids
    row.closed = row.closed or token == spec.think_close_id
    over_budget = spec.budget is not None and not row.closed and len(row.ids) >= spec.budget
    if finished or len(row.ids) == spec.max_new_tokens or over_budget:
        return Sample(ids=row.ids, logprobs=torch.stack(row.lps).cpu().tolist(), finished=finished)
    return None


@torch.inference_mode()
def decode_rows(
    model, feed: RowFeed, *, tile: int, device: str = "cpu", prefill_chunk: int | None = None, states: Any = None
) -> None:
    """Decode every row ``feed`` gives, in the slots of one tile: one ``(tile, 1)`` forward per step.

    A row enters a free slot with its prefilled cache (consecutive rows with the same prompt share
    one prefill) and leaves it when it ends; the next waiting row takes the slot, so rows the feed
    receives while others decode join them. Idle slots compute a dummy token nobody reads.
    Returns when no row is live and the feed has none waiting.

    A hybrid model (linear-attention, Mamba or convolution layers) is prefilled in canonical chunks
    of ``prefill_chunk`` tokens (default :data:`kiln.core.policy.prefix_states.PREFILL_CHUNK`), starting
    from the longest prefix kept in ``states`` (a :class:`kiln.core.policy.prefix_states.PrefixStates`);
    the bytes are the same with or without ``states``.
    """
    from kiln.core.policy.prefix_states import PREFILL_CHUNK, chunked_prefill, is_hybrid
    from kiln.core.policy.row_attention import RowCache, rows_forward

    kw = cache_kwarg(model)
    chunk = (prefill_chunk or PREFILL_CHUNK) if is_hybrid(model) else None

    def prefill(prompt: tuple[int, ...]):
        if chunk is None:
            return _prefill(model, list(prompt), device)
        return chunked_prefill(model, prompt, device, chunk, states, kw)

    slots: list[_Row | None] = [None] * tile
    cache = RowCache(model, tile)
    shared: tuple[tuple[int, ...], tuple] | None = None  # the last prompt's prefill
    while True:
        for s in range(tile):
            while slots[s] is None and (taken := feed.next_row()) is not None:
                key, spec = taken
                if spec.max_new_tokens <= 0:
                    feed.row_done(key, Sample(ids=[], logprobs=[], finished=False))
                    continue
                if shared is None or shared[0] != spec.prompt:
                    shared = (spec.prompt, prefill(spec.prompt))
                prefilled, logits = shared[1]
                uniforms = _row_uniforms(spec.seed, spec.max_new_tokens, device) if spec.temperature > 0 else None
                row = _Row(key, spec, uniforms, logits, [], [])
                sample = _step(row, device)
                if sample is not None:
                    feed.row_done(key, sample)
                    continue
                slots[s] = row
                cache.place(s, prefilled)  # decoding appends to the row's own copies, never in place
        live = [(s, row) for s, row in enumerate(slots) if row is not None]
        if not live:
            return
        tokens = [row.ids[-1] if row is not None else 0 for row in slots]
        positions = [len(row.spec.prompt) + len(row.ids) - 1 if row is not None else 0 for row in slots]
        with model_forward(model):
            logits = rows_forward(
                model,
                cache,
                kw,
                torch.tensor(tokens, dtype=torch.long, device=device).view(tile, 1),
                torch.tensor(positions, dtype=torch.long, device=device).view(tile, 1),
            ).logits[:, -1, :]
        feed.stepped([row.key for _, row in live])
        for s, row in live:
            row.logits = logits[s : s + 1].clone()  # a row of its own, as a batch of one's logits are
            sample = _step(row, device)
            if sample is not None:
                feed.row_done(row.key, sample)
                slots[s] = None
                cache.free(s)


class _ListFeed:
    """The rows of one :func:`sample_batch` call, in order; their samples by index."""

    def __init__(self, specs: list[RowSpec]) -> None:
        self.specs = specs
        self.next = 0
        self.samples: list[Sample | None] = [None] * len(specs)

    def next_row(self) -> tuple[int, RowSpec] | None:
        if self.next == len(self.specs):
            return None
        self.next += 1
        return self.next - 1, self.specs[self.next - 1]

    def row_done(self, key: int, sample: Sample) -> None:
        self.samples[key] = sample

    def stepped(self, keys: list[Any]) -> None:
        return None


def sample_batch(
    model,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_id: int,
    think_close_id: int | None = None,
    think_budget: int | None = None,
    device: str = "cpu",
    constraints: list | None = None,
    tile: int = DEFAULT_DECODE_TILE,
    prefill_chunk: int | None = None,
    states: Any = None,
) -> list[Sample]:
    """Sample every prompt, ``tile`` rows per decode forward (batch-invariant); see the module
    docstring (``prefill_chunk`` / ``states``: a hybrid model's prefill, :func:`decode_rows`)."""
    if not _check_inputs(prompts, seeds, constraints, temperature):
        return []
    budget = think_budget if (think_budget is not None and think_close_id is not None) else None
    feed = _ListFeed(
        [
            RowSpec(
                tuple(prompt),
                int(seed),
                int(max_new_tokens),
                temperature,
                stop_id,
                think_close_id,
                budget,
                constraints[i] if constraints is not None else None,
            )
            for i, (prompt, seed) in enumerate(zip(prompts, seeds))
        ]
    )
    decode_rows(model, feed, tile=tile, device=device, prefill_chunk=prefill_chunk, states=states)
    return [s for s in feed.samples if s is not None]


def _allowed(constraint, vocab_size: int, device) -> torch.Tensor | None:
    """The ``(1, vocab_size)`` mask of the tokens one row's grammar allows now (None: all)."""
    from kiln.core.policy.constrained import allowed_tokens

    return allowed_tokens([constraint], [True], vocab_size, device)


def _keep_allowed(tok: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Guard the inverse-CDF clamp: a row never gets a masked token (last allowed id instead)."""
    ok = allowed.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    ids = torch.arange(allowed.shape[-1], device=allowed.device)
    last = torch.where(allowed, ids, torch.full_like(ids, -1)).max(dim=-1).values
    return torch.where(ok, tok, last)


@torch.inference_mode()
def completion_logprobs(
    model,
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    temperature: float,
    device: str = "cpu",
    constraint=None,
) -> list[float]:
    """Log-probs of ``completion_ids`` after ``prompt_ids`` in one unpadded forward pass.

    With ``constraint`` (a fresh :class:`kiln.core.policy.constrained.RowConstraint`) each position's
    logits are masked exactly as :func:`sample_batch` masked them; a completion the grammar
    rejects raises ``ValueError``.
    """
    if not completion_ids:
        return []
    if not prompt_ids:
        raise ValueError("empty prompt")
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    n = len(completion_ids)
    with model_forward(model):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=n + 1,
        )
    logits = out.logits[0, :-1, :]
    if constraint is not None:
        masks = []
        for pos, token in enumerate(completion_ids):
            mask = constraint.allowed()
            if mask is not None:
                width = logits.shape[-1]
                if mask.shape[0] < width:
                    mask = torch.cat([mask, torch.zeros(width - mask.shape[0], dtype=torch.bool)])
                masks.append(mask[:width])
            else:
                masks.append(torch.ones(logits.shape[-1], dtype=torch.bool))
            if not constraint.advance(token):
                raise ValueError(f"completion token {token} at position {pos} violates the action grammar")
        allowed = torch.stack(masks).to(logits.device)
        logits = logits.masked_fill(~allowed, float("-inf"))
    lp = _log_probs(logits, temperature)
    target = ids[0, -n:]
    return lp.gather(-1, target.unsqueeze(-1)).squeeze(-1).cpu().tolist()
