"""The training stage across online-run iterations, through real SeaweedFS: iteration 1 stores its
optimizer state, iteration 2 continues from it (the receipt names the stored object), a stale
iteration scores its data with the behaviour adapter; the curve figures come back in TrainResult."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kiln.core.artifacts.adapters import adapter_ref_from_files  # noqa: E402
from kiln.core.artifacts.group_sets import group_set  # noqa: E402
from kiln.core.artifacts.store import S3Store  # noqa: E402
from kiln.core.canonical import canonical_json  # noqa: E402
from kiln.core.training_config import TrainingConfig
from kiln.core.errors import TrainingFailed  # noqa: E402
from kiln.core.policy.identity import model_content_sha256  # noqa: E402
from kiln.core.records import AdapterRef, StoredObject, TrainInput, TrainResult  # noqa: E402
from kiln.core.stages.training import train  # noqa: E402
from tests.unit.test_train_support import BEHAVIOR, bandit_groups, build_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _inputs(store: S3Store, groups: list[dict], behavior: dict, **fields) -> TrainInput:
    refs = [StoredObject.of(store.put_blob(canonical_json({"group_index": i, "line": g})))
            for i, g in enumerate(groups)]
    config = TrainingConfig(seed=3, epochs=1, optimizer="adamw", learning_rate=2e-2, echo={"lambda": 0.1},
                            is_level="token", kl_coeff=0.1)  # the KL curve figures need KL on
    return TrainInput(run_id="online", groups=group_set(store, [refs]), training_config=config, output_adapter="it",
                      behavior_policy=behavior, **fields)


def _ref(result: TrainResult) -> AdapterRef:
    return adapter_ref_from_files("it", result.adapter_sha256 or "", result.adapter_files)


def _receipt(store: S3Store, result: TrainResult) -> dict:
    assert result.receipt is not None
    return json.loads(store.get_bytes(result.receipt.ref()))


def test_iterations_hand_over_the_optimizer_state(s3_server: dict[str, str], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    store = S3Store(endpoint=s3_server["endpoint"], access_key=s3_server["access_key"],
                    secret_key=s3_server["secret_key"], bucket=s3_server["bucket"])
    model = build_tiny_qwen3(tmp_path / "model")
    behavior = {**BEHAVIOR, "base_model_sha256": model_content_sha256(model)}
    groups = bandit_groups(3, behavior=behavior, warning=True)

    def run(name: str, inp: TrainInput) -> TrainResult:
        work = tmp_path / name
        work.mkdir()
        return train(inp, store=store, model_path=model, work_dir=work, cache_dir=tmp_path / "cache",
                     heartbeat=lambda _d: None, should_cancel=lambda: False)

    single = run("single", _inputs(store, groups, behavior))
    assert single.final_state is None and "continued_from" not in _receipt(store, single)
    first = run("first", _inputs(store, groups, behavior, keep_state=True))
    assert first.adapter_sha256 == single.adapter_sha256  # keeping the state changes no byte
    assert first.final_state is not None and first.final_state.bytes > 0
    receipt = _receipt(store, first)
    assert receipt["final_state_sha256"] == first.final_state.sha256
    # Curve figures: 12 completions × (3 context + turn 1: 2 action + 3 warning + 6 observation +
    # 2 context + turn 2: 2 action + 6 observation + 2 context), every token counted once.
    assert (first.tokens, first.action_tokens) == (12 * 26, 12 * 4)
    assert first.kl == pytest.approx(sum(s["kl"] for s in receipt["steps"]) / 3)
    assert first.final_loss == receipt["loss"]["final"]

    second = run("second", _inputs(store, groups, behavior, base_adapter=_ref(first),
                                   init_state=first.final_state, keep_state=True))
    continued = _receipt(store, second)["continued_from"]
    assert continued == {"adapter_sha256": first.adapter_sha256,
                         "optimizer_state_sha256": first.final_state.sha256, "optimizer_steps_before": 3}
    assert second.final_state is not None and second.final_state.sha256 != first.final_state.sha256
    fresh = run("fresh", _inputs(store, groups, behavior, base_adapter=_ref(first)))
    assert fresh.adapter_sha256 != second.adapter_sha256

    # Iteration 3 with max_staleness 1: data sampled by adapter 1 while iteration 2 trained.
    stale_behavior = {**behavior, "adapter_sha256": first.adapter_sha256}
    stale_groups = bandit_groups(3, behavior=stale_behavior)
    third = run("third", _inputs(store, stale_groups, stale_behavior, base_adapter=_ref(second),
                                 init_state=second.final_state, behavior_adapter=_ref(first), staleness=1))
    stale = _receipt(store, third)
    assert stale["staleness"]["behavior_adapter_sha256"] == first.adapter_sha256
    assert stale["staleness"]["is_max_weight"] == 2.0
    assert [s["staleness"] for s in stale["steps"]] == [1, 1, 1]
    assert all(s["is_weight_max"] <= 2.0 for s in stale["steps"])

    # A state handed to the wrong adapter is refused before any artifact is stored.
    with pytest.raises(TrainingFailed) as err:
        run("wrong", _inputs(store, groups, behavior, base_adapter=_ref(second), init_state=first.final_state))
    assert err.value.code == "resume_invalid"


@pytest.mark.timeout(300)
def test_stale_behaviour_logprobs_reproduce_the_samplers(tiny_model_dir: Path, counter_env_url: str,
                                                         tmp_path: Path) -> None:
    """Groups sampled by adapter A (T=0.7, unconstrained) on the counter environment, trained stale
    from adapter B: the behaviour log-probs the trainer scores with A equal the sampler's recorded
    ones on every action token."""
    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.train.batches import collate
    from kiln.core.train.trainer import prepare_training
    from tests.support.counter_loop import collect
    from tests.support.models import make_lora_adapter

    torch.set_num_threads(1)
    sampler = make_lora_adapter(tiny_model_dir, tmp_path / "A", seed=5, scale=0.1)
    start = make_lora_adapter(tiny_model_dir, tmp_path / "B", seed=6, scale=0.1)
    runtime = PolicyRuntime.load(tiny_model_dir)
    documents = collect(runtime, counter_env_url, [400, 401, 402], group_size=3, temperature=0.7,
                        adapter_dir=sampler)
    lines = [d["line"] for d in documents]
    identity = lines[0]["completions"][0]["openenv"]["behavior_policy"]
    config = TrainingConfig(epochs=1, echo=None, optimizer="adamw")
    loop, plan = prepare_training(model_path=tiny_model_dir, groups=lines, config=config, work_dir=tmp_path / "w",
                                  base_adapter_dir=start, expected_behavior_policy=identity,
                                  behavior_adapter_dir=sampler, staleness=1)
    assert plan.settings.temperature == 0.7 and len(plan.kept) >= 2
    from kiln.core.train.batches import group_rows
    from kiln.core.train.step import batch_logprobs

    checked, start_deviation = 0, 0.0
    for index, (group, rows) in enumerate(zip(plan.kept, loop.rows)):
        recorded = collate(group_rows(group, group_index=index, warning_filter=True))
        scored = collate(rows)
        mask = scored.action_mask
        assert torch.equal(mask, recorded.action_mask)
        deviation = ((scored.behavior_logprobs - recorded.behavior_logprobs).abs() * mask).max()
        assert float(deviation) <= 1e-4, index
        checked += int(mask.sum())
        with torch.no_grad():  # the starting adapter B's own log-probs are not the sampler's
            own = batch_logprobs(loop.model, scored, 0.7)
        start_deviation = max(start_deviation, float(((own - recorded.behavior_logprobs).abs() * mask).max()))
    assert checked > 50 and start_deviation > 1e-2


def test_data_past_the_version_bound_is_dropped_and_counted(s3_server: dict[str, str], tmp_path: Path) -> None:
    """max_staleness 2, iteration 5 (training starts from version 4) on groups that version 1
    sampled (lag 3): every group is dropped before training, each with its warning, and counted;
    without allow_empty_training that is zero_groups, naming the bound."""
    store = S3Store(endpoint=s3_server["endpoint"], access_key=s3_server["access_key"],
                    secret_key=s3_server["secret_key"], bucket=s3_server["bucket"])
    groups = bandit_groups(3, behavior=BEHAVIOR)
    past = {"iteration": 5, "staleness": 3, "max_staleness": 2, "behavior_version": 1}

    def run(name: str, inp: TrainInput) -> TrainResult:
        return train(inp, store=store, model_path=tmp_path / "unused", work_dir=tmp_path / name,
                     cache_dir=tmp_path / "cache", heartbeat=lambda _d: None, should_cancel=lambda: False)

    result = run("empty", _inputs(store, groups, BEHAVIOR, allow_empty_training=True, **past))
    assert not result.trained and result.selection_ref is not None
    selection = json.loads(store.get_bytes(result.selection_ref.ref()))
    assert selection["stale"] == {"max_staleness": 2, "trained_from_version": 4, "lags": {"3": 3}, "dropped_groups": 3}
    assert selection["stale_groups_dropped"] == 3 and selection["groups_submitted"] == 3
    assert selection["warnings"] == [
        f"group {g} was sampled 3 adapter versions behind version 4, past max_staleness 2; dropped before training"
        for g in range(3)
    ]
    with pytest.raises(TrainingFailed) as err:
        run("refused", _inputs(store, groups, BEHAVIOR, **past))
    assert err.value.code == "training_failed" and "past max_staleness 2" in err.value.message
    assert err.value.details["reason"] == "zero_groups"
