"""Optional schema-constrained decoding of the final answer (``--constrained-actions``), via xgrammar.

The action schema (the one shown to the policy, :func:`kiln.core.openenv.schema.policy_action_schema`)
is compiled once per schema (cached by :func:`kiln.core.canonical.digest_json`) into an xgrammar
grammar over the model's vocabulary::

    root ::= [ \\n\\r\\t]{0,8} JSON_OBJECT_OF_THE_SCHEMA

where the schema is first tightened by :func:`kiln.core.policy.grammar_schema.grammar_schema`
(fixed values and discriminators required, every string, number, array and free-form object
bounded, so an answer the grammar completes always parses and validates locally). The tightened
schema's compact JSON text (:attr:`ActionGrammar.schema_json`, keys in schema order, with its
digest :attr:`ActionGrammar.grammar_schema_sha256`) is the one source of the grammar: the
hf engine compiles it here, another engine hands the very same text to its own structured-output
backend. I.e. up to :data:`MAX_PREFIX_WHITESPACE` whitespace characters may precede the JSON (Kiln's
template writes ``</think>\\n\\n{...}``), and inside the JSON at most :data:`MAX_WHITESPACE` whitespace
characters are allowed between tokens (``any_whitespace`` with a cap, so a model can neither loop on
blanks nor be forced into one separator style). ``strict_mode`` is on: properties not named by the
schema are never generated, which is a subset of what the schema accepts.

Each sampled row owns a :class:`RowConstraint` (its own ``GrammarMatcher``), so rows of a batch
progress independently. A row is *free* while it is inside reasoning (``thinking=True`` and
``</think>`` not yet produced, matched by token id like :meth:`PolicyRuntime.split_action`);
from the first token of the answer (the token right after ``</think>``, or the first generated
token when not thinking) the next-token distribution is restricted to the tokens the grammar
allows; once the grammar has accepted a complete object the only allowed token is the stop token
``<|im_end|>``.

**Behaviour log-probs.** Disallowed logits are set to ``-inf`` *before* the temperature-scaled
``log_softmax``, so a constrained row samples from the masked, renormalised distribution and the
recorded log-prob of every token is its log-prob under exactly that distribution (for greedy,
temperature 0, the masked untempered distribution, following :mod:`kiln.core.policy.sampling`).
Reasoning tokens are unmasked, so their log-probs are the ordinary ones.
:meth:`PolicyRuntime.logprobs_of` with the same ``action_schema`` teacher-forces the completion
through a fresh matcher and applies the same masks, reproducing the recorded values.

xgrammar is imported lazily: importing this module (and :mod:`kiln.core.policy.sampling`) does not need
it; :class:`ActionGrammarCache` raises :class:`ConstrainedDecodingUnavailable` with an install hint
when it is missing.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

import torch

from kiln.core.canonical import compact_json, digest_json, sha256_bytes
from kiln.core.policy.grammar_schema import compiler_form, grammar_bounds, grammar_schema

MAX_PREFIX_WHITESPACE = 8  # whitespace characters allowed before the JSON object
MAX_WHITESPACE = 4  # whitespace characters allowed between JSON tokens
GRAMMAR_LIBRARY = "xgrammar"
PINNED_VERSION = "0.2.8"

FREE, ANSWER, DONE = "free", "answer", "done"

__all__ = [
    "ActionGrammar",
    "ActionGrammarCache",
    "ConstrainedDecodingUnavailable",
    "RowConstraint",
    "allowed_tokens",
    "unpack_bitmask",
]


class ConstrainedDecodingUnavailable(RuntimeError):
    """The grammar library is missing or cannot compile the given action schema."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConstrainedDecodingUnavailable(
            f"constrained actions need xgrammar: pip install xgrammar=={PINNED_VERSION}"
        ) from exc
    return xgrammar


