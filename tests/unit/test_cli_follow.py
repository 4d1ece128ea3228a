"""``--follow`` when stdout is not a terminal: one plain line per event, 4 significant digits; a
timed-out status query never shows as a line; the terminal summary keeps links whole; ``runs``
fits 80 columns."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from kiln.cli.console import KilnConsole
from kiln.cli.control_cmds import runs_header, runs_row
from kiln.cli.follow import TIMED_OUT_NOTICE, follow, num, print_outcome, progress_line, progress_view
from kiln.core.run_view import RunSummary, RunView

DIGEST = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"


def _status(phase: str, groups: int, state: str = "running", **extra: object) -> RunView:
    return RunView.model_validate(
        {"run_id": "r1", "state": state, "phase": phase,
         "progress": {"groups_completed": groups, "groups_total": 2, "rollouts_completed": 2 * groups,
                      "rollouts_total": 4}, **extra})


def test_number_format() -> None:
    assert num(0.45233768224716187) == "0.4523"
    assert num(1234567.0) == "1.235e+06"
    assert num(3) == "3" and num(None) == "-" and num(2.5) == "2.5"


@pytest.mark.timeout(30)
def test_follow_prints_one_line_per_event_when_not_a_terminal() -> None:
    sequence = [
        _status("collecting", 0),
        _status("collecting", 0),  # no change: no line
        _status("collecting", 1, mean_return=0.6666666),
        _status("training", 2, mean_return=0.75, training_progress={"step": 3, "total_steps": 8, "loss": 0.45233768224716187, "kl": 0.0, "env_ce": 11.123456}),
        _status("completed", 2, state="completed", mean_return=0.75),
    ]
    calls = iter(sequence)
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    final = follow(lambda: next(calls), console, poll_s=0.0)
    assert final.state == "completed"
    lines = out.getvalue().splitlines()
    assert lines == [
        "phase=collecting  groups=0/2  episodes=0/4",
        "phase=collecting  groups=1/2  episodes=2/4  mean_return=0.6667",
        "phase=training  groups=2/2  episodes=4/4  mean_return=0.75  train_step=3/8  loss=0.4523  kl=0  env_ce=11.12",
        "phase=completed  groups=2/2  episodes=4/4  mean_return=0.75",
    ]


def test_outcome_has_no_highlighting_and_short_numbers() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, highlight=False, width=200)
    status = _status("completed", 2, state="completed", mean_return=0.75,
                     training={"trained": True, "steps": 8, "final_loss": 0.45233768224716187, "adapter_sha256": DIGEST,
                               "selection": {}, "skip_reason": None})
    assert print_outcome(status, console) == 0
    text = out.getvalue()
    assert "final loss 0.4523," in text
    assert DIGEST in text  # printed whole, not split by colour codes
    assert "\x1b[1;36m" not in text and "\x1b[32m" not in text  # rich's number/string highlighter


def test_runs_table_fits_80_columns_and_wide_shows_everything() -> None:
    header = runs_header()
    assert header.split() == ["RUN", "STATE", "KIND", "ADAPTER", "RETURN", "PROMOTED", "STARTED"]
    done = RunSummary.model_validate({"run_id": "0123abcd" + "0" * 28, "state": "completed", "kind": "train", "phase": "completed",
            "output_adapter": "counter-agent-with-a-long-name", "mean_return": 2.6666666, "promoted": True,
            "evaluated": True, "started_at": "2026-12-01T07:55:03.123456+00:00"})
    row = runs_row(done)
    assert row.split() == ["0123abcd", "completed", "train", "counter-age…", "2.667", "yes", "12-01", "07:55"]
    running = runs_row(RunSummary(run_id="1" * 36, state="running", kind="rollout", phase="post_evaluating"))
    assert running.split()[:4] == ["1" * 8, "post_evaluating", "rollout", "-"]
    # promoted without an evaluation: status says promoted, so does the column (issue 41)
    assert runs_row(done.model_copy(update={"evaluated": False})).split()[5] == "yes"
    unevaluated = runs_row(done.model_copy(update={"evaluated": False, "promoted": False}))
    assert unevaluated.split()[5:7] == ["no", "eval"]
    failed = RunSummary(run_id="2" * 36, state="failed", kind="rollout", failure_code="environment_unavailable",
                        started_at="2026-12-01T07:55:03+00:00")
    for line in (header, row, running, unevaluated, runs_row(failed)):
        assert len(line) <= 80, line
    wide = runs_row(done, wide=True)
    assert wide.split()[:5] == [done.run_id, "completed", "train", "counter-agent-with-a-long-name", "2.667"]
    assert wide.endswith("2026-12-01T07:55:03.123456+00:00")
    assert runs_row(failed, wide=True).split()[-2:] == ["environment_unavailable", "2026-12-01T07:55:03+00:00"]
    assert runs_header(wide=True).split()[3] == "PHASE"


def test_online_runs_show_the_iteration_and_the_curve() -> None:
    status = _status("training", 8, mean_return=3.5, iteration=3, iterations_total=4,
                     iterations=[{"iteration": 1, "seed_start": 0, "behavior_adapter_sha256": None, "mean_return": 2.4375},
                                 {"iteration": 2, "seed_start": 8, "behavior_adapter_sha256": DIGEST, "mean_return": 3.125}])
    assert progress_line(status).startswith("phase=training  iteration=3/4  groups=8/")
    out = io.StringIO()
    Console(file=out, force_terminal=False, width=200).print(progress_view(status))
    assert "3/4  returns 2.438 → 3.125" in out.getvalue()


@pytest.mark.timeout(30)
def test_follow_keeps_the_last_real_status_while_the_status_query_times_out() -> None:
    stub = RunView(run_id="r1", phase="unknown", status_source="history")  # what the API answers
    assert stub.timed_out
    sequence = [_status("collecting", 0), stub, stub, _status("collecting", 1), stub,
                _status("completed", 2, state="completed")]
    calls = iter(sequence)
    out, notes = io.StringIO(), io.StringIO()
    final = follow(lambda: next(calls), Console(file=out, force_terminal=False, width=200), poll_s=0.0,
                   notices=Console(file=notes, force_terminal=False, width=200))
    assert final.state == "completed"
    assert out.getvalue().splitlines() == [
        "phase=collecting  groups=0/2  episodes=0/4",
        "phase=collecting  groups=1/2  episodes=2/4",
        "phase=completed  groups=2/2  episodes=4/4",
    ]
    assert notes.getvalue() == TIMED_OUT_NOTICE + "\n"  # one line, however many timeouts


@pytest.mark.timeout(30)
def test_follow_waits_for_a_first_real_status_and_a_failed_stub_is_final() -> None:
    stub = RunView(run_id="r1", phase="unknown", status_source="history")
    failed = RunView.model_validate({"run_id": "r1", "state": "failed", "phase": "failed", "status_source": "history",
                                     "failure": {"code": "environment_unavailable", "stage": "discovery", "message": "down"}})
    calls = iter([stub, stub, failed])
    out, notes = io.StringIO(), io.StringIO()
    final = follow(lambda: next(calls), Console(file=out, force_terminal=False, width=200), poll_s=0.0,
                   notices=Console(file=notes, force_terminal=False, width=200))
    assert final.failure is not None and final.failure.code == "environment_unavailable"
    assert out.getvalue().splitlines() == ["phase=failed  groups=0/0  episodes=0/0"]
    assert notes.getvalue().splitlines() == [TIMED_OUT_NOTICE]


def _visible_lines(text: str) -> list[str]:
    """Terminal output without colour and hyperlink escapes, as lines."""
    text = re.sub(r"\x1b\]8;[^\x1b]*\x1b\\", "", text)
    return re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()


def test_tty_summary_prints_links_whole_and_the_run_page() -> None:
    out = io.StringIO()
    console = KilnConsole(file=out, force_terminal=True, width=80)
    run_id = "6f1c1f1e-8d2a-4c55-9a57-4b9a3c1d2e10"
    ui = f"http://127.0.0.1:8233/namespaces/default/workflows/{run_id}"
    manifest = f"s3://kiln-artifacts/runs/{run_id}/manifest.json"
    status = _status("completed", 2, state="completed", run_id=run_id, temporal_ui=ui,
                     manifest={"uri": manifest, "sha256": DIGEST},
                     training={"trained": True, "steps": 8, "final_loss": 0.5, "adapter_sha256": DIGEST,
                               "selection": {}, "skip_reason": None})
    assert print_outcome(status, console, "http://127.0.0.1:8000/") == 0
    raw = out.getvalue()
    lines = _visible_lines(raw)
    page = f"http://127.0.0.1:8000/runs/{run_id}"
    assert f"web ui   {ui}" in lines
    assert f"run page {page}" in lines
    assert lines.index(f"web ui   {ui}") + 1 == lines.index(f"run page {page}")  # next to each other
    assert f"\x1b]8;id=" in raw and f";{page}\x1b\\" in raw  # a terminal hyperlink
    for text in (manifest, DIGEST):  # longer than 80 columns together, never cut
        assert any(text in line for line in lines), text
    assert max(len(line) for line in lines) > 80  # soft wrap: the terminal, not Kiln, folds lines


@pytest.mark.timeout(30)
def test_the_gate_line_says_its_verdict_once() -> None:
    verdict = "Promoted: the trained adapter passed the gate and is now served; 5 wins; mean return 0.2 -> 0.8."
    evidence = {"paired_groups": 20, "baseline_mean_return": 0.2, "candidate_mean_return": 0.8, "improved_groups": 5,
                "regressed_groups": 0, "tied_groups": 15, "exact_sign_test_p_value": 0.03125}
    status = RunView.model_validate({
        "run_id": "r", "state": "completed", "environment_evaluation": {
            "state": "done", "seed_start": 0, "groups": 20, "group_size": 2,
            "progress": {"groups_total": 20, "rollouts_total": 40}, "decision": "passed", "outcome": "promoted",
            "verdict": verdict, "evidence": evidence}})
    out = io.StringIO()
    print_outcome(status, Console(file=out, force_terminal=False, width=400))
    gate = [line for line in out.getvalue().splitlines() if line.startswith("gate")]
    assert gate == [f"gate     {verdict}"]
