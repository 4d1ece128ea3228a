"""Online-run training on a tiny random Qwen3: the single-pass path unchanged, the optimizer state
continued across iterations (and refused when it is not the base adapter's), stale data trained
with truncated behaviour importance weights."""

from __future__ import annotations

import copy
import io
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kiln.core.canonical import digest_json, sha256_bytes  # noqa: E402
from kiln.core.training_config import TrainingConfig
from kiln.core.errors import PolicyIdentityChanged, RunCancelled, TrainingFailed  # noqa: E402
from kiln.core.policy.identity import ADAPTER_FILES  # noqa: E402
from kiln.core.train.batches import build_group_batch  # noqa: E402
from kiln.core.train.checkpoints import pack_folder, unpack_folder  # noqa: E402
from kiln.core.train.model import adapter_content_sha256  # noqa: E402
from kiln.core.train.trainer import prepare_training, train_grpo  # noqa: E402
from tests.support.models import make_lora_adapter  # noqa: E402
from tests.support.train_reference import evaluate  # noqa: E402
from tests.unit.test_train_support import BEHAVIOR, bandit_groups, build_tiny_qwen3  # noqa: E402

WALL_CLOCK = ("produced_at", "phase_timings")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return build_tiny_qwen3(tmp_path_factory.mktemp("continuation-model") / "model")


def _config(optimizer: str = "adamw", **overrides) -> TrainingConfig:
    return TrainingConfig(**{"seed": 3, "epochs": 1, "optimizer": optimizer, "learning_rate": 2e-2,
                             "is_level": "token", "kl_coeff": 0.1, **overrides})


def _bytes(adapter_dir: Path) -> dict[str, bytes]:
    return {name: (adapter_dir / name).read_bytes() for name in ADAPTER_FILES}


def _train(model_path: Path, out: Path, config: TrainingConfig | None = None, **kwargs):
    kwargs.setdefault("groups", bandit_groups(3))
    kwargs.setdefault("expected_behavior_policy", BEHAVIOR)
    return train_grpo(model_path=model_path, config=config or _config(), output_dir=out, **kwargs)


def _stable(receipt: dict) -> str:
    return digest_json({k: v for k, v in receipt.items() if k not in WALL_CLOCK})


