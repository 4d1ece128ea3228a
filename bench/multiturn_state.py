"""Benchmark: multi-turn state reuse on a hybrid model (hf engine), per-turn prefill tokens and time.

A random-weight Qwen3.5-shaped model (3 Gated DeltaNet layers + 1 full-attention layer, hidden
``--hidden``) plays a ``--turns``-turn episode with a group of ``--group`` candidates: each turn's
prompt is the whole context so far (a ``--prompt``-token start, then per turn the candidate's
``--action``-token action and a ``--observation``-token observation turn). Both sides decode the
same rows with the same canonical chunked prefill (``kiln.core.policy.prefix_states``), so their bytes
are equal (checked); one keeps the row states between turns, the other keeps none and re-prefills
every turn's whole context. Printed: the prompt tokens each side prefilled per turn, and the
episode's wall time, median of ``--repeats`` alternating runs, as a ratio.

    python bench/multiturn_state.py [--turns 4] [--group 4] [--prompt 300] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig  # noqa: E402

from kiln.core.policy.prefix_states import PREFILL_CHUNK, PrefixStates  # noqa: E402
from kiln.core.policy.sampling import sample_batch  # noqa: E402


def _model(hidden: int):
    config = Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=hidden // 8, linear_value_head_dim=hidden // 8,
        layer_types=["linear_attention"] * 3 + ["full_attention"], eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().requires_grad_(False)


def _episode(model, args, states: PrefixStates) -> tuple[list[int], list, float]:
    gen = torch.Generator().manual_seed(11)
    start = torch.randint(3, 4096, (args.prompt,), generator=gen).tolist()
    contexts = [list(start) for _ in range(args.group)]
    per_turn, rows_out = [], []
    began = time.perf_counter()
    for turn in range(args.turns):
        before = states.figures["prefill_tokens"]
        rows = sample_batch(model, contexts, [turn * 100 + i for i in range(args.group)],
                            max_new_tokens=args.action, temperature=1.0, stop_id=2, tile=args.group,
                            states=states)
        per_turn.append(states.figures["prefill_tokens"] - before)
        rows_out.append([(r.ids, r.logprobs) for r in rows])
        for context, row in zip(contexts, rows):
            context.extend(row.ids + torch.randint(3, 4096, (args.observation,), generator=gen).tolist())
    return per_turn, rows_out, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--action", type=int, default=24)
    parser.add_argument("--observation", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = _model(args.hidden)
    times: dict[str, list[float]] = {"reuse": [], "re-prefill": []}
    tokens: dict[str, list[int]] = {}
    rows: dict[str, list] = {}
    for repeat in range(args.repeats):
        order = ["reuse", "re-prefill"] if repeat % 2 == 0 else ["re-prefill", "reuse"]
        for side in order:
            states = PrefixStates() if side == "reuse" else PrefixStates(capacity=0)
            tokens[side], rows[side], seconds = _episode(model, args, states)
            times[side].append(seconds)
    assert rows["reuse"] == rows["re-prefill"], "the two sides sampled different bytes"
    print(f"qwen3.5-shaped hybrid, hidden {args.hidden}, chunk {PREFILL_CHUNK}, group {args.group}, "
          f"{args.turns} turns, prompt {args.prompt} + per turn {args.action} action + {args.observation} "
          "observation tokens")
    for turn in range(args.turns):
        print(f"turn {turn + 1}: prefill tokens reuse {tokens['reuse'][turn]:6d}   "
              f"re-prefill {tokens['re-prefill'][turn]:6d}")
    reuse, full = statistics.median(times["reuse"]), statistics.median(times["re-prefill"])
    print(f"episode wall time (median of {args.repeats}): reuse {reuse:.3f} s, re-prefill {full:.3f} s, "
          f"re-prefill / reuse = {full / reuse:.2f}x")


if __name__ == "__main__":
    main()
