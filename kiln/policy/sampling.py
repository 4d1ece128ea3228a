"""Batched, seeded KV-cache sampling loop with exact behaviour log-probs (torch).

One forward pass per generated token for the whole batch: prompts are left-padded, the attention
mask grows with the generated tokens and ``position_ids = (mask.cumsum(-1) - 1).clamp(min=0)``
(the same positions :func:`completion_logprobs` uses, so the recorded log-probs match a single
unpadded forward). Each row owns a ``torch.Generator`` seeded with its u64 seed; all the uniforms
a row may need are drawn up front (one call per row, none per token) and a token is picked by
inverse-CDF sampling, so a row's tokens depend only on its prompt, its seed and the batch
composition (through padding numerics).

Temperature 0 means greedy; its recorded log-probs are those of the untempered (temperature 1)
distribution, and :func:`completion_logprobs` follows the same rule.

Optional constrained decoding (``constraints=``, one :class:`kiln.policy.constrained.RowConstraint`
or None per row): at each step the logits of a row whose constraint is active are masked (``-inf``)
to the tokens its grammar allows *before* the log-softmax, so the token is drawn from the masked,
renormalised distribution and its recorded log-prob is the log-prob under that distribution;
every produced token is then fed to the row's constraint. ``completion_logprobs(constraint=...)``
applies the same masks teacher-forced. Without constraints nothing changes.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

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


def _left_pad(prompts: list[list[int]], pad_id: int, total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids ``(batch, width)`` and the attention mask ``(batch, total)``."""
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, total), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) : width] = 1
    mask[:, width:] = 1
    return input_ids.to(device), mask.to(device)


def _row_uniforms(seeds: list[int], steps: int, device) -> torch.Tensor:
    """All the uniforms each row may need, one seeded generator call per row (float64)."""
    rows = []
    for seed in seeds:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(torch_seed(seed))
        rows.append(torch.rand(steps, generator=gen, dtype=torch.float64))
    return torch.stack(rows).to(device)


def _prefill(model, prompts, input_ids, mask, positions, device):
    """Prefill each distinct prompt once (a group's candidates share their first prompt), then
    expand the KV cache to one row per candidate. Returns ``(cache, last_logits)``."""
    width = input_ids.shape[1]
    first_row: dict[tuple[int, ...], int] = {}
    row_to_unique = [first_row.setdefault(tuple(p), len(first_row)) for p in prompts]
    unique_rows = [row_to_unique.index(u) for u in range(len(first_row))]
    dedup = len(unique_rows) < len(prompts)
    sel = torch.tensor(unique_rows, dtype=torch.long, device=device)
    out = model(
        input_ids=input_ids[sel] if dedup else input_ids,
        attention_mask=mask[sel, :width] if dedup else mask[:, :width],
        position_ids=positions[sel] if dedup else positions,
        use_cache=True,
        logits_to_keep=1,
    )
    cache = _out_cache(out)
    logits = out.logits[:, -1, :]
    if dedup:
        expand = torch.tensor(row_to_unique, dtype=torch.long, device=device)
        cache.reorder_cache(expand)
        logits = logits[expand]
    return cache, logits


def _pick(lp: torch.Tensor, uniforms: torch.Tensor | None, t: int) -> torch.Tensor:
    """Greedy (no uniforms) or inverse-CDF sampling with the row's t-th uniform."""
    if uniforms is None:
        return lp.argmax(dim=-1)
    cdf = lp.double().exp().cumsum(dim=-1)
    u = uniforms[:, t : t + 1] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


