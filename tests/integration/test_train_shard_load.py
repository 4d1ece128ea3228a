"""Shard-only loading across ranks (kiln.core.train.shard_load): real spawned ranks over gloo,
FSDP2 over a LoRA-wrapped tiny Qwen3 (tied embeddings).

- each rank's local shards, concatenated over the ranks, equal the single-process model's weights
  bit for bit (a single ``model.safetensors``, and a sharded folder with an index, over 3 ranks:
  torch.chunk's uneven split of the 64-row weights); the tied head is the embeddings' one tensor;
- the non-persistent buffers (rotary ``inv_freq``), the seeded LoRA init (fresh and from a
  ``base_adapter_dir``) and torch's generator state afterwards equal the single process's;
- a checkpoint lacking a tensor, or holding one the model has no parameter for, or of another
  shape, is ``training_checkpoint_mismatch``.
"""

from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from kiln.core.errors import TrainingFailed  # noqa: E402
from kiln.core.train.prepare import load_model  # noqa: E402
from kiln.core.training_config import TrainingConfig  # noqa: E402
from tests.unit.test_train_support import build_tiny_qwen3  # noqa: E402

SEED = 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("shard-model") / "model")


def _rank_load(rank: int, world: int, model: str, adapter: str | None, out: str) -> None:
    """One rank: load the model as the trainer does; save its shards, LoRA, buffers, RNG state."""
    import torch.distributed as dist

    from kiln.core.train.distributed import RankGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    loaded = load_model(Path(model), TrainingConfig(seed=SEED), Path(adapter) if adapter else None,
                        torch.device("cpu"), "float32", None, RankGroup(rank, world, "gloo"))
    lm = loaded.get_base_model()
    shards = {n: p.to_local().detach().clone() for n, p in lm.named_parameters() if not p.requires_grad}
    torch.save({"shards": shards,
                "tied": lm.lm_head.weight is lm.model.embed_tokens.weight,
                "lora": {n: p.detach().clone() for n, p in loaded.named_parameters() if p.requires_grad},
                "buffers": {n: b.clone() for n, b in lm.named_buffers()},
                "rng": torch.get_rng_state()}, f"{out}/rank-{rank}.pt")
    dist.destroy_process_group()


def _across(world: int, model: Path, adapter: Path | None, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_rank_load, args=(r, world, str(model), str(adapter) if adapter else None,
                                                      str(out))) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * world
    return [torch.load(out / f"rank-{r}.pt") for r in range(world)]


def _alone(model: Path, adapter: Path | None) -> tuple[dict, dict, dict, torch.Tensor]:
    loaded = load_model(model, TrainingConfig(seed=SEED), adapter, torch.device("cpu"), "float32", None, None)
    rng = torch.get_rng_state()
    lm = loaded.get_base_model()
    base = {n: p.detach() for n, p in lm.named_parameters() if not p.requires_grad}
    lora = {n: p.detach() for n, p in loaded.named_parameters() if p.requires_grad}
    return base, lora, dict(lm.named_buffers()), rng


def _check_equal(ranks: list[dict], model: Path, adapter: Path | None) -> None:
    base, lora, buffers, rng = _alone(model, adapter)
    assert len(base) == 24 and len(lora) == 28 and sorted(buffers) == ["model.rotary_emb.inv_freq",
                                                                      "model.rotary_emb.original_inv_freq"]
    for name, whole in base.items():
        parts = [r["shards"][name] for r in ranks]
        assert sum(p.shape[0] for p in parts) == whole.shape[0]
        assert torch.equal(torch.cat(parts), whole), name
    for r in ranks:
        assert sorted(r["shards"]) == sorted(base) and r["tied"]
        assert sorted(r["lora"]) == sorted(lora) and all(torch.equal(r["lora"][n], lora[n]) for n in lora)
        assert all(torch.equal(r["buffers"][n], buffers[n]) for n in buffers)
        assert torch.equal(r["rng"], rng)


@pytest.mark.timeout(240)
def test_two_ranks_read_their_rows_of_a_single_file(model_path, tmp_path):
    ranks = _across(2, model_path, None, tmp_path / "fresh")
    assert [r["shards"]["model.embed_tokens.weight"].shape[0] for r in ranks] == [150, 150]
    _check_equal(ranks, model_path, None)
    # a warm start: the adapter's own weights, on every rank
    adapter = tmp_path / "adapter"
    _save_moved_adapter(model_path, adapter)
    warm = _across(2, model_path, adapter, tmp_path / "warm")
    _check_equal(warm, model_path, adapter)
    assert any(float(t.abs().max()) > 0 for n, t in warm[0]["lora"].items() if "lora_B" in n)


def _save_moved_adapter(model_path: Path, adapter: Path) -> None:
    from kiln.core.train.model import save_adapter

    loaded = load_model(model_path, TrainingConfig(seed=11), None, torch.device("cpu"), "float32", None, None)
    with torch.no_grad():
        for _, param in loaded.named_parameters():
            if param.requires_grad:
                param.add_(0.01)
    save_adapter(loaded, adapter)


@pytest.mark.timeout(240)
def test_three_ranks_read_uneven_rows_of_an_indexed_folder(model_path, tmp_path):
    folder = tmp_path / "indexed"
    shutil.copytree(model_path, folder)
    (folder / "model.safetensors").unlink()
    tensors = load_file(str(model_path / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    import json

    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: file for file, part in halves.items() for n in part}}))
    ranks = _across(3, folder, None, tmp_path / "three")
    # torch.chunk over 3 ranks: 64 rows are 22 + 22 + 20
    assert [r["shards"]["model.norm.weight"].shape[0] for r in ranks] == [22, 22, 20]
    _check_equal(ranks, folder, None)


def _fill_alone(folder: Path):
    from kiln.core.train.shard_load import fill_shards, weightless_model

    model = weightless_model(folder, "float32", torch.device("cpu"))
    fill_shards(model, folder)
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["missing", "unknown", "shape"])
def test_a_checkpoint_unlike_its_model_is_refused(model_path, tmp_path, fault):
    folder = tmp_path / fault
    shutil.copytree(model_path, folder)
    tensors = load_file(str(model_path / "model.safetensors"))
    if fault == "missing":
        del tensors["model.norm.weight"]
    elif fault == "unknown":
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    else:
        tensors["model.norm.weight"] = torch.zeros(63)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TrainingFailed) as caught:
        _fill_alone(folder)
    error = caught.value
    assert error.code == "training_checkpoint_mismatch" and not error.retryable
    named = {"missing": "model.norm.weight", "unknown": "model.layers.0.mlp.extra.weight",
             "shape": "model.norm.weight"}[fault]
    assert named in error.message and "KILN_TRAIN_DEVICES=1" in error.hint
    # the intact checkpoint fills an unsharded model's every weight (whole tensors) exactly
    from kiln.core.train.model import load_base_model

    filled = dict(_fill_alone(model_path).named_parameters())
    loaded = dict(load_base_model(model_path, "cpu").named_parameters())
    assert sorted(filled) == sorted(loaded) and all(torch.equal(filled[n], loaded[n]) for n in loaded)
