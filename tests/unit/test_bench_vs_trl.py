"""``bench/vs_trl.py`` plumbing that needs no TRL: each environment's TRL-side action check accepts
what Kiln's validator of that environment's schema accepts, and the guess env's episode length."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from bench.vs_trl import ENVS, parse_args

pytestmark = pytest.mark.timeout(30)


def _trl_side():
    path = Path(__file__).resolve().parents[2] / "bench" / "trl_side.py"
    spec = importlib.util.spec_from_file_location("trl_side_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # stdlib only at import time (TRL is imported when it runs)
    return module


def test_action_checks_per_environment():
    parse = _trl_side().parse_action
    counter, guess = ENVS["counter"]["action_spec"], ENVS["guess"]["action_spec"]
    assert parse('{"amount": 3}', counter) == {"amount": 3} == parse('{"amount": 3}')
    assert parse('{"amount": 6}', counter) is None and parse('{"guess": 3}', counter) is None
    assert parse('{"guess": 40}', guess) == {"guess": 40}
    assert parse('{"guess": 99}', guess) == {"guess": 99}  # out of range reaches the env: a recoverable error
    assert parse('{"guess": true}', guess) is None and parse('{"amount": 2}', guess) is None
    assert parse('```json\n{"guess": 7}\n```', guess) == {"guess": 7}


def test_env_option():
    assert parse_args([]).env == "counter"
    assert parse_args(["--env", "guess"]).env == "guess" and ENVS["guess"]["episode"] == {"max_steps": 8}
    with pytest.raises(SystemExit):
        parse_args(["--env", "maze"])
