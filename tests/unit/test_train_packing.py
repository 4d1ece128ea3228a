"""Sequence packing (training_config.packing): the bins, the per-row log-probs against each row
scored alone, and a packed optimizer step against the padded one (every LoRA gradient and every
step figure) on the tiny Qwen3 and on gpt-oss (sliding-window + full attention with sinks);
recurrent families are refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kiln.core.errors import TrainingFailed  # noqa: E402
from kiln.core.train.batches import Row, collate, group_rows  # noqa: E402
from kiln.core.train.model import attach_lora, load_base_model, trainable_parameters  # noqa: E402
from kiln.core.train.packing import pack_bins, packed_logprobs, packed_microbatches, require_packable  # noqa: E402
from kiln.core.train.step import LogprobCache, StepSettings, microbatches, train_step  # noqa: E402
from tests.support.model_builders import family_model  # noqa: E402
from tests.unit.test_train_support import X_TOKEN, Y_TOKEN, build_tiny_qwen3, completion  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _fake(length: int, key: int) -> Row:
    zeros = torch.zeros(length - 1)
    return Row(key=(0, key), ids=torch.arange(length), action=zeros, env=zeros, obs_length=0.0,
               behavior=None, advantage=0.0, reward=0.0)


def test_bins_first_fit_decreasing_and_microbatch_budget():
    rows = [_fake(n, i) for i, n in enumerate([10, 3, 7, 4, 6, 2, 10])]
    bins = pack_bins(rows, 10)
    assert [[r.key[1] for r in b] for b in bins] == [[0], [6], [2, 1], [4, 3], [5]]
    assert all(sum(r.length for r in b) <= 10 for b in bins)
    micro = packed_microbatches(rows, 25)  # 2 bins of 10 per micro-batch
    assert [len(m) for m in micro] == [2, 2, 1]
    assert sorted(r.key[1] for m in micro for b in m for r in b) == list(range(7))
    assert [len(m) for m in packed_microbatches(rows, 5)] == [1] * 5  # a row longer than the budget: alone


def _groups() -> list[dict]:
    """Two groups of rows of 1–4 turns (lengths 13 … 43 tokens), rewards that vary in each group."""
    groups = []
    for g in range(2):
        comps = [completion(g, X_TOKEN if i % 2 == 0 else Y_TOKEN, turns=1 + (i + g) % 4, warning=i == 1,
                            reward=float((i * 3 + g) % 4)) for i in range(4)]
        groups.append({"messages": [], "completions": comps})
    return groups


def _rows() -> list[Row]:
    return [r for g, group in enumerate(_groups()) for r in group_rows(group, group_index=g, warning_filter=True)]


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("packing") / "model")


def _lora(base):
    model = attach_lora(base, rank=4, alpha=8.0, seed=3, base_adapter_dir=None)
    with torch.no_grad():  # a non-zero B so the adapter changes the log-probs and every A has a gradient
        for name, p in trainable_parameters(model):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return model


def _models(family: str, qwen3_path):
    def one():
        if family == "qwen3":
            return _lora(load_base_model(qwen3_path, "cpu"))
        return _lora(family_model(family))

    return one(), one()


def _alone(model, row: Row) -> torch.Tensor:
    """Brute force: the row alone in a batch of one, full logits, log-softmax, gather."""
    with torch.no_grad():
        logits = model(input_ids=row.ids.unsqueeze(0), use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, row.ids[1:].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_packed_logprobs_equal_each_row_scored_alone(family, qwen3_path):
    model, _ = _models(family, qwen3_path)
    rows = _rows()
    bins = packed_microbatches(rows, 1 << 20)[0]
    assert len(bins) < len(rows)  # rows do share sequences
    ordered = [r for b in bins for r in b]
    width = max(r.length for r in rows)
    with torch.no_grad():
        packed = packed_logprobs(model, bins, width, 1.0, torch.device("cpu"), with_entropy=False)
    assert packed.shape == (len(rows), width - 1)
    for b, row in enumerate(ordered):
        n = row.length - 1
        assert torch.allclose(packed[b, :n], _alone(model, row), atol=1e-5, rtol=0), (family, row.key)
        assert torch.count_nonzero(packed[b, n:]) == 0


def _slots(micro) -> int:
    """Token slots the forwards run over: rows × longest row, or bins × longest bin."""
    return sum(len(b) * max(sum(r.length for r in x) for x in b) if b else len(m) * max(r.length for r in m)
               for m, b in micro)


def _step(model, rows, packing: bool, **overrides):
    settings = StepSettings(clip_epsilon=0.2, kl_coeff=0.05, kl_estimator="k3", echo_lambda=0.05,
                            max_grad_norm=1e9, recorded=False, is_level=overrides.pop("is_level", "cispo"),
                            max_tokens_per_microbatch=96, entropy_coeff=0.01, packing=packing, **overrides)
    named = trainable_parameters(model)
    params = [p for _, p in named]
    optimizer = torch.optim.SGD(params, lr=0.0)  # the gradient is compared, the weights stay
    cache = LogprobCache()
    first = train_step(model, rows, optimizer, params, settings, cache, torch.device("cpu"))
    second = train_step(model, rows, optimizer, params, settings, cache, torch.device("cpu"))
    assert first["loss"] == pytest.approx(second["loss"], abs=1e-7)  # lr 0: nothing moved
    return second, {name: p.grad.clone() for name, p in named}, settings


@pytest.mark.parametrize("family,is_level", [("qwen3", "cispo"), ("qwen3", "token"), ("qwen3", "sequence"),
                                             ("gpt_oss", "cispo")])
def test_packed_step_has_the_padded_step_gradient_and_figures(family, is_level, qwen3_path):
    padded_model, packed_model = _models(family, qwen3_path)
    rows = _rows()
    padded, padded_grads, settings = _step(padded_model, rows, False, is_level=is_level)
    packed, packed_grads, packed_settings = _step(packed_model, rows, True, is_level=is_level)
    # fewer forwards over fewer token slots: 8 rows of 13–43 tokens, a budget of 96 tokens
    slots = {name: _slots(microbatches(rows, s)) for name, s in (("padded", settings), ("packed", packed_settings))}
    assert packed["microbatches"] < padded["microbatches"]
    assert slots["packed"] < slots["padded"]
    assert packed["tokens"] == padded["tokens"] == sum(r.length for r in rows)
    assert set(packed) == set(padded)
    for key in ("loss", "policy_loss", "env_ce", "kl", "entropy", "approx_kl", "clip_fraction",
                "max_ratio_deviation", "grad_norm"):
        assert packed[key] == pytest.approx(padded[key], abs=2e-5, rel=1e-4), key
    assert padded["env_ce"] > 0 and padded["kl"] > 0 and padded["entropy"] > 0
    assert set(packed_grads) == set(padded_grads) and len(padded_grads) > 0
    for name, grad in padded_grads.items():
        assert float(grad.abs().max()) > 0, name  # every LoRA tensor gets a gradient
        assert torch.allclose(packed_grads[name], grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_next", "granitemoehybrid", "lfm2"])
def test_recurrent_families_are_refused(family):
    with pytest.raises(TrainingFailed) as err:
        require_packable(family_model(family))
    assert err.value.code == "packing_unsupported"
    assert "packing" in err.value.message and "carry a state" in err.value.message
    assert "set training_config.packing to false" in err.value.hint


def test_attention_families_are_packable(qwen3_path):
    require_packable(load_base_model(qwen3_path, "cpu"))
    require_packable(family_model("gpt_oss"))
    require_packable(family_model("qwen3_moe"))


def test_collate_order_matches_the_bins():
    rows = _rows()
    (micro, bins), = microbatches(rows, StepSettings(clip_epsilon=0.2, kl_coeff=0.0, echo_lambda=0.0,
                                                     max_grad_norm=1.0, recorded=False, packing=True,
                                                     max_tokens_per_microbatch=1 << 20))
    assert [r.key for r in micro] == [r.key for b in bins for r in b]
    assert collate(micro).keys == [r.key for r in micro]


def test_train_grpo_with_packing_gives_the_padded_adapter(qwen3_path, tmp_path):
    """Through the trainer: fewer micro-batches, the same adapter to float tolerance, and the
    setting recorded in the receipt's effective config only when on."""
    from safetensors.torch import load_file

    from kiln.core.train.trainer import train_grpo
    from kiln.core.training_config import TrainingConfig

    weights, steps, configs = {}, {}, {}
    for packing in (False, True):
        config = TrainingConfig(seed=1, epochs=2, groups_per_step=2, max_tokens_per_microbatch=96,
                                learning_rate=1e-2, kl_coeff=0.05, kl_estimator="k3", packing=packing)
        result = train_grpo(model_path=qwen3_path, groups=_groups(), config=config, output_dir=tmp_path / str(packing))
        weights[packing] = load_file(str(result.adapter_dir / "adapter_model.safetensors"))
        steps[packing] = result.receipt["steps"]
        configs[packing] = result.receipt["config"]
    assert configs[True]["packing"] is True and "packing" not in configs[False]  # later settings: off = absent
    assert len(steps[True]) == len(steps[False]) == 2
    for padded, packed in zip(steps[False], steps[True]):
        assert packed["microbatches"] < padded["microbatches"]
        for key in ("loss", "policy_loss", "env_ce", "kl", "grad_norm"):
            assert packed[key] == pytest.approx(padded[key], abs=2e-5, rel=1e-4), key
    moved = 0.0
    for key, tensor in weights[False].items():
        assert torch.allclose(weights[True][key], tensor, atol=1e-5, rtol=0), key
        moved = max(moved, float(tensor.abs().max()))
    assert moved > 1e-3


def test_train_grpo_refuses_packing_on_a_recurrent_family(tmp_path):
    from kiln.core.train.trainer import train_grpo
    from kiln.core.training_config import TrainingConfig

    folder = tmp_path / "lfm2"
    family_model("lfm2").save_pretrained(str(folder))
    with pytest.raises(TrainingFailed) as err:
        train_grpo(model_path=folder, groups=_groups(), config=TrainingConfig(packing=True),
                   output_dir=tmp_path / "out")
    assert err.value.code == "packing_unsupported" and "lfm2" in err.value.message
