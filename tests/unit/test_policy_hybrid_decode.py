"""The hf engine's tiled decode on every cache layer kind: hybrid (Gated DeltaNet, Mamba, short
convolution) and mixture-of-experts families, random weights with each family's real layer pattern.

What is asserted, per family:

* **against a batch-of-one reference** (:func:`tests.support.model_builders.reference_decode`:
  transformers' own ``DynamicCache``, one row, the model's own attention and kernels): at a tile of
  1 and of 4, every row's ids are equal and every log-prob is within ``TOLERANCE``. The tiled
  decode runs the projections on ``tile`` rows at once, so its bits differ from a batch of one's by
  float rounding (measured on this CPU with :mod:`tests.support.model_builders`' tiny configs,
  largest per family at a tile of 4: gpt_oss 1.9e-5, qwen3_next 1.2e-5, qwen3_5 8.6e-6,
  granitemoehybrid 7.6e-6, lfm2 3.8e-6, qwen3_moe 3.1e-6; at a tile of 1 at most 1.4e-6).
  A routed mixture of experts (top-k of the
  router's scores) can pick another expert on a near tie when the rounding differs: measured on
  qwen3_next routing 2 of 4 experts, 8.9e-4 at one step at a tile of 2. So the reference check of
  a routed family runs with every expert selected (routing weights still computed), and the
  tile size is part of the behaviour identity;
* **batch invariance at a fixed tile**: a row's ids and log-probs are bit-identical alone, beside
  other rows, in any slot, for every family here, routed ones included (experts run token by token
  in the tile, :mod:`kiln.core.policy.row_attention`);
* **multi-turn keep-state** (qwen3_5): an episode whose later turns start from kept row states
  gives bitwise the bytes of one re-prefilling every turn (:mod:`kiln.core.policy.prefix_states`).
"""

from __future__ import annotations

import pytest

from tests.support.model_builders import DECODE_FAMILIES as FAMILIES
from tests.support.model_builders import VOCAB, family_model, reference_decode, tiny_config

TOLERANCE = 1e-4  # about 5x the largest difference measured (gpt_oss at a tile of 4, random weights of scale 0.2)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22], [5, 6, 7, 8, 9, 10, 11]]
SEEDS = [1, 2, 3, 4]
STEPS = 14  # more than every conv kernel: rows run on their cached conv windows, not the prefill's
ALL_EXPERTS = {"qwen3_next": {"num_experts_per_tok": 4}, "granitemoehybrid": {"num_experts_per_tok": 4},
               "qwen3_moe": {"num_experts_per_tok": 4}, "gpt_oss": {"num_experts_per_tok": 4}}


def _sample(model, prompts, seeds, tile):
    from kiln.core.policy.sampling import sample_batch

    return sample_batch(model, prompts, seeds, max_new_tokens=STEPS, temperature=1.0, stop_id=2, tile=tile)