def _library_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(GRAMMAR_LIBRARY)
    except PackageNotFoundError:  # pragma: no cover - depends on the environment
        return "unknown"


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask ``(rows, ceil(V/32))`` -> bool ``(rows, vocab_size)``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _bit(bit: int) -> int:
    """The int32 value with only ``bit`` set (bit 31 is the sign bit)."""
    value = 1 << bit
    return value - (1 << 32) if value >= 1 << 31 else value


class ActionGrammar:
    """One compiled action grammar for one tokenizer; hands out per-row constraints."""

    def __init__(
        self,
        compiled,
        *,
        schema_sha256: str,
        schema_json: str,
        vocab_size: int,
        stop_id: int,
        think_close_id: int,
        ebnf: str = "",
    ):
        self.compiled = compiled
        self.schema_sha256 = schema_sha256  # the policy-facing (untightened) schema's digest
        # The tightened schema as compact JSON in schema key order (property order is the order
        # the grammar writes properties in), and the sha256 of exactly that text.
        self.schema_json = schema_json
        self.grammar_schema_sha256 = sha256_bytes(schema_json.encode("utf-8"))
        # The grammar's EBNF text (prefix whitespace + the schema's value), compiled from exactly
        # schema_json: what another engine (vllm) is handed, so both engines mask alike.
        self.ebnf = ebnf
        self.vocab_size = int(vocab_size)
        self.stop_id = int(stop_id)
        self.think_close_id = int(think_close_id)
        self._bitmask_words = (self.vocab_size + 31) // 32

    def row(self, *, thinking: bool) -> "RowConstraint":
        """A fresh constraint for one completion (free until ``</think>`` when ``thinking``)."""
        return RowConstraint(self, thinking=thinking)

    def identity(self) -> dict:
        """What a behaviour-policy record should carry about the constraint."""
        return {
            "library": GRAMMAR_LIBRARY,
            "version": _library_version(),
            "schema_sha256": self.schema_sha256,
            "grammar_schema_sha256": self.grammar_schema_sha256,
            "max_prefix_whitespace": MAX_PREFIX_WHITESPACE,
            "max_whitespace": MAX_WHITESPACE,
            "fixed_values_required": True,
            "bounds": grammar_bounds(),
        }


class RowConstraint:
    """The grammar state of one sampled row: ``free`` (reasoning) -> ``answer`` -> ``done``."""

    def __init__(self, grammar: ActionGrammar, *, thinking: bool):
        xgr = _xgrammar()
        self.grammar = grammar
        self.phase = FREE if thinking else ANSWER
        self._matcher = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=[grammar.stop_id])
        self._bitmask = torch.empty((1, grammar._bitmask_words), dtype=torch.int32)

    @property
    def active(self) -> bool:
        """True while the next token is masked (inside the answer, before the stop token)."""
        return self.phase == ANSWER

    def fill(self, bitmask: torch.Tensor, index: int) -> bool:
        """Write the allowed-next-token bits into row ``index`` of a packed int32 CPU bitmask.

        Returns False (row untouched) when the row is unrestricted (reasoning, or done).
        """
        if self.phase != ANSWER:
            return False
        if self._matcher.is_completed():  # a complete object: only the stop token
            bitmask[index].zero_()
            word, bit = divmod(self.grammar.stop_id, 32)
            bitmask[index, word] = _bit(bit)
            return True
        self._matcher.fill_next_token_bitmask(bitmask, index)
        if not bool(bitmask[index].any()):  # never expected; keep the row well-defined
            word, bit = divmod(self.grammar.stop_id, 32)
            bitmask[index, word] = _bit(bit)
        return True

    def allowed(self) -> torch.Tensor | None:
        """Bool mask ``(vocab_size,)`` of the tokens allowed next, or None when unrestricted."""
        if not self.fill(self._bitmask, 0):
            return None
        return unpack_bitmask(self._bitmask, self.grammar.vocab_size)[0]

    def advance(self, token: int) -> bool:
        """Consume one produced token; False when the grammar rejects it (state unchanged)."""
        token = int(token)
        if self.phase == FREE:
            if token == self.grammar.think_close_id:
                self.phase = ANSWER
            return True
        if self.phase == DONE:
            return False
        if self._matcher.is_completed() and token != self.grammar.stop_id:
            return False
        if not self._matcher.accept_token(token):
            return False
        if self._matcher.is_terminated():
            self.phase = DONE
        return True


