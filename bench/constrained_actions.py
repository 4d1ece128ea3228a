"""Benchmark: invalid-action rate and sampling time with and without schema-constrained decoding.

    python bench/constrained_actions.py [--model DIR] [--prompts 4] [--group 64] [--temperature 1.0]

Without ``--model`` the tiny demo model is built into a temporary directory first. Prompts are
Kiln's real counter prompts (system prompt with the embedded policy action schema, observation
``input_text``, later turns appended as ids like the collector does), ``--prompts`` of them with
0, 2, 4, ... previous turns, ``--group`` seeded samples each, for thinking on and off. An action is
*invalid* when the sample did not finish, has no answer (no ``</think>``), the answer is not JSON,
or it fails the action schema (:class:`kiln.core.openenv.schema.ActionValidator`). Each configuration
is sampled once unconstrained and once with ``action_schema=`` (same prompts, same seeds, after a
warm-up that also compiles the grammar); the script prints the invalid rates, their breakdown, the
median wall times of ``--repeats`` identical runs and the time ratio (constrained / unconstrained,
total and per generated token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from examples.envs.counter.server import CounterAction  # noqa: E402
from kiln.core.openenv.schema import policy_action_schema  # noqa: E402

# The counter environment's action schema exactly as the policy is shown it.
COUNTER_SCHEMA = policy_action_schema(CounterAction.model_json_schema())
METADATA = {
    "name": "counter",
    "description": "Count up to the target without going over; small steps score more.",
}


def _prompts(rt, n: int, thinking: bool) -> list[list[int]]:
    """Kiln counter prompts with 0, 2, 4, ... earlier turns (appended ids, never re-rendered)."""
    from kiln.core.rollout.prompts import initial_messages, observation_content

    prompts = []
    for p in range(n):
        target = 8 + p % 5

        def wire(c: int, target: int = target) -> dict:
            text = f"Count is {c}. Target is {target}."
            return {"observation": {"count": c, "target": target, "input_text": text}}

        ids = rt.encode_prompt(initial_messages(METADATA, COUNTER_SCHEMA, wire(0)), thinking=thinking)
        for turn in range(2 * p):
            action = ("</think>\n\n" if thinking else "") + '{"amount": 1}<|im_end|>'
            ids = ids + rt.tokenizer.encode(action, add_special_tokens=False)
            before, content, after = rt.encode_observation_turn(
                observation_content(wire(turn + 1), "step result"), thinking=thinking
            )
            ids = ids + before + content + after
        prompts.append(ids)
    return prompts


def _classify(rt, validator, sample, thinking: bool) -> str:
    if not sample.finished:
        return "unfinished"
    _, answer = rt.split_action(sample.ids, thinking=thinking)
    if answer is None:
        return "no_answer"
    try:
        action = json.loads(answer)
    except ValueError:
        return "not_json"
    return "valid" if validator.is_valid(action) else "schema"


def _run(rt, prompts, group: int, kw: dict, schema: dict | None) -> tuple[list, float]:
    samples = []
    start = time.perf_counter()
    for p, prompt in enumerate(prompts):
        seeds = [1000 * p + i for i in range(group)]
        samples += rt.sample([prompt] * group, seeds, action_schema=schema, **kw)
    return samples, time.perf_counter() - start


def _timed(rt, prompts, group: int, kw: dict, schema: dict | None, repeats: int) -> tuple[list, float]:
    """Samples of the first run (same seeds every run) and the median wall time over ``repeats``."""
    runs = [_run(rt, prompts, group, kw, schema) for _ in range(max(1, repeats))]
    assert all([s.ids for s in r[0]] == [s.ids for s in runs[0][0]] for r in runs)  # seeded
    return runs[0][0], statistics.median(r[1] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timing runs (median); ids must match")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from kiln.core.openenv.schema import ActionValidator
    from kiln.core.policy.runtime import PolicyRuntime

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from kiln.core.policy.tiny import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny")
        rt = PolicyRuntime.load(model_dir)
        validator = ActionValidator.compile(COUNTER_SCHEMA)
        t0 = time.perf_counter()
        rt.action_grammar(COUNTER_SCHEMA)
        compile_s = time.perf_counter() - t0
        print(f"grammar compile (tokenizer info + schema): {compile_s * 1000:.1f} ms")
        print(
            f"{args.prompts} prompts x {args.group} samples, temperature {args.temperature}, "
            f"max_new_tokens {args.max_new_tokens}"
        )
        for thinking in (True, False):
            prompts = _prompts(rt, args.prompts, thinking)
            kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, thinking=thinking)
            rt.sample([prompts[0]] * 4, [0, 1, 2, 3], action_schema=COUNTER_SCHEMA, **kw)  # warm-up
            rt.sample([prompts[0]] * 4, [0, 1, 2, 3], **kw)
            rows = {}
            for label, schema in (("free", None), ("constrained", COUNTER_SCHEMA)):
                samples, seconds = _timed(rt, prompts, args.group, kw, schema, args.repeats)
                kinds = [_classify(rt, validator, s, thinking) for s in samples]
                tokens = sum(len(s.ids) for s in samples)
                counts = {k: kinds.count(k) for k in ("unfinished", "no_answer", "not_json", "schema")}
                invalid = len(kinds) - kinds.count("valid")
                rows[label] = (invalid, len(kinds), seconds, tokens)
                print(
                    f"thinking={str(thinking):5} {label:11}: invalid {invalid}/{len(kinds)} "
                    f"({100.0 * invalid / len(kinds):.1f}%) {counts}  time {seconds:.2f}s  "
                    f"tokens {tokens}  ({1000.0 * seconds / max(tokens, 1):.3f} ms/token)"
                )
            free, cons = rows["free"], rows["constrained"]
            ratio = cons[2] / free[2]
            per_token = (cons[2] / max(cons[3], 1)) / (free[2] / max(free[3], 1))
            print(
                f"thinking={str(thinking):5} time ratio constrained/free: "
                f"{ratio:.2f}x total, {per_token:.2f}x per token"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
