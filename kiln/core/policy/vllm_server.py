"""Kiln's vLLM engine server: one process, token ids over loopback HTTP (stdlib + vllm only, and
its neighbours :mod:`vllm_lora_cpu`, :mod:`vllm_moe_lora_cpu` and :mod:`vllm_vision`, which need
only torch, and :mod:`vllm_cpu_wait` and :mod:`vllm_model_kind`: what it makes of a model folder).

Started by :class:`kiln.core.policy.engine_vllm.VllmEngine` with the Python of the engine's own virtual
environment (``python vllm_server.py --model DIR --port P ...``); it imports nothing from Kiln's
package, so vLLM's pins (torch, transformers) never meet the worker's. It serves one model with
LoRA enabled through vLLM's ``AsyncLLM``, so every request in flight (from any group, any run) is
batched continuously by the engine.

Endpoints (JSON bodies, one request per connection):

- ``GET /health`` -> ``{"ok": true, "vllm": VERSION, "model": DIR, "pid": PID, "lora_products":
  "grouped"|"stock", "reader_wait": "napping"|"stock", "cpu_reserved_cores": N|null}`` (whether
  :mod:`vllm_lora_cpu`'s grouped LoRA products replaced vLLM's per-token ones on its CPU path,
  whether the engine processes wait for each other as :mod:`vllm_cpu_wait` makes them on a CPU, and
  how many cores vLLM keeps off its model worker's threads there: 0 unless the user set
  ``VLLM_CPU_NUM_OF_RESERVED_CPU``), plus ``"text_only"`` (a vision-language checkpoint served as
  its language model only) and ``"torchvision"``: ``"compiled"|"text-only"|"absent"``, the
  torchvision its processes import (:mod:`vllm_vision`: vLLM's Qwen3.5 classes need one) and
  ``"dtype"``, what the model is served in (``--dtype``, but for a hybrid model on a CPU), and
  ``"moe_lora": "torch"|"stock"`` (whether :mod:`vllm_moe_lora_cpu`'s torch experts replaced
  vLLM's Triton ones, which the CPU build cannot run)

A server that cannot build its engine (an architecture vLLM cannot inspect or run, an MoE model on
the CPU build that :mod:`vllm_moe_lora_cpu` does not serve, weights that do not load) prints one ``FAULT_MARK`` line and exits with ``FAULT_EXIT``: the same model and build
fail the same way on every start, so the client reports it instead of restarting.
- ``POST /generate`` ``{"prompt_ids", "seed", "max_tokens", "temperature", "top_p", "stop_ids",
  "grammar": EBNF|null, "json_schema": {...}|null, "adapter": {"name": SHA, "path": DIR}|null,
  "tag": str|null, "route": str|null}`` -> ``{"ids", "logprobs", "finish_reason", "adapter": SHA|null}``. Prompts are
  token ids; no chat template is applied and nothing is detokenized for the caller. ``logprobs``
  are the sampled tokens' log-probs after temperature and grammar masking (``processed_logprobs``).
- ``POST /unload`` ``{"name": SHA}`` -> ``{"unloaded": bool}``
- ``GET /stats`` -> batching figures: the largest number of requests in flight at once, for each
  ``tag`` the number of requests that ran while another tag's request was in flight, and the
  requests in flight now per tag, and the requests served per ``route`` (the episodes a request
  belongs to: :mod:`kiln.core.policy.vllm_router` sends each route to one engine).

Adapters are PEFT folders hot-loaded by path (``LoRARequest``), never merged; each gets a small
integer id on first use, keyed by its content digest (the name the client sends). On vLLM's CPU
path the LoRA products are :mod:`vllm_lora_cpu`'s grouped ones (one product per adapter in the
batch, none for rows without one) instead of vLLM's per-token weight gathers, and the engine's
processes wait for each other's steps without holding a core (:mod:`vllm_cpu_wait`), so the model
worker's threads get every core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import uuid

try:  # imported as Kiln's module (tests, benches) or run as the engine's script beside it
    from .vllm_model_kind import Unsupported, adapter_is_3d, model_facts, model_settings
except ImportError:
    from vllm_model_kind import (  # type: ignore[no-redef]  # the same module, run beside this script
        Unsupported,
        adapter_is_3d,
        model_facts,
        model_settings,
    )

_MAX_BODY = 64 * 1024 * 1024
MAX_LORA_RANK = 16  # the largest adapter rank served
MAX_LORAS = 4  # adapters in one batch


# vLLM's CPU build starts its engine core and model worker with ``spawn``, which runs this script
# again (as ``__mp_main__``) before the engine is built there: that is where the model runs and the
# processes wait for each other, so the grouped LoRA products and the CPU reader wait (this
# script's neighbours ``vllm_lora_cpu`` and ``vllm_cpu_wait``) are installed at import in each.
def install_cpu_paths() -> tuple[str, str, int | None]:
    """Install the neighbours where vLLM's CPU path has them; ``(lora_products, reader_wait,
    cpu_reserved_cores)`` as ``/health`` reports them (``"stock"`` for each one vLLM keeps; the
    cores kept off the model worker's threads, ``None`` where vLLM decides alone). Napping readers
    free the core vLLM would keep for its spinning ones (:func:`vllm_cpu_wait.free_reserved_cores`).
    """
    import vllm_cpu_wait
    import vllm_lora_cpu

    lora_products = "grouped" if vllm_lora_cpu.install() else "stock"
    if not vllm_cpu_wait.install():
        return lora_products, "stock", None
    return lora_products, "napping", vllm_cpu_wait.free_reserved_cores()


def install_moe_lora() -> str:
    """:mod:`vllm_moe_lora_cpu`'s torch experts in place of vLLM's Triton ones (CPU build only);
    what ``/health`` reports as ``moe_lora``."""
    import vllm_moe_lora_cpu

    return "torch" if vllm_moe_lora_cpu.install() else "stock"


def install_vision() -> str:
    """The engine's torchvision (:mod:`vllm_vision`), before anything imports vLLM's model classes,
    here and in vLLM's model-inspection subprocess; what ``/health`` reports as ``torchvision``."""
    import vllm_vision

    found = vllm_vision.install()
    if found != "absent":
        vllm_vision.patch_inspection(os.path.dirname(os.path.abspath(__file__)))
    return found


LORA_PRODUCTS, READER_WAIT, CPU_RESERVED_CORES, VISION, MOE_LORA = "stock", "stock", None, "absent", "stock"
if __name__ in ("__main__", "__mp_main__"):
    VISION = install_vision()
    LORA_PRODUCTS, READER_WAIT, CPU_RESERVED_CORES = install_cpu_paths()
    MOE_LORA = install_moe_lora()


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-lora-rank", type=int, default=MAX_LORA_RANK)
    p.add_argument("--max-loras", type=int, default=MAX_LORAS)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    return p.parse_args(argv)


# Prefill tokens per engine step on CPU, where a prompt is never split across steps (below).
CPU_PREFILL_TOKENS_PER_STEP = 8192


def prefill_settings(max_model_len: int, on_cpu: bool) -> dict:
    """How prompts are scheduled. On vLLM's CPU build chunked prefill is off: when a step splits a
    prompt, vLLM rewinds that request's seeded generator (``Generator.set_offset``), which a CPU
    generator does not support, and the engine core dies ("CPU Generator does not use offset"). That
    happens as soon as the prompts arriving together exceed one step's token budget (2048 by
    default), e.g. when the groups in flight are retried together after a restart. Without chunking
    a step takes whole prompts only, up to ``max(max_model_len, CPU_PREFILL_TOKENS_PER_STEP)``
    tokens. On GPUs vLLM's defaults stay."""
    if not on_cpu:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_PREFILL_TOKENS_PER_STEP)}


