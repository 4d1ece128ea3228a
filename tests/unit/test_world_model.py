"""Observation cross-entropy of a policy on evaluation transcripts (kiln.core.train.world_model)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from kiln.core.train.world_model import (  # noqa: E402
    observation_cross_entropy,
    world_model_comparison,
)

torch.set_num_threads(1)

OBS = [30, 31, 32, 33]
WARN = [40, 41, 42]


def _tiny_qwen3(path: Path) -> Path:
    """The trainer tests' random tiny Qwen3 (one builder for both suites)."""
    from tests.unit.test_train_support import build_tiny_qwen3

    return build_tiny_qwen3(path)


def _adapter(model_path: Path, path: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)  # B starts at zero; make the adapter do something
    peft_model.save_pretrained(str(path))
    return path


def _completion(action: int, *, warning: bool) -> dict:
    pieces = [
        {"kind": "context", "ids": [3, 4, 5]},
        {"kind": "action", "ids": [action, 22], "logprobs": [-1.0, -1.0]},
    ]
    if warning:
        pieces.append({"kind": "observation", "ids": list(WARN), "warning": True})
    pieces += [
        {"kind": "observation", "ids": list(OBS), "warning": False},
        {"kind": "context", "ids": [11, 12]},
        {"kind": "action", "ids": [action + 1, 22]},
        {"kind": "observation", "ids": [50, 51], "warning": False},
    ]
    return {"reward": 1.0, "tokens": {"pieces": pieces}}


def _lines() -> list[dict]:
    return [
        {"messages": [], "completions": [_completion(20, warning=True), _completion(21, warning=False)]},
        {"messages": [], "completions": [_completion(24, warning=True)]},
    ]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return _tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def adapter_dir(model_path, tmp_path_factory) -> Path:
    return _adapter(model_path, tmp_path_factory.mktemp("adapter"))


def _manual(model, lines, *, include_warnings: bool = False) -> tuple[float, int]:
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for line in lines:
        for completion in line["completions"]:
            ids: list[int] = []
            target: list[bool] = []
            for piece in completion["tokens"]["pieces"]:
                keep = piece["kind"] == "observation" and (
                    include_warnings or not piece.get("warning", False)
                )
                ids += piece["ids"]
                target += [keep] * len(piece["ids"])
            x = torch.tensor([ids])
            with torch.no_grad():
                logits = model(input_ids=x).logits[0, :-1].float()
            mask = torch.tensor(target[1:])
            total += F.cross_entropy(logits[mask], x[0, 1:][mask], reduction="sum").double()
            count += int(mask.sum())
    return float(total / count), count


def _load(model_path: Path, adapter: Path | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    return model


def test_base_ce_matches_manual_and_excludes_warnings(model_path) -> None:
    lines = _lines()
    result = observation_cross_entropy(model_path, lines)
    expected, tokens = _manual(_load(model_path), lines)
    assert result["sequences"] == 3
    assert result["env_tokens"] == tokens == 3 * (len(OBS) + 2)
    assert result["mean_env_ce"] == pytest.approx(expected, abs=1e-5)
    with_warnings, warn_tokens = _manual(_load(model_path), lines, include_warnings=True)
    assert warn_tokens == tokens + 2 * len(WARN)
    assert abs(with_warnings - result["mean_env_ce"]) > 1e-3  # warning tokens would change it


def test_warning_flag_decides_membership(model_path) -> None:
    lines = _lines()
    for line in lines:
        for completion in line["completions"]:
            for piece in completion["tokens"]["pieces"]:
                piece.pop("warning", None)
    result = observation_cross_entropy(model_path, lines)
    expected, tokens = _manual(_load(model_path), lines, include_warnings=True)
    assert result["env_tokens"] == tokens == 3 * (len(OBS) + 2) + 2 * len(WARN)
    assert result["mean_env_ce"] == pytest.approx(expected, abs=1e-5)


def test_adapter_changes_ce_and_matches_manual(model_path, adapter_dir) -> None:
    lines = _lines()
    base = observation_cross_entropy(model_path, lines)
    candidate = observation_cross_entropy(model_path, lines, adapter_dir=adapter_dir)
    expected, _ = _manual(_load(model_path, adapter_dir), lines)
    assert candidate["mean_env_ce"] == pytest.approx(expected, abs=1e-5)
    assert candidate["env_tokens"] == base["env_tokens"]
    assert abs(candidate["mean_env_ce"] - base["mean_env_ce"]) > 1e-3
    both = world_model_comparison(model_path, lines, adapter_dir=adapter_dir)
    assert both[0]["mean_env_ce"] == pytest.approx(base["mean_env_ce"], abs=1e-6)
    assert both[1]["mean_env_ce"] == pytest.approx(candidate["mean_env_ce"], abs=1e-6)


def test_no_observation_tokens_gives_none(model_path) -> None:
    lines = [
        {
            "completions": [
                {
                    "tokens": {
                        "pieces": [
                            {"kind": "context", "ids": [3, 4]},
                            {"kind": "action", "ids": [20]},
                            {"kind": "observation", "ids": WARN, "warning": True},
                        ]
                    }
                }
            ]
        }
    ]
    assert observation_cross_entropy(model_path, lines) == {
        "mean_env_ce": None,
        "env_tokens": 0,
        "sequences": 1,
    }


def test_missing_adapter_raises(model_path, tmp_path) -> None:
    from kiln.core.errors import AdapterNotFound

    with pytest.raises(AdapterNotFound):
        observation_cross_entropy(model_path, _lines(), adapter_dir=tmp_path / "nope")


@pytest.mark.timeout(120)
def test_full_weights_are_the_candidate_model(model_path, tmp_path) -> None:
    """adapter: full: the candidate is the full-weights folder itself (a model of its own)."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    with torch.no_grad():
        for param in full.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) * 0.05)
    folder = tmp_path / "full"
    full.save_pretrained(str(folder))
    (folder / "generation_config.json").unlink(missing_ok=True)
    lines = _lines()
    base, candidate = world_model_comparison(model_path, lines, adapter_dir=folder)
    assert base["mean_env_ce"] == pytest.approx(_manual(_load(model_path), lines)[0], abs=1e-5)
    expected, tokens = _manual(_load(folder), lines)
    assert candidate["env_tokens"] == tokens and candidate["mean_env_ce"] == pytest.approx(expected, abs=1e-5)
    assert abs(candidate["mean_env_ce"] - base["mean_env_ce"]) > 1e-3
