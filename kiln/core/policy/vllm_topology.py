"""Where a gpu worker's vllm engine servers run (no torch, no I/O: the caller says what is visible).

Two settings shape it (:class:`kiln.core.settings.Settings`, docs/engines.md):

- ``KILN_VLLM_TENSOR_PARALLEL`` (default 1): the devices one server spans (vLLM's tensor-parallel
  size), for a model that does not fit one GPU;
- ``KILN_VLLM_ENGINES`` (default 1): how many servers the worker runs, each on devices of its own,
  with every turn of an episode sent to the same one (:mod:`kiln.core.policy.vllm_router`).

On CUDA, engine ``i`` gets the visible GPUs ``i*tp … (i+1)*tp - 1`` as its ``CUDA_VISIBLE_DEVICES``;
asking for more GPUs than are visible is :class:`kiln.core.errors.EngineSettingsInvalid`. On a CPU
the servers share the machine: with several engines or ranks, each engine is bound to a slice of
the worker's cores and each of its ranks to a slice of that (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``,
the ranks' slices joined by ``|``; vLLM's own binding wants a NUMA node per rank), where there are
cores enough to give every rank one; else vLLM binds each as it would alone. One engine with one
device keeps today's environment exactly.
"""

from __future__ import annotations

from typing import Sequence

from kiln.core.errors import EngineSettingsInvalid

TENSOR_PARALLEL_SETTING = "KILN_VLLM_TENSOR_PARALLEL"
ENGINES_SETTING = "KILN_VLLM_ENGINES"
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def _at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise EngineSettingsInvalid(
            f"{name}={value}: the vllm engine needs at least 1",
            hint=f"set {name} to 1 or more (1 is the default)",
            details={"field": name, "value": value},
        )


def _slices(items: Sequence, parts: int) -> list[list]:
    """``items`` cut into ``parts`` contiguous slices, the first ones longer by one where uneven."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def _cpu_bind(cores: Sequence[int]) -> str:
    """vLLM's bind string for one rank's cores: ``"0-3"`` for a run, ``"0,2,5"`` otherwise."""
    ordered = sorted(cores)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 1:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(str(c) for c in ordered)


def engine_envs(
    tensor_parallel: int, engines: int, *, on_cuda: bool, gpus: Sequence[str], cores: Sequence[int]
) -> list[dict[str, str]]:
    """The environment each engine server adds to its own (one dict per engine, in order).

    ``gpus``: the visible CUDA devices as the worker names them (its ``CUDA_VISIBLE_DEVICES``
    entries, else ``0 … count-1``); ``cores``: the CPU cores the worker may run on."""
    _at_least_one(TENSOR_PARALLEL_SETTING, tensor_parallel)
    _at_least_one(ENGINES_SETTING, engines)
    if on_cuda:
        need = tensor_parallel * engines
        if need > len(gpus):
            raise EngineSettingsInvalid(
                f"{ENGINES_SETTING}={engines} x {TENSOR_PARALLEL_SETTING}={tensor_parallel} asks for {need} "
                f"GPUs but {len(gpus)} are visible ({', '.join(gpus) or 'none'})",
                hint=f"lower {TENSOR_PARALLEL_SETTING} or {ENGINES_SETTING} so that their product is at most "
                f"{len(gpus)}, or make more GPUs visible to the worker (CUDA_VISIBLE_DEVICES)",
                details={
                    "field": TENSOR_PARALLEL_SETTING,
                    "value": tensor_parallel,
                    "engines": engines,
                    "visible_gpus": len(gpus),
                },
            )
        if need == 1:
            return [{}]
        return [
            {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tensor_parallel : (i + 1) * tensor_parallel])}
            for i in range(engines)
        ]
    if engines * tensor_parallel == 1 or len(cores) < engines * tensor_parallel:
        return [{} for _ in range(engines)]
    return [
        {CPU_BIND_ENV: "|".join(_cpu_bind(rank) for rank in _slices(own, tensor_parallel))}
        for own in _slices(sorted(cores), engines)
    ]


__all__ = ["CPU_BIND_ENV", "ENGINES_SETTING", "TENSOR_PARALLEL_SETTING", "engine_envs"]
