"""Benchmark: a group sampled in one call vs one candidate at a time (same prompts, seeds, run).

    python bench/sampling.py [--model DIR] [--group 4] [--rounds 20] [--max-new-tokens 64]

Without ``--model`` the tiny demo model is built into a temporary directory first. Each round
samples a group of ``--group`` candidates for one counter prompt (a multi-turn prompt every other
round) both ways; the script prints tokens/s of both, the ratio, and how many completions are
bit-identical both ways (ids and float32 log-prob bytes). Sampling is batch-invariant
(docs/models.md): every row is decoded on its own, so all completions must be identical and the
group call gains only the shared prefill of its common prompt (ratio about 1.0-1.3).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _prompts(rt, rounds: int, thinking: bool) -> list[list[int]]:
    text = 'Count is {c}. Target is {t}. Reply with {{"amount": N}} where N is 1-5.'
    prompts = []
    for r in range(rounds):
        ids = rt.encode_prompt(
            [
                {"role": "system", "content": "You are playing the counter game."},
                {"role": "user", "content": text.format(c=0, t=8 + r % 5)},
            ],
            thinking=thinking,
        )
        for turn in range(r % 2 * 4):  # every other round: a 5-turn prompt built by appending ids
            action = ("</think>\n\n" if thinking else "") + '{"amount": 1}<|im_end|>'
            ids = ids + rt.tokenizer.encode(action, add_special_tokens=False)
            before, content, after = rt.encode_observation_turn(
                text.format(c=turn + 1, t=8 + r % 5), thinking=thinking
            )
            ids = ids + before + content + after
        prompts.append(ids)
    return prompts


def _f32(values: list[float]) -> bytes:
    import struct

    return struct.pack(f"<{len(values)}f", *values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-thinking", action="store_true")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from kiln.core.policy.runtime import PolicyRuntime

    tmp = None
    model_dir = args.model
    if model_dir is None:
        from kiln.core.policy.tiny import build_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="kiln-bench-")
        t0 = time.perf_counter()
        model_dir = build_tiny_model(Path(tmp.name) / "tiny")
        print(f"built tiny model in {time.perf_counter() - t0:.2f}s")
    rt = PolicyRuntime.load(model_dir)
    thinking = not args.no_thinking
    prompts = _prompts(rt, args.rounds, thinking)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, thinking=thinking)

    def seeds_of(r: int) -> list[int]:
        return [(r * 1_000_003 + i * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(args.group)]

    rt.sample([prompts[0]] * args.group, seeds_of(0), **kw)  # warm-up (allocator, kernels)
    batched_tokens = single_tokens = 0
    batched_s = single_s = 0.0
    same = 0
    for r, prompt in enumerate(prompts):
        seeds = seeds_of(r)
        t0 = time.perf_counter()
        group = rt.sample([prompt] * args.group, seeds, **kw)
        batched_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        singles = [rt.sample([prompt], [seed], **kw)[0] for seed in seeds]
        single_s += time.perf_counter() - t0
        batched_tokens += sum(len(s.ids) for s in group)
        single_tokens += sum(len(s.ids) for s in singles)
        same += sum(a.ids == b.ids and _f32(a.logprobs) == _f32(b.logprobs) for a, b in zip(group, singles))
    n = args.rounds * args.group
    print(f"prompts: {args.rounds} (lengths {min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"group {args.group}, max_new_tokens {args.max_new_tokens}, temperature {args.temperature}, "
          f"threads {args.threads}")
    print(f"group call: {batched_s:.3f}s  {batched_tokens} tokens  {batched_tokens / batched_s:.0f} tok/s")
    print(f"one-by-one: {single_s:.3f}s  {single_tokens} tokens  {single_tokens / single_s:.0f} tok/s")
    print(f"bit-identical completions (ids and log-probs), group call vs single: {same}/{n}")
    print(f"ratio (one-by-one time / group-call time): {single_s / batched_s:.2f}x")
    if tmp is not None:
        tmp.cleanup()
    return 0 if same == n else 1


if __name__ == "__main__":
    raise SystemExit(main())
