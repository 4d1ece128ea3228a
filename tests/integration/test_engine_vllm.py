"""The vllm engine for real (CPU build in .venv-vllm, no mocks): repeatability, token alignment and
the trainer's log-prob gap, LoRA by path, constrained actions, and one vllm-engine gpu worker
serving a two-iteration online run and two rollout runs at once through a kill -9 of its engine.

``scripts/test.sh`` installs the engine; where it is absent the module is skipped with a reason
(install it with ``scripts/setup.sh --engine vllm``), unless ``KILN_REQUIRE_VLLM=1`` (CI), where the
first test fails with ``engine_unavailable`` instead. One engine process (restarted once, by the
kill) serves the whole module, the gpu worker's runs included.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Iterator

import pytest

from kiln.core.policy.engine_vllm import default_python

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not default_python().is_file() and os.environ.get("KILN_REQUIRE_VLLM") != "1",
                       reason="the vllm engine is not installed (scripts/setup.sh --engine vllm)"),
]

# Largest |vLLM log-prob - trainer one-pass log-prob| accepted on the CPU float32 build; the
# measured figure is in docs/engines.md.
LOGPROB_TOLERANCE = 1e-4

MESSAGES = [
    {"role": "system", "content": "You are playing the counter game."},
    {"role": "user", "content": 'Count is 0. Target is 10. Reply with {"amount": N} where N is 1-5.'},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.support.models import shared_random_qwen

    # vLLM's CPU attention needs a real head size (the "tiny" shape's 16 is refused): the
    # qwen3-0.6b shape with 2 layers, the one test_real_shape_run builds (shared per session)
    return shared_random_qwen(tmp_path_factory, shape="qwen3-0.6b", layers=2)


@pytest.fixture(scope="module")
def vrt(model_dir: Path, tmp_path_factory):
    """A PolicyRuntime whose engine is a real vLLM server process."""
    import torch

    from kiln.core.policy.engine_vllm import VllmConfig, VllmEngine
    from kiln.core.policy.runtime import PolicyRuntime

    torch.set_num_threads(1)
    rt = PolicyRuntime.load(model_dir)
    log = Path(tmp_path_factory.mktemp("vllm")) / "engine.log"
    engine = VllmEngine(VllmConfig(model_path=model_dir, python=default_python(), log_path=log,
                                   max_model_len=2048, cpu_kvcache_gb=1, max_num_seqs=64))
    rt.use_engine(engine)
    try:
        engine.start()
        yield rt
    finally:
        engine.close()


@pytest.fixture(scope="module")
def adapter(model_dir: Path, tmp_path_factory) -> Path:
    from tests.support.models import make_lora_adapter

    return make_lora_adapter(model_dir, Path(tmp_path_factory.mktemp("lora")) / "a", seed=3, scale=0.8)


@pytest.mark.timeout(1200)  # pays for the module's model build and engine start
def test_same_prompt_seed_and_adapter_give_the_same_ids_twice(vrt, adapter: Path) -> None:
    prompt = vrt.encode_prompt(MESSAGES, thinking=False)
    seeds = [101, 102, 103, 104]
    first = vrt.sample([prompt] * 4, seeds, max_new_tokens=16, temperature=1.0, thinking=False, adapter_dir=adapter)
    second = vrt.sample([prompt] * 4, seeds, max_new_tokens=16, temperature=1.0, thinking=False, adapter_dir=adapter)
    assert [g.ids for g in first] == [g.ids for g in second]
    assert len({tuple(g.ids) for g in first}) > 1  # the seeds matter
    digest = vrt.adapter_handle(adapter).sha256
    assert {g.adapter_sha256 for g in first} == {digest}
    base = vrt.sample([prompt] * 4, seeds, max_new_tokens=16, temperature=1.0, thinking=False)
    assert {g.adapter_sha256 for g in base} == {None}
    assert [g.ids for g in base] != [g.ids for g in first]  # the adapter was served, not the base
    identity = vrt.runtime_identity()
    assert identity["engine"]["name"] == "vllm" and identity["engine"]["version"].startswith("0.32")


@pytest.mark.timeout(600)
def test_trainer_logprobs_of_the_returned_ids_match_vllms_within_tolerance(vrt, adapter: Path) -> None:
    """Base and adapter rows go to the engine in one call, so they are decoded in the same batches:
    the grouped LoRA products (``vllm_lora_cpu``) give each row its own adapter's, or none."""
    from kiln.core.policy.engine import GenerationRequest

    assert vrt.engine.lora_products == "grouped"  # as the server's /health reported it
    assert vrt.engine.reader_wait == "napping"  # vllm_cpu_wait is in place on the CPU build
    prompt = vrt.encode_prompt(MESSAGES, thinking=False)
    handle = vrt.adapter_handle(adapter)
    adapters = [None, handle] * 4
    rows = vrt.engine.generate([
        GenerationRequest(prompt_ids=tuple(prompt), seed=7 + i, max_tokens=24, temperature=1.0, stop_id=vrt.stop_id,
                          adapter=a)
        for i, a in enumerate(adapters)
    ])
    assert [r.adapter_sha256 for r in rows] == [None if a is None else handle.sha256 for a in adapters]
    worst = 0.0
    for row, a in zip(rows, adapters):
        assert len(row.ids) == len(row.logprobs) > 0
        assert all(0 <= t < vrt.model.config.vocab_size for t in row.ids)
        # the trainer teacher-forces the very ids vLLM returned: a shifted or re-tokenized id
        # would show as a log-prob gap of whole nats, not rounding; a row given another row's
        # adapter (or none) as a gap of the adapter's size
        trainer = vrt.logprobs_of(prompt, row.ids, temperature=1.0, adapter_dir=None if a is None else adapter)
        worst = max(worst, max(abs(x - y) for x, y in zip(trainer, row.logprobs)))
    print(f"max |vLLM - trainer| log-prob: {worst:.3e}")
    assert worst < LOGPROB_TOLERANCE


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def _physical_cores(cpus: set[int]) -> int:
    """Distinct (package, core) pairs among ``cpus``, from sysfs: vLLM binds one thread per core."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
    return len(cores)


@pytest.mark.timeout(600)
def test_the_model_workers_threads_are_bound_to_every_core(vrt) -> None:
    """vLLM's CPU build keeps a core per model worker free for its spinning engine core, which
    halves a 2-core machine's forward; the server's napping readers need none, so it reserves 0 and
    the worker's threads are pinned one per physical core the server may use."""
    assert vrt.engine.cpu_reserved_cores == 0  # as /health reported it
    workers = [pid for pid in _descendants(vrt.engine.pid)
               if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::Worker")]
    assert len(workers) == 1
    pinned = set()
    for task in os.listdir(f"/proc/{workers[0]}/task"):
        cpus = os.sched_getaffinity(int(task))
        if len(cpus) == 1:  # an OpenMP thread vLLM bound to its core
            pinned |= cpus
    allowed = os.sched_getaffinity(vrt.engine.pid)
    assert pinned <= allowed
    assert len(pinned) == _physical_cores(allowed)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_a_tensor_parallel_engine_of_two_ranks_samples_what_one_rank_does(vrt, model_dir: Path, tmp_path: Path) -> None:
    """``KILN_VLLM_TENSOR_PARALLEL=2`` on the CPU build: two model workers, each bound to its own
    slice of the cores (``vllm_topology``: vLLM's own binding wants a NUMA node per rank), sample
    the module's one-rank engine's ids at the same seeds, log-probs within the tolerance, and the
    identity records the tensor-parallel size (each layer's sums are split across the ranks)."""
    from kiln.core.policy.engine import GenerationRequest
    from kiln.core.policy.engine_vllm import VllmConfig, VllmEngine
    from kiln.core.policy.vllm_topology import engine_envs

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("tensor parallel on the CPU build needs a core per rank")
    (env,) = engine_envs(2, 1, on_cuda=False, gpus=[], cores=cores)
    engine = VllmEngine(VllmConfig(model_path=model_dir, python=default_python(), log_path=tmp_path / "tp2.log",
                                   max_model_len=2048, cpu_kvcache_gb=1, max_num_seqs=64, tensor_parallel=2,
                                   extra_env=env))
    prompt = vrt.encode_prompt(MESSAGES, thinking=False)
    requests = [GenerationRequest(prompt_ids=tuple(prompt), seed=300 + i, max_tokens=16, temperature=1.0,
                                  stop_id=vrt.stop_id) for i in range(4)]
    one = vrt.engine.generate(requests)
    try:
        engine.start()
        workers = [pid for pid in _descendants(engine.pid)
                   if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::Worker")]
        pinned = []
        for worker in workers:
            pinned.append(set().union(*[cpus for task in os.listdir(f"/proc/{worker}/task")
                                        if len(cpus := os.sched_getaffinity(int(task))) == 1]))
        two = engine.generate(requests)
        identity = engine.identity()
    finally:
        engine.close()
    assert len(workers) == 2 and all(pinned) and not pinned[0] & pinned[1]  # a slice of cores each
    assert identity == {**vrt.engine.identity(), "tensor_parallel": 2}
    assert [r.ids for r in two] == [r.ids for r in one]
    gap = max(abs(a - b) for x, y in zip(one, two) for a, b in zip(x.logprobs, y.logprobs))
    print(f"max |TP 2 - TP 1| log-prob: {gap:.3e}")
    assert gap < LOGPROB_TOLERANCE


@pytest.mark.timeout(600)
def test_prompts_beyond_one_steps_token_budget_arrive_together_without_killing_the_engine(vrt) -> None:
    """Seeded rows whose prompts add up to more than vLLM's default step budget (2048 tokens), sent
    at once, as when the groups in flight are retried together after a restart. With chunked
    prefill, vLLM's CPU build splits a prompt, rewinds its seeded generator and its engine core dies
    ("CPU Generator does not use offset"); the server turns chunking off on CPU."""
    import random

    from kiln.core.policy.engine import GenerationRequest

    restarts = vrt.engine.restarts
    rng = random.Random(5)
    vocab = vrt.model.config.vocab_size
    prompts = [tuple(rng.randrange(1000, vocab - 1000) for _ in range(80)) for _ in range(40)]  # 3,200 tokens
    rows = vrt.engine.generate([
        GenerationRequest(prompt_ids=p, seed=i, max_tokens=3, temperature=1.0, stop_id=vrt.stop_id)
        for i, p in enumerate(prompts)
    ])
    assert len(rows) == 40 and all(1 <= len(r.ids) <= 3 for r in rows)
    assert vrt.engine.restarts == restarts  # the engine served them; nothing was restarted


SCHEMAS = {
    "integer": {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["amount"], "additionalProperties": False},
    "free_form_object": {"type": "object", "properties": {"message": {"type": "string"},
                                                          "data": {"type": "object"}},
                         "required": ["message"]},
    "mcp_union": {"anyOf": [
        {"type": "object", "properties": {"type": {"const": "call_tool"}, "tool_name": {"const": "add"},
                                          "arguments": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                        "required": ["a"]}},
         "required": ["type", "tool_name", "arguments"]},
        {"type": "object", "properties": {"type": {"const": "list_tools"}}, "required": ["type"]},
    ]},
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shape", sorted(SCHEMAS))
def test_constrained_actions_parse_and_validate(vrt, shape: str) -> None:
    import jsonschema

    schema = SCHEMAS[shape]
    prompt = vrt.encode_prompt(MESSAGES, thinking=False)
    rows = vrt.sample([prompt] * 3, [1, 2, 3], max_new_tokens=96, temperature=1.0, thinking=False,
                      action_schema=schema)
    # every token was checked against Kiln's own mask by the engine (a violation raises); finished
    # rows are complete objects that validate against the schema
    finished = [row for row in rows if row.finished]
    assert finished, "no constrained row finished within 96 tokens"
    for row in finished:
        _, answer = vrt.split_action(row.ids, thinking=False)
        jsonschema.validate(json.loads(answer), schema)
        # the trainer replays the same grammar over the same ids
        vrt.logprobs_of(prompt, row.ids, temperature=1.0, action_schema=schema, thinking=False)


@pytest.fixture(scope="module")
def roomy_counter_url() -> Iterator[str]:
    """A counter server with a session for every candidate of two 4 x 8 runs at once."""
    from tests.support.servers import serve_example_env

    with serve_example_env("counter", max_concurrent_envs=64) as url:
        yield url


@pytest.mark.heavy
@pytest.mark.asyncio
@pytest.mark.timeout(1500)
async def test_two_iterations_and_two_runs_at_once_on_one_vllm_engine_worker(
    kiln_settings, counter_env_url: str, roomy_counter_url: str, model_dir: Path, tmp_path: Path, vrt
) -> None:
    """One vllm-engine gpu worker serves three runs at once, and survives kill -9 of its engine.

    - Two rollout runs of 4 groups x 8 (eight groups of eight from two runs): the engine holds
      requests of both runs at once. vLLM schedules every request in flight in each step while
      they fit in ``max_num_seqs``, so they are decoded in the same batches.
    - Then the engine's process group is killed with SIGKILL mid-collection: the groups in flight
      fail with ``engine_unavailable`` and are re-collected once the worker has restarted the
      engine; the groups that had finished are not; every run completes.
    - A train run, two online iterations of 3 groups x 2: iteration 2 samples with iteration 1's
      adapter (served by path), whose samples differ from the base's; the run verifies offline;
      each receipt records the engine's log-prob gap.
    """
    import asyncio

    from activities.gpu import GpuActivities, LockedPolicy
    from api.runs import RunService
    from kiln.core.artifacts.store import S3Store
    from kiln.core.canonical import canonical_json
    from kiln.core.contracts import parse_run_request
    from kiln.core.policy.runtime import PolicyRuntime
    from kiln.core.rollout.verify.run import verify_run
    from tests.integration.test_real_shape_run import RUN
    from tests.support.kiln_workers import running_workers
    from tests.support.run_folders import download_run
    from tests.support.waiting import workflow_result

    def factory(settings, store, path):
        # The worker serves through the module's engine process (one engine start fewer; how a
        # worker configures its own engine from settings is tested in tests/unit/test_policy_engine.py).
        acts = GpuActivities(settings, store, path)
        runtime = PolicyRuntime.load(path, device=settings.device, dtype=settings.dtype)
        runtime.use_engine(vrt.engine)
        acts._policy = LockedPolicy(runtime)
        return acts

    settings = kiln_settings(model_path=model_dir, device="cpu", dtype="auto", engine="vllm",
                             vllm_cpu_kvcache_gb=1, vllm_max_model_len=2048)
    # 3 groups: a group's rewards can tie, and an iteration whose every group ties trains nothing.
    # A learning rate well above the default, so that one step moves this random model's sampling
    # (at 3e-4 the first 16 ids of a few rows did not change) and the served adapter shows in the ids.
    request = parse_run_request({**RUN, "groups": 3, "group_size": 2, "iterations": 2,
                                 "environment_urls": [counter_env_url], "output_adapter": "vllm-run",
                                 "training_config": {**RUN["training_config"], "learning_rate": 3e-3}})
    assert settings.vllm_max_concurrent_activities >= 16  # every group of the runs at once
    rollout = parse_run_request({"kind": "rollout", "groups": 4, "group_size": 8, "max_steps": 1,
                                 "max_action_tokens": 16, "thinking": False, "constrained_actions": True,
                                 "environment_urls": [roomy_counter_url]})
    engine = vrt.engine
    old_pid, restarts = engine.pid, engine.restarts
    async with running_workers(settings, gpu_factory=factory) as client:
        service = RunService(client, settings)
        run_ids = [(await service.submit(r))[0].run_id for r in (request, rollout, rollout)]
        results = asyncio.gather(
            *(workflow_result(client.get_workflow_handle(r), timeout_s=1000) for r in run_ids))
        # every collection request is tagged with its run id: wait until both rollout runs have
        # requests in the engine at once (at least a group's worth together), then kill it
        deadline = asyncio.get_running_loop().time() + 600
        while True:
            figures = await asyncio.to_thread(engine.stats)
            now = figures["in_flight"]
            if all(now.get(r, 0) >= 1 for r in run_ids[1:]) and sum(now.values()) >= 8:
                break
            assert asyncio.get_running_loop().time() < deadline, f"the rollout runs never met: {figures}"
            await asyncio.sleep(0.2)
        print(f"engine figures before the kill: {figures}")
        assert set(now) <= set(run_ids)
        os.killpg(old_pid, signal.SIGKILL)
        final, *rollouts = await results
    assert final["state"] == "completed", final.get("failure")
    assert [r["state"] for r in rollouts] == ["completed", "completed"], [r.get("failure") for r in rollouts]
    assert engine.pid != old_pid and engine.restarts == restarts + 1  # restarted once, by the worker
    # Only the groups in flight at the kill were re-collected: each on a later attempt, with the
    # engine's error recorded, at most the 4 groups a run keeps in flight; all 32 episodes each.
    redone = {}
    for run_id, status in zip(run_ids, [final, *rollouts]):
        groups = [i for i in status["interruptions"] if i["activity"] == "collect_group"]
        assert all(i["attempts"] >= 2 and i["code"] == "engine_unavailable" for i in groups), groups
        assert len({i["group_index"] for i in groups}) == len(groups) <= 4
        redone[run_id] = len(groups)
    assert sum(redone[r] for r in run_ids[1:]) >= 2, redone  # both rollout runs had groups in flight
    for status in rollouts:
        assert (status["progress"]["groups_completed"], status["progress"]["rollouts_completed"]) == (4, 32)
    first, second = final["iterations"]
    assert first["trained"] and second["trained"]
    assert first["behavior_adapter_sha256"] is None
    assert second["behavior_adapter_sha256"] == first["adapter_sha256"]  # on-policy: iteration 1's adapter
    store = S3Store.from_settings(settings)
    manifest = json.loads(store.get_key(f"runs/{final['run_id']}/manifest.json"))
    folder = download_run(store, final["run_id"], manifest, tmp_path / "run")
    report = verify_run(folder)
    assert [r["sampled_by"] for r in report["iterations"]] == [None, first["adapter_sha256"]]
    for k, iteration in ((1, first), (2, second)):
        prefix = folder / "iterations" / f"{k:06d}"
        lines = [json.loads(line) for line in (prefix / "rollouts.jsonl").read_text().splitlines()]
        policies = {canonical_json(c["openenv"]["behavior_policy"]) for line in lines for c in line["completions"]}
        assert len(policies) == 1
        policy = json.loads(policies.pop())
        assert policy["runtime"]["engine"]["name"] == "vllm"
        assert policy["adapter_sha256"] == iteration["behavior_adapter_sha256"]
        # The receipt records the engine's gap; constrained actions' log-probs are of the
        # grammar-masked distribution, so it is recorded but not corrected.
        receipt = json.loads((prefix / "train_receipt.json").read_bytes())
        mismatch = receipt["engine_mismatch"]
        assert (mismatch["engine"], mismatch["correction"], mismatch["reason"]) == \
            ("vllm", "none", "constrained_actions")
        assert mismatch["tokens"] == receipt["token_counts"]["action_tokens"] > 0  # the kept groups' action tokens
        assert mismatch["max_abs_delta"] >= mismatch["mean_abs_delta"] >= 0.0
    # Iteration 1's adapter, downloaded from the run, is served by path: every row reports its digest,
    # and its samples differ from the base's at the same seeds.
    adapter = folder / "iterations" / "000001" / "adapter"
    prompt = vrt.encode_prompt(MESSAGES, thinking=False)
    seeds = [11, 12, 13, 14, 15, 16, 17, 18]
    tuned = vrt.sample([prompt] * 8, seeds, max_new_tokens=24, temperature=1.0, thinking=False, adapter_dir=adapter)
    base = vrt.sample([prompt] * 8, seeds, max_new_tokens=24, temperature=1.0, thinking=False)
    assert {g.adapter_sha256 for g in tuned} == {first["adapter_sha256"]}
    assert {g.adapter_sha256 for g in base} == {None}
    differing = sum(t.ids != b.ids for t, b in zip(tuned, base))
    print(f"iteration 1's adapter vs the base, same 8 seeds: {differing} rows differ")
    assert differing >= 1
