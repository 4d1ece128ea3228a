"""vLLM's own generate on a recorded token workload: the engine's limit that ``bench.engine``
compares Kiln's collection with.

Runs with the vllm engine's Python (``.venv-vllm/bin/python bench/vllm_raw.py ...``) and imports
nothing from Kiln's package, only, by path, ``kiln/core/policy/vllm_server.py``'s prompt scheduling and
(with ``--lora grouped``) ``kiln/core/policy/vllm_lora_cpu.py`` and ``kiln/core/policy/vllm_cpu_wait.py``, as
Kiln's server does. The workload is a JSON list of requests ``{"prompt_ids", "max_tokens", "seed"}``
(``bench.engine`` records every request its vllm collection sent, with the number of tokens each
produced). All of them are given to one ``LLM.generate`` call, as token ids, with the engine
settings of Kiln's vllm server (eager mode, prefix caching, ``--dtype``, default float32, the choices it makes
for the model's kind (a hybrid model on a CPU: bfloat16, no prefix caching), its torchvision, no chunked
prefill on CPU, the sampled token's log-prob), each generating exactly its recorded number of
tokens (``min_tokens = max_tokens``, EOS ignored) at its recorded seed. ``--lora``: ``off`` (vLLM's
plain limit), ``stock`` (LoRA enabled, vLLM's own CPU LoRA products) or ``grouped`` (LoRA enabled
with Kiln's grouped products and CPU reader wait: the server's settings). In every mode the model
worker's threads get every core, as in Kiln's server (``VLLM_CPU_NUM_OF_RESERVED_CPU`` 0 unless
set), so each figure is the engine's limit on this machine's cores. Prints one JSON line:
``{"seconds", "requests", "tokens", "start_s"}``, the generate call timed after an untimed one of
the whole workload at other seeds and an emptied prefix cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kiln" / "core" / "policy"))

# vLLM's CPU build spawns its engine core, which runs this script again as ``__mp_main__`` with the
# same argv: the grouped products and the reader wait go in there, as in Kiln's server.
# The engine's torchvision (vllm_vision, for vLLM's Qwen3.5 classes) goes in each of them as well.
if __name__ in ("__main__", "__mp_main__"):
    import vllm_server  # stdlib at import

    vllm_server.install_vision()
if __name__ in ("__main__", "__mp_main__") and "grouped" in sys.argv:
    if vllm_server.install_cpu_paths()[0] != "grouped":
        raise SystemExit("vllm_lora_cpu.install() found no vLLM CPU LoRA path to patch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON file: a list of {prompt_ids, max_tokens, seed}")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lora", choices=("off", "stock", "grouped"), default="off",
                        help="LoRA off, enabled with vLLM's CPU products, or enabled with Kiln's grouped ones")
    args = parser.parse_args()
    requests = json.loads(open(args.workload, encoding="utf-8").read())

    import vllm_cpu_wait  # stdlib at import

    vllm_cpu_wait.free_reserved_cores()
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform
    from vllm_server import (  # the server's settings (stdlib at import)
        MAX_LORA_RANK, MAX_LORAS, model_facts, model_settings, prefill_settings,
    )

    on_cpu = current_platform.is_cpu()
    chosen = {"dtype": args.dtype, "enable_prefix_caching": True, **prefill_settings(args.max_model_len, on_cpu),
              **model_settings(model_facts(args.model), on_cpu)}  # as the server chooses them (a hybrid: bf16)
    started = time.perf_counter()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              enforce_eager=True, seed=0, **chosen,
              **({"enable_lora": True, "max_lora_rank": MAX_LORA_RANK, "max_loras": MAX_LORAS}
                 if args.lora != "off" else {}))
    start_s = time.perf_counter() - started

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=1, max_tokens=n, min_tokens=n, ignore_eos=True, temperature=args.temperature,
                              seed=seed, logprobs=0, detokenize=False, skip_special_tokens=False)

    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in requests]
    sampling = [params(int(r["max_tokens"]), int(r["seed"])) for r in requests]
    # untimed: the whole workload once at other seeds (vLLM's CPU kernels are built per batch size
    # on first use), then an empty prefix cache, so the timed call prefills every prompt as Kiln's did
    llm.generate(prompts, [params(int(r["max_tokens"]), int(r["seed"]) + 1) for r in requests], use_tqdm=False)
    if chosen["enable_prefix_caching"] and not llm.reset_prefix_cache():
        raise SystemExit("vLLM did not empty its prefix cache after the warm-up")
    started = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"seconds": seconds, "requests": len(outputs), "tokens": tokens, "start_s": start_s}), flush=True)


if __name__ == "__main__":  # vLLM spawns an engine-core process: the guard is required
    main()