@pytest.fixture(scope="module")
def first_iteration(model_path, tmp_path_factory):
    """Iteration 1 of an online run (AdamW): a fresh adapter that keeps its final state."""
    return _train(model_path, tmp_path_factory.mktemp("iteration-1"), keep_state=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_single_pass_training_has_no_online_blocks(model_path, tmp_path, optimizer):
    """A single-pass training carries none of the continuation fields, repeats bit for bit in the
    same process, and keeping its final state changes nothing else. Both sides of every comparison
    are computed here, in this run: float results are never compared with digests recorded on
    another machine (CPU kernels differ between machines)."""
    config = TrainingConfig(seed=3, epochs=2, optimizer=optimizer, learning_rate=2e-2)
    groups = bandit_groups(3, warning=True)
    plain = _train(model_path, tmp_path / "plain", config, groups=groups)
    again = _train(model_path, tmp_path / "again", config, groups=groups)
    assert _bytes(again.adapter_dir) == _bytes(plain.adapter_dir)
    assert again.receipt["adapter_sha256"] == plain.receipt["adapter_sha256"]
    assert plain.receipt["adapter_sha256"] == adapter_content_sha256(plain.adapter_dir)
    assert _stable(again.receipt) == _stable(plain.receipt)
    assert plain.steps == 6  # 3 groups x 2 epochs, one optimizer step per group
    assert plain.final_state is None and not (tmp_path / "plain" / "final_state.tar").exists()
    for key in ("continued_from", "staleness", "final_state_sha256"):
        assert key not in plain.receipt
    assert "stale_is_max_weight" not in plain.receipt["config"]
    # Keeping the state changes nothing else: same adapter, same receipt plus the state's digest.
    kept = _train(model_path, tmp_path / "kept", config, groups=groups, keep_state=True)
    assert _bytes(kept.adapter_dir) == _bytes(plain.adapter_dir)
    state_sha = kept.receipt.pop("final_state_sha256")
    assert _stable(kept.receipt) == _stable(plain.receipt)
    assert state_sha == kept.final_state_sha256 == sha256_bytes(kept.final_state.read_bytes())


def _saved_optimizer(archive: Path, folder: Path) -> tuple[dict, dict]:
    unpack_folder(archive.read_bytes(), folder)
    saved = torch.load(io.BytesIO((folder / "optimizer.pt").read_bytes()), weights_only=True)
    return saved, json.loads((folder / "state.json").read_text())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_continuation_keeps_the_second_moment_and_zeroes_the_first(model_path, tmp_path, optimizer):
    """At an iteration boundary AdamW's ``exp_avg`` (Muon's momentum buffer) is zero, while
    ``exp_avg_sq`` and ``step`` are the saved ones bit for bit."""
    first = _train(model_path, tmp_path / "it1", _config(optimizer), keep_state=True)
    saved, state = _saved_optimizer(first.final_state, tmp_path / "unpacked")
    assert state["kind"] == "final_state" and state["optimizer"] == optimizer
    assert state["adapter_sha256"] == first.receipt["adapter_sha256"]
    assert state["optimizer_steps_total"] == first.steps == 3
    loop, _ = prepare_training(
        model_path=model_path, groups=bandit_groups(3), config=_config(optimizer),
        work_dir=tmp_path / "it2", base_adapter_dir=first.adapter_dir, init_state=first.final_state,
        expected_behavior_policy=BEHAVIOR)
    live = loop.optimizer.state_dict()  # what the new optimizer holds before its first step
    assert live["state"].keys() == saved["state"].keys() and len(live["state"]) == len(loop.named) == 28
    keys = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "muon": {"momentum_buffer"}}[optimizer]
    for index, values in saved["state"].items():
        assert set(values) == keys
        for key, tensor in values.items():
            restored = live["state"][index][key]
            assert restored.dtype == tensor.dtype and restored.shape == tensor.shape, (index, key)
            if key in ("exp_avg", "momentum_buffer"):
                assert tensor.abs().sum() > 0 and not restored.any(), (index, key)
            else:
                assert torch.equal(restored, tensor), (index, key)
        if optimizer == "adamw":
            assert float(values["step"]) == 3.0 and values["exp_avg_sq"].abs().sum() > 0
    assert loop.continued_from == {"adapter_sha256": first.receipt["adapter_sha256"],
                                   "optimizer_state_sha256": first.final_state_sha256,
                                   "optimizer_steps_before": 3}


@pytest.mark.timeout(180)
def test_two_iterations_continue_the_optimizer_deterministically(model_path, first_iteration, tmp_path):
    first = first_iteration
    again = _train(model_path, tmp_path / "it1-again", keep_state=True)
    assert _bytes(again.adapter_dir) == _bytes(first.adapter_dir)
    assert again.final_state.read_bytes() == first.final_state.read_bytes()

    def second(name: str, **kwargs):
        return _train(model_path, tmp_path / name, base_adapter_dir=first.adapter_dir, **kwargs)

    continued = [second(f"cont-{i}", init_state=first.final_state, keep_state=True) for i in range(2)]
    fresh = [second(f"fresh-{i}") for i in range(2)]
    assert _bytes(continued[0].adapter_dir) == _bytes(continued[1].adapter_dir)
    assert _bytes(fresh[0].adapter_dir) == _bytes(fresh[1].adapter_dir)
    assert _bytes(continued[0].adapter_dir) != _bytes(fresh[0].adapter_dir)
    receipt = continued[0].receipt
    assert receipt["base_adapter_sha256"] == first.receipt["adapter_sha256"]
    assert receipt["continued_from"] == {"adapter_sha256": first.receipt["adapter_sha256"],
                                         "optimizer_state_sha256": first.final_state_sha256,
                                         "optimizer_steps_before": 3}
    assert "continued_from" not in fresh[0].receipt
    _, state = _saved_optimizer(continued[0].final_state, tmp_path / "state-2")
    assert state["optimizer_steps_total"] == 6 and state["adapter_sha256"] == receipt["adapter_sha256"]
    # One learning-rate schedule over the run (constant here: every step at the base lr).
    assert [h["lr"] for h in receipt["steps"]] == [2e-2] * 3
    # Curve figures: the last epoch's mean KL of the per-step values.
    assert continued[0].kl == pytest.approx(sum(h["kl"] for h in receipt["steps"]) / 3) and continued[0].kl != 0


