"""post_eval static suites: loading, digest, scoring, evaluation, outcome table."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from kiln.core.canonical import digest_json
from kiln.core.errors import KilnError
from kiln.core.evaluation import static_suite
from kiln.core.evaluation.static_suite import (
    evaluate_suite,
    installed_suites,
    load_suite,
    post_eval_outcome,
    score_answer,
    suite_digest,
)

SUITE = "counter-format"


# ------------------------------------------------------------------------------ loading/digest
def test_module_does_not_import_torch():
    import subprocess

    code = "import sys, kiln.core.evaluation.static_suite; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_counter_format_is_installed_and_well_formed():
    suites = installed_suites()
    assert SUITE in suites and suites[SUITE].name == "counter-format.jsonl"
    cases = load_suite(SUITE)
    assert len(cases) == 24
    assert len({c["id"] for c in cases}) == 24
    for case in cases:
        system, user = case["messages"]
        assert system["role"] == "system"
        assert system["content"].startswith('You are acting in the OpenEnv environment "counter".')
        assert user["role"] == "user" and user["content"].startswith("Count is ")
        assert case["expected"] == '{"amount": 1}'


def test_suite_digest_is_canonical_and_order_sensitive():
    cases = load_suite(SUITE)
    digest = suite_digest(cases)
    assert digest == digest_json(cases) and digest.startswith("sha256:")
    assert suite_digest(load_suite(SUITE)) == digest
    assert suite_digest(list(reversed(cases))) != digest


def test_unknown_suite_names_the_installed_ones():
    with pytest.raises(KilnError) as info:
        load_suite("no-such-suite")
    assert info.value.code == "post_eval_suite_not_found"
    assert SUITE in info.value.message
    assert info.value.details["installed"] == sorted(installed_suites())


@pytest.mark.parametrize(
    "lines, problem",
    [
        (['{"id": "a", "messages": [{"role": "user", "content": "x"}], "expected": "y"}'] * 2, "duplicate"),
        (["not json"], "not JSON"),
        (['{"id": "a", "messages": [], "expected": "y"}'], "messages"),
        (['{"id": "a", "messages": [{"role": "user", "content": "x"}], "expected": 1}'], "expected"),
        ([""], "no cases"),
    ],
)
def test_malformed_suite_is_rejected(tmp_path, monkeypatch, lines, problem):
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.setattr(static_suite, "SUITES_DIR", tmp_path)
    with pytest.raises(KilnError) as info:
        load_suite("bad")
    assert info.value.code == "post_eval_suite_invalid"
    assert problem in info.value.message


# ------------------------------------------------------------------------------------ scoring
@pytest.mark.parametrize(
    "answer, expected, ok",
    [
        ('{"amount": 1}', '{"amount": 1}', True),
        ('{"amount":1}', '{"amount": 1}', True),  # canonical JSON equality
        ('  {\n "b": 2, "a": 1 }  ', '{"a": 1, "b": 2}', True),  # key order, whitespace
        ('{"amount": 1.0}', '{"amount": 1}', False),  # canonical JSON keeps 1.0 != 1
        ('{"amount": 2}', '{"amount": 1}', False),
        ('{"amount": 1, "note": "x"}', '{"amount": 1}', False),
        ("[1, 2]", "[1,2]", False),  # arrays are not objects: exact string
        ("[1,2]", "[1,2]", True),
        ("Paris", "Paris", True),  # exact string
        (" Paris \n", "Paris", True),  # answer is stripped
        ("paris", "Paris", False),
        ('{"amount": 1', '{"amount": 1}', False),  # unparseable answer
        ("", '{"amount": 1}', False),
        (None, '{"amount": 1}', False),  # missing answer (no </think>)
        (None, "", False),
    ],
)
def test_score_answer(answer, expected, ok):
    assert score_answer(answer, expected) is ok


# ------------------------------------------------------------------------- evaluation (fake)
class FakePolicy:
    """Answers text chosen per prompt; records sample calls."""

    def __init__(self, answers: dict[str, str | None]):
        self.answers = answers
        self.calls: list[dict] = []

    def encode_prompt(self, messages, *, thinking):
        return [messages[-1]["content"]]

    def sample(self, prompts, seeds, *, max_new_tokens, temperature, adapter_dir=None, thinking=True):
        self.calls.append(
            {"n": len(prompts), "seeds": list(seeds), "temperature": temperature, "adapter_dir": adapter_dir,
             "max_new_tokens": max_new_tokens, "thinking": thinking}
        )
        return [SimpleNamespace(ids=[p[0]], logprobs=[0.0], finished=True) for p in prompts]

    def split_action(self, ids, *, thinking):
        return "", self.answers[ids[0]]


def test_evaluate_suite_batches_seeds_and_scores():
    cases = load_suite(SUITE)
    answers = {c["messages"][-1]["content"]: '{"amount": 3}' for c in cases}
    answers[cases[0]["messages"][-1]["content"]] = ' {"amount":1} '
    answers[cases[17]["messages"][-1]["content"]] = '{"amount": 1}'
    answers[cases[5]["messages"][-1]["content"]] = None
    policy = FakePolicy(answers)
    report = evaluate_suite(policy, cases, adapter_dir="ad", thinking=False, max_new_tokens=7, seed=100,
                            suite=SUITE)
    assert [c["n"] for c in policy.calls] == [16, 8]
    assert policy.calls[0]["seeds"] == list(range(100, 116))
    assert policy.calls[1]["seeds"] == list(range(116, 124))
    assert all(c["temperature"] == 0.0 and c["adapter_dir"] == "ad" and c["max_new_tokens"] == 7
               and c["thinking"] is False for c in policy.calls)
    assert set(report) == {"suite", "cases", "correct", "accuracy", "suite_sha256", "results"}
    assert report["suite"] == SUITE and report["cases"] == 24 and report["correct"] == 2
    assert report["accuracy"] == 2 / 24
    assert report["suite_sha256"] == suite_digest(cases)
    assert report["results"][0] == {"id": cases[0]["id"], "correct": True, "answer": '{"amount":1}'}
    assert report["results"][5] == {"id": cases[5]["id"], "correct": False, "answer": None}
    assert [r["id"] for r in report["results"]] == [c["id"] for c in cases]


def test_evaluate_empty_suite():
    report = evaluate_suite(FakePolicy({}), [])
    assert (report["cases"], report["correct"], report["accuracy"]) == (0, 0, 0.0)


# ------------------------------------------------------------------------- evaluation (tiny)
@pytest.fixture(scope="module")
def tiny_runtime(tmp_path_factory):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.support.models import shared_tiny_model

    model_dir = shared_tiny_model(tmp_path_factory)
    return model_dir, PolicyRuntime.load(model_dir)


@pytest.mark.parametrize("thinking", [True, False])
def test_tiny_model_accuracy_is_deterministic(tiny_runtime, thinking):
    _, runtime = tiny_runtime
    cases = load_suite(SUITE)
    first = evaluate_suite(runtime, cases, thinking=thinking, suite=SUITE)
    second = evaluate_suite(runtime, cases, thinking=thinking, suite=SUITE)
    assert first == second
    assert first["cases"] == len(cases) == 24
    assert 0.0 <= first["accuracy"] <= 1.0
    assert first["correct"] == sum(r["correct"] for r in first["results"])
    # The warmed-up tiny model emits the action format (its greedy amount is not the best one).
    assert all(r["answer"] is not None and json.loads(r["answer"]).keys() == {"amount"}
               for r in first["results"])


def test_tiny_model_with_adapter(tiny_runtime, tmp_path):
    from tests.support.models import make_lora_adapter

    model_dir, runtime = tiny_runtime
    adapter = make_lora_adapter(model_dir, tmp_path / "adapter", seed=3, scale=0.5)
    cases = load_suite(SUITE)[:5]
    first = evaluate_suite(runtime, cases, adapter_dir=adapter, max_new_tokens=16)
    assert first == evaluate_suite(runtime, cases, adapter_dir=adapter, max_new_tokens=16)
    assert first["cases"] == 5 and 0.0 <= first["accuracy"] <= 1.0


# ------------------------------------------------------------------------------------ outcome
def _report(correct: int, cases: int = 10, sha: str = "sha256:" + "a" * 64) -> dict:
    return {"suite": SUITE, "cases": cases, "correct": correct,
            "accuracy": correct / cases if cases else 0.0, "suite_sha256": sha, "results": []}


@pytest.mark.parametrize(
    "cand, base, min_acc, owns, expected",
    [
        (_report(3), None, None, True,
         {"gate_outcome": "kept", "reason": "diagnostic (no min_accuracy): accuracy 3/10 = 0.3000"}),
        (_report(3), _report(9), None, True,
         {"gate_outcome": "kept", "reason": "diagnostic (no min_accuracy): accuracy 3/10 = 0.3000"}),
        (_report(0, cases=0), None, 0.5, True,
         {"gate_outcome": "inconclusive", "reason": "the suite evaluated no case"}),
        (_report(8), None, 0.8, True,
         {"gate_outcome": "promoted", "reason": "accuracy 8/10 = 0.8000 >= min_accuracy 0.8000"}),
        (_report(8), _report(10), 0.8, True,
         {"gate_outcome": "promoted", "reason": "accuracy 8/10 = 0.8000 >= min_accuracy 0.8000"}),
        (_report(9), None, 0.8, False,
         {"gate_outcome": "kept",
          "reason": "accuracy 9/10 = 0.9000 >= min_accuracy 0.8000; post_eval does not own promotion"}),
        (_report(0), None, 0.0, True,
         {"gate_outcome": "promoted", "reason": "accuracy 0/10 = 0.0000 >= min_accuracy 0.0000"}),
        (_report(5), _report(6), 0.8, True,
         {"gate_outcome": "regression",
          "reason": "accuracy 5/10 = 0.5000 < min_accuracy 0.8000 and below the baseline's 6/10 = 0.6000"}),
        (_report(5), _report(6), 0.8, False,
         {"gate_outcome": "regression",
          "reason": "accuracy 5/10 = 0.5000 < min_accuracy 0.8000 and below the baseline's 6/10 = 0.6000"}),
        (_report(5), _report(5), 0.8, True,
         {"gate_outcome": "inconclusive",
          "reason": "accuracy 5/10 = 0.5000 < min_accuracy 0.8000; not below the baseline's 5/10 = 0.5000"}),
        (_report(5), None, 0.8, True,
         {"gate_outcome": "inconclusive",
          "reason": "accuracy 5/10 = 0.5000 < min_accuracy 0.8000; no baseline was evaluated"}),
    ],
)
def test_post_eval_outcome_table(cand, base, min_acc, owns, expected):
    assert post_eval_outcome(cand, base, min_accuracy=min_acc, owns_promotion=owns) == expected


def test_post_eval_outcome_rejects_bad_inputs():
    with pytest.raises(ValueError):
        post_eval_outcome(_report(5), None, min_accuracy=1.5, owns_promotion=True)
    with pytest.raises(KilnError) as info:
        post_eval_outcome(_report(5), _report(5, sha="sha256:" + "b" * 64), min_accuracy=0.5, owns_promotion=True)
    assert info.value.code == "post_eval_suite_mismatch"
