"""The model family table on real transformers models of each family's layer pattern (random weights).

For every family: the folder loads through Kiln's loader with the family's attention implementation,
LoRA adapts exactly the family entry's modules and expert parameters (resolved against the model,
phi3's fused projections and Qwen3.5's Gated DeltaNet projections included), one training
forward/backward reaches every adapted module, and ``adapter_config.json`` names the resolved set.
Unknown architectures and composite checkpoints without a text-only loader are refused with
``model_unsupported``; the Qwen3.5 hub layout loads its language model only, recorded in the identity.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.core.errors import ModelUnsupported
from kiln.core.policy.device import Placement
from kiln.core.policy.families import FAMILIES, family_of, load_identity_fields, require_servable
from kiln.core.policy.identity import model_part_of
from kiln.core.policy.loading import load_causal_lm
from kiln.core.train.model import adapted_targets, attach_lora, save_adapter
from tests.support.model_builders import TINY, build_family_folder

CPU = Placement("cpu", "float32")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {case: build_family_folder(case, root / case) for case in TINY}


def test_every_family_of_the_table_has_a_tiny_model() -> None:
    assert {family for family, *_ in TINY.values()} == set(FAMILIES)
    assert len(FAMILIES) == 13


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(TINY))
def test_lora_adapts_exactly_the_family_entry_and_gradients_reach_it(
    case: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    family = FAMILIES[TINY[case][0]]
    assert family_of(folders[case]).family is family
    model = load_causal_lm(folders[case], CPU)
    assert model.config._attn_implementation == family.attn_implementation
    peft_model = attach_lora(model, rank=2, alpha=4.0, seed=3, base_adapter_dir=None)
    adapted = adapted_targets(peft_model)
    assert adapted == {"modules": sorted(family.lora_modules), "parameters": sorted(family.lora_parameters)}

    # One training forward/backward: every LoRA B matrix gets a non-zero gradient (A's are zero
    # at initialisation because B starts at zero).
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 12))
    logits = peft_model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    b_grads = {n: p.grad for n, p in peft_model.named_parameters() if "lora_B" in n}
    assert b_grads and all(g is not None and float(g.abs().sum()) > 0 for g in b_grads.values())
    reached = {n.split(".lora_B")[0].split(".")[-1] for n in b_grads}
    owners = set(adapted["modules"]) | {p.split(".")[0] for p in adapted["parameters"]}
    assert owners <= reached | {"base_layer"}

    save_adapter(peft_model, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_modules"] == sorted(family.lora_modules)
    assert (written.get("target_parameters") or []) == sorted(family.lora_parameters)


def test_phi3_and_qwen3_5_entries_name_their_real_modules() -> None:
    assert {"qkv_proj", "gate_up_proj"} <= set(FAMILIES["phi3"].lora_modules)
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"} <= set(FAMILIES["qwen3_5"].lora_modules)
    assert FAMILIES["qwen3_moe"].lora_parameters == ("experts.gate_up_proj", "experts.down_proj")
    assert FAMILIES["gpt_oss"].attn_implementation == "eager"
    # The hf engine's tile runs each row's experts alone, so MoE rows are batch-invariant too.
    assert [n for n, f in FAMILIES.items() if not f.batch_invariant] == []


@pytest.mark.timeout(120)
def test_the_hub_layout_loads_its_language_model_only(folders: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    folder = folders["qwen3_5"]
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    saved = load_file(str(folder / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in saved)  # the folder has a vision tower
    model = load_causal_lm(folder, CPU)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not [n for n, _ in model.named_parameters() if "visual" in n]
    # The language model's weights are the checkpoint's, not a fresh initialisation.
    assert torch.equal(model.model.embed_tokens.weight, saved["model.language_model.embed_tokens.weight"])
    assert load_identity_fields(folder) == {"model_part": "language_model"}
    assert load_identity_fields(folders["qwen3_5_text"]) == {} == load_identity_fields(folders["qwen3"])
    assert model_part_of({"runtime": {"kiln": "0", "model_part": "language_model"}}) == "language_model"
    assert model_part_of({"runtime": {"kiln": "0"}}) == "whole" == model_part_of(None)


@pytest.mark.timeout(120)
def test_the_behaviour_identity_records_the_language_model_only_choice(tmp_path: Path) -> None:
    from kiln.core.policy.runtime import PolicyRuntime

    hub = PolicyRuntime.load(build_family_folder("qwen3_5", tmp_path / "hub", template="qwen3"), device="cpu")
    text = PolicyRuntime.load(build_family_folder("qwen3_5_text", tmp_path / "text", template="qwen3"), device="cpu")
    assert hub.identity()["runtime"]["model_part"] == "language_model"
    assert model_part_of(hub.identity()) == "language_model"
    assert "model_part" not in text.identity()["runtime"] and model_part_of(text.identity()) == "whole"


def _unknown_folder(root: Path, config: dict) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.timeout(60)
def test_an_architecture_the_table_does_not_know_is_refused(tmp_path: Path) -> None:
    from transformers import AutoConfig, PretrainedConfig

    class KilnTestConfig(PretrainedConfig):
        model_type = "kiln_made_up"

    AutoConfig.register("kiln_made_up", KilnTestConfig)
    made_up = _unknown_folder(tmp_path / "made-up", {"model_type": "kiln_made_up", "architectures": ["MadeUpForCausalLM"]})
    gpt2 = _unknown_folder(tmp_path / "gpt2", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    for folder, architecture in ((made_up, "MadeUpForCausalLM"), (gpt2, "GPT2LMHeadModel")):
        with pytest.raises(ModelUnsupported) as info:
            load_causal_lm(folder, CPU)
        error = info.value
        assert error.code == "model_unsupported" and error.http_status == 400 and not error.retryable
        assert error.details["architecture"].startswith(architecture)
        assert error.details["missing"] == "no model family entry for this architecture"
        assert error.details["supported"] == sorted(FAMILIES)
        assert architecture in error.message and "qwen3_5" in error.message and str(folder) in error.message
    composite = _unknown_folder(tmp_path / "gemma3-vl", {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"model_type": "gemma3_text"}, "vision_config": {"model_type": "siglip_vision_model"}})
    with pytest.raises(ModelUnsupported, match="vision-language checkpoint of gemma3"):
        family_of(composite)


def test_engines_refuse_what_they_cannot_serve(folders: dict[str, Path]) -> None:
    for case in ("qwen3", "qwen3_moe", "gpt_oss", "phi3", "llama", "qwen3_5", "qwen3_next", "granitemoehybrid", "lfm2"):
        assert require_servable(folders[case], "hf").family.name == TINY[case][0]
    assert require_servable(folders["qwen3_moe"], "vllm").family.name == "qwen3_moe"  # placement unknown
    # on a CPU: qwen3_moe through Kiln's torch experts (vllm_moe_lora_cpu), the other MoE families refused
    assert require_servable(folders["qwen3_moe"], "vllm", cpu=True).family.name == "qwen3_moe"
    for case in ("gpt_oss", "qwen3_next", "granitemoehybrid"):
        with pytest.raises(ModelUnsupported, match="Triton, which the CPU build lacks, and Kiln's CPU experts serve "
                           "qwen3_moe only"):
            require_servable(folders[case], "vllm", cpu=True)
    assert FAMILIES["qwen3_5"].vllm.options == ("--language-model-only",)


@pytest.mark.timeout(300)
def test_gpt_oss_loads_eager_samples_and_trains_one_step(tmp_path: Path) -> None:
    from kiln.core.policy.runtime import PolicyRuntime

    folder = build_family_folder("gpt_oss", tmp_path / "gpt-oss", template="qwen3")
    runtime = PolicyRuntime.load(folder, device="cpu", dtype="float32")
    assert runtime.model.config._attn_implementation == "eager"
    prompt = runtime.encode_prompt([{"role": "user", "content": "Count is 3."}], thinking=False)
    samples = runtime.sample([prompt, prompt], [1, 2], max_new_tokens=6, temperature=1.0, thinking=False)
    assert [len(s.ids) for s in samples] == [len(s.logprobs) for s in samples]
    assert all(0 < len(s.ids) <= 6 for s in samples)
    recomputed = runtime.logprobs_of(prompt, samples[0].ids, temperature=1.0, thinking=False)
    assert max(abs(a - b) for a, b in zip(recomputed, samples[0].logprobs)) < 1e-4

    with runtime.training_lease() as lease:
        peft_model = attach_lora(lease.model, rank=2, alpha=4.0, seed=1, base_adapter_dir=None)
        lease.trained = peft_model
        params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
        for p in params:
            p.requires_grad_(True)
        before = [p.detach().clone() for p in params]
        ids = torch.tensor([prompt + samples[0].ids])
        logits = peft_model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
        torch.optim.SGD(params, lr=0.1).step()
        changed = sum(int(not torch.equal(a, p.detach())) for a, p in zip(before, params))
        assert changed == len(params) // 2  # every LoRA B moved (A's gradient is zero at B = 0)
        save_adapter(peft_model, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    # The runtime samples with the trained adapter (experts' LoRA included): another distribution.
    tuned = runtime.sample([prompt], [1], max_new_tokens=6, temperature=1.0, thinking=False,
                           adapter_dir=tmp_path / "adapter")[0]
    scored = runtime.logprobs_of(prompt, samples[0].ids, temperature=1.0, thinking=False,
                                 adapter_dir=tmp_path / "adapter")
    assert scored != samples[0].logprobs and len(tuned.ids) == len(tuned.logprobs) > 0


@pytest.mark.timeout(60)
def test_a_family_target_that_matches_nothing_fails_instead_of_a_smaller_adapter(folders: dict[str, Path]) -> None:
    model = load_causal_lm(folders["llama"], CPU)
    model.config.model_type = "phi3"  # a model whose modules are not its entry's: no fused qkv/gate_up
    with pytest.raises(ModelUnsupported) as info:
        attach_lora(model, rank=2, alpha=4.0, seed=3, base_adapter_dir=None)
    assert info.value.details["family"] == "phi3"
    assert info.value.details["missing"] == ["gate_up_proj", "qkv_proj"]
    assert info.value.details["adapted"] == ["down_proj", "o_proj"]