@pytest.mark.timeout(180)
def test_resumed_attempt_of_a_continued_training_uses_its_own_checkpoint(model_path, first_iteration, tmp_path):
    first = first_iteration
    config = _config(checkpoint_interval=2, epochs=2)  # 6 steps, checkpoints at 2, 4
    common = dict(base_adapter_dir=first.adapter_dir, init_state=first.final_state, keep_state=True)
    whole = _train(model_path, tmp_path / "whole", config, **common)
    calls = {"n": 0}

    def cancel_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    with pytest.raises(RunCancelled):
        _train(model_path, tmp_path / "killed", config, should_cancel=cancel_after_three, **common)
    checkpoint = tmp_path / "saved-step-2"
    shutil.copytree(tmp_path / "killed" / "checkpoints" / "step-000002", checkpoint)
    resumed = _train(model_path, tmp_path / "resumed", config, resume_from=checkpoint, **common)
    assert _bytes(resumed.adapter_dir) == _bytes(whole.adapter_dir)
    assert resumed.final_state.read_bytes() == whole.final_state.read_bytes()
    assert resumed.receipt["resumed_from_step"] == 2
    assert resumed.receipt["continued_from"] == whole.receipt["continued_from"]
    assert resumed.receipt["steps"] == whole.receipt["steps"]
    assert resumed.receipt["checkpoint"]["used"] is True
    # That checkpoint belongs to the continued training: a fresh-optimizer attempt may not use it,
    # so that attempt restarts from its first step, exactly as a fresh one.
    other = _train(model_path, tmp_path / "other", config, base_adapter_dir=first.adapter_dir,
                   resume_from=checkpoint)
    fresh = _train(model_path, tmp_path / "fresh", config, base_adapter_dir=first.adapter_dir)
    assert _bytes(other.adapter_dir) == _bytes(fresh.adapter_dir) != _bytes(whole.adapter_dir)
    assert other.receipt["resumed_from_step"] is None
    assert other.receipt["checkpoint"]["used"] is False and other.receipt["checkpoint"]["step"] == 2
    assert other.receipt["checkpoint"]["reason"] == "the checkpoint's init_state_sha256 differs from this training's"


def _repack(archive: Path, folder: Path, edit) -> Path:
    unpack_folder(archive.read_bytes(), folder)
    state = json.loads((folder / "state.json").read_text())
    edit(state)
    (folder / "state.json").write_text(json.dumps(state))
    out = folder.with_suffix(".tar")
    out.write_bytes(pack_folder(folder))
    return out


