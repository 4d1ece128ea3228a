"""The context rule (kiln.core.rollout.context) on its own: the served context, the per-turn decision
and the status warning's threshold, checked against hand-counted figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kiln.core.rollout.context import context_warning, served_context
from kiln.core.rollout.episode import CandidateEpisode

pytestmark = pytest.mark.timeout(30)


def test_served_context_is_the_smaller_of_config_and_engine() -> None:
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096))
    assert served_context(SimpleNamespace(model=model)) == 4096
    engine = SimpleNamespace(config=SimpleNamespace(max_model_len=2048))
    assert served_context(SimpleNamespace(model=model, engine=engine)) == 2048
    assert served_context(SimpleNamespace()) is None
    # a wrapper that forwards calls (the gpu worker's locked policy) asks the runtime
    assert served_context(SimpleNamespace(context_tokens=lambda: 1024, model=lambda: None)) == 1024


def _episode(prompt: int, limit: int, action: int = 10) -> CandidateEpisode:
    return CandidateEpisode(candidate_index=0, prompt_ids=[1] * prompt, protocol_error_reward=-1.0,
                            max_recoverable_errors=3, context_limit=limit, max_action_tokens=action)


def test_a_turn_is_kept_only_when_it_leaves_room_for_an_action() -> None:
    ep = _episode(prompt=50, limit=100)
    assert ep.check_context()  # 50 + 10 <= 100
    ep.record_action([2] * 10, [-0.1] * 10, "a", 0.0)  # 60 ids
    ep.append_observation_tokens(([3] * 5, [4] * 20, [5] * 5), warning=False)  # 90 + 10 <= 100: kept
    assert ep.live and len(ep.context_ids) == 90
    ep.record_action([2] * 5, [-0.1] * 5, "b", 0.0)  # 95 ids
    ep.append_observation_tokens(([3], [4], [5]), warning=False)  # 98 + 10 > 100: left out
    assert ep.termination == "context_exhausted" and len(ep.context_ids) == 95
    assert ep.context_exhausted == {"code": "CONTEXT_EXHAUSTED", "limit_tokens": 100, "tokens": 95,
                                    "omitted_turn_tokens": 3}
    assert [p["kind"] for p in ep.pieces][-1] == "action"


def test_a_prompt_without_room_ends_before_sampling() -> None:
    ep = _episode(prompt=95, limit=100)
    assert not ep.check_context()
    assert ep.context_exhausted["omitted_turn_tokens"] == 0 and ep.episode_return == 0.0
    penalised = _episode(prompt=95, limit=100)
    penalised.penalise_context = True
    penalised.check_context()
    assert penalised.episode_return == -1.0


def test_the_warning_needs_more_than_half() -> None:
    assert context_warning({"rollouts": 4, "context_exhausted_count": 2, "context_tokens": 512}) is None
    message = context_warning({"rollouts": 4, "context_exhausted_count": 3, "context_tokens": 512})
    assert message is not None and message.startswith("3 of 4 episodes ended at the model's context (512 tokens")
    assert "--max-steps" in message and "max_position_embeddings" in message
    assert context_warning({"rollouts": 0}) is None


def test_the_outcome_line_counts_context_exhausted_episodes() -> None:
    import io

    from rich.console import Console

    from kiln.cli.follow import print_outcome
    from kiln.core.run_view import RunView

    stats = {"rollouts": 4, "mean_episode_return": 1.0, "min_episode_return": 0.0, "max_episode_return": 2.0,
             "done_count": 0, "invalid_model_action_count": 1, "context_exhausted_count": 3, "context_tokens": 409}
    status = RunView.model_validate({"run_id": "r1", "state": "completed", "phase": "completed", "rollout_stats": stats})
    out = io.StringIO()
    print_outcome(status, Console(file=out, width=300))
    assert "invalid actions 1  context exhausted 3 (of 409 tokens)" in out.getvalue()


def test_windowed_episodes_are_counted_and_warned_about() -> None:
    import io

    from rich.console import Console

    from kiln.cli.follow import print_outcome
    from kiln.core.run_view import RunView

    # half windowed, one ended: 3 of 4 outgrew the context, so the run warns and says how
    stats = {"rollouts": 4, "mean_episode_return": 1.0, "min_episode_return": 0.0, "max_episode_return": 2.0,
             "done_count": 0, "invalid_model_action_count": 0, "context_exhausted_count": 1,
             "context_windowed_count": 2, "context_tokens": 409}
    message = context_warning(stats)
    assert message is not None and message.startswith(
        "3 of 4 episodes outgrew the model's context (409 tokens): 2 kept going with their earliest turns "
        "dropped (CONTEXT_WINDOWED), 1 ended (CONTEXT_EXHAUSTED)"
    )
    assert "--max-steps" in message
    assert context_warning({**stats, "context_windowed_count": 1}) is None  # 2 of 4: not most
    status = RunView.model_validate({"run_id": "r1", "state": "completed", "phase": "completed", "rollout_stats": stats})
    out = io.StringIO()
    print_outcome(status, Console(file=out, width=300))
    assert "context exhausted 1 (of 409 tokens)  context windowed 2" in out.getvalue()


def test_the_window_drops_the_fewest_oldest_turns_brute_force() -> None:
    import itertools

    from kiln.core.rollout.context import window_drop

    for kept in itertools.product([3, 9, 20], repeat=3):
        for turn in (5, 30, 60):
            fits = [d for d in range(4) if 10 + sum(kept[d:]) + turn + 8 <= 60]
            assert window_drop(10, list(kept), turn, 8, 60) == (fits[0] if fits else None), (kept, turn)
