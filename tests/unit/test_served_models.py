"""Served models: the folders under KILN_MODELS_DIR, their task queues, admission's rejection."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.contracts import parse_run_request
from kiln.core.request_digest import request_digest
from kiln.core.errors import InvalidRequest, ModelNotServed
from kiln.core.served_models import model_task_queue, require_served, served_models


def _model(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    return folder


@pytest.mark.timeout(30)
def test_each_subfolder_with_a_config_is_a_served_model(tmp_path: Path) -> None:
    qwen, llama = _model(tmp_path, "qwen3-tiny"), _model(tmp_path, "llama-tiny")
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    _model(tmp_path, ".cache")  # hidden: skipped
    (tmp_path / "README.txt").write_text("x")
    assert served_models(tmp_path) == {"llama-tiny": llama, "qwen3-tiny": qwen}
    assert served_models(None) == {} and served_models(tmp_path / "missing") == {}


@pytest.mark.timeout(30)
def test_model_task_queues() -> None:
    assert model_task_queue("kiln-gpu", None) == "kiln-gpu"
    assert model_task_queue("kiln-gpu", "qwen3-4b") == "kiln-gpu.qwen3-4b"


@pytest.mark.timeout(30)
def test_unknown_model_is_a_field_error_listing_the_served_ones(tmp_path: Path) -> None:
    _model(tmp_path, "b-model")
    _model(tmp_path, "a-model")
    require_served(None, tmp_path)  # the default model is always served
    require_served("a-model", tmp_path)
    with pytest.raises(ModelNotServed) as error:
        require_served("c-model", tmp_path)
    assert isinstance(error.value, InvalidRequest)
    assert error.value.code == "model_not_served" and error.value.http_status == 400
    assert error.value.details == {"field": "model", "model": "c-model", "served": ["a-model", "b-model"]}
    assert "model: 'c-model' is not served" in error.value.message
    assert "served models: a-model, b-model" in error.value.message
    with pytest.raises(ModelNotServed, match="served models: none besides the default"):
        require_served("c-model", None)


@pytest.mark.timeout(30)
def test_unset_model_keeps_the_request_digest_of_a_default_request() -> None:
    base = {"environment_urls": ["http://127.0.0.1:1"]}
    plain = parse_run_request(base)
    named = parse_run_request({**base, "model": "qwen3-tiny"})
    assert "model" not in plain.model_dump(exclude_none=True)
    assert request_digest(plain) != request_digest(named)
    assert request_digest(plain) == request_digest(parse_run_request({**base, "model": None}))


@pytest.mark.timeout(30)
def test_a_named_model_of_an_unsupported_family_is_refused_and_the_worker_splits_its_models(tmp_path: Path) -> None:
    from kiln.core.errors import ModelUnsupported
    from kiln.core.served_models import servable_split

    qwen = _model(tmp_path, "qwen")
    made_up = _model(tmp_path, "made-up")
    (made_up / "config.json").write_text('{"model_type": "kiln_made_up", "architectures": ["MadeUpForCausalLM"]}')
    moe = _model(tmp_path, "moe")
    # an MoE family the vllm CPU build does not serve (its experts are not Kiln's CPU experts' kind)
    (moe / "config.json").write_text('{"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}')
    hybrid = _model(tmp_path, "hybrid")
    (hybrid / "config.json").write_text('{"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"]}')
    require_served("qwen", tmp_path, engine="hf")
    require_served("moe", tmp_path, engine="vllm")  # the placement is the gpu worker's to judge
    for name, engine in (("made-up", None), ("made-up", "vllm"), ("made-up", "hf")):
        with pytest.raises(ModelUnsupported) as error:
            require_served(name, tmp_path, engine=engine)
        assert error.value.code == "model_unsupported" and error.value.http_status == 400
        assert str(tmp_path / name) in error.value.message
    require_served("hybrid", tmp_path)  # without an engine only the architecture is judged

    models = {None: qwen, "made-up": made_up, "moe": moe, "hybrid": hybrid, "absent": tmp_path / "absent"}
    kept, refused = servable_split(models, "vllm", cpu=True)
    assert set(kept) == {None, "hybrid", "absent"} and set(refused) == {"made-up", "moe"}
    assert refused["moe"].details["engine"] == "vllm" and "Triton" in refused["moe"].details["missing"]
    assert "qwen3_moe" in refused["moe"].details["supported"]  # served on the CPU build through Kiln's experts
    require_served("hybrid", tmp_path, engine="hf")  # the hf engine keeps conv and recurrent states per row
    kept, refused = servable_split(models, "hf", cpu=True)
    assert set(kept) == {None, "moe", "hybrid", "absent"} and set(refused) == {"made-up"}
    assert refused["made-up"].details["architecture"].startswith("MadeUpForCausalLM")