@pytest.mark.timeout(180)
def test_a_state_that_does_not_fit_is_refused(model_path, first_iteration, tmp_path):
    first = first_iteration
    other = _train(model_path, tmp_path / "other", _config(lora_rank=4))  # another adapter, rank 4
    other_sha = other.receipt["adapter_sha256"]
    _train(model_path, tmp_path / "ckpt", _config(checkpoint_interval=1))  # writes a heartbeat checkpoint
    (tmp_path / "ckpt.tar").write_bytes(pack_folder(tmp_path / "ckpt" / "checkpoints" / "step-000001"))
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not a tar archive")
    cases = {
        "another adapter": (other.adapter_dir, first.final_state, _config(), "belongs to adapter"),
        "another optimizer": (first.adapter_dir, first.final_state, _config("muon"), "'adamw' optimizer state"),
        "other parameter shapes": (
            other.adapter_dir,
            _repack(first.final_state, tmp_path / "relabelled", lambda s: s.update(adapter_sha256=other_sha)),
            _config(), "names/shapes differ"),
        "a heartbeat checkpoint": (
            first.adapter_dir,
            tmp_path / "ckpt.tar",
            _config(), "not a continuation state"),
        "not an archive": (first.adapter_dir, garbage, _config(), "unreadable training state"),
    }
    for name, (adapter, state, config, fragment) in cases.items():
        out = tmp_path / f"refused-{name.replace(' ', '-')}"
        with pytest.raises(TrainingFailed) as err:
            _train(model_path, out, config, base_adapter_dir=adapter, init_state=state)
        assert err.value.code == "resume_invalid", name
        assert fragment in err.value.message, (name, err.value.message)
        assert not (out / "adapter").exists() and not (out / "train_receipt.json").exists()


@pytest.fixture(scope="module")
def behavior_adapter(model_path, tmp_path_factory) -> Path:
    """Adapter "k−1" of a stale iteration: a random LoRA (q/v, rank 4) far from the trained one."""
    return make_lora_adapter(model_path, tmp_path_factory.mktemp("behavior") / "adapter", seed=1, scale=0.5)


def _stale_data(adapter: Path) -> tuple[list[dict], dict]:
    behavior = {**BEHAVIOR, "adapter_sha256": adapter_content_sha256(adapter)}
    return bandit_groups(3, behavior=behavior), behavior


@pytest.mark.timeout(180)
def test_stale_training_uses_truncated_behaviour_weights(model_path, first_iteration, behavior_adapter, tmp_path):
    first = first_iteration
    groups, behavior = _stale_data(behavior_adapter)
    config = _config(stale_is_max_weight=1.5)
    result = _train(model_path, tmp_path / "stale", config, groups=groups, expected_behavior_policy=behavior,
                    base_adapter_dir=first.adapter_dir, init_state=first.final_state,
                    behavior_adapter_dir=behavior_adapter, staleness=1)
    receipt = result.receipt
    assert receipt["staleness"] == {"staleness": 1, "behavior_adapter_sha256": behavior["adapter_sha256"],
                                    "behavior_logprobs": "scored_with_behavior_policy", "is_max_weight": 1.5}
    assert receipt["config"]["stale_is_max_weight"] == 1.5 and receipt["behavior_policy"] == behavior
    steps = receipt["steps"]
    assert [h["staleness"] for h in steps] == [1, 1, 1]
    assert all(abs(h["loss"]) < 1e3 for h in steps)  # finite (the trainer refuses non-finite)
    assert max(h["is_ratio_max"] for h in steps) > 1.5  # the ratio exceeds the cap…
    assert max(h["is_weight_max"] for h in steps) == 1.5  # …and the weight is truncated at it
    # The proximal policy is the pre-update one for every row: some steps' groups stay under the cap.
    assert all(0 <= h["is_truncated_fraction"] < 1 for h in steps)
    assert any(h["is_truncated_fraction"] > 0 for h in steps)


