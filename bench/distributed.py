"""Distributed trainer benchmark: training step time and peak memory per rank, 1 rank vs N ranks.

Both sides run the same training (``kiln.core.train.trainer.train_grpo`` on the same groups and
config), each in fresh processes: the N-rank side through the launcher
(:func:`kiln.core.train.launch.train_across`: spawned ranks, FSDP2 over the base model, each rank
reading only its shards, gloo on the CPU, NCCL on CUDA), the 1-rank side the plain trainer (what
``KILN_TRAIN_DEVICES=1`` runs) in a spawned process. Sides alternate, each repeated ``--repeats``
times; the figures are medians. Per side:

- ``step_s``: the receipt's training time (``phase_timings.train_s``) over its optimizer steps;
  ``tokens_per_s``: the tokens trained (every row's tokens, every step) over that time;
- ``base_weight_bytes``: the receipt's resident base weights of the rank holding the most (its
  local FSDP2 shards, :func:`kiln.core.train.distributed.resident_base_bytes`);
- ``base_load_peak_bytes`` / ``training_peak_bytes``: the receipt's ``process_memory``
  (:mod:`kiln.core.train.memory`): the largest rank's ``VmHWM`` after loading (and sharding) the
  base model, and at the end of training, minus its ``VmRSS`` before the load;
- ``peak_rss_bytes`` (CPU): the largest ``VmHWM`` (the kernel's peak resident set) of any rank,
  read by the bench from ``/proc/<pid>/status`` while the ranks run (the brute-force reading of
  the same counter, imports included);
- ``peak_device_bytes`` (CUDA): the most memory in use on any of the ranks' GPUs during the
  training (``torch.cuda.mem_get_info`` sampled every 0.1 s, minus what was in use before);
- ``adapter_rel_diff``: the largest relative difference (Frobenius) of an adapter tensor from the
  1-rank side's (AdamW: the 2-rank adapter equals the 1-rank one up to float rounding).

Prints each side and the ratios N / 1. On this 2-core CPU the time ratio is not the point (two
ranks share two cores, and gloo is slow); the memory ratio and the equality are.

    python bench/distributed.py [--ranks 2] [--layers 2] [--rows 8] [--tokens 256] [--repeats 1]
    python bench/distributed.py --device cuda --ranks 2      # a GPU box: NCCL, bf16, every layer
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

BEHAVIOR = {"base_model_sha256": "sha256:" + "0" * 64, "adapter_sha256": None, "runtime": {"kiln": "bench"}}


def synthetic_groups(n_groups: int, size: int, tokens: int, vocab: int) -> list[dict]:
    """``n_groups`` groups of ``size`` completions of ``tokens`` tokens each (a context, then
    action/observation turns of 16 + 16 tokens), rewards varying within every group."""
    gen = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    groups = []
    for g in range(n_groups):
        comps = []
        for c in range(size):
            turns = max(1, (tokens - 32) // 32)
            pieces = [{"kind": "context", "ids": ids(max(1, tokens - 32 * turns))}]
            for _ in range(turns):
                action = ids(16)
                pieces.append({"kind": "action", "ids": action, "logprobs": [-1.0] * len(action)})
                pieces.append({"kind": "observation", "ids": ids(16), "warning": False})
            comps.append({"reward": float((g + c) % 2), "tokens": {"pieces": pieces},
                          "openenv": {"behavior_policy": dict(BEHAVIOR)}})
        groups.append({"messages": [], "completions": comps})
    return groups


def group_tokens(groups: list[dict]) -> int:
    return sum(len(p["ids"]) for g in groups for c in g["completions"] for p in c["tokens"]["pieces"])


def _hwm_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM``), 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakWatch:
    """Samples the ranks' ``VmHWM`` (CPU) or the GPUs' memory in use (CUDA) every 0.1 s."""

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.cuda = [int(d.split(":")[1]) for d in devices if d.startswith("cuda")]
        self.before = {i: self._used(i) for i in self.cuda}
        self.pids: list[int] = []
        self.rss: dict[int, int] = {}
        self.device: dict[int, int] = {i: 0 for i in self.cuda}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _used(index: int) -> int:
        free, total = torch.cuda.mem_get_info(index)
        return total - free

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for pid in list(self.pids):
                self.rss[pid] = max(self.rss.get(pid, 0), _hwm_bytes(pid))
            for index in self.cuda:
                self.device[index] = max(self.device[index], self._used(index) - self.before[index])

    def stop(self) -> dict[str, int | None]:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_bytes": max(self.rss.values()) if self.rss and not self.cuda else None,
                "peak_device_bytes": max(self.device.values()) if self.cuda else None}


def _train_alone(kwargs: dict[str, Any], threads: int) -> None:
    """The 1-rank side: the plain trainer (what ``KILN_TRAIN_DEVICES=1`` runs), in a fresh process."""
    from kiln.core.train.trainer import train_grpo

    torch.set_num_threads(threads)
    train_grpo(**kwargs)


def run_side(world: int, *, model: Path, groups: list[dict], config: Any, device: str, dtype: str,
             work: Path) -> dict[str, Any]:
    """One training across ``world`` ranks (1: the plain trainer in a process of its own); its
    figures and adapter tensors."""
    import multiprocessing

    from safetensors.torch import load_file

    from kiln.core.train.launch import Launch, rank_devices, train_across

    threads = max(1, torch.get_num_threads() // world) if device == "cpu" else 1
    launch = Launch(devices=rank_devices(device, world), collective_timeout_s=600.0, threads_per_rank=threads)
    watch = PeakWatch(launch.devices)
    out = work / f"world-{world}-{time.monotonic_ns()}"
    kwargs = dict(output_dir=out, model_path=model, groups=groups, config=config,
                  expected_behavior_policy=BEHAVIOR, dtype=dtype)
    try:
        if world == 1:
            alone = multiprocessing.get_context("spawn").Process(
                target=_train_alone, args=({**kwargs, "device": launch.devices[0]}, threads))
            alone.start()
            watch.pids.append(alone.pid)
            alone.join()
            if alone.exitcode != 0:
                raise RuntimeError(f"the 1-rank training exited with {alone.exitcode}")
        else:
            train_across(launch, on_start=lambda ranks: watch.pids.extend(ranks.pids), **kwargs)
    finally:
        peaks = watch.stop()
    receipt = json.loads((out / "train_receipt.json").read_text())
    train_s = receipt["phase_timings"]["train_s"]
    steps = max(1, len(receipt["steps"]))
    trained_tokens = group_tokens(groups) * config.epochs
    memory = receipt["runtime"]["process_memory"] or {}
    return {"world_size": receipt["runtime"]["world_size"], "steps": steps, "step_s": train_s / steps,
            "tokens_per_s": trained_tokens / train_s, "base_weight_bytes": receipt["runtime"]["base_weight_bytes"],
            "base_load_peak_bytes": memory.get("base_load_peak_bytes"),
            "training_peak_bytes": memory.get("training_peak_bytes"),
            **peaks, "losses": [h["loss"] for h in receipt["steps"]],
            "adapter": load_file(str(out / "adapter" / "adapter_model.safetensors"))}


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)) for k in b)


def compare(worlds: list[int], *, model: Path, groups: list[dict], config: Any, device: str, dtype: str,
            repeats: int, work: Path) -> list[dict[str, Any]]:
    """Each world size ``repeats`` times, alternating; the median figures per world size (the
    first is the baseline of ``adapter_rel_diff``)."""
    runs: dict[int, list[dict[str, Any]]] = {w: [] for w in worlds}
    for _ in range(repeats):
        for world in worlds:
            runs[world].append(run_side(world, model=model, groups=groups, config=config, device=device,
                                        dtype=dtype, work=work))
    baseline = runs[worlds[0]][0]["adapter"]
    rows = []
    for world in worlds:
        sides = runs[world]
        row: dict[str, Any] = {"world_size": world, "steps": sides[0]["steps"]}
        for key in ("step_s", "tokens_per_s", "base_weight_bytes", "base_load_peak_bytes", "training_peak_bytes",
                    "peak_rss_bytes", "peak_device_bytes"):
            values = [s[key] for s in sides if s[key] is not None]
            row[key] = statistics.median(values) if values else None
        row["adapter_rel_diff"] = max(_relative(s["adapter"], baseline) for s in sides)
        row["loss_max_abs_diff"] = max(abs(x - y) for s in sides
                                       for x, y in zip(s["losses"], runs[worlds[0]][0]["losses"]))
        rows.append(row)
    return rows


def _ratio(rows: list[dict[str, Any]], key: str) -> str:
    base, other = rows[0].get(key), rows[-1].get(key)
    return f"{other / base:.3f}" if base and other is not None else "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="the other side's world size (the baseline is 1)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=None, help="layers of the qwen3-0.6b shape (default: 2 on "
                        "CPU, all 28 on CUDA)")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4, help="completions per group")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per completion")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from kiln.core.training_config import TrainingConfig
    from kiln.core.policy.random_model import build_random_model

    on_cuda = args.device == "cuda"
    layers = args.layers if args.layers is not None else (None if on_cuda else 2)
    dtype = "bfloat16" if on_cuda else "float32"
    config = TrainingConfig(seed=0, optimizer="adamw", learning_rate=1e-3, echo=None, epochs=1,
                            groups_per_step=args.groups, max_tokens_per_microbatch=args.tokens * 2)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-dist-") as tmp:
        work = Path(tmp)
        model = build_random_model(work / "model", shape="qwen3-0.6b", layers=layers, dtype="bfloat16")
        groups = synthetic_groups(args.groups, args.rows, args.tokens, vocab=151_000)
        rows = compare([1, args.ranks], model=model, groups=groups, config=config, device=args.device,
                       dtype=dtype, repeats=args.repeats, work=work)
    print(f"qwen3-0.6b shape, {layers or 28} layers, {dtype} on {args.device}; {args.groups} groups x {args.rows} "
          f"rows x {args.tokens} tokens, one step; median of {args.repeats}")
    for row in rows:
        print(json.dumps(row))
    print(f"ratios {args.ranks} ranks / 1 rank: step_s {_ratio(rows, 'step_s')}, base_weight_bytes per rank "
          f"{_ratio(rows, 'base_weight_bytes')}, process-measured base-weights load peak per rank "
          f"{_ratio(rows, 'base_load_peak_bytes')}, whole-training peak per rank {_ratio(rows, 'training_peak_bytes')}, "
          f"peak_rss per rank {_ratio(rows, 'peak_rss_bytes')}, peak device "
          f"memory per GPU {_ratio(rows, 'peak_device_bytes')}; adapter max relative diff "
          f"{rows[-1]['adapter_rel_diff']:.2e}, loss max abs diff {rows[-1]['loss_max_abs_diff']:.2e}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
