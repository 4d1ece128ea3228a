"""``post_eval``: an installed static evaluation suite with exact expected answers.

Runtime-agnostic: nothing here imports torch. :func:`evaluate_suite` takes any *policy* object
with the :class:`kiln.core.policy.runtime.PolicyRuntime` surface it uses::

    encode_prompt(messages, *, thinking) -> list[int]
    sample(prompts, seeds, *, max_new_tokens, temperature, adapter_dir, thinking) -> [Sample]
    split_action(ids, *, thinking) -> (reasoning, answer | None)

Suites are JSONL files installed in :mod:`kiln.core.evaluation.suites` (package data); see that
package's docstring for the format and the shipped suites.

Scoring (:func:`score_answer`): the final answer (``split_action``'s answer, whitespace-stripped)
must equal ``expected``. When both parse as JSON *objects* they compare by canonical JSON (key
order and spacing do not matter); otherwise the comparison is exact string equality. A missing
answer (thinking on and no ``</think>``) is wrong.

Outcome (:func:`post_eval_outcome`), first match wins:

1. ``min_accuracy`` is None → ``kept`` (diagnostic: the suite never decides promotion).
2. the candidate evaluated no case → ``inconclusive``.
3. ``candidate.accuracy >= min_accuracy`` → ``promoted`` when post_eval owns promotion, else
   ``kept`` (the threshold is met but another gate, or nobody, owns promotion).
4. below the threshold, a baseline was evaluated and ``candidate.accuracy < baseline.accuracy``
   → ``regression``.
5. otherwise (below the threshold, no baseline or not worse than it) → ``inconclusive``.

``demoted`` and ``error`` are never produced here: ``error`` is the caller's when promotion
itself fails, ``demoted`` belongs to a later process. Only one of post_eval and the paired
environment gate may own promotion; the caller passes ``owns_promotion`` accordingly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.core.canonical import canonical_json, digest_json
from kiln.core.errors import InvalidRequest, KilnError

SUITES_DIR = Path(__file__).resolve().parent / "suites"
BATCH_SIZE = 16
GATE_OUTCOMES = ("promoted", "kept", "regression", "inconclusive")

__all__ = [
    "BATCH_SIZE",
    "GATE_OUTCOMES",
    "evaluate_suite",
    "installed_suites",
    "load_suite",
    "post_eval_outcome",
    "score_answer",
    "suite_digest",
]


# ------------------------------------------------------------------------------------- suites
def installed_suites() -> dict[str, Path]:
    """``{name: path}`` of every installed suite (``suites/<name>.jsonl``), sorted by name."""
    if not SUITES_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(SUITES_DIR.glob("*.jsonl")) if p.is_file()}


def _invalid(name: str, line: int, problem: str) -> KilnError:
    return KilnError(
        f"installed post_eval suite {name!r} is malformed at line {line}: {problem}",
        code="post_eval_suite_invalid",
        details={"suite": name, "line": line},
    )


def _check_case(name: str, line: int, case: Any) -> dict:
    if not isinstance(case, dict) or set(case) != {"id", "messages", "expected"}:
        raise _invalid(name, line, 'a case is an object with exactly "id", "messages", "expected"')
    if not isinstance(case["id"], str) or not case["id"]:
        raise _invalid(name, line, '"id" must be a non-empty string')
    if not isinstance(case["expected"], str):
        raise _invalid(name, line, '"expected" must be a string')
    messages = case["messages"]
    if not isinstance(messages, list) or not messages:
        raise _invalid(name, line, '"messages" must be a non-empty list')
    for message in messages:
        if (
            not isinstance(message, dict)
            or set(message) != {"role", "content"}
            or not all(isinstance(message[k], str) for k in ("role", "content"))
        ):
            raise _invalid(name, line, 'each message is {"role": str, "content": str}')
    return case


def load_suite(name: str) -> list[dict]:
    """The cases of the installed suite ``name``, in file order.

    Raises KilnError ``post_eval_suite_not_found`` (naming the installed suites) for an unknown
    name, ``post_eval_suite_invalid`` for a malformed file (bad JSON, bad case, duplicate id, empty).
    """
    suites = installed_suites()
    path = suites.get(name) if isinstance(name, str) else None
    if path is None:
        raise _not_found(name, sorted(suites))
    cases: list[dict] = []
    seen: set[str] = set()
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            case = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _invalid(name, number, f"not JSON ({exc.msg})") from exc
        case = _check_case(name, number, case)
        if case["id"] in seen:
            raise _invalid(name, number, f"duplicate id {case['id']!r}")
        seen.add(case["id"])
        cases.append(case)
    if not cases:
        raise _invalid(name, 0, "the suite has no cases")
    return cases


def _not_found(name: Any, available: list[str]) -> KilnError:
    return InvalidRequest(
        f"post_eval suite {name!r} is not installed; installed suites: " + (", ".join(available) or "(none)"),
        code="post_eval_suite_not_found",
        hint="post_eval.suite names a suite shipped in kiln/core/evaluation/suites/",
        details={"suite": name, "installed": available},
    )


def suite_digest(cases: list[dict]) -> str:
    """``sha256:<hex>`` of the canonical JSON of the case list (order matters)."""
    return digest_json(cases)


# ------------------------------------------------------------------------------------ scoring
def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def score_answer(answer: str | None, expected: str) -> bool:
    """True when ``answer`` (stripped) matches ``expected`` (canonical JSON for two objects)."""
    if answer is None:
        return False
    answer = answer.strip()
    if answer == expected:
        return True
    got, want = _json_object(answer), _json_object(expected)
    if got is None or want is None:
        return False
    try:
        return canonical_json(got) == canonical_json(want)
    except ValueError:  # NaN/Infinity are not canonical JSON
        return False


# --------------------------------------------------------------------------------- evaluation
def evaluate_suite(
    policy: Any,
    cases: list[dict],
    *,
    adapter_dir: Path | None = None,
    thinking: bool = True,
    max_new_tokens: int = 48,
    seed: int = 0,
    suite: str | None = None,
) -> dict:
    """Greedy (temperature 0) answers to every case, in batches of :data:`BATCH_SIZE`.

    Case ``i`` is sampled with seed ``seed + i`` (greedy decoding does not depend on it; it keeps
    the call identical to a sampled one). ``adapter_dir=None`` evaluates the base model.
    Returns ``{"suite", "cases", "correct", "accuracy", "suite_sha256", "results"}`` where
    ``results`` is ``[{"id", "correct", "answer"}]`` in case order and ``accuracy`` is
    ``correct / cases`` (0.0 for an empty case list).
    """
    results: list[dict] = []
    for start in range(0, len(cases), BATCH_SIZE):
        chunk = cases[start : start + BATCH_SIZE]
        prompts = [policy.encode_prompt(case["messages"], thinking=thinking) for case in chunk]
        seeds = [seed + start + offset for offset in range(len(chunk))]
        samples = policy.sample(
            prompts,
            seeds,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            adapter_dir=adapter_dir,
            thinking=thinking,
        )
        for case, sample in zip(chunk, samples, strict=True):
            _, answer = policy.split_action(list(sample.ids), thinking=thinking)
            answer = None if answer is None else answer.strip()
            results.append({"id": case["id"], "correct": score_answer(answer, case["expected"]), "answer": answer})
    correct = sum(1 for r in results if r["correct"])
    return {
        "suite": suite,
        "cases": len(results),
        "correct": correct,
        "accuracy": correct / len(results) if results else 0.0,
        "suite_sha256": suite_digest(cases),
        "results": results,
    }


# ------------------------------------------------------------------------------------ outcome
def post_eval_outcome(
    candidate: dict,
    baseline: dict | None,
    *,
    min_accuracy: float | None,
    owns_promotion: bool,
) -> dict:
    """``{"gate_outcome", "reason"}`` by the first-match rule in the module docstring.

    ``candidate``/``baseline`` are :func:`evaluate_suite` results. A baseline evaluated on a
    different suite (``suite_sha256`` differs) raises KilnError ``post_eval_suite_mismatch``;
    ``min_accuracy`` outside 0..1 raises ``ValueError``.
    """
    if min_accuracy is not None and not (0.0 <= float(min_accuracy) <= 1.0):
        raise ValueError(f"min_accuracy must be within 0..1, got {min_accuracy!r}")
    if baseline is not None and baseline.get("suite_sha256") != candidate.get("suite_sha256"):
        raise KilnError(
            "post_eval baseline and candidate were evaluated on different suites",
            code="post_eval_suite_mismatch",
            details={
                "candidate_suite_sha256": candidate.get("suite_sha256"),
                "baseline_suite_sha256": baseline.get("suite_sha256"),
            },
        )
    accuracy = float(candidate["accuracy"])
    score = f"{candidate['correct']}/{candidate['cases']} = {accuracy:.4f}"
    if min_accuracy is None:
        return {"gate_outcome": "kept", "reason": f"diagnostic (no min_accuracy): accuracy {score}"}
    if candidate["cases"] == 0:
        return {"gate_outcome": "inconclusive", "reason": "the suite evaluated no case"}
    threshold = float(min_accuracy)
    if accuracy >= threshold:
        if owns_promotion:
            return {
                "gate_outcome": "promoted",
                "reason": f"accuracy {score} >= min_accuracy {threshold:.4f}",
            }
        return {
            "gate_outcome": "kept",
            "reason": f"accuracy {score} >= min_accuracy {threshold:.4f}; post_eval does not own promotion",
        }
    if baseline is not None and accuracy < float(baseline["accuracy"]):
        return {
            "gate_outcome": "regression",
            "reason": (
                f"accuracy {score} < min_accuracy {threshold:.4f} and below the baseline's "
                f"{baseline['correct']}/{baseline['cases']} = {float(baseline['accuracy']):.4f}"
            ),
        }
    tail = (
        "no baseline was evaluated"
        if baseline is None
        else (f"not below the baseline's {baseline['correct']}/{baseline['cases']} = {float(baseline['accuracy']):.4f}")
    )
    return {
        "gate_outcome": "inconclusive",
        "reason": f"accuracy {score} < min_accuracy {threshold:.4f}; {tail}",
    }
