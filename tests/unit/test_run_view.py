"""``RunView``/``RunList``: the API's typed run answers parse every status a workflow has produced."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.core.run_status import RunStatus
from kiln.core.run_view import RunList, RunView

HISTORIES = Path(__file__).resolve().parents[1] / "histories"


def _completed_results() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(HISTORIES.glob("*/*.json")):  # every kept release
        for event in json.loads(path.read_text())["events"]:
            attrs = event.get("workflowExecutionCompletedEventAttributes")
            if attrs and attrs.get("result", {}).get("payloads"):
                out.append((path.name, json.loads(base64.b64decode(attrs["result"]["payloads"][0]["data"]))))
    return out


@pytest.mark.timeout(30)
def test_every_recorded_workflow_result_parses_as_a_run_view() -> None:
    results = _completed_results()
    assert len(results) >= 5  # rollout, model_rollout, online_rl, train_dataset, train_with_gate
    for name, result in results:
        view = RunView.model_validate({**result, "status_source": "result"})
        # Every key the workflow wrote comes back unchanged, under the same name (a field newer than
        # the recording release is left out here: it takes its default in the view).
        written = view.model_dump(mode="json", by_alias=True, exclude_unset=True)
        for key, value in result.items():
            assert written[key] == value, (name, key)
        assert view.model_dump(mode="json", by_alias=True)["schema"] == "kiln.run-status.v1"


@pytest.mark.timeout(30)
def test_run_view_is_run_status_plus_the_api_fields() -> None:
    own = set(RunView.model_fields) - set(RunStatus.model_fields)
    assert own == {
        "status_source", "started_at", "closed_at", "temporal_ui", "in_flight",
        "training_progress", "live_training", "cancel_requested", "unclaimed", "termination",
    }
    stub = RunView(run_id="r", phase="unknown", status_source="history")
    assert stub.timed_out and not stub.terminal
    assert not RunView(state="failed", status_source="history").timed_out
    with pytest.raises(ValidationError):
        RunView.model_validate({"run_id": "r", "no_such_field": 1})


@pytest.mark.timeout(30)
def test_run_list_round_trips_with_its_schema_name() -> None:
    body = {
        "schema": "kiln.openenv-run-list.v1",
        "runs": [{"run_id": "a", "state": "failed", "failure_code": "environment_unavailable"}],
    }
    listing = RunList.model_validate(body)
    assert listing.runs[0].failure_code == "environment_unavailable"
    assert listing.model_dump(mode="json", by_alias=True)["schema"] == "kiln.openenv-run-list.v1"
    with pytest.raises(ValidationError):
        RunList.model_validate({"runs": [{"run_id": "a", "state": "sleeping"}]})


@pytest.mark.timeout(30)
def test_a_status_from_another_version_keeps_what_it_can() -> None:
    from api.runs import _view_of

    newer = _view_of({"run_id": "r", "phase": "training", "added_later": 1,
                      "progress": {"groups_completed": 3}}, "query")
    assert (newer.phase, newer.progress.groups_completed, newer.status_source) == ("training", 3, "query")
    assert newer.warnings == ["this API could not read every field of the run's status (another Kiln version)"]
    broken = _view_of({"run_id": "r", "phase": "training", "progress": {"renamed": 1}}, "query")
    assert broken.timed_out and broken.phase == "unknown"
