"""A worker runs activities in threads: model loads, seeded LoRA inits and adapter loads in
several threads at once give what each gives alone (torch's one generator and its model
construction state are held by one lock, ``kiln.core.policy.loading.TORCH_GLOBAL_STATE``).

Measured before the lock: two concurrent base-model loads gave one of them meta weights
("Cannot copy out of meta tensor"), and two concurrent trainings on one worker gave adapters that
differed from an undisturbed run's.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kiln.core.train.model import attach_lora, load_base_model  # noqa: E402
from tests.unit.test_train_support import build_tiny_qwen3  # noqa: E402

ROUNDS = 4


def _lora_init(model_path: Path, seed: int) -> dict[str, torch.Tensor]:
    model = attach_lora(load_base_model(model_path, "cpu"), rank=4, alpha=8.0, seed=seed, base_adapter_dir=None)
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


@pytest.mark.timeout(240)
def test_loads_and_seeded_lora_inits_in_threads_equal_each_alone(tmp_path: Path) -> None:
    model_path = build_tiny_qwen3(tmp_path / "tiny")
    alone = {seed: _lora_init(model_path, seed) for seed in (1, 2)}
    got: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def work(seed: int, round_: int) -> None:
        try:
            got[(seed, round_)] = _lora_init(model_path, seed)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed, r)) for r in range(ROUNDS) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=200)
    assert errors == [] and len(got) == 2 * ROUNDS, errors
    for (seed, _), weights in got.items():
        assert sorted(weights) == sorted(alone[seed])
        for name, tensor in weights.items():
            assert tensor.device.type == "cpu" and torch.equal(tensor, alone[seed][name]), (seed, name)
    assert any(not torch.equal(alone[1][n], alone[2][n]) for n in alone[1])  # the seed does decide it
