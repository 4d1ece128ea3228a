"""Benchmark: Kiln's GRPO+ECHO training step vs a bare PEFT forward/backward/step loop.

Both run in this process, on the same tiny random Qwen3 (or ``--model DIR``), on identical group
batches, with the same LoRA and AdamW settings. The bare loop is the minimum any LoRA
policy-gradient trainer must do (forward, advantage-weighted action log-prob, backward, clip,
step); the ratio shows what Kiln's masks, PPO surrogate, ECHO term and diagnostics cost on top.
Target: ≤ 1.15×.

Then Kiln's step with ``packing`` against the same step padded, on groups whose completions have
1 … ``--turns`` turns (so rows differ in length): the padding fraction of each layout (token slots
the forwards run over that hold no row token), the fraction packing removes, and the step time
of each side, alternating sides in every repeat, with the per-repeat ratios and their median.

    python bench/training.py [--model DIR] [--groups 8] [--group-size 8] [--turns 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln.core.train.batches import collate, group_rows  # noqa: E402
from kiln.core.train.losses import token_logprobs  # noqa: E402
from kiln.core.train.model import attach_lora, load_base_model, trainable_parameters  # noqa: E402
from kiln.core.train.step import LogprobCache, StepSettings, microbatches, train_step  # noqa: E402


def _tiny_model(folder: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True, initializer_range=0.2,
    )
    Qwen3ForCausalLM(config).save_pretrained(str(folder))
    return folder


def _groups(n_groups: int, size: int, turns: int, vocab: int, vary: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    groups = []
    for g in range(n_groups):
        comps = []
        for c in range(size):
            pieces = [{"kind": "context", "ids": ids(48)}]
            for _ in range(1 + (g * size + c) % turns if vary else turns):
                action = ids(12)
                pieces.append({"kind": "action", "ids": action, "logprobs": [-1.0] * len(action)})
                pieces.append({"kind": "observation", "ids": ids(4), "warning": True})
                pieces.append({"kind": "observation", "ids": ids(12), "warning": False})
            comps.append({"reward": float((g + c) % 3), "tokens": {"pieces": pieces}})
        groups.append({"messages": [], "completions": comps})
    return groups


def _bare_step(model, batch, optimizer, params, max_grad_norm: float) -> None:
    optimizer.zero_grad(set_to_none=True)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    lp = token_logprobs(out.logits, batch.labels)
    weighted = lp * batch.action_mask * batch.advantages.unsqueeze(-1)
    loss = -weighted.sum() / batch.action_mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()


def _make(model_path: Path, device: torch.device):
    model = attach_lora(load_base_model(model_path, device), rank=16, alpha=32.0, seed=0,
                        base_adapter_dir=None)
    params = [p for _, p in trainable_parameters(model)]
    return model, params, torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)


def _slots(step_rows: list, settings: StepSettings) -> int:
    """Token slots the step's forwards run over: micro-batch rows × longest row, or bins × longest bin."""
    total = 0
    for micro, bins in microbatches(step_rows, settings):
        if bins is None:
            total += len(micro) * max(r.length for r in micro)
        else:
            total += len(bins) * max(sum(r.length for r in b) for b in bins)
    return total