# The line a server that could not build its engine prints before it exits with FAULT_EXIT: a JSON
# object, ``{"kind": "model_unsupported"|"engine_fault", "error", "architectures"}``; the client
# reads it (and the root cause the engine logged) from the engine log.
FAULT_MARK = "kiln-vllm-server fault: "
FAULT_EXIT = 3
# what vLLM says when it cannot serve an architecture, and how the fault line puts it
_UNSUPPORTED = {
    "failed to be inspected": "vLLM could not load its model class for the architecture",
    "are not supported for now": "this vLLM build does not support the architecture",
}


def report_fault(exc: BaseException, facts: dict) -> None:
    """Print the fault line for an engine that failed to build (deterministic for this model and
    build: the same configuration fails the same way on every start)."""
    text = " ".join(str(exc).split())
    reasons = [reason for phrase, reason in _UNSUPPORTED.items() if phrase in text]
    if isinstance(exc, Unsupported):
        reasons = [text]
    line = {
        "kind": "model_unsupported" if reasons else "engine_fault",
        "error": reasons[0] if reasons else text[:1000],
        "architectures": facts.get("architectures", []),
    }
    print(FAULT_MARK + json.dumps(line), flush=True)


# The command-line flags handed to vLLM's engine as they are (each flag names its engine argument).
_ENGINE_FLAGS = (
    "model max_lora_rank max_loras max_model_len max_num_seqs gpu_memory_utilization tensor_parallel_size seed"
)