class _Rows:
    """Per-row decoding state of one batch (tokens, log-probs, lengths, stop/budget flags)."""

    def __init__(self, batch: int, steps: int, pad_id: int, device) -> None:
        self.tokens = torch.full((batch, steps), pad_id, dtype=torch.long, device=device)
        self.lps = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.closed = torch.zeros(batch, dtype=torch.bool, device=device)

    def samples(self) -> list[Sample]:
        tokens_l = self.tokens.cpu().tolist()
        lps_l = self.lps.cpu().tolist()
        lengths_l = self.lengths.cpu().tolist()
        finished_l = self.finished.cpu().tolist()
        return [
            Sample(ids=tokens_l[i][: lengths_l[i]], logprobs=lps_l[i][: lengths_l[i]], finished=bool(finished_l[i]))
            for i in range(len(tokens_l))
        ]


@torch.inference_mode()
def sample_batch(
    model,
    prompts: list[list[int]],
    seeds: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    stop_id: int,
    pad_id: int,
    think_close_id: int | None = None,
    think_budget: int | None = None,
    device: str = "cpu",
    constraints: list | None = None,
) -> list[Sample]:
    """Sample every prompt in one batch; see the module docstring for the guarantees."""
    if not _check_inputs(prompts, seeds, constraints, temperature):
        return []
    width = max(len(p) for p in prompts)
    input_ids, mask = _left_pad(prompts, pad_id, width + max(int(max_new_tokens), 0), device)
    if max_new_tokens <= 0:
        return [Sample(ids=[], logprobs=[], finished=False) for _ in prompts]
    uniforms = _row_uniforms(seeds, max_new_tokens, device) if temperature > 0 else None
    kw = cache_kwarg(model)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    cache, logits = _prefill(model, prompts, input_ids, mask, positions, device)
    next_pos = positions[:, -1:] + 1
    rows = _Rows(len(prompts), max_new_tokens, pad_id, device)
    budget = think_budget if (think_budget is not None and think_close_id is not None) else None

    for t in range(max_new_tokens):
        allowed = None
        if constraints is not None:
            allowed = _allowed(constraints, rows.done, logits.shape[-1], device)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        lp = _log_probs(logits, temperature)
        tok = _pick(lp, uniforms, t)
        if allowed is not None:
            tok = _keep_allowed(tok, allowed)
        live = ~rows.done
        tok = torch.where(live, tok, torch.full_like(tok, pad_id))
        if constraints is not None:
            _advance(constraints, tok, live)
        rows.tokens[:, t] = tok
        rows.lps[:, t] = lp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        rows.lengths += live.long()
        hit_stop = live & (tok == stop_id)
        rows.finished |= hit_stop
        rows.done |= hit_stop
        if budget is not None:
            rows.closed |= tok == think_close_id
            rows.done |= live & ~rows.closed & (rows.lengths >= budget)
        if t + 1 == max_new_tokens or bool(rows.done.all()):
            break
        out = model(
            input_ids=tok.unsqueeze(-1),
            attention_mask=mask[:, : width + t + 1],
            position_ids=next_pos,
            use_cache=True,
            **{kw: cache},
        )
        cache = _out_cache(out)
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    return rows.samples()


def _allowed(constraints: list, done: torch.Tensor, vocab_size: int, device) -> torch.Tensor | None:
    from kiln.policy.constrained import allowed_tokens

    live = (~done).cpu().tolist()
    return allowed_tokens(constraints, live, vocab_size, device)


def _keep_allowed(tok: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Guard the inverse-CDF clamp: a row never gets a masked token (last allowed id instead)."""
    ok = allowed.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    ids = torch.arange(allowed.shape[-1], device=allowed.device)
    last = torch.where(allowed, ids, torch.full_like(ids, -1)).max(dim=-1).values
    return torch.where(ok, tok, last)


def _advance(constraints: list, tok: torch.Tensor, live: torch.Tensor) -> None:
    for i, (token, is_live) in enumerate(zip(tok.cpu().tolist(), live.cpu().tolist())):
        row = constraints[i]
        if row is not None and is_live and not row.advance(token):
            raise RuntimeError(f"row {i}: the sampled token {token} was rejected by its grammar")


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

    With ``constraint`` (a fresh :class:`kiln.policy.constrained.RowConstraint`) each position's
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
