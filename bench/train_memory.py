"""Peak memory of one GRPO training step: chunked log-probs vs materialised full-vocabulary logits.

Model: a Qwen3-architecture causal LM with the real vocabulary size (151,936), random init, 2 layers,
hidden 1024 (16 heads, 8 KV heads, head dim 128, MLP 3072, tied embeddings), float32, with Kiln's
LoRA (rank 16 on every projection). Batch: ``--batch`` × ``--seq`` random tokens (the issue's shape
is 4 × 2048), every target an action token, advantage ±1.

One step = forward, token log-probs of the targets, policy-gradient loss, backward:

- ``full``: ``model(...).logits`` (B × T × V fp32) then ``log_softmax`` over them — what the trainer
  did before (:func:`kiln.core.train.losses.token_logprobs`);
- ``chunked``: :func:`kiln.core.train.losses.sequence_logprobs` — the backbone once, then the output head
  over chunks of positions under activation checkpointing (the trainer's path).

Measurement: each variant runs in a fresh child process. On CUDA the figure is
``torch.cuda.max_memory_allocated`` during the step. On CPU it is the process's peak resident set
(``VmHWM``) during the step minus the resident set just before it: the child resets the kernel's
peak counter by writing ``5`` to ``/proc/self/clear_refs`` after building the model and the batch,
so model construction does not count, then reads ``VmHWM`` after the step (Linux only; tracemalloc
does not see torch's allocator). Prints both peaks and the ratio chunked / full (target ≤ 0.4).

Run: ``python -m bench.train_memory [--batch 4] [--seq 2048] [--device cpu]``. On this 2-core CPU
``--batch 1 --seq 2048`` takes about a minute per variant; the full-logits variant at 4 × 2048 needs
~20 GB of RAM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 151_936


def _build(device: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kiln.core.train.model import LORA_TARGETS

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    model = Qwen3ForCausalLM(config).to(device).eval()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    return get_peft_model(model, lora)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(variant: str, batch: int, seq: int, device: str, threads: int) -> dict:
    import torch

    from kiln.core.train.losses import sequence_logprobs, token_logprobs

    torch.set_num_threads(threads)
    model = _build(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen).to(device)
    attention = torch.ones_like(ids)
    labels = ids[:, 1:]
    adv = (torch.arange(batch, device=device) % 2 * 2 - 1).float().unsqueeze(-1)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss_kib("VmRSS") * 1024
    started = time.perf_counter()
    if variant == "full":
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        logprobs = token_logprobs(logits, labels)
    else:
        logprobs = sequence_logprobs(model, ids, attention, labels)
    loss = -(logprobs * adv).mean()
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _rss_kib("VmHWM") * 1024 - before
    grad = sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
    return {"variant": variant, "peak_bytes": peak, "seconds": time.perf_counter() - started,
            "loss": float(loss.detach()), "grad_abs_sum": grad}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-ratio", type=float, default=0.4)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.batch, args.seq, args.device, args.threads)))
        return 0
    results = {}
    for variant in ("chunked", "full"):
        out = subprocess.run(
            [sys.executable, "-m", "bench.train_memory", "--child", variant, "--batch", str(args.batch),
             "--seq", str(args.seq), "--device", args.device, "--threads", str(args.threads)],
            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, check=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    chunked, full = results["chunked"], results["full"]
    print(f"Qwen3 2 layers, hidden 1024, vocab {VOCAB}, batch {args.batch} × {args.seq} tokens, {args.device}")
    for r in (full, chunked):
        print(f"{r['variant']:>8}: step peak {r['peak_bytes'] / 2**30:7.2f} GiB, {r['seconds']:6.1f} s, "
              f"loss {r['loss']:.6f}, Σ|grad| {r['grad_abs_sum']:.6e}")
    ratio = chunked["peak_bytes"] / full["peak_bytes"]
    print(f"ratio chunked / full: {ratio:.3f} (target <= {args.max_ratio})")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    raise SystemExit(main())
