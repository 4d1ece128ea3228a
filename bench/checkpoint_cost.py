"""Benchmark: what a training checkpoint costs next to the training steps it protects.

Picks ``checkpoint_interval``'s default (kiln/core/contracts.py). Both figures are measured in this
process on the same model, LoRA and optimizer: the median Kiln ``train_step`` on a group, and the
median checkpoint (``save_checkpoint`` of the trainable tensors, the AdamW state, the log-prob
cache and RNG, then ``pack_folder`` into the blob the activity uploads; the upload itself is not
counted). Printed: the ratio checkpoint/step, and for each interval the share of training time
checkpoints take and the most steps a kill re-does.

    python bench/checkpoint_cost.py                 # tiny random Qwen3
    python bench/checkpoint_cost.py --shape qwen3-0.6b --layers 2   # real shape, 2 layers, real vocab
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from training import _groups, _make, _tiny_model  # noqa: E402  (bench/training.py)

from kiln.core.train.batches import group_rows  # noqa: E402
from kiln.core.train.checkpoints import pack_folder, save_checkpoint  # noqa: E402
from kiln.core.train.model import trainable_parameters  # noqa: E402
from kiln.core.train.step import LogprobCache, StepSettings, train_step  # noqa: E402

INTERVALS = (1, 2, 5, 10, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="a real model shape (kiln.core.policy.random_model), e.g. qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(tempfile.mkdtemp(prefix="kiln-ckpt-bench-"))
    if args.shape:
        from kiln.core.policy.random_model import build_random_model

        model_path = build_random_model(work / "model", shape=args.shape, layers=args.layers, dtype="bfloat16")
    else:
        model_path = _tiny_model(work / "tiny")

    model, params, optimizer = _make(model_path, device)
    named = trainable_parameters(model)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    rows = [group_rows(g, group_index=i, warning_filter=True)
            for i, g in enumerate(_groups(args.groups, args.group_size, args.turns, vocab))]
    settings = StepSettings(clip_epsilon=0.2, kl_coeff=0.0, echo_lambda=0.05, max_grad_norm=1.0, recorded=False)
    cache = LogprobCache()
    train_step(model, rows[0], optimizer, params, settings, cache, device)  # warm-up, optimizer state

    step_times, ckpt_times, sizes = [], [], []
    for r in range(args.repeats):
        for group in rows:
            t0 = time.perf_counter()
            train_step(model, group, optimizer, params, settings, cache, device)
            step_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        folder = save_checkpoint(work / f"ckpt-{r}", params=named, optimizer=optimizer,
                                 state={"step": r, "history": []}, logprobs=cache.tensors())
        sizes.append(len(pack_folder(folder)))
        ckpt_times.append(time.perf_counter() - t0)
    step_s, ckpt_s = statistics.median(step_times), statistics.median(ckpt_times)
    trainable = sum(p.numel() for p in params)
    print(f"model={args.shape or 'tiny'} layers={args.layers if args.shape else 2} device={device.type} "
          f"trainable={trainable:,} checkpoint_bytes={statistics.median(sizes):,.0f}")
    print(f"train_step (one group) : {step_s * 1000:9.1f} ms")
    print(f"checkpoint (save+pack) : {ckpt_s * 1000:9.1f} ms")
    print(f"ratio checkpoint/step  : {ckpt_s / step_s:.3f}x")
    for interval in INTERVALS:
        share = ckpt_s / (interval * step_s + ckpt_s)
        print(f"interval {interval:>2}: checkpoints take {share:6.1%} of training; a kill re-does <= {interval} steps")


if __name__ == "__main__":
    main()
