"""Seeded, batch-invariant KV-cache sampling with exact behaviour log-probs (torch).

**Batch-invariant:** every row is computed on its own, as a batch of one with no padding: one
unpadded prefill forward of its prompt (rows with the same prompt, e.g. a group's candidates on
their first turn, share one prefill and decode from copies of its KV cache), then one batch-of-1
forward per generated token with ``position_ids`` continuing the prompt's. The kernels a row runs,
their shapes and their inputs depend only on that row, so a row's ids *and* log-probs are
bit-identical whichever rows share the call (a wave of 1 on a 1-session server, a group of 8 in
one call, any order). Batched matrix kernels are not row-invariant (a 1-row and a 4-row matmul
round differently), which is why rows are not stacked. Each row owns a ``torch.Generator`` seeded
with its u64 seed; all the uniforms a row may need are drawn up front (one call per row, none per
token) and a token is picked by inverse-CDF sampling, so a row's tokens depend only on its prompt,
its seed, the model/adapter and the placement.

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

import copy
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


def _row_uniforms(seed: int, steps: int, device) -> torch.Tensor:
    """All the uniforms one row may need, one seeded generator call (float64, shape ``(1, steps)``)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(torch_seed(seed))
    return torch.rand(steps, generator=gen, dtype=torch.float64).unsqueeze(0).to(device)


def _prefill(model, prompt: list[int], device):
    """One unpadded forward over ``prompt`` (batch of 1): ``(cache, last_logits)``."""
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    positions = torch.arange(len(prompt), dtype=torch.long, device=device).unsqueeze(0)
    out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1)
    return _out_cache(out), out.logits[:, -1, :]


class _Prefills:
    """Each distinct prompt is prefilled once (a group's candidates share their first prompt);
    a row that is not the prompt's last user decodes from a copy of the cache."""

    def __init__(self, model, prompts: list[list[int]], device) -> None:
        self.model, self.device = model, device
        self.left: dict[tuple[int, ...], int] = {}
        for prompt in prompts:
            self.left[tuple(prompt)] = self.left.get(tuple(prompt), 0) + 1
        self.done: dict[tuple[int, ...], tuple] = {}

    def take(self, prompt: list[int]):
        key = tuple(prompt)
        if key not in self.done:
            self.done[key] = _prefill(self.model, prompt, self.device)
        self.left[key] -= 1
        cache, logits = self.done[key]
        if self.left[key] == 0:
            del self.done[key]
            return cache, logits
        return copy.deepcopy(cache), logits


def _pick(lp: torch.Tensor, uniforms: torch.Tensor | None, t: int) -> torch.Tensor:
    """Greedy (no uniforms) or inverse-CDF sampling with the row's t-th uniform."""
    if uniforms is None:
        return lp.argmax(dim=-1)
    cdf = lp.double().exp().cumsum(dim=-1)
    u = uniforms[:, t : t + 1] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


@dataclass
class _Decode:
    """What every row of one call decodes with."""

    model: object
    max_new_tokens: int
    temperature: float
    stop_id: int
    think_close_id: int | None
    budget: int | None
    device: str
    kw: str


def _sample_row(d: _Decode, cache, logits, n_prompt: int, seed: int, constraint) -> Sample:
    """Decode one row from its prefilled cache: one batch-of-1 forward per token."""
    uniforms = _row_uniforms(seed, d.max_new_tokens, d.device) if d.temperature > 0 else None
    ids: list[int] = []
    lps: list[torch.Tensor] = []
    finished = closed = False
    for t in range(d.max_new_tokens):
        allowed = None
        if constraint is not None:
            allowed = _allowed([constraint], torch.zeros(1, dtype=torch.bool), logits.shape[-1], d.device)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        lp = _log_probs(logits, d.temperature)
        tok = _pick(lp, uniforms, t)
        if allowed is not None:
            tok = _keep_allowed(tok, allowed)
        token = int(tok.item())
        if constraint is not None:
            _advance([constraint], tok, torch.ones(1, dtype=torch.bool))
        ids.append(token)
        lps.append(lp[0, token])
        finished = token == d.stop_id
        closed = closed or token == d.think_close_id
        if finished or t + 1 == d.max_new_tokens:
            break
        if d.budget is not None and not closed and len(ids) >= d.budget:
            break
        out = d.model(
            input_ids=tok.view(1, 1),
            position_ids=torch.tensor([[n_prompt + t]], dtype=torch.long, device=d.device),
            use_cache=True,
            **{d.kw: cache},
        )
        cache = _out_cache(out)
        logits = out.logits[:, -1, :]
    return Sample(ids=ids, logprobs=torch.stack(lps).cpu().tolist() if lps else [], finished=finished)


@torch.inference_mode()
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
) -> list[Sample]:
    """Sample every prompt, each row on its own (batch-invariant); see the module docstring."""
    if not _check_inputs(prompts, seeds, constraints, temperature):
        return []
    if max_new_tokens <= 0:
        return [Sample(ids=[], logprobs=[], finished=False) for _ in prompts]
    budget = think_budget if (think_budget is not None and think_close_id is not None) else None
    d = _Decode(model, int(max_new_tokens), temperature, stop_id, think_close_id, budget, device,
                cache_kwarg(model))
    prefills = _Prefills(model, prompts, device)
    samples = []
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        cache, logits = prefills.take(prompt)
        constraint = constraints[i] if constraints is not None else None
        samples.append(_sample_row(d, cache, logits, len(prompt), seed, constraint))
    return samples


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