def allowed_tokens(rows: list[RowConstraint | None], live: list[bool], vocab_size: int, device) -> torch.Tensor | None:
    """Bool ``(batch, vocab_size)`` allowed-token mask for one step, or None when no row is masked.

    The matchers write one packed int32 bitmask on the CPU; only that (32x smaller than the mask)
    moves to ``device``, where it is unpacked. Rows that are not live, have no constraint or are
    free (reasoning) allow everything; ids beyond the grammar's vocabulary are never allowed in a
    masked row.
    """
    batch = len(rows)
    words = (vocab_size + 31) // 32
    bitmask = None
    restricted = []
    grammar_vocab = vocab_size
    for i, (row, is_live) in enumerate(zip(rows, live)):
        if row is None or not is_live or not row.active:
            continue
        if bitmask is None:
            bitmask = torch.full((batch, max(words, row.grammar._bitmask_words)), -1, dtype=torch.int32)
        bitmask[i].fill_(0)
        row.fill(bitmask, i)
        restricted.append(i)
        grammar_vocab = min(grammar_vocab, row.grammar.vocab_size)
    if bitmask is None:
        return None
    allowed = unpack_bitmask(bitmask.to(device), vocab_size)
    if grammar_vocab < vocab_size:  # logits wider than the grammar's vocabulary
        index = torch.tensor(restricted, dtype=torch.long, device=allowed.device)
        allowed[index, grammar_vocab:] = False
    return allowed


class ActionGrammarCache:
    """Compiles action schemas for one tokenizer, once per schema (LRU keyed by the schema digest)."""

    def __init__(self, tokenizer, *, vocab_size: int, stop_id: int, think_close_id: int, max_entries: int = 32):
        xgr = _xgrammar()
        self.vocab_size = int(vocab_size)
        self.stop_id = int(stop_id)
        self.think_close_id = int(think_close_id)
        self.max_entries = max(1, int(max_entries))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=[stop_id])
        threads = max(1, min(4, os.cpu_count() or 1))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._entries: OrderedDict[str, ActionGrammar] = OrderedDict()
        self.compilations = 0  # how many schemas were actually compiled (tests check the cache)

    def get(self, action_schema: dict[str, Any]) -> ActionGrammar:
        """The compiled grammar of ``action_schema`` (compiled on first use)."""
        digest = digest_json(action_schema)
        grammar = self._entries.get(digest)
        if grammar is None:
            schema_json = compact_json(grammar_schema(action_schema)).decode("utf-8")
            compiled, ebnf = self._compile(schema_json)
            grammar = ActionGrammar(
                compiled,
                ebnf=ebnf,
                schema_sha256=digest,
                schema_json=schema_json,
                vocab_size=self.vocab_size,
                stop_id=self.stop_id,
                think_close_id=self.think_close_id,
            )
            self.compilations += 1
            self._entries[digest] = grammar
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        self._entries.move_to_end(digest)
        return grammar

    def _compile(self, schema_json: str):
        xgr = _xgrammar()
        try:
            body = xgr.Grammar.from_json_schema(
                compact_json(compiler_form(json.loads(schema_json))).decode("utf-8"),
                any_whitespace=True,
                max_whitespace_cnt=MAX_WHITESPACE,
                strict_mode=True,
            )
            prefix = xgr.Grammar.from_ebnf(f"root ::= [ \\n\\r\\t]{{0,{MAX_PREFIX_WHITESPACE}}}")
            grammar = xgr.Grammar.concat(prefix, body)
            return self._compiler.compile_grammar(grammar), str(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConstrainedDecodingUnavailable(
                f"the action schema cannot be compiled into a decoding grammar: {exc}"
            ) from exc
