"""A random policy sampled under Kiln's action grammar: the tiny model's tokenizer with random
logits (a model that knows nothing), temperature 1, thinking off.

Each step draws standard-normal logits for every row, masks them with the real
:func:`kiln.core.policy.constrained.allowed_tokens` (the same call the sampler makes), and samples from
the masked softmax, until the stop token or ``max_new_tokens``. Everything the grammar allows gets
a fair chance, so long strings, many digits and full objects are reached far more often than a
trained model would: the worst case the bounds must hold against. The answers then go through
Kiln's own :func:`kiln.core.rollout.exchange.judge_answer` (bounded parser + local validation) and
:func:`kiln.core.rollout.exchange.truncation_outcome`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TOKENIZERS: dict[str, Any] = {}


def random_policy_tokenizer(tmp_dir: Path):
    """The tiny model's tokenizer (trained in-process; no model weights), cached per process."""
    if "tok" not in _TOKENIZERS:
        from kiln.core.policy import tiny
        from kiln.core.policy.tokenizer import train_and_save

        _TOKENIZERS["tok"] = train_and_save(
            tiny._tokenizer_corpus(random.Random(tiny.SEED)), Path(tmp_dir), tiny.VOCAB_SIZE
        )
    return _TOKENIZERS["tok"]


@dataclass
class Outcomes:
    """What happened to each sampled answer (harness code, or ``valid``) and the answers."""

    codes: list[str] = field(default_factory=list)
    actions: list[dict | None] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def count(self, code: str) -> int:
        return self.codes.count(code)


def grammar_cache(tokenizer):
    from kiln.core.policy.chat_template import IM_END
    from kiln.core.policy.constrained import ActionGrammarCache

    return ActionGrammarCache(
        tokenizer,
        vocab_size=len(tokenizer),
        stop_id=tokenizer.convert_tokens_to_ids(IM_END),
        think_close_id=tokenizer.convert_tokens_to_ids("</think>"),
    )


def sample_random_actions(
    cache, tokenizer, shown_schema: dict, validator, *, n: int = 256, max_new_tokens: int = 1024, seed: int = 0
) -> Outcomes:
    """``n`` answers of the random policy under the grammar of ``shown_schema``, judged by Kiln."""
    import torch

    from kiln.core.policy.constrained import allowed_tokens

    torch.set_num_threads(1)  # tiny tensors: threads only contend
    from kiln.core.rollout.exchange import judge_answer, truncation_outcome

    grammar = cache.get(shown_schema)
    vocab = grammar.vocab_size
    rows = [grammar.row(thinking=False) for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    live = [True] * n
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        active = [i for i in range(n) if live[i]]
        if not active:
            break
        allowed = allowed_tokens([rows[i] for i in active], [True] * len(active), vocab, "cpu")
        logits = torch.randn((len(active), vocab), generator=gen)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        picks = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1).tolist()
        for i, token in zip(active, picks):
            assert rows[i].advance(token), "the sampler drew a token the grammar refuses"
            ids[i].append(token)
            if token == grammar.stop_id:
                live[i] = False
    out = Outcomes()
    for row_ids in ids:
        finished = bool(row_ids) and row_ids[-1] == grammar.stop_id
        text = tokenizer.decode(row_ids[:-1] if finished else row_ids)
        action, harness = judge_answer(text, validator)
        if harness is not None:
            code, _ = truncation_outcome(*harness, len(row_ids), max_new_tokens)
            if not finished and code not in ("MODEL_ACTION_TRUNCATED",):
                code = "MODEL_ACTION_TRUNCATED"
        else:
            code = "valid" if finished else "MODEL_ACTION_TRUNCATED"
        out.codes.append(code)
        out.actions.append(action)
        out.lengths.append(len(row_ids))
    return out
