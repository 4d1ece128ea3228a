"""The ``vllm`` engine: a vLLM server process (:mod:`kiln.core.policy.vllm_server`) behind the port.

The gpu worker starts the server with the Python of the engine's own virtual environment (vLLM
pins torch and transformers versions that differ from Kiln's), waits until it answers
``/health``, and stops it by PID. Every row is one loopback HTTP request; rows are sent
concurrently, so all the rows the worker has in flight (many collection activities at once) are
batched continuously by vLLM.

**What a row means here.** Token ids in, token ids out, no chat template. ``ignore_eos`` is set
and the stop ids are explicit, so a row stops exactly where the ``hf`` engine's would. The thinking
budget and a grammar that starts after ``</think>`` are served in two requests: the reasoning is
generated first (stopping at ``</think>``, the stop id or the budget), then the answer continues
from the reasoning's ids with the grammar active and a seed derived from the row's seed
(:func:`answer_seed`). The grammar is the one :class:`kiln.core.policy.constrained.ActionGrammar`
compiled from the tightened schema: vLLM gets its exact EBNF text (the same tightened schema,
whitespace caps included), and the engine checks every returned answer token against Kiln's own
mask (a token Kiln's grammar rejects fails the row loudly).

**Faults.** A connection error or a dead process marks the engine for restart and raises
:class:`kiln.core.errors.EngineUnavailable` (retryable): the groups in flight fail and Temporal retries
them, as for any worker fault; the next call starts a fresh server. A failure that repeats on every
attempt (an architecture the engine cannot serve, weights it cannot load, a kernel its build
lacks) is :class:`kiln.core.errors.ModelUnsupported` or :class:`kiln.core.errors.EngineFault` instead, not
retried, with the cause from the engine's log (:mod:`kiln.core.policy.vllm_faults`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx

from kiln.core.errors import EngineUnavailable
from kiln.core.policy import vllm_faults
from kiln.core.policy.engine import AdapterHandle, Generation, GenerationRequest, request_route, request_tag
from kiln.core.policy.vllm_server import MAX_LORA_RANK, MAX_LORAS  # stdlib-only at import

SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")
_U63 = 1 << 63


def answer_seed(seed: int) -> int:
    """The seed of a row's second request (the answer after its reasoning): derived, fixed."""
    return (int(seed) * 6364136223846793005 + 1442695040888963407) % _U63


@dataclass
class VllmConfig:
    """How to start the engine server (from :class:`kiln.core.settings.Settings`)."""

    model_path: Path
    python: Path
    dtype: str = "float32"
    log_path: Path | None = None
    max_model_len: int = 4096
    max_lora_rank: int = MAX_LORA_RANK
    max_loras: int = MAX_LORAS
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.5
    cpu_kvcache_gb: int = 4
    start_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    batch_invariant: bool = False
    tensor_parallel: int = 1  # the devices one server spans (vLLM's tensor-parallel size)
    extra_env: dict[str, str] = field(default_factory=dict)


