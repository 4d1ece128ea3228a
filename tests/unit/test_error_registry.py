"""Every KilnError class lives in ``kiln/core/errors/`` and registers its code when it is defined, so
``error_from_dict`` rebuilds the same class whatever else the process imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.errors import KilnError, error_from_dict, error_type, registered_errors

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("kiln", "api", "activities", "workers", "workflows")


def _error_classes_outside_errors_module() -> list[str]:
    """``module:Class`` for every class in the product folders deriving from a kiln.core.errors class."""
    known = set(registered_errors().values())
    names = {cls.__name__ for cls in known} | {"KilnError"}
    found = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.parent == ROOT / "kiln" / "core" / "errors":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    if bases & names:
                        found.append(f"{path.relative_to(ROOT)}:{node.name}")
    return found


@pytest.mark.timeout(60)
def test_no_kiln_error_class_is_defined_outside_kiln_errors() -> None:
    assert _error_classes_outside_errors_module() == []


@pytest.mark.timeout(60)
def test_the_codes_that_depended_on_import_order_resolve_to_their_classes() -> None:
    expected = {
        "environment_evaluation_failed": "EnvironmentEvaluationFailed",
        "environment_at_capacity": "EnvironmentAtCapacity",
        "openenv_verification_failed": "VerificationFailed",
        "openenv_replay_drift": "ReplayDrift",
        "training_invalid_dataset": "DatasetInvalid",
        "openenv_run_idempotency_conflict": "IdempotencyConflict",
        "api_unavailable": "ApiUnavailable",
        # two classes share this code: the first defined keeps it, as before the registry
        "environment_protocol_error": "EnvironmentProtocolError",
        "no_such_code": "KilnError",
    }
    assert {code: error_type(code).__name__ for code in expected} == expected
    rebuilt = error_from_dict({"code": "openenv_replay_drift", "message": "m", "details": {"field": "x"}})
    assert type(rebuilt).__name__ == "ReplayDrift" and rebuilt.details == {"field": "x"} and rebuilt.http_status == 409


@pytest.mark.timeout(60)
def test_every_registered_class_round_trips_through_its_wire_form() -> None:
    codes = registered_errors()
    assert len(codes) >= 50
    for code, cls in codes.items():
        assert cls.code == code and issubclass(cls, KilnError)
        error = cls(f"a {code} happened", hint="h")
        again = error_from_dict(error.to_dict())
        assert type(again) is cls and again.to_dict() == error.to_dict()


@pytest.mark.timeout(120)
def test_a_fresh_interpreter_catches_the_class_after_importing_the_client_alone() -> None:
    program = (
        "import kiln.client\n"
        "from kiln.client import EnvironmentEvaluationFailed, raise_for_outcome, RunView\n"
        "view = RunView.model_validate({'run_id': 'r', 'state': 'failed', 'failure': {\n"
        "    'code': 'environment_evaluation_failed', 'message': 'no evidence', 'retryable': False,\n"
        "    'stage': 'evaluation'}})\n"
        "try:\n"
        "    raise_for_outcome(view)\n"
        "except EnvironmentEvaluationFailed as error:\n"
        "    print('caught', error.code, error.retryable)\n"
        "import sys\n"
        "print(sorted(m for m in sys.modules if m == 'kiln.cli' or m.startswith(('kiln.core.evaluation', 'kiln.cli.'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["caught environment_evaluation_failed False", "[]"]


@pytest.mark.timeout(60)
def test_no_error_class_sets_an_attribute_twice() -> None:
    """A class body that assigns ``stage`` (or ``code`` …) twice silently keeps the last value:
    the kind of line a merge leaves behind. Each error's attributes are set once, as a class
    keyword (``class X(KilnError, code="x")``) or in the body, never both."""
    repeated = {}
    nodes = [
        n
        for p in sorted((ROOT / "kiln" / "core" / "errors").glob("*.py"))
        for n in ast.parse(p.read_text(encoding="utf-8")).body
    ]
    for node in nodes:
        if isinstance(node, ast.ClassDef):
            names = [t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)]
            names += [k.arg for k in node.keywords if k.arg is not None]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                repeated[node.name] = twice
    assert repeated == {}


@pytest.mark.timeout(60)
def test_class_keywords_and_body_attributes_declare_the_same_error() -> None:
    """A class keyword fixes the attribute as a body assignment would; an unset one is inherited."""
    from kiln.core.errors import InvalidRequest, ReplayDrift

    assert (ReplayDrift.code, ReplayDrift.http_status, ReplayDrift.retryable) == ("openenv_replay_drift", 409, False)
    assert (InvalidRequest.code, InvalidRequest.http_status, InvalidRequest.stage) == (
        "openenv_invalid_request",
        400,
        "admission",
    )

    from kiln.core.errors import base

    try:

        class BodyDeclared(InvalidRequest):
            code = "test_body_declared"
            retryable = True

        class KeywordDeclared(InvalidRequest, code="test_keyword_declared", retryable=True):
            pass

        for cls in (BodyDeclared, KeywordDeclared):
            assert (cls.retryable, cls.http_status, cls.stage) == (True, 400, "admission")
            assert cls.__dict__["code"] == cls.code and error_type(cls.code) is cls
    finally:  # the registry is the process's: docs/errors.md is rendered from it
        base._REGISTRY.pop("test_body_declared", None)
        base._REGISTRY.pop("test_keyword_declared", None)
