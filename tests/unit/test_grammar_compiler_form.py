"""xgrammar stays quiet about Kiln's own tightened strings, and compiles the same grammar.

A tightened string carries ``maxLength`` and Kiln's own length-bounded ``pattern``; xgrammar
ignores the lengths beside a pattern and writes one C++ warning per string to stderr.
``compiler_form`` leaves those lengths out of what the compiler sees (the pattern spells them), so
the grammar text is identical and nothing is written; an environment's own pattern is untouched.
"""

from __future__ import annotations

import json

import pytest

from kiln.core.canonical import compact_json
from kiln.core.policy.grammar_schema import bounded_string_pattern, compiler_form, grammar_schema

pytestmark = pytest.mark.timeout(60)

SCHEMA = {
    "type": "object",
    "properties": {
        "message": {"type": "string"},
        "note": {"type": "string", "minLength": 2, "maxLength": 10},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$", "maxLength": 3},  # the environment's own
        "extra": {"type": "object"},  # free-form: Kiln's free scalars hold strings too
    },
    "required": ["message"],
}
WARNING = "not supported"


def _ebnf(schema: dict) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(compact_json(schema).decode(), any_whitespace=True, strict_mode=True))


def test_kiln_strings_lose_their_lengths_for_the_compiler_only() -> None:
    tightened = grammar_schema(SCHEMA)
    form = compiler_form(tightened)
    props, shown = tightened["properties"], form["properties"]
    assert props["message"]["maxLength"] == 64 and "maxLength" not in shown["message"]
    assert shown["message"]["pattern"] == bounded_string_pattern(0, 64)
    assert "minLength" not in shown["note"] and shown["note"]["pattern"] == bounded_string_pattern(2, 10)
    assert shown["code"] == {"type": "string", "pattern": "^[A-Z]{3}$", "maxLength": 3}
    assert "maxLength" in json.dumps(tightened["$defs"]) and "maxLength" not in json.dumps(form["$defs"])


def test_the_grammar_is_the_same_and_stderr_stays_empty(capfd: pytest.CaptureFixture[str]) -> None:
    tightened = grammar_schema({**SCHEMA, "properties": {k: v for k, v in SCHEMA["properties"].items() if k != "code"}})
    capfd.readouterr()
    raw = _ebnf(tightened)
    noisy = capfd.readouterr().err
    assert noisy.count(WARNING) >= 3  # message, note and the free scalar string: the noise is real
    quiet = _ebnf(compiler_form(tightened))
    assert WARNING not in capfd.readouterr().err
    assert quiet == raw