class VllmEngine:
    """Client of one vLLM server process (see the module docstring)."""

    name = "vllm"
    concurrent = True

    def __init__(self, config: VllmConfig, *, tag: str | None = None) -> None:
        self.config = config
        self.tag = tag
        self._proc: subprocess.Popen | None = None
        self._port: int | None = None
        self._version: str | None = None
        self.lora_products: str | None = None  # the server's LoRA products ("grouped"/"stock"), from /health
        self.reader_wait: str | None = None  # how its processes wait for each other ("napping"/"stock")
        self.cpu_reserved_cores: int | None = None  # cores vLLM keeps off its CPU model worker (0: none)
        self.text_only = False  # a vision-language checkpoint served as its language model only
        self.torchvision: str | None = None  # the torchvision its processes import (vllm_vision)
        self.served_dtype: str | None = None  # what the server serves the model in (from /health)
        self.moe_lora: str | None = None  # its MoE experts with LoRA ("torch": vllm_moe_lora_cpu's)
        self._log_offset = 0  # where the running server's lines begin in the engine log
        self._start_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(8, config.max_num_seqs), thread_name_prefix="kiln-vllm")
        self._gate = _Gate()
        # One client for every request: a client of its own per request (``httpx.post``) builds an
        # SSL context each time, 23 ms of CPU per loopback request against 1 ms (bench/engine.py);
        # the server closes each connection, so nothing is kept alive between requests.
        self._http = httpx.Client(
            timeout=config.request_timeout_s, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0)
        )
        self._broken_port: int | None = None  # a request to this server could not connect
        self.restarts = 0

    # --------------------------------------------------------------------------- process
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server when it is not running (restarting a dead one); wait for health."""
        with self._start_lock:
            # a killed server's process can still look alive while the kernel tears it down: a
            # refused or reset connection to the current port restarts it as well
            if self._alive() and self._port is not None and self._broken_port != self._port:
                return
            if self._proc is not None:
                self.restarts += 1
                self._stop_process()
            self._launch()

    def _launch(self) -> None:
        cfg = self.config
        if not Path(cfg.python).is_file():
            raise EngineUnavailable(
                f"the vllm engine's Python {cfg.python} does not exist",
                hint="install the engine with `scripts/setup.sh --engine vllm` or set KILN_VLLM_PYTHON",
                retryable=False,
                details={"python": str(cfg.python)},
            )
        port = _free_port()
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kvcache_gb),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            **cfg.extra_env,
        }
        env.pop("PYTHONPATH", None)  # the server imports nothing from Kiln's environment
        argv = [
            str(cfg.python),
            str(SERVER_SCRIPT),
            "--model",
            str(cfg.model_path),
            "--port",
            str(port),
            "--dtype",
            cfg.dtype,
            "--max-model-len",
            str(cfg.max_model_len),
            "--max-lora-rank",
            str(cfg.max_lora_rank),
            "--max-loras",
            str(cfg.max_loras),
            "--max-num-seqs",
            str(cfg.max_num_seqs),
            "--gpu-memory-utilization",
            str(cfg.gpu_memory_utilization),
            "--tensor-parallel-size",
            str(cfg.tensor_parallel),
            "--parent-pid",
            str(os.getpid()),
        ]
        if cfg.batch_invariant:
            argv.append("--batch-invariant")
        self._log_offset = vllm_faults.log_size(cfg.log_path)
        log = open(cfg.log_path, "ab") if cfg.log_path is not None else None
        try:
            self._proc = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.DEVNULL if log is None else log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()
        self._port = port
        deadline = time.monotonic() + cfg.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise vllm_faults.start_failure(
                    cfg.model_path,
                    self._proc.returncode,
                    vllm_faults.read_since(cfg.log_path, self._log_offset),
                    cfg.log_path,
                )
            try:
                health = self._http.get(self._url("/health"), timeout=2.0).json()
                self._version = str(health["vllm"])
                self.lora_products = health.get("lora_products")
                self.reader_wait = health.get("reader_wait")
                self.cpu_reserved_cores = health.get("cpu_reserved_cores")
                self.text_only = bool(health.get("text_only"))
                self.torchvision = health.get("torchvision")
                self.served_dtype = health.get("dtype")
                self.moe_lora = health.get("moe_lora")
                return
            except (httpx.HTTPError, ValueError, KeyError):
                time.sleep(0.5)
        self._stop_process()
        raise EngineUnavailable(f"the vllm engine did not answer within {cfg.start_timeout_s:.0f} s")

    def _stop_process(self) -> None:
        proc, self._proc, self._port = self._proc, None, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def close(self) -> None:
        with self._start_lock:
            self._stop_process()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._port}{path}"

    # ------------------------------------------------------------------------------ port
    def identity(self) -> dict[str, Any]:
        if self._version is None:
            self.start()
        out: dict[str, Any] = {"name": self.name, "version": str(self._version)}
        if self.text_only:
            out["text_only"] = True  # a vision-language checkpoint's language model alone
        if self.served_dtype not in (None, self.config.dtype):  # the server chose it (a hybrid on a CPU)
            out["dtype"] = self.served_dtype
        if self.config.tensor_parallel != 1:  # every row's reductions are split across the devices
            out["tensor_parallel"] = self.config.tensor_parallel
        return out

    def stats(self) -> dict[str, Any]:
        return self._post("/stats", None)

    def load_adapter(self, adapter: AdapterHandle) -> None:
        """vLLM loads an adapter by path on its first request; nothing to do ahead of it."""
        return None

    def unload_adapter(self, sha256: str) -> None:
        self._post("/unload", {"name": sha256})

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._gate.exclusive():
            yield

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        if not requests:
            return []
        self.start()
        tag = request_tag.get() or self.tag
        route = request_route.get()
        with self._gate.shared():
            futures = [self._pool.submit(self._row, req, tag, route) for req in requests]
            return [f.result() for f in futures]

    # ------------------------------------------------------------------------------ rows
    def _row(self, req: GenerationRequest, tag: str | None = None, route: str | None = None) -> Generation:
        if req.max_tokens <= 0:
            return Generation(
                ids=[], logprobs=[], finished=False, adapter_sha256=req.adapter.sha256 if req.adapter else None
            )
        close_id = req.think_close_id if req.thinking else None
        if close_id is None or (req.budget is None and req.grammar is None):  # one phase
            grammar = req.grammar if close_id is None else None
            out = self._call(req, req.prompt_ids, req.max_tokens, req.seed, req.stop_ids, grammar, (tag, route))
            return self._finish(req, out["ids"], out["logprobs"], out["adapter"])
        first_max = req.max_tokens if req.budget is None else min(req.max_tokens, req.budget)
        out = self._call(req, req.prompt_ids, first_max, req.seed, [*req.stop_ids, close_id], None, (tag, route))
        ids, lps = list(out["ids"]), list(out["logprobs"])
        if not ids or ids[-1] != close_id or len(ids) >= req.max_tokens:
            return self._finish(req, ids, lps, out["adapter"])
        rest = self._call(
            req,
            tuple(req.prompt_ids) + tuple(ids),
            req.max_tokens - len(ids),
            answer_seed(req.seed),
            req.stop_ids,
            req.grammar,
            (tag, route),
        )
        return self._finish(req, ids + list(rest["ids"]), lps + list(rest["logprobs"]), rest["adapter"])

    def _finish(self, req: GenerationRequest, ids: list[int], lps: list[float], served: str | None) -> Generation:
        expected = req.adapter.sha256 if req.adapter else None
        if served != expected:
            raise EngineUnavailable(
                f"the vllm engine served adapter {served} for a request naming {expected}",
                details={"served": served, "requested": expected},
            )
        if req.grammar is not None:
            _check_grammar(req, ids)
        finished = bool(ids) and ids[-1] in req.stop_ids
        return Generation(
            ids=[int(t) for t in ids], logprobs=[float(x) for x in lps], finished=finished, adapter_sha256=served
        )

    def _call(
        self,
        req: GenerationRequest,
        prompt: Sequence[int],
        max_tokens: int,
        seed: int,
        stop_ids: list[int],
        grammar: Any,
        names: tuple[str | None, str | None],
    ) -> dict[str, Any]:
        """One request; ``names``: its run tag and its route (the engine's figures count both)."""
        body = {
            "prompt_ids": [int(t) for t in prompt],
            "seed": int(seed) % _U63,
            "max_tokens": int(max_tokens),
            "temperature": float(req.temperature),
            "top_p": float(req.top_p),
            "stop_ids": stop_ids,
            "grammar": grammar.ebnf if grammar is not None else None,
            "adapter": {"name": req.adapter.sha256, "path": str(req.adapter.path)} if req.adapter else None,
            "tag": names[0],
            "route": names[1],
        }
        return self._post("/generate", body)

    def _post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        port = self._port
        try:
            if body is None:
                resp = self._http.get(f"http://127.0.0.1:{port}{path}")
            else:
                resp = self._http.post(
                    f"http://127.0.0.1:{port}{path}",
                    content=json.dumps(body),
                    headers={"content-type": "application/json"},
                )
        except httpx.HTTPError as exc:
            if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)):
                with self._start_lock:
                    self._broken_port = port  # the next call restarts this server
            raise self._death(str(exc)) from exc
        if resp.status_code == 400:
            raise ValueError(f"the vllm engine rejected the request: {resp.json().get('error')}")
        if resp.status_code != 200:
            if "EngineDeadError" in resp.text:
                raise self._death(resp.text[:500])
            raise EngineUnavailable(
                f"the vllm engine failed a request: {resp.text[:500]}",
                details={"status": resp.status_code},
            )
        return resp.json()

    def _death(self, error: str) -> Exception:
        """The error for a server that could not answer: deterministic when its engine core
        stopped on an exception of its own (:func:`vllm_faults.death`)."""
        log = vllm_faults.read_since(self.config.log_path, self._log_offset)
        return vllm_faults.death(self.pid, log, self.config.log_path, error)


def _check_grammar(req: GenerationRequest, ids: list[int]) -> None:
    """Every answer token vLLM produced must be allowed by Kiln's own mask at its position."""
    row = req.grammar.row(thinking=req.thinking)
    for pos, token in enumerate(ids):
        mask = row.allowed()
        if mask is not None and (token >= mask.shape[0] or not bool(mask[token])):
            raise EngineUnavailable(
                f"the vllm engine produced token {token} at position {pos}, which the action grammar "
                "does not allow there",
                retryable=False,
                details={"position": pos, "token": token},
            )
        if not row.advance(token):
            raise EngineUnavailable(
                f"the action grammar rejected token {token} at position {pos}",
                retryable=False,
                details={"position": pos, "token": token},
            )


class _Gate:
    """Shared (generation) / exclusive (training) gate: exclusive waits for shared holders to end
    and blocks new ones until it is released."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


def default_python() -> Path:
    """``.venv-vllm/bin/python`` of the Kiln checkout (where ``scripts/setup.sh --engine vllm`` installs)."""
    return Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


__all__ = ["SERVER_SCRIPT", "VllmConfig", "VllmEngine", "answer_seed", "default_python"]
