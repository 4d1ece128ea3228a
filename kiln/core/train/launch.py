"""Launch one training across N ranks: spawned child processes of the caller, stopped by PID.

:func:`train_across` runs :func:`kiln.core.train.trainer.train_grpo` in ``world_size`` spawned
processes (``multiprocessing`` spawn context), one device each (``cuda:i`` with NCCL, or the CPU
with gloo: one code path, the device is a setting), joined by a file rendezvous in the work
folder. Rank 0 sends its progress, each checkpoint it wrote and its result over a queue; the
caller's thread relays them (heartbeats, checkpoint uploads), so the activity keeps its own
heartbeat and retry contract (:mod:`kiln.core.train.distributed` has the ranks' side).

A rank that dies fails the attempt cleanly:

- the launcher polls its ranks every ``POLL_S`` (0.25 s); when one has exited with a failure (a
  KilnError it raised comes back as itself; anything else, a signal included, is
  ``training_rank_failed``, retryable), it SIGKILLs every other rank by PID and reaps them all,
  so the attempt fails within about ``POLL_S`` + ``DRAIN_S`` (≈ 1.3 s) of the death and no rank
  outlives it; the retry resumes from the last checkpoint rank 0 wrote;
- every collective of a rank times out after ``collective_timeout_s``
  (``KILN_TRAIN_COLLECTIVE_TIMEOUT_S``, default 300 s): a rank left waiting on a peer that hangs
  without dying raises, exits, and the launcher fails the attempt as above;
- each rank asks the kernel for SIGKILL when its launcher dies (``PR_SET_PDEATHSIG``), so a
  worker killed with ``kill -9`` leaves no rank behind either.

Cancellation (``should_cancel``) kills the ranks the same way and raises ``cancelled``.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
import pickle
import queue as queue_module
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from kiln.core.errors import KilnError, RunCancelled, TrainingRankFailed, error_from_dict

POLL_S = 0.25
DRAIN_S = 1.0
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Launch:
    """How to spread one training over ranks: one device per rank."""

    devices: tuple[str, ...]  # per rank: "cpu" (gloo) or "cuda:i" (nccl)
    collective_timeout_s: float = 300.0
    threads_per_rank: int = 1  # torch CPU threads of each rank

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def backend(self) -> str:
        return "nccl" if self.devices[0].startswith("cuda") else "gloo"


def rank_devices(device: str, world_size: int) -> tuple[str, ...]:
    """One device per rank: ``cuda:0 … cuda:N-1`` on a CUDA device, else the CPU N times."""
    if device.startswith("cuda"):
        return tuple(f"cuda:{i}" for i in range(world_size))
    return ("cpu",) * world_size


def launch_for(train_devices: str, device: str, *, collective_timeout_s: float = 300.0) -> Launch | None:
    """The launch of a ``KILN_TRAIN_DEVICES`` value on the resolved ``device`` (``cpu`` or
    ``cuda:N``): None for one rank (the trainer runs in the caller's process, as ever); ``auto``
    is every visible CUDA GPU, one rank on the CPU. More ranks than GPUs is refused."""
    import torch

    from kiln.core.errors import DeviceUnavailable

    on_cuda = device.startswith("cuda")
    gpus = torch.cuda.device_count() if on_cuda else 0
    count = (gpus if on_cuda else 1) if train_devices == "auto" else int(train_devices)
    if on_cuda and count > gpus:
        raise DeviceUnavailable(
            f"KILN_TRAIN_DEVICES={train_devices} but only {gpus} CUDA GPU(s) are visible",
            hint="set KILN_TRAIN_DEVICES to at most the visible GPUs, or auto",
            details={"field": "KILN_TRAIN_DEVICES"},
        )
    if count <= 1:
        return None
    threads = max(1, torch.get_num_threads() // count) if not on_cuda else 1
    return Launch(
        devices=rank_devices(device, count), collective_timeout_s=collective_timeout_s, threads_per_rank=threads
    )


@dataclass
class RankHandles:
    """The live ranks of one launch (their PIDs, for callers and tests that watch them)."""

    pids: list[int]


def train_across(
    launch: Launch,
    *,
    output_dir: Path,
    progress: Callable[[dict], None] | None = None,
    checkpoint_sink: Callable[[int, Path], None] | None = None,
    should_cancel: Callable[[], bool] | None = None,
    on_start: Callable[[RankHandles], None] | None = None,
    **train_kwargs: Any,
) -> Any:
    """``train_grpo(output_dir=…, **train_kwargs)`` across ``launch.world_size`` ranks; returns
    rank 0's :class:`kiln.core.train.trainer.TrainedAdapter`. ``train_kwargs`` must pickle (paths,
    groups, the config); ``device`` is the launch's per rank. ``on_start`` gets the ranks' PIDs."""
    output_dir = Path(output_dir)
    work = output_dir.parent / f"{output_dir.name}.ranks"
    work.mkdir(parents=True, exist_ok=True)
    job = work / "job.pkl"
    job.write_bytes(pickle.dumps({**train_kwargs, "output_dir": output_dir}))
    rendezvous = work / "rendezvous"
    if rendezvous.exists():
        rendezvous.unlink()
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    procs = [
        context.Process(
            target=rank_main,
            name=f"kiln-train-rank-{rank}",
            args=(rank, launch, str(job), str(rendezvous), os.getpid(), messages),
        )
        for rank in range(launch.world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        if on_start is not None:
            on_start(RankHandles(pids=[p.pid for p in procs if p.pid is not None]))
        return _watch(procs, messages, progress, checkpoint_sink, should_cancel)
    finally:
        _stop(procs)
        messages.close()


def _watch(
    procs: list[Any],
    messages: Any,
    progress: Callable[[dict], None] | None,
    checkpoint_sink: Callable[[int, Path], None] | None,
    should_cancel: Callable[[], bool] | None,
) -> Any:
    """Relay rank 0's messages until every rank exited 0 (rank 0's result) or one failed."""
    result: Any = None
    while True:
        try:
            message = messages.get(timeout=POLL_S)
        except queue_module.Empty:
            message = None
        if message is not None:
            kind = message[0]
            if kind == "progress" and progress is not None:
                progress(message[1])
            elif kind == "checkpoint" and checkpoint_sink is not None:
                checkpoint_sink(message[1], Path(message[2]))
            elif kind == "done":
                result = message[1]
            elif kind == "error":
                raise _failure(procs, messages, message)
            continue
        if should_cancel is not None and should_cancel():
            raise RunCancelled("training cancelled; its ranks were stopped")
        if any(p.exitcode not in (None, 0) for p in procs):
            raise _failure(procs, messages, None)
        if all(p.exitcode == 0 for p in procs):
            if result is None:
                raise TrainingRankFailed("every training rank exited, but rank 0 sent no result")
            return result


def _failure(procs: list[Any], messages: Any, first: tuple | None) -> KilnError:
    """Why the attempt failed, decided before the launcher stops the other ranks: a KilnError a
    rank raised, as itself; else the rank that died (a signal, an exit) — its peers' collective
    errors are the consequence; else the first rank's own failure. ``training_rank_failed``."""
    reports = [first] if first is not None else []
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline:
        try:
            message = messages.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue_module.Empty:
            break
        if message[0] == "error":
            reports.append(message)
    codes = [p.exitcode for p in procs]  # before the survivors are killed
    for _, _rank, error in reports:
        if error.get("kiln"):
            return error_from_dict(error)
    reported = {rank for _, rank, _ in reports}
    died = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0) and rank not in reported]
    if died:
        described = ", ".join(
            f"rank {rank} " + (f"killed by signal {-code}" if code < 0 else f"exit status {code}")
            for rank, code in died
        )
        return TrainingRankFailed(
            f"a training rank died ({described}); every rank was stopped", details={"ranks": [rank for rank, _ in died]}
        )
    _, rank, error = reports[0]
    return TrainingRankFailed(
        f"training rank {rank} failed: {error['message']}; every rank was stopped", details={"ranks": [rank]}
    )


