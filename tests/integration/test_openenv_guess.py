"""The guess-the-number example (``examples/envs/guess``) over the real ``openenv`` server: the
reward is paid only at the end, errors are recoverable, and only a policy that keeps the
interval across turns wins every episode."""

import random

import pytest

from kiln.core.openenv import inspect_environment, normalize_url, open_session_and_reset
from tests.support.servers import serve_example_env

pytestmark = pytest.mark.timeout(120)

MAX_STEPS, LOW, HIGH = 8, 1, 64


@pytest.fixture(scope="module")
def guess_url():
    with serve_example_env("guess", max_concurrent_envs=2) as base_url:
        yield base_url


async def _play(url: str, seed: int, choose) -> tuple[list[float], list[dict]]:
    """One episode; ``choose(observations)`` picks each guess from every observation so far."""
    session, reset, _ = await open_session_and_reset(normalize_url(url), {"seed": seed}, capacity_wait_s=5)
    rewards, seen = [], [reset.observation["observation"]]
    try:
        result = reset
        while not result.done:
            result = await session.step({"guess": choose(seen)})
            assert result.kind == "observation"
            rewards.append(result.reward_value)
            seen.append({**result.observation["observation"], "metadata": result.observation.get("metadata")})
    finally:
        await session.close()
    return rewards, seen


def _bisect():
    lo, hi, last = LOW, HIGH, None

    def choose(seen):
        nonlocal lo, hi, last
        feedback = seen[-1]["feedback"]
        if feedback == "low":
            lo = last + 1
        elif feedback == "high":
            hi = last - 1
        last = (lo + hi) // 2
        return last
    return choose


async def test_inspect_guess(guess_url):
    inspection = await inspect_environment(guess_url)
    assert inspection["identity"]["environments"] == ["guess"]
    assert inspection["schema"]["action"]["required"] == ["guess"]


async def test_bisection_wins_every_seed_and_only_the_last_step_pays(guess_url):
    lengths = []
    for seed in range(12):
        secret = random.Random(seed).randint(LOW, HIGH)
        rewards, seen = await _play(guess_url, seed, _bisect())
        assert seen[-1]["feedback"] == "correct" and len(rewards) <= 7
        assert rewards[:-1] == [0.0] * (len(rewards) - 1)
        assert rewards[-1] == 1.0 + (MAX_STEPS - len(rewards)) / MAX_STEPS
        assert f"{secret} is correct!" in seen[-1]["input_text"]
        lengths.append(len(rewards))
    assert max(lengths) >= 6  # episodes of 6 or more steps occur


async def test_errors_are_recoverable_and_forgetting_the_interval_loses(guess_url):
    secret = random.Random(5).randint(LOW, HIGH)
    wrong = 1 if secret != 1 else 2
    plays = iter([0, wrong, wrong, 65, wrong, wrong, wrong, wrong])  # out of range, repeated: steps lost
    rewards, seen = await _play(guess_url, 5, lambda s: next(plays))
    assert len(rewards) == MAX_STEPS and rewards == [0.0] * MAX_STEPS  # ran out: the episode pays 0
    assert [o["feedback"] for o in seen[1:5]] == ["out_of_range", "low" if wrong < secret else "high",
                                                  "repeated", "out_of_range"]
    assert seen[1]["metadata"] == {"error": "out_of_range"} and seen[3]["metadata"] == {"error": "repeated"}
    assert [o["guesses_left"] for o in seen[1:]] == list(range(MAX_STEPS - 1, -1, -1))
    # Recovering after an error: bisection after a lost guess still wins within the 7 guesses left.
    bisect, errors = _bisect(), [99]
    rewards, seen = await _play(guess_url, 5, lambda s: errors.pop() if errors else bisect(s))
    assert seen[1]["feedback"] == "out_of_range" and seen[-1]["feedback"] == "correct"
    assert rewards[-1] == 1.0 + (MAX_STEPS - len(rewards)) / MAX_STEPS and sum(rewards[:-1]) == 0.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kiln_collects_and_trains_on_guess(guess_url, tiny_model_dir, tmp_path):
    """Kiln's collector plays the guess env with the tiny demo model (8-step episodes) and trains
    one epoch on the groups: the receipt's token counts are the collected pieces', and the drift
    KL is positive (the policy moved)."""
    torch = pytest.importorskip("torch")
    from kiln.core.training_config import TrainingConfig
    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.train.trainer import train_grpo
    from tests.support.counter_loop import collect

    torch.set_num_threads(1)
    runtime = PolicyRuntime.load(tiny_model_dir)
    documents = collect(runtime, guess_url, [0, 1, 2, 3], group_size=3, max_steps=MAX_STEPS, max_action_tokens=24)
    lines = [d["line"] for d in documents]
    completions = [c for line in lines for c in line["completions"]]
    assert len(completions) == 12
    for c in completions:
        actions = [p for p in c["tokens"]["pieces"] if p["kind"] == "action"]
        assert 1 <= len(actions) <= MAX_STEPS
    # Make every group trainable whatever the tiny model played: distinct rewards per completion.
    for line in lines:
        for i, c in enumerate(line["completions"]):
            c["reward"] = float(c["reward"]) + 0.1 * i
    result = train_grpo(model_path=tiny_model_dir, groups=lines,
                        config=TrainingConfig(epochs=1, learning_rate=1e-3, seed=0), output_dir=tmp_path / "out")
    pieces = [p for c in completions for p in c["tokens"]["pieces"]]
    assert result.receipt["token_counts"]["action_tokens"] == sum(len(p["ids"]) for p in pieces if p["kind"] == "action")
    assert result.steps == 4 and result.kl_to_previous > 0
