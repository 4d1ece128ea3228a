"""vLLM's own generate on a recorded token workload: the engine's limit that ``bench.engine``
compares Kiln's collection with.

Runs with the vllm engine's Python (``.venv-vllm/bin/python bench/vllm_raw.py ...``) and imports
nothing from Kiln. The workload is a JSON list of requests ``{"prompt_ids", "max_tokens", "seed"}``
(``bench.engine`` records every request its vllm collection sent, with the number of tokens each
produced). All of them are given to one ``LLM.generate`` call, as token ids, with the engine settings
of Kiln's vllm server (eager mode, prefix caching, float32 on CPU, the sampled token's log-prob;
LoRA enabled with ``--enable-lora``, as the server always runs), each generating exactly its
recorded number of tokens (``min_tokens = max_tokens``, EOS ignored) at its recorded seed. Prints one JSON line: ``{"seconds", "requests", "tokens", "start_s"}``, the
generate call timed after a warm-up request.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True, help="JSON file: a list of {prompt_ids, max_tokens, seed}")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--enable-lora", action="store_true", help="LoRA enabled, as Kiln's server runs it")
    args = parser.parse_args()
    requests = json.loads(open(args.workload, encoding="utf-8").read())

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              enforce_eager=True, enable_prefix_caching=True, seed=0,
              **({"enable_lora": True, "max_lora_rank": 16, "max_loras": 4} if args.enable_lora else {}))
    start_s = time.perf_counter() - started

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=1, max_tokens=n, min_tokens=n, ignore_eos=True, temperature=args.temperature,
                              seed=seed, logprobs=0, detokenize=False, skip_special_tokens=False)

    warm = requests[0]
    llm.generate([{"prompt_token_ids": warm["prompt_ids"]}], [params(4, 0)], use_tqdm=False)
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in requests]
    sampling = [params(int(r["max_tokens"]), int(r["seed"])) for r in requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"seconds": seconds, "requests": len(outputs), "tokens": tokens, "start_s": start_s}), flush=True)


if __name__ == "__main__":  # vLLM spawns an engine-core process: the guard is required
    main()