def _stop(procs: list[Any]) -> None:
    """SIGKILL every rank still running, by PID, and reap them all."""
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        if proc.pid is not None:
            proc.join()


def _die_with(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its launcher exits (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's own kill still applies
        pass
    if os.getppid() != parent_pid:  # the launcher died before the request took effect
        os._exit(1)


def rank_main(rank: int, launch: Launch, job: str, rendezvous: str, parent_pid: int, messages: Any) -> None:
    """One rank: join the group, train, send rank 0's messages; exit status 1 on any failure."""
    _die_with(parent_pid)
    import torch
    import torch.distributed as dist

    from kiln.core.train.distributed import RankGroup
    from kiln.core.train.trainer import train_grpo

    torch.set_num_threads(max(1, launch.threads_per_rank))
    device = launch.devices[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    try:
        dist.init_process_group(
            launch.backend,
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=launch.world_size,
            timeout=timedelta(seconds=launch.collective_timeout_s),
        )
        kwargs = pickle.loads(Path(job).read_bytes())
        main = rank == 0
        result = train_grpo(
            **kwargs,
            device=device,
            ranks=RankGroup(rank=rank, world_size=launch.world_size, backend=launch.backend),
            progress=(lambda values: messages.put(("progress", values))) if main else None,
            checkpoint_sink=(lambda step, folder: messages.put(("checkpoint", step, str(folder)))) if main else None,
        )
        if main:
            messages.put(("done", result))
    except BaseException as exc:  # noqa: BLE001 - every failure leaves as a message and exit status 1
        if not isinstance(exc, KilnError):
            traceback.print_exc()  # the rank's own log (stderr): where an unexpected failure came from
        error = (
            {**exc.to_dict(), "kiln": True}
            if isinstance(exc, KilnError)
            else {"message": str(exc)[:2000] or "an unexpected error", "kiln": False}
        )
        messages.put(("error", rank, error))
        messages.close()
        messages.join_thread()
        os._exit(1)
    _leave(dist, messages)


def _leave(dist: Any, messages: Any) -> None:
    """A rank's clean exit: a last barrier (no rank closes its connections while another still
    talks), the group torn down, rank 0's messages flushed, then ``os._exit(0)``: the interpreter's
    own teardown, where a native thread left joinable aborts the process ("terminate called without
    an active exception", seen once under load), has nothing left to do for a rank."""

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    messages.close()
    messages.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
