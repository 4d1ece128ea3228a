"""The torch MoE experts with LoRA the vLLM server installs on vLLM's CPU build
(kiln/core/policy/vllm_moe_lora_cpu.py): each token's selected experts get ``W + B @ A`` of the
token's own adapter, tokens without one (-1) the base experts only, summed with the router's
weights; checked against a per-token float64 computation with the merged weights."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)

import torch

from kiln.core.policy import vllm_moe_lora_cpu as moe

torch.set_num_threads(1)

TOKENS, HIDDEN, INTER, EXPERTS, K, SLOTS, RANK = 9, 12, 6, 4, 2, 3, 4


def _case(seed: int, *, fused: bool) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(TOKENS)])
    weights = torch.softmax(rnd(TOKENS, K), dim=-1)
    if fused:  # one slice for gate and up (vLLM's 3-D layout)
        w13_a, w13_b = (rnd(SLOTS, EXPERTS, RANK, HIDDEN),), (rnd(SLOTS, EXPERTS, 2 * INTER, RANK),)
    else:  # gate and up slices
        w13_a = (rnd(SLOTS, EXPERTS, RANK, HIDDEN), rnd(SLOTS, EXPERTS, RANK, HIDDEN))
        w13_b = (rnd(SLOTS, EXPERTS, INTER, RANK), rnd(SLOTS, EXPERTS, INTER, RANK))
    return {
        "hidden": rnd(TOKENS, HIDDEN), "w13": rnd(EXPERTS, 2 * INTER, HIDDEN), "w2": rnd(EXPERTS, HIDDEN, INTER),
        "topk_weights": weights, "topk_ids": ids.to(torch.int32),
        "token_slots": torch.tensor([0, -1, 2, 0, 1, -1, 2, 2, -1]),
        "w13_a": w13_a, "w13_b": w13_b,
        "w2_a": rnd(SLOTS, EXPERTS, RANK, INTER), "w2_b": rnd(SLOTS, EXPERTS, HIDDEN, RANK),
    }


def _token(case: dict, t: int) -> torch.Tensor:
    """Token ``t``'s output, the slow way: its adapter merged into each selected expert's weights."""
    d = torch.float64
    x = case["hidden"][t].to(d)
    slot = int(case["token_slots"][t])
    out = torch.zeros(HIDDEN, dtype=d)
    for j in range(K):
        e = int(case["topk_ids"][t, j])
        w13, w2 = case["w13"][e].to(d).clone(), case["w2"][e].to(d).clone()
        if slot >= 0:
            w13 += torch.cat([b[slot, e].to(d) @ a[slot, e].to(d) for a, b in zip(case["w13_a"], case["w13_b"])])
            w2 += case["w2_b"][slot, e].to(d) @ case["w2_a"][slot, e].to(d)
        h = torch.stack([(w13[o] * x).sum() for o in range(2 * INTER)])
        act = h[:INTER] / (1 + torch.exp(-h[:INTER])) * h[INTER:]
        out += float(case["topk_weights"][t, j]) * torch.stack([(w2[o] * act).sum() for o in range(HIDDEN)])
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_each_token_gets_its_own_adapters_experts_and_none_without_one(fused: bool) -> None:
    case = _case(1, fused=fused)
    got = moe.experts_with_lora(**case)
    assert got.shape == (TOKENS, HIDDEN) and got.dtype == torch.float32
    for t in range(TOKENS):
        assert torch.allclose(got[t].to(torch.float64), _token(case, t), rtol=1e-4, atol=1e-4), t
    # the base-only rows are the adapter-free experts: the LoRA factors do not reach them
    bare = {**case, "w13_a": tuple(a * 0 for a in case["w13_a"]), "w2_b": case["w2_b"] * 0}
    base = moe.experts_with_lora(**bare)
    no_adapter = (case["token_slots"] < 0).nonzero(as_tuple=True)[0]
    assert torch.equal(got[no_adapter], base[no_adapter])
    named = (case["token_slots"] >= 0).nonzero(as_tuple=True)[0]
    assert float((got[named] - base[named]).abs().min()) > 1e-3  # every adapter row moved


def test_a_row_is_the_same_alone_as_beside_rows_of_other_adapters() -> None:
    case = _case(2, fused=False)
    together = moe.experts_with_lora(**case)
    for t in (0, 1, 4):
        alone = {**case, "hidden": case["hidden"][t : t + 1], "topk_weights": case["topk_weights"][t : t + 1],
                 "topk_ids": case["topk_ids"][t : t + 1], "token_slots": case["token_slots"][t : t + 1]}
        assert torch.allclose(moe.experts_with_lora(**alone)[0], together[t], rtol=1e-5, atol=1e-5)


def test_router_weights_already_on_the_input_are_not_applied_twice() -> None:
    case = _case(3, fused=False)
    one = {**case, "topk_weights": case["topk_weights"][:, :1], "topk_ids": case["topk_ids"][:, :1]}
    weighed = moe.experts_with_lora(**one)
    unweighed = moe.experts_with_lora(**one, weigh_outputs=False)
    assert torch.allclose(weighed, unweighed * case["topk_weights"][:, :1], rtol=1e-5, atol=1e-6)


def test_a_shared_factor_of_expert_dim_one_serves_every_expert() -> None:
    case = _case(4, fused=False)
    shared_a = tuple(a[:, :1] for a in case["w13_a"])
    expanded = tuple(a.expand(-1, EXPERTS, -1, -1) for a in shared_a)
    got = moe.experts_with_lora(**{**case, "w13_a": shared_a})
    assert torch.equal(got, moe.experts_with_lora(**{**case, "w13_a": expanded}))


class _Experts:
    w1_bias = None
    w2_bias = None

    class quant_config:  # noqa: N801 - stands for vLLM's attribute of that name
        quant_dtype = None


@pytest.mark.parametrize(("activation", "bias", "expert_map", "says"), [
    ("swigluoai", None, None, "gated SiLU experts, not 'swigluoai'"),
    ("silu", torch.zeros(1), None, "experts without biases"),
    ("silu", None, torch.zeros(1), "does not run expert parallelism"),
])
def test_experts_it_does_not_compute_are_refused_naming_them(activation, bias, expert_map, says) -> None:
    experts = _Experts()
    experts.w1_bias = bias
    with pytest.raises(moe.ExpertsUnsupported) as caught:
        moe._check_layer(experts, activation, expert_map)
    assert says in str(caught.value)
    moe._check_layer(_Experts(), "silu", None)  # the kind it computes passes


def test_install_is_a_no_op_without_vllm() -> None:
    assert moe.install() is False  # Kiln's venv has no vLLM: vLLM's own kernels stay


def test_the_installed_apply_reads_the_layers_lora_context_and_writes_the_output() -> None:
    """vLLM calls ``apply`` on its experts object: the LoRA buffers and each token's adapter slot
    come from the layer's LoRA context (the punica wrapper's per-token indices), the result goes
    into ``output``; without a context every token gets the base experts."""
    from types import SimpleNamespace

    case = _case(5, fused=False)
    ctx = SimpleNamespace(
        w13_lora_a_stacked=case["w13_a"], w13_lora_b_stacked=case["w13_b"],
        w2_lora_a_stacked=(case["w2_a"],), w2_lora_b_stacked=(case["w2_b"],),
        punica_wrapper=SimpleNamespace(token_lora_indices=case["token_slots"]),
        local_token_lora_mapping=None, original_hidden_states=None)
    experts = _Experts()
    experts._lora_context = ctx
    output = torch.full((TOKENS, HIDDEN), 5.0)
    moe.apply(experts, output, case["hidden"], case["w13"], case["w2"], case["topk_weights"], case["topk_ids"],
              "silu", 4, None, None, None, torch.empty(0), torch.empty(0), None, False)
    for t in range(TOKENS):
        assert torch.allclose(output[t].to(torch.float64), _token(case, t), rtol=1e-4, atol=1e-4), t
    bare = _Experts()
    moe.apply(bare, output, case["hidden"], case["w13"], case["w2"], case["topk_weights"], case["topk_ids"],
              "silu", 4, None, None, None, torch.empty(0), torch.empty(0), None, False)
    base_case = {**case, "token_slots": torch.full((TOKENS,), -1)}
    for t in range(TOKENS):
        assert torch.allclose(output[t].to(torch.float64), _token(base_case, t), rtol=1e-4, atol=1e-4), t