def _bits(sample) -> tuple[list[int], bytes]:
    import struct

    return sample.ids, struct.pack(f"{len(sample.logprobs)}f", *sample.logprobs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tile", [1, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_tiled_rows_equal_a_batch_of_one_reference(family: str, tile: int) -> None:
    model = family_model(family, overrides=ALL_EXPERTS.get(family))
    rows = _sample(model, PROMPTS, SEEDS, tile)
    assert len(rows) == len(PROMPTS)
    for prompt, seed, row in zip(PROMPTS, SEEDS, rows):
        ids, lps = reference_decode(model, prompt, seed, STEPS, stop_id=2)
        assert row.ids == ids
        assert len(row.logprobs) == len(lps) == len(ids)
        assert max(abs(a - b) for a, b in zip(row.logprobs, lps)) <= TOLERANCE


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_is_bit_identical_beside_any_tile_mates(family: str) -> None:
    """Routed families with their real top-k: a row alone, with others in the tile, and in another
    slot (the order reversed) gives the same bytes."""
    model = family_model(family)
    together = [_bits(s) for s in _sample(model, PROMPTS, SEEDS, 4)]
    alone = [_bits(_sample(model, [p], [s], 4)[0]) for p, s in zip(PROMPTS, SEEDS)]
    backwards = [_bits(s) for s in _sample(model, PROMPTS[::-1], SEEDS[::-1], 4)][::-1]
    assert together == alone == backwards
    assert together[0] != together[3]  # same prompt, other seed: another sample
    assert all(len(ids) == STEPS for ids, _ in together)  # the random models never stop early here


@pytest.mark.timeout(60)
def test_which_layer_kinds_the_tile_keeps_per_row() -> None:
    """Every family here is served (and batch-invariant); DeepSeek-V3.2's indexed attention (indexer
    keys the tile does not keep) is named, from its real config class."""
    from transformers import DeepseekV32Config, Gemma3TextConfig

    from kiln.core.policy.row_attention import batch_invariant, unsupported_layer_kinds
    for family in FAMILIES:
        assert unsupported_layer_kinds(tiny_config(family, VOCAB)) == [] and batch_invariant(tiny_config(family, VOCAB))
    assert unsupported_layer_kinds(Gemma3TextConfig(num_hidden_layers=2)) == []
    assert unsupported_layer_kinds(DeepseekV32Config(num_hidden_layers=2)) == ["indexed_attention"]
    assert batch_invariant(DeepseekV32Config(num_hidden_layers=2)) is False


@pytest.mark.timeout(60)
def test_a_config_that_does_not_match_its_layers_is_a_model_fault() -> None:
    """A qwen3_5 model whose config calls its full-attention layer ``linear_attention`` fails inside
    transformers' own forward: a non-retryable model_fault naming the family and where, no Python
    exception class name."""
    from kiln.core.errors import ModelFault
    from kiln.core.policy.sampling import sample_batch

    model = family_model("qwen3_5_text")
    model.config.layer_types = ["linear_attention"] * 4  # the 4th layer is full attention in the model
    with pytest.raises(ModelFault) as info:
        sample_batch(model, [PROMPTS[0]], [1], max_new_tokens=3, temperature=1.0, stop_id=2, tile=2)
    assert info.value.code == "model_fault" and info.value.retryable is False
    assert info.value.details["model_type"] == "qwen3_5_text"  # Qwen3_5TextConfig's own model_type
    assert "cache_utils.py" in info.value.details["where"]
    assert "Error" not in info.value.message and "Traceback" not in info.value.message


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.support.models import shared_tiny_model

    return shared_tiny_model(tmp_path_factory)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_moe"])
def test_the_runtime_serves_the_family_batch_invariantly(family: str, tiny_dir, tmp_path) -> None:
    """A saved model folder of the family loads in the PolicyRuntime; its engine says its rows are
    batch-invariant, and a group sampled in one call equals its rows sampled one by one."""
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.support.model_builders import build_family_folder

    rt = PolicyRuntime.load(build_family_folder(family, tmp_path / family, tokenizer_dir=tiny_dir), decode_tile=4)
    assert rt.engine.batch_invariant is True
    prompt = rt.encode_prompt([{"role": "user", "content": "Count is 0. Reply with JSON."}], thinking=True)
    longer = rt.encode_prompt([{"role": "user", "content": "Count is 3. Target is 10. Reply."}], thinking=True)
    prompts, seeds = [prompt, longer, prompt], [7, 8, 9]
    group = [_bits(s) for s in rt.sample(prompts, seeds, max_new_tokens=10, temperature=1.0)]
    singles = [_bits(rt.sample([p], [s], max_new_tokens=10, temperature=1.0)[0]) for p, s in zip(prompts, seeds)]
    assert group == singles and group[0] != group[2]


def _episode(rt, first, turns: int) -> tuple[list, list[list[int]]]:
    """Two candidates, ``turns`` turns, decoded together; each turn's prompt is the whole context so
    far (actions and observation turns appended as ids)."""
    contexts, turns_out = [list(first), list(first)], []
    for turn in range(turns):
        seeds = [100 + turn, 200 + turn]
        rows = rt.sample([list(c) for c in contexts], seeds, max_new_tokens=6, temperature=1.0, thinking=False)
        turns_out.append([(list(c), s, r) for c, s, r in zip(contexts, seeds, rows)])
        for context, row in zip(contexts, rows):
            before, content, after = rt.encode_observation_turn(f"Count is {turn + 1}.", thinking=False)
            context.extend((row.ids if row.finished else row.ids + [rt.stop_id]) + before + content + after)
    return turns_out, contexts


def _reuse_by_brute_force(prompts: list[list[int]], chunk: int) -> int:
    """Tokens taken from kept states when ``prompts`` are prefilled in order: each prefilled prompt
    keeps its last chunk boundary below its end; a later prompt starts from the longest kept one
    it extends (shorter than itself)."""
    kept: list[list[int]] = []
    reused = 0
    for prompt in prompts:
        reused += max([len(k) for k in kept if len(k) < len(prompt) and prompt[: len(k)] == k], default=0)
        boundary = ((len(prompt) - 1) // chunk) * chunk
        if boundary > 0:
            kept.append(prompt[:boundary])
    return reused


@pytest.mark.timeout(240)
def test_a_three_turn_episode_keeps_state_and_equals_re_prefilling_each_turn(tiny_dir, tmp_path) -> None:
    """Multi-turn keep-state on qwen3_5 (prefill chunks of 16 here): later turns start from the
    kept row states and prefill only what was appended (plus less than a chunk). The ids and
    log-probs equal, bitwise, those of the same episode on an engine that keeps no state (every
    turn re-prefills its whole context), and per turn a batch-of-one decode of the whole context
    through transformers' own cache (within TOLERANCE) and the trainer's teacher-forced log-probs."""
    from kiln.core.policy.engine_hf import HfEngine
    from kiln.core.policy.runtime import PolicyRuntime
    from tests.support.model_builders import build_family_folder

    rt = PolicyRuntime.load(build_family_folder("qwen3_5", tmp_path / "qwen3_5", tokenizer_dir=tiny_dir), decode_tile=4)
    rt.use_engine(HfEngine(rt, 4, prefill_chunk=16))
    assert rt.engine.identity()["prefill_chunk"] == 16
    first = rt.encode_prompt([{"role": "user", "content": "Count is 0. Reply with JSON."}], thinking=False)
    kept, contexts = _episode(rt, first, 3)
    figures = rt.engine.prefill_figures
    rt.use_engine(HfEngine(rt, 4, prefill_chunk=16, kept_states=0))
    forgot, _ = _episode(rt, first, 3)
    def bytes_of(episode):
        return [[(context, _bits(row)) for context, _, row in turn] for turn in episode]

    assert bytes_of(kept) == bytes_of(forgot)
    prefilled = [first] + [context for turn in kept[1:] for context, _, _ in turn]  # turn 1's prompt once
    assert rt.engine.prefill_figures == {"prefill_tokens": sum(len(p) for p in prefilled), "prefill_tokens_reused": 0}
    reused = _reuse_by_brute_force(prefilled, 16)
    assert figures == {"prefill_tokens": sum(len(p) for p in prefilled) - reused, "prefill_tokens_reused": reused}
    assert reused >= 2 * 2 * 16  # turns 2 and 3 of both candidates start past their first chunk
    for turn in kept:
        for context, seed, row in turn:
            ids, lps = reference_decode(rt.model, context, seed, 6, stop_id=rt.stop_id)
            assert row.ids == ids
            assert max(abs(a - b) for a, b in zip(row.logprobs, lps)) <= TOLERANCE
            forced = rt.logprobs_of(context, row.ids, temperature=1.0)
            assert max(abs(a - b) for a, b in zip(row.logprobs, forced)) <= TOLERANCE
    assert len(contexts[0]) > len(first) + 3 * 6 and contexts[0] != contexts[1]