@pytest.mark.timeout(120)
def test_behaviour_logprobs_are_the_behaviour_adapters_own(model_path, first_iteration, behavior_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    groups, behavior = _stale_data(behavior_adapter)
    plain, _ = prepare_training(model_path=model_path, groups=groups, config=_config(), work_dir=tmp_path / "a",
                                base_adapter_dir=first_iteration.adapter_dir, expected_behavior_policy=behavior)
    loop, plan = prepare_training(model_path=model_path, groups=groups, config=_config(), work_dir=tmp_path / "b",
                                  base_adapter_dir=first_iteration.adapter_dir, expected_behavior_policy=behavior,
                                  behavior_adapter_dir=behavior_adapter, staleness=1)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(base, str(behavior_adapter)).eval()
    batches = [build_group_batch(g, warning_filter=True) for g in plan.kept]
    want = evaluate(reference, batches, torch.device("cpu"))["action_logprob_sums"]
    for group, sums in zip(loop.rows, want):
        for row, expected in zip(group, sums):
            assert float((row.behavior * row.action).sum()) == pytest.approx(expected, abs=1e-5)
    # Behaviour = the bare base model (iteration 1's data trained stale from adapter 1).
    from_base, _ = prepare_training(model_path=model_path, groups=bandit_groups(3), config=_config(),
                                    work_dir=tmp_path / "c", base_adapter_dir=first_iteration.adapter_dir,
                                    expected_behavior_policy=BEHAVIOR, staleness=1)
    bare = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    want = evaluate(bare, batches, torch.device("cpu"))["action_logprob_sums"]
    for group, sums in zip(from_base.rows, want):
        for row, expected in zip(group, sums):
            assert float((row.behavior * row.action).sum()) == pytest.approx(expected, abs=1e-5)
    # The behaviour adapter is gone again: the same trainable parameters, still trainable.
    assert [n for n, _ in loop.named] == [n for n, _ in plain.named]
    assert all(p.requires_grad for _, p in loop.named)
    assert set(loop.model.peft_config) == {"default"}


@pytest.mark.timeout(120)
def test_stale_inputs_are_checked(model_path, first_iteration, behavior_adapter, tmp_path):
    groups, behavior = _stale_data(behavior_adapter)
    with pytest.raises(PolicyIdentityChanged):  # the data says another adapter sampled it
        _train(model_path, tmp_path / "a", groups=groups, expected_behavior_policy=behavior,
               base_adapter_dir=first_iteration.adapter_dir, behavior_adapter_dir=first_iteration.adapter_dir,
               staleness=1)
    with pytest.raises(TrainingFailed) as err:
        _train(model_path, tmp_path / "b", groups=groups, expected_behavior_policy=behavior,
               base_adapter_dir=first_iteration.adapter_dir, behavior_adapter_dir=behavior_adapter)
    assert err.value.code == "staleness_invalid"
    assert not (tmp_path / "a" / "adapter").exists() and not (tmp_path / "b" / "adapter").exists()


@pytest.mark.timeout(180)
def test_stale_engine_data_records_the_engines_gap_not_the_rescored_one(model_path, first_iteration,
                                                                         behavior_adapter, tmp_path):
    """Stale data is re-scored under the adapter that sampled it, so the engine gap is not
    corrected; the receipt's block still compares the engine's recorded log-probs with the
    trainer's, not the re-scored ones: moving every recorded value moves the figures (the
    re-scored log-probs do not depend on them)."""
    groups, behavior = _stale_data(behavior_adapter)
    vllm = {**behavior, "runtime": {**behavior["runtime"], "engine": {"name": "vllm", "version": "0"}}}
    blocks = []
    for shift in (0.0, -20.0):
        shifted = copy.deepcopy(groups)
        for group in shifted:
            for completion in group["completions"]:
                completion["openenv"]["behavior_policy"] = vllm
                for piece in completion["tokens"]["pieces"]:
                    if piece["kind"] == "action":
                        piece["logprobs"] = [value + shift for value in piece["logprobs"]]
        result = _train(model_path, tmp_path / f"stale-vllm{shift}", _config(), groups=shifted,
                        expected_behavior_policy=vllm, base_adapter_dir=first_iteration.adapter_dir,
                        init_state=first_iteration.final_state, behavior_adapter_dir=behavior_adapter, staleness=1)
        assert result.receipt["staleness"]["behavior_logprobs"] == "scored_with_behavior_policy"
        blocks.append(result.receipt["engine_mismatch"])
        assert blocks[-1]["tokens"] == result.receipt["token_counts"]["action_tokens"]
    for block in blocks:
        assert (block["engine"], block["correction"], block["reason"]) == ("vllm", "none", "stale_data_rescored")
        assert "is_cap" not in block
    # re-scored log-probs would give both runs the same figures
    assert abs(blocks[1]["mean_abs_delta"] - blocks[0]["mean_abs_delta"]) > 1.0, blocks
