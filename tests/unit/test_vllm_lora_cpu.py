"""The grouped LoRA products the vLLM server installs on vLLM's CPU path (kiln/core/policy/vllm_lora_cpu.py):
each row gets its own adapter's product, rows without an adapter (-1) get none, and the
write/accumulate and width rules are those of the per-token products they replace."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)

import torch

from kiln.core.policy import vllm_lora_cpu as ops

torch.set_num_threads(1)


def _weights(slots: int, out: int, inp: int, *, four_d: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(slots, out, inp, generator=g)
    return w.unsqueeze(1) if four_d else w


def _row_product(x: torch.Tensor, w: torch.Tensor, index: int) -> torch.Tensor:
    """One row's product the slow, obvious way: a float64 dot product per output element."""
    w3 = w.squeeze(1) if w.dim() == 4 else w
    if index < 0:
        return torch.zeros(w3.shape[1], dtype=torch.float64)
    m = w3[index].to(torch.float64)
    return torch.stack([(m[o] * x.to(torch.float64)).sum() for o in range(m.shape[0])])


@pytest.mark.parametrize("four_d", [False, True])
def test_shrink_gives_each_row_its_adapters_product_and_zero_without_one(four_d: bool) -> None:
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(1))
    a = _weights(4, 3, 12, four_d=four_d)
    idx = torch.tensor([2, -1, 0, 2, -1, 3])
    out = torch.full((6, 5), 7.0)
    ops.bgmv_shrink(x, a, out, idx, 0.5)
    for row, i in enumerate(idx.tolist()):
        assert torch.allclose(out[row, :3].double(), 0.5 * _row_product(x[row], a, i), atol=1e-5)
    assert torch.equal(out[:, 3:], torch.full((6, 2), 7.0))  # past the rank: untouched
    assert torch.equal(out[1, :3], torch.zeros(3)) and torch.equal(out[4, :3], torch.zeros(3))


def test_shrink_without_any_adapter_writes_zeros_to_the_rank_columns() -> None:
    out = torch.full((3, 4), 9.0)
    ops.bgmv_shrink(torch.ones(3, 8), _weights(2, 4, 8, four_d=True), out, torch.tensor([-1, -1, -1]), 2.0)
    assert torch.equal(out, torch.zeros(3, 4))


@pytest.mark.parametrize("add", [True, False])
def test_expand_accumulates_or_writes_each_rows_product(add: bool) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    b = _weights(3, 10, 4, four_d=True)
    idx = torch.tensor([1, 1, -1, 0, 2])
    base = torch.randn(5, 10, generator=torch.Generator().manual_seed(3))
    out = base.clone()
    ops.bgmv_expand(x, b, out, idx, add_inputs=add)
    for row, i in enumerate(idx.tolist()):
        want = _row_product(x[row], b, i) + (base[row].double() if add else 0.0)
        assert torch.allclose(out[row].double(), want, atol=1e-5)
    if add:
        assert torch.equal(out[2], base[2])  # no adapter: the row is left exactly as it was


def test_expand_without_any_adapter_leaves_accumulated_rows_alone_and_zeroes_written_ones() -> None:
    base = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    idx = torch.tensor([-1, -1, -1, -1])
    out = base.clone()
    ops.bgmv_expand(torch.ones(4, 2), _weights(2, 6, 2, four_d=False), out, idx, add_inputs=True)
    assert torch.equal(out, base)
    ops.bgmv_expand(torch.ones(4, 2), _weights(2, 6, 2, four_d=False), out, idx, add_inputs=False)
    assert torch.equal(out, torch.zeros(4, 6))


def test_expand_covers_only_the_narrower_of_the_two_widths() -> None:
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(5))
    wide = _weights(1, 9, 3, four_d=False)  # the adapter pads past the output's 7 columns
    out = torch.zeros(2, 7)
    ops.bgmv_expand(x, wide, out, torch.tensor([0, 0]), add_inputs=True)
    for row in range(2):
        assert torch.allclose(out[row].double(), _row_product(x[row], wide, 0)[:7], atol=1e-5)
    narrow = _weights(1, 4, 3, four_d=False)
    out = torch.full((2, 7), 1.0)
    ops.bgmv_expand(x, narrow, out, torch.tensor([0, 0]), add_inputs=True)
    assert torch.equal(out[:, 4:], torch.ones(2, 3))
    assert torch.allclose(out[0, :4].double(), 1.0 + _row_product(x[0], narrow, 0), atol=1e-5)


@pytest.mark.parametrize("add", [True, False])
def test_expand_slice_touches_only_its_columns(add: bool) -> None:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(6))
    b = _weights(2, 5, 3, four_d=True)
    idx = torch.tensor([0, -1, 1, 0])
    base = torch.randn(4, 12, generator=torch.Generator().manual_seed(7))
    out = base.clone()
    ops.bgmv_expand_slice(x, b, out, idx, 4, 5, add_inputs=add)
    assert torch.equal(out[:, :4], base[:, :4]) and torch.equal(out[:, 9:], base[:, 9:])
    for row, i in enumerate(idx.tolist()):
        want = _row_product(x[row], b, i) + (base[row, 4:9].double() if add else 0.0)
        assert torch.allclose(out[row, 4:9].double(), want, atol=1e-5)


def test_a_single_index_applies_to_every_row() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(8))
    a = _weights(2, 2, 4, four_d=False)
    out = torch.zeros(3, 2)
    ops.bgmv_shrink(x, a, out, torch.tensor([1]), 1.0)
    for row in range(3):
        assert torch.allclose(out[row].double(), _row_product(x[row], a, 1), atol=1e-5)


def test_products_are_computed_in_the_outputs_dtype() -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    a = _weights(1, 3, 4, four_d=False).to(torch.bfloat16)
    out = torch.zeros(2, 3, dtype=torch.float32)
    ops.bgmv_shrink(x, a, out, torch.tensor([0, 0]), 1.0)
    assert out.dtype == torch.float32
    for row in range(2):
        assert torch.allclose(out[row].double(), _row_product(x[row].float(), a.float(), 0), atol=1e-5)


def test_install_changes_nothing_where_vllm_is_absent() -> None:
    try:  # Kiln's own environment has no vllm: the engine runs in its own venv
        import vllm  # noqa: F401
    except ImportError:
        assert ops.install() is False
    else:  # pragma: no cover - only where someone installed vllm beside Kiln
        pytest.skip("vllm is importable here")
