"""Rules the test suite holds itself to (issue 14 §9): nothing can hang, nothing has sub-second
timing slack.

- Every test runs under pytest-timeout (a default in pyproject; long ones marked).
- No bare ``await <handle>.result()``: a workflow result is awaited through
  ``tests.support.waiting.workflow_result`` (or ``asyncio.wait_for``), so a stuck run fails the
  test instead of waiting up to the 12 h training timeout.
- No timing assert with less than a second of slack (``< 0.05``-style bounds flake on 2 cores).
- No assert on a wall-clock ratio (``assert shared <= 2.0 * solo``): on runs of a second or two,
  scheduling noise decides it. Assert the property from histories or counts; a ratio that is the
  point belongs in ``bench/``.
- No digest of float results pinned from one machine: CPU kernels differ between machines. The
  ``sha256:`` literals the suite may pin are digests of canonical JSON, listed in
  ``PINNED_CANONICAL_DIGESTS`` with what each one digests.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
BARE_RESULT = re.compile(r"await\s+(?!asyncio\.wait_for)[\w.\[\]()\"']*\.result\(\s*\)")
# e.g. `assert elapsed < 0.05`, `assert delta <= 0.3`: a timing bound below one second.
SUBSECOND_TIMING = re.compile(
    r"assert\s+[^\n]*(elapsed|took|duration|seconds|_s\b|time\.monotonic\(\)|timestamp\(\)|deadline)"
    r"[^\n]*([<>]=?|[-+])\s*0\.\d+"
)

# `assert shared <= 2.0 * solo` / `assert took < 3 * alone`: a ratio of two measured durations
# (names that say time; a ratio of losses or counts is fine).
RATIO_ASSERT = re.compile(r"assert\s+[\w.\[\]\"']+\s*<=?\s*[0-9.]+\s*\*\s*[\w.\[\]\"']+")
TIMING_WORD = re.compile(r"solo|alone|shared|elapsed|seconds|duration|took|wall|time|_s\b|blocked")
DIGEST_LITERAL = re.compile(r"sha256:[0-9a-f]{64}")
# Every digest literal the tests pin, with where it is and what it digests: canonical JSON only.
PINNED_CANONICAL_DIGESTS = {
    "sha256:8c9d210f72f7cf830065c9b60747192282be51534dc6c217e7af1ba7151c9696":
        ("tests/unit/test_openenv_identity.py", "digest_json of a small JSON document (canonical form)"),
    "sha256:5f225581baf49279bb2f41d15bc7bd751e6784a74e0366b3117bae6b605d65d7":
        ("tests/unit/test_online_plan.py", "request_digest of a run request (canonical JSON)"),
    "sha256:08f2095cfc0fc441b62020716f2cbf01ed3268692c623f171b82e80fb473eae0":
        ("tests/unit/test_run_request.py", "reset_plan_sha256 of two reset templates (canonical JSON)"),
    "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef":
        ("tests/unit/test_cli_follow.py", "a made-up digest the CLI formats (no hashing)"),
}


def _test_sources() -> list[Path]:
    return [p for p in TESTS.rglob("*.py") if p.name != "test_suite_rules.py"]


def test_pytest_timeout_is_configured_for_every_test() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    options = config["tool"]["pytest"]["ini_options"]
    assert int(options["timeout"]) > 0
    assert any(dep.startswith("pytest-timeout") for dep in config["project"]["optional-dependencies"]["test"])
    assert "pytest-timeout==" in (ROOT / "constraints.txt").read_text()


def test_no_bare_workflow_result_waits() -> None:
    offenders = []
    for path in _test_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith(("#", "A bare")) or "``" in line:
                continue  # prose, not code
            if BARE_RESULT.search(line) and "wait_for" not in line:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "use tests.support.waiting.workflow_result:\n" + "\n".join(offenders)


def test_no_subsecond_timing_asserts() -> None:
    offenders = []
    for path in _test_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if SUBSECOND_TIMING.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)


def test_no_wall_clock_ratio_asserts() -> None:
    offenders = []
    for path in _test_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = RATIO_ASSERT.search(line)
            if match and TIMING_WORD.search(match.group(0)):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "assert the property, or move the ratio to bench/:\n" + "\n".join(offenders)


def test_every_pinned_digest_is_of_canonical_json() -> None:
    """A new pinned digest must be added to PINNED_CANONICAL_DIGESTS with what it digests: never a
    digest of trained weights, log-probs or any other float result."""
    found: dict[str, set[str]] = {}
    for path in _test_sources():
        if path.suffix != ".py":
            continue
        for digest in DIGEST_LITERAL.findall(path.read_text()):
            found.setdefault(digest, set()).add(str(path.relative_to(ROOT)))
    unlisted = {d: sorted(paths) for d, paths in found.items() if d not in PINNED_CANONICAL_DIGESTS}
    assert unlisted == {}, f"pinned digests not known to be of canonical JSON: {unlisted}"
    for digest, (where, _what) in PINNED_CANONICAL_DIGESTS.items():
        assert where in found.get(digest, set()), f"{digest} is no longer pinned in {where}: drop it from the list"
