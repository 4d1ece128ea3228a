"""Fuzz the REST API from its own OpenAPI document with schemathesis (issue 14).

The real app served by uvicorn on loopback, with a real Temporal dev server and SeaweedFS (the
session fixtures) and a real control worker, so accepted runs start and are answered quickly.
Every operation gets schema-valid (positive) and schema-breaking (negative) requests; the test
asserts that no answer is a 500, every error answer is the Kiln envelope with a documented code,
and a 5xx other than an unreachable environment's 502 never happens. The figures are printed
(``-s``) and kept in ``FIGURES``.

How many: ``KILN_FUZZ_PER_OPERATION`` examples per operation and mode (default 40: about 800
requests, a minute on a 2-core machine busy with other work, as part of every suite run);
``KILN_FUZZ_PER_OPERATION=150`` is the long fuzz (over 2,000 requests). The test asserts at least
``MIN_REQUESTS`` = 40/3 × that number were answered, so a schema that stopped generating cases fails.

Negative mode is not tried on an operation with nothing to violate (``nothing_to_break``: only
free-form string path parameters, no body but raw bytes), where it could generate no request.

Excluded by design: positive requests to ``/v1/openenv/training/preflight`` (a valid one waits up
to 6 minutes for a gpu worker to resolve the behaviour policy; its negative requests are fuzzed).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.integration.test_api_helpers import serve_api
from tests.support.kiln_workers import running_workers

ROOT = Path(__file__).resolve().parents[2]
# Examples per operation and mode: 40 by default (about 800 requests), 150 for the long fuzz (~2,400).
PER_OPERATION = int(os.environ.get("KILN_FUZZ_PER_OPERATION", "40"))
MIN_REQUESTS = PER_OPERATION * 40 // 3  # 2,000 at 150
FIGURES: dict[str, Any] = {}
# The 5xx a fuzzer can legitimately provoke: a generated environment URL that does not answer.
UPSTREAM_CODES = {"environment_unavailable", "openenv_inspection_failed", "openenv_task_catalog_failed"}


def documented_codes() -> set[str]:
    """Every code listed in docs/errors.md (generated from kiln/core/errors/; the contract answers are held to)."""
    text = (ROOT / "docs" / "errors.md").read_text()
    return set(re.findall(r"^\| `([a-z][a-z0-9_]+)` \|", text, flags=re.MULTILINE))


def nothing_to_break(document: dict[str, Any], operation: Any) -> bool:
    """Whether negative generation has nothing to violate in ``operation``: no query, header or
    cookie parameter, every path parameter any string, and no body but raw bytes. Hypothesis would
    reject about 460 attempts (seconds) before raising ``Unsatisfiable`` for such an operation."""
    definition = document["paths"][operation.path][operation.method.lower()]
    for parameter in definition.get("parameters", []):
        schema = {k: v for k, v in parameter.get("schema", {}).items() if k not in ("title", "description")}
        if parameter["in"] != "path" or schema != {"type": "string"}:
            return False
    content = definition.get("requestBody", {}).get("content", {})
    return all(media["schema"] == {"type": "string", "format": "binary"} for media in content.values())


class _ControlWorker:
    """A real control worker on its own thread and event loop (the fuzzer is synchronous)."""

    def __init__(self, settings_obj: Any) -> None:
        self.settings = settings_obj
        self.ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with running_workers(self.settings, roles=("control",)):
            self.ready.set()
            await self._stop.wait()

    def __enter__(self) -> "_ControlWorker":
        self.thread.start()
        assert self.ready.wait(60), "the control worker did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fuzz_the_api_from_its_openapi(kiln_settings: Any, counter_env_url: str) -> None:
    app_settings = kiln_settings()
    codes = documented_codes()
    statuses: Counter[int] = Counter()
    by_code: Counter[str] = Counter()
    problems: list[str] = []
    timings: dict[str, tuple[int, float]] = {}
    unbreakable: list[str] = []  # operations whose negative mode has nothing to violate
    with _ControlWorker(app_settings), serve_api(app_settings) as base_url:
        document = httpx.get(f"{base_url}/openapi.json", timeout=30).json()
        schema = schemathesis.openapi.from_dict(document)
        session = requests.Session()

        def check(case: Any) -> None:
            response = case.call(base_url=base_url, session=session, timeout=60)
            statuses[response.status_code] += 1
            if response.status_code < 400:
                return
            try:
                body = response.json()
            except ValueError:
                problems.append(f"{case.method} {case.path}: {response.status_code} not JSON")
                return
            code = body.get("code") if isinstance(body, dict) else None
            by_code[str(code)] += 1
            if not isinstance(code, str) or not isinstance(body.get("message"), str) or "retryable" not in body:
                problems.append(f"{case.method} {case.path}: {response.status_code} not the envelope: {body}")
            elif code not in codes:
                problems.append(f"{case.method} {case.path}: undocumented code {code}")
            if response.status_code >= 500 and code not in UPSTREAM_CODES:
                problems.append(f"{case.method} {case.path}: {response.status_code} {body}")

        operations = [result.ok() for result in schema.get_all_operations()]
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.POSITIVE and operation.path.endswith("/training/preflight"):
                    continue
                if mode is GenerationMode.NEGATIVE and nothing_to_break(document, operation):
                    unbreakable.append(operation.label)
                    continue

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(max_examples=PER_OPERATION, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                def run(case: Any) -> None:
                    check(case)

                started = time.monotonic()
                before = sum(statuses.values())
                try:
                    run()
                except Unsatisfiable:  # negative mode of an operation with nothing to break
                    assert mode is GenerationMode.NEGATIVE, operation.label
                timings[f"{mode.value} {operation.label}"] = (
                    sum(statuses.values()) - before, round(time.monotonic() - started, 1))
        # Accepted runs: schema-valid bodies aimed at a real, healthy environment, so the 202 path
        # (preflight passed, workflow started, status answered) is fuzzed too.
        submit = schema.find_operation_by_label("POST /v1/openenv/runs")
        accepted: list[str] = []

        @given(case=submit.as_strategy(generation_mode=GenerationMode.POSITIVE))
        @settings(max_examples=PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def run_accepted(case: Any) -> None:
            if isinstance(case.body, dict):
                case.body["environment_urls"] = [counter_env_url]
                for key in ("environments", "credential_ids", "environment_reset_options"):
                    case.body.pop(key, None)
            case.query = {}
            response = case.call(base_url=base_url, session=session, timeout=60)
            statuses[response.status_code] += 1
            if response.status_code == 202:
                accepted.append(response.json()["run_id"])
                assert response.json()["kind"] in ("rollout", "train")
            elif response.status_code >= 400:
                by_code[str(response.json().get("code"))] += 1
                if response.status_code >= 500 or response.json().get("code") not in codes:
                    problems.append(f"accepted-path {response.status_code} {response.text[:300]}")

        started = time.monotonic()
        run_accepted()
        timings["positive POST /v1/openenv/runs (real environment)"] = (PER_OPERATION, round(time.monotonic() - started, 1))
        for run_id in accepted:
            session.post(f"{base_url}/v1/openenv/runs/{run_id}/cancel", timeout=60)
        FIGURES["accepted_runs"] = len(accepted)
    total = sum(statuses.values())
    FIGURES.update(requests=total, statuses=dict(statuses), codes=dict(by_code),
                   operations=len(operations), unbreakable=unbreakable)
    print(f"\nschemathesis fuzz: {total} requests over {len(operations)} operations; "
          f"statuses {dict(sorted(statuses.items()))}; 5xx {sum(n for s, n in statuses.items() if s >= 500)} "
          f"(500: {statuses.get(500, 0)}); accepted runs {FIGURES.get('accepted_runs')}; codes {dict(by_code)}")
    for label, (count, seconds) in timings.items():
        print(f"  {label}: {count} requests, {seconds} s")
    print(f"  negative mode skipped (nothing to violate): {unbreakable}")
    assert problems == [], problems[:20]
    assert statuses.get(500, 0) == 0
    assert total >= MIN_REQUESTS, total