class Server:
    def __init__(self, args: argparse.Namespace, facts: dict) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = current_platform.is_cpu()
        self.model_kind = model_settings(facts, on_cpu, MOE_LORA)
        chosen = {
            "dtype": args.dtype,
            "enable_prefix_caching": True,
            **prefill_settings(args.max_model_len, on_cpu),
            **self.model_kind,
        }
        engine_args = AsyncEngineArgs(
            **{name: getattr(args, name) for name in _ENGINE_FLAGS.split()},
            enable_lora=True,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            structured_outputs_config={"backend": "xgrammar"},
            **chosen,
        )
        self.dtype = str(chosen["dtype"])  # what the model is served in
        self.engine = AsyncLLM.from_engine_args(engine_args)
        self.model = args.model
        self.text_only = bool(facts["text_only"])
        self.loras: dict[str, int] = {}
        self.in_flight: dict[str, str | None] = {}
        self.met_another_run: set[str] = set()  # requests in flight together with another tag's
        self.max_in_flight = 0
        self.overlapped: dict[str, int] = {}
        self.routes: dict[str, int] = {}  # requests served per route (the episodes they belong to)

    # ---------------------------------------------------------------------------- generation
    def _lora(self, adapter: dict | None):
        if not adapter:
            return None
        from vllm.lora.request import LoRARequest

        name = str(adapter["name"])
        if name not in self.loras:
            self.loras[name] = len(self.loras) + 1 if not self.loras else max(self.loras.values()) + 1
        path = str(adapter["path"])
        return LoRARequest(name, self.loras[name], path, is_3d_lora_weight=adapter_is_3d(path))

    def _params(self, body: dict):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None
        if body.get("grammar"):
            structured = StructuredOutputsParams(grammar=body["grammar"])
        elif body.get("json_schema") is not None:
            structured = StructuredOutputsParams(json=body["json_schema"])
        return SamplingParams(
            n=1,
            max_tokens=int(body["max_tokens"]),
            temperature=float(body["temperature"]),
            top_p=float(body.get("top_p", 1.0)),
            seed=int(body["seed"]),
            logprobs=0,
            stop_token_ids=[int(t) for t in body.get("stop_ids", [])],
            ignore_eos=True,
            skip_special_tokens=False,
            detokenize=False,
            structured_outputs=structured,
            # one output per request, at its end: streaming every step's cumulative ids and
            # log-probs back through the server costs a core on a small machine
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(self, body: dict) -> dict:
        request_id = uuid.uuid4().hex
        tag, route = body.get("tag"), body.get("route")
        if route is not None:
            self.routes[str(route)] = self.routes.get(str(route), 0) + 1
        if tag is not None:  # two requests overlap when one arrives while the other is in flight
            others = [rid for rid, t in self.in_flight.items() if t is not None and t != tag]
            if others:
                self.met_another_run.add(request_id)
                self.met_another_run.update(others)
        self.in_flight[request_id] = tag
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        final = None
        try:
            async for out in self.engine.generate(
                {"prompt_token_ids": [int(t) for t in body["prompt_ids"]]},
                self._params(body),
                request_id,
                lora_request=self._lora(body.get("adapter")),
            ):
                final = out
        finally:
            self.in_flight.pop(request_id, None)
            if request_id in self.met_another_run:  # only a tagged request is ever added
                self.met_another_run.discard(request_id)
                if tag is not None:
                    self.overlapped[tag] = self.overlapped.get(tag, 0) + 1
        if final is None:
            raise RuntimeError("vLLM finished the request without an output")
        completion = final.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        logprobs = []
        for token, entry in zip(ids, completion.logprobs or []):
            logprobs.append(float(entry[token].logprob))
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
        adapter = body.get("adapter")
        return {
            "ids": ids,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "adapter": adapter["name"] if adapter else None,
        }

    async def unload(self, body: dict) -> dict:
        lora_id = self.loras.pop(str(body["name"]), None)
        if lora_id is not None:
            await self.engine.remove_lora(lora_id)
        return {"unloaded": lora_id is not None}

    def health(self) -> dict:
        import vllm

        return {
            "ok": True,
            "vllm": vllm.__version__,
            "model": self.model,
            "pid": os.getpid(),
            "lora_products": LORA_PRODUCTS,
            "reader_wait": READER_WAIT,
            "cpu_reserved_cores": CPU_RESERVED_CORES,
            "text_only": self.text_only,
            "torchvision": VISION,
            "dtype": self.dtype,
            "moe_lora": MOE_LORA,
        }

    def stats(self) -> dict:
        now: dict[str, int] = {}
        for tag in self.in_flight.values():
            if tag is not None:
                now[tag] = now.get(tag, 0) + 1
        return {
            "max_in_flight": self.max_in_flight,
            "overlapped": dict(self.overlapped),
            "in_flight": now,
            "routes": dict(self.routes),
        }

    # ------------------------------------------------------------------------------------ HTTP
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        status, payload = 200, {}
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            length = int(headers.get("content-length", "0"))
            if length > _MAX_BODY:
                raise ValueError("request body too large")
            body = json.loads(await reader.readexactly(length)) if length else {}
            if method == "GET" and path == "/health":
                payload = self.health()
            elif method == "GET" and path == "/stats":
                payload = self.stats()
            elif method == "POST" and path == "/generate":
                payload = await self.generate(body)
            elif method == "POST" and path == "/unload":
                payload = await self.unload(body)
            else:
                status, payload = 404, {"error": f"no route {method} {path}"}
        except (ValueError, KeyError, TypeError) as exc:
            status, payload = 400, {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - reported to the client
            status, payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
            if type(exc).__name__ == "EngineDeadError":  # the engine core is gone: exit, so the
                asyncio.get_running_loop().call_later(0.2, _exit_group)  # client restarts us
        data = json.dumps(payload).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Internal Server Error")
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        try:
            await writer.drain()
        finally:
            writer.close()


async def _serve(args: argparse.Namespace) -> None:
    facts = model_facts(args.model)
    try:
        server = Server(args, facts)
    except Exception as exc:  # noqa: BLE001 - reported to the client through the log, then exit
        report_fault(exc, facts)
        _exit_group(FAULT_EXIT)
    listener = await asyncio.start_server(server.handle, args.host, args.port, limit=_MAX_BODY)
    print(f"kiln-vllm-server ready on {args.host}:{args.port} pid {os.getpid()}", flush=True)
    if args.parent_pid:
        asyncio.get_running_loop().create_task(_watch_parent(args.parent_pid))
    async with listener:
        await listener.serve_forever()


def _exit_group(status: int = 1) -> None:
    """Stop this server and the engine-core processes it spawned (its own process group)."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the exit status below is the server's
        os.killpg(os.getpgid(0), signal.SIGTERM)
    finally:
        os._exit(status)


async def _watch_parent(pid: int) -> None:
    """Exit when the worker that started the engine is gone (no orphaned engine holds the GPU)."""
    while True:
        await asyncio.sleep(2.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _exit_group()


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    asyncio.run(_serve(args))


if __name__ == "__main__":  # the engine spawns a core process: the guard is required
    main()