def _packing(args: argparse.Namespace, model_path: Path, device: torch.device, sync) -> None:
    """Packed vs padded Kiln steps on rows of varied length (two models from one seed)."""
    padded_model, padded_params, padded_opt = _make(model_path, device)
    packed_model, packed_params, packed_opt = _make(model_path, device)
    vocab = int(padded_model.get_input_embeddings().weight.shape[0])
    groups = _groups(args.groups, args.group_size, args.turns, vocab, vary=True)
    rows = [group_rows(g, group_index=i, warning_filter=True) for i, g in enumerate(groups)]
    base = dict(clip_epsilon=0.2, kl_coeff=0.0, echo_lambda=0.05, max_grad_norm=1.0, recorded=False)
    padded_settings, packed_settings = StepSettings(**base), StepSettings(**base, packing=True)
    caches = (LogprobCache(), LogprobCache())

    def run(model, opt, params, settings, cache) -> None:
        for r in rows:
            train_step(model, r, opt, params, settings, cache, device)

    sides = {
        "padded": lambda: run(padded_model, padded_opt, padded_params, padded_settings, caches[0]),
        "packed": lambda: run(packed_model, packed_opt, packed_params, packed_settings, caches[1]),
    }
    for fn in sides.values():
        fn()  # warm-up (and the first-visit old log-probs)
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    for repeat in range(args.repeats):  # alternate which side goes first
        for name in ("padded", "packed") if repeat % 2 == 0 else ("packed", "padded"):
            sync()
            t0 = time.perf_counter()
            sides[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    tokens = sum(r.length for step in rows for r in step)
    slots = {
        "padded": sum(_slots(r, padded_settings) for r in rows),
        "packed": sum(_slots(r, packed_settings) for r in rows),
    }
    pad = {k: 1.0 - tokens / v for k, v in slots.items()}
    removed = (slots["padded"] - slots["packed"]) / max(1, slots["padded"] - tokens)
    ratios = [b / a for a, b in zip(times["padded"], times["packed"])]
    lengths = sorted(r.length for step in rows for r in step)
    print(f"packing: rows={len(lengths)} lengths {lengths[0]}..{lengths[-1]} tokens={tokens}")
    print(f"padding fraction    : padded {pad['padded']:.3f}  packed {pad['packed']:.3f}  "
          f"(packing removes {removed:.1%} of the padding; slots {slots['padded']} -> {slots['packed']})")
    for name in ("padded", "packed"):
        print(f"kiln step {name:<9} : {statistics.median(times[name]) / len(rows) * 1000:8.2f} ms/step (median)")
    print(f"ratio packed/padded : {statistics.median(ratios):.3f}x median of "
          f"[{', '.join(f'{r:.3f}' for r in ratios)}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-bare", action="store_true", help="only the packed vs padded comparison")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model_path = args.model or _tiny_model(Path(tempfile.mkdtemp()) / "tiny")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    if not args.skip_bare:
        _kiln_vs_bare(args, model_path, device, sync)
    _packing(args, model_path, device, sync)


def _kiln_vs_bare(args: argparse.Namespace, model_path: Path, device: torch.device, sync) -> None:
    """Kiln's default step against the bare PEFT loop on rows of one length."""

    kiln_model, kiln_params, kiln_opt = _make(model_path, device)
    bare_model, bare_params, bare_opt = _make(model_path, device)
    vocab = int(kiln_model.get_input_embeddings().weight.shape[0])
    rows = [group_rows(g, group_index=i, warning_filter=True)
            for i, g in enumerate(_groups(args.groups, args.group_size, args.turns, vocab))]
    batches = [collate(r).to(device) for r in rows]
    # Kiln's step as configured by default except the KL term (the bare loop has no reference
    # model): chunked log-probs, first-visit old log-probs (cached after the warm-up pass, as in
    # every epoch after the first), PPO clip, ECHO λ=0.05, micro-batches by token budget.
    settings = StepSettings(clip_epsilon=0.2, kl_coeff=0.0, echo_lambda=0.05, max_grad_norm=1.0,
                            recorded=False)
    cache = LogprobCache()

    def run_kiln() -> None:
        for r in rows:
            train_step(kiln_model, r, kiln_opt, kiln_params, settings, cache, device)

    def run_bare() -> None:
        for b in batches:
            _bare_step(bare_model, b, bare_opt, bare_params, 1.0)

    run_kiln(), run_bare()  # warm-up
    kiln_times, bare_times = [], []
    for _ in range(args.repeats):  # interleaved so drift hits both equally
        for fn, sink in ((run_bare, bare_times), (run_kiln, kiln_times)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            sink.append(time.perf_counter() - t0)
    tokens = sum(b.tokens for b in batches)
    kiln_s, bare_s = statistics.median(kiln_times), statistics.median(bare_times)
    print(f"device={device.type} groups={len(batches)} tokens/epoch={tokens} "
          f"shape={tuple(batches[0].input_ids.shape)}")
    print(f"bare peft step loop : {bare_s / len(batches) * 1000:8.2f} ms/step "
          f"({tokens / bare_s:,.0f} tok/s)")
    print(f"kiln train_step     : {kiln_s / len(batches) * 1000:8.2f} ms/step "
          f"({tokens / kiln_s:,.0f} tok/s)")
    ratio = kiln_s / bare_s
    verdict = "OK" if ratio <= 1.15 else "OVER"
    print(f"ratio kiln/bare     : {ratio:.3f}x (target <= 1.15x) {verdict}")


if __name__ == "__main__":
    main()
