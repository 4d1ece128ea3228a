"""Model families: what differs between the transformers architectures Kiln serves (pure: no torch).

One table, :data:`FAMILIES`, of frozen :class:`Family` entries keyed by transformers ``model_type``
says per family which attention implementation loads, which modules and parameters LoRA adapts,
which chat-template family the hub's checkpoints use, whether the hf engine's decode tile keeps a
row's bytes independent of its tile-mates (``batch_invariant``), and whether and how each rollout
engine serves it (:class:`Serving`). :func:`family_of` resolves a model folder's ``config.json``
(no weights read) and :func:`require_servable` refuses an architecture the table does not know,
or one an engine cannot serve, with ``model_unsupported`` naming the architecture, what is missing
and the supported list. Adding a family is one entry (docs/models.md "Adding a family").

Vision-language checkpoints (``composite``: a ``text_config`` beside a ``vision_config``, as the
hub ships Qwen3.5) are served as text: transformers' ``AutoModelForCausalLM`` maps the composite
``model_type`` to its text-only causal LM and loads only the language model's weights, so no vision
tower is ever in memory. :func:`load_identity_fields` records that choice in the behaviour identity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kiln.core.errors import ModelUnsupported

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")
# Experts stored as 3-D parameters (one tensor for all experts): peft's ``target_parameters``.
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")

# Kiln's torch experts for the CPU build (kiln/core/policy/vllm_moe_lora_cpu.py) compute qwen3_moe's;
# the other MoE families' are not measured there.
_MOE_LORA_CPU = (
    "vLLM's LoRA kernel for MoE layers needs Triton, which the CPU build lacks, and Kiln's CPU "
    "experts serve qwen3_moe only"
)


@dataclass(frozen=True)
class Serving:
    """Whether an engine serves a family. ``missing``: why it cannot at all (None = served);
    ``missing_on_cpu``: why it cannot on a CPU placement; ``options``: engine arguments the family
    needs (the vllm engine reads them, e.g. ``--language-model-only`` for a composite checkpoint)."""

    missing: str | None = None
    missing_on_cpu: str | None = None
    options: tuple[str, ...] = ()

    def why_not(self, *, cpu: bool | None) -> str | None:
        """The reason this engine cannot serve the family (``cpu``: None = placement unknown, only
        the placement-independent reason counts), else None."""
        if self.missing:
            return self.missing
        return self.missing_on_cpu if cpu else None


SERVED = Serving()


@dataclass(frozen=True)
class Family:
    """What Kiln needs to know about one transformers architecture."""

    name: str  # the table key: the config's model_type (a composite's top-level one)
    architectures: tuple[str, ...]  # the transformers classes its checkpoints name
    layers: tuple[str, ...]  # layer kinds: attention, linear_attention, mamba, conv, moe
    lora_modules: tuple[str, ...]  # peft target_modules: nn.Linear leaf names
    template: str  # chat-template family: chatml-think, llama3, gemma, mistral, phi3, harmony, ...
    lora_parameters: tuple[str, ...] = ()  # peft target_parameters: 3-D expert weights
    # Targets a checkpoint of the family may lack (the experts of a granite config without
    # them); every other target must match in every checkpoint.
    lora_optional: tuple[str, ...] = ()
    attn_implementation: str = "sdpa"
    batch_invariant: bool = True  # rows' bytes independent of tile-mates in the hf engine's tile
    aliases: tuple[str, ...] = ()  # other model_types of the family (a text-only config's)
    # The text-only causal LM that loads a vision-language checkpoint's language model alone
    # (None: a composite checkpoint of this family is refused, never loaded with its vision tower).
    composite_text_class: str | None = None
    hf: Serving = SERVED
    vllm: Serving = SERVED
    notes: str = ""

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """Every name LoRA adapts: modules, then parameters."""
        return self.lora_modules + self.lora_parameters


_ENTRIES = (
    Family("qwen3", ("Qwen3ForCausalLM",), ("attention",), ATTENTION + GATED_MLP, "chatml-think"),
    Family(
        "qwen3_5",
        ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
        ("linear_attention", "attention"),
        ATTENTION + GATED_MLP + ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
        "chatml-think",
        aliases=("qwen3_5_text",),
        composite_text_class="Qwen3_5ForCausalLM",
        vllm=Serving(options=("--language-model-only",)),
        notes="the hub ships a vision-language checkpoint: Kiln loads its language model only",
    ),
    Family(
        "qwen3_next",
        ("Qwen3NextForCausalLM",),
        ("linear_attention", "attention", "moe"),
        ATTENTION + ("in_proj_qkvz", "in_proj_ba", "out_proj"),
        "chatml-think",
        lora_parameters=EXPERT_PARAMETERS,
        vllm=Serving(missing_on_cpu=_MOE_LORA_CPU),
        notes="the shared expert is not adapted: peft 0.21 rewrites gate/up/down_proj targets of this "
        "family into the routed experts' fused parameters",
    ),
    Family(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        ("attention", "moe"),
        ATTENTION,
        "chatml-think",
        lora_parameters=EXPERT_PARAMETERS,
        notes="experts through target_parameters (peft would rewrite gate/up/down_proj into them); "
        "on vLLM's CPU build through Kiln's torch experts",
    ),
    Family(
        "gpt_oss",
        ("GptOssForCausalLM",),
        ("attention", "moe"),
        ATTENTION,
        "harmony",
        lora_parameters=EXPERT_PARAMETERS,
        attn_implementation="eager",
        vllm=Serving(missing_on_cpu=_MOE_LORA_CPU),
        notes="attention sinks: sdpa is refused by transformers, eager loads",
    ),
    Family("llama", ("LlamaForCausalLM",), ("attention",), ATTENTION + GATED_MLP, "llama3"),
    Family("gemma3", ("Gemma3ForCausalLM",), ("attention",), ATTENTION + GATED_MLP, "gemma", aliases=("gemma3_text",)),
    Family("mistral", ("MistralForCausalLM",), ("attention",), ATTENTION + GATED_MLP, "mistral"),
    Family("smollm3", ("SmolLM3ForCausalLM",), ("attention",), ATTENTION + GATED_MLP, "chatml-think"),
    Family(
        "phi3",
        ("Phi3ForCausalLM",),
        ("attention",),
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        "phi3",
        notes="fused qkv_proj and gate_up_proj",
    ),
    Family("olmo2", ("Olmo2ForCausalLM",), ("attention",), ATTENTION + GATED_MLP, "tulu"),
    Family(
        "granitemoehybrid",
        ("GraniteMoeHybridForCausalLM",),
        ("mamba", "attention", "moe"),
        ATTENTION + ("in_proj", "out_proj", "input_linear", "output_linear"),
        "granite",
        lora_parameters=EXPERT_PARAMETERS,
        lora_optional=EXPERT_PARAMETERS,
        vllm=Serving(missing_on_cpu=_MOE_LORA_CPU),
        notes="input_linear/output_linear are the shared MLP's; experts where the config has them",
    ),
    Family(
        "lfm2",
        ("Lfm2ForCausalLM",),
        ("conv", "attention"),
        ("q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3"),
        "chatml",
        notes="out_proj is both the attention output and the conv block's; w1/w3/w2 the MLP",
    ),
)

FAMILIES: dict[str, Family] = {entry.name: entry for entry in _ENTRIES}
_BY_MODEL_TYPE: dict[str, Family] = {
    model_type: entry for entry in _ENTRIES for model_type in (entry.name, *entry.aliases)
}


@dataclass(frozen=True)
class ModelShape:
    """What ``config.json`` says about a model folder: its family, and whether it is composite."""

    family: Family
    model_type: str
    architecture: str
    composite: bool = False  # a vision-language checkpoint, served as its language model


def family_named(model_type: str) -> Family:
    """The family of a loaded model's ``config.model_type`` (``model_unsupported`` when unknown)."""
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise _unsupported(
            "the loaded model",
            f"model_type {model_type or 'missing'}",
            "no model family entry for this architecture",
            {"model_type": model_type},
        )
    return family


def supported_names() -> list[str]:
    return sorted(FAMILIES)


def read_config(model_dir: Path) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict (``model_unsupported`` when it is not JSON)."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelUnsupported(
            f"cannot read the model config {path}: {exc}",
            hint="point at a folder saved with transformers' save_pretrained",
            details={"path": str(path), "missing": "config.json"},
        ) from exc
    if not isinstance(data, dict):
        raise ModelUnsupported(f"the model config {path} is not a JSON object", details={"path": str(path)})
    return data


def _unsupported(
    where: str,
    architecture: str,
    missing: str,
    details: dict[str, Any],
    *,
    engine: str | None = None,
    cpu: bool | None = None,
) -> ModelUnsupported:
    """The refusal; ``supported`` lists the table's families, or those ``engine`` serves."""
    if engine is None:
        supported, label = supported_names(), "supported families"
    else:
        supported = [name for name in supported_names() if _serving(FAMILIES[name], engine).why_not(cpu=cpu) is None]
        label = f"families the {engine} engine serves"
    return ModelUnsupported(
        f"the model at {where} is {architecture}, which Kiln cannot serve: {missing}; {label}: {', '.join(supported)}",
        hint="use a model of a supported family (docs/models.md lists them and how to add one)",
        details={"architecture": architecture, "missing": missing, "supported": supported, **details},
    )


def shape_of(config: Mapping[str, Any], *, where: str = "the model folder") -> ModelShape:
    """The :class:`ModelShape` of a parsed ``config.json`` (``model_unsupported`` when the table
    does not know its ``model_type``)."""
    model_type = str(config.get("model_type") or "")
    architectures = config.get("architectures") or []
    architecture = str(architectures[0]) if architectures else (model_type or "an unnamed architecture")
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise _unsupported(
            where,
            f"{architecture} (model_type {model_type or 'missing'!s})",
            "no model family entry for this architecture",
            {"model_type": model_type, "path": where},
        )
    composite = isinstance(config.get("text_config"), Mapping) and isinstance(config.get("vision_config"), Mapping)
    if composite and family.composite_text_class is None:
        raise _unsupported(
            where,
            architecture,
            f"a vision-language checkpoint of {family.name}, whose language model Kiln "
            "cannot load alone yet (Kiln never loads a vision tower)",
            {"model_type": model_type, "family": family.name, "path": where},
        )
    return ModelShape(family=family, model_type=model_type, architecture=architecture, composite=composite)


def family_of(model_dir: Path) -> ModelShape:
    """The :class:`ModelShape` of the model folder ``model_dir`` (reads only its config.json)."""
    return shape_of(read_config(model_dir), where=str(model_dir))


def require_servable(model_dir: Path, engine: str, *, cpu: bool | None = None) -> ModelShape:
    """The folder's shape, or ``model_unsupported`` when the table does not know its architecture
    or ``engine`` cannot serve its family (on a CPU placement when ``cpu``; None = unknown yet)."""
    shape = family_of(model_dir)
    missing = _serving(shape.family, engine).why_not(cpu=cpu)
    if missing:
        raise _unsupported(
            str(model_dir),
            shape.architecture,
            f"the {engine} engine cannot serve {shape.family.name}: {missing}",
            {"model_type": shape.model_type, "family": shape.family.name, "engine": engine, "path": str(model_dir)},
            engine=engine,
            cpu=cpu,
        )
    return shape


def _serving(family: Family, engine: str) -> Serving:
    return family.hf if engine == "hf" else family.vllm


def load_identity_fields(model_dir: Path) -> dict[str, Any]:
    """What a behaviour identity's ``runtime`` block adds for the folder's checkpoint: for a
    composite (vision-language) checkpoint ``{"model_part": "language_model"}`` (Kiln loads its
    language model only); nothing otherwise, so identities of text checkpoints keep their digests.
    An identity without the field loaded the whole checkpoint
    (:func:`kiln.core.policy.identity.model_part_of`)."""
    try:
        shape = family_of(model_dir)
    except ModelUnsupported:
        return {}
    return {"model_part": "language_model"} if shape.composite else {}


__all__ = [
    "EXPERT_PARAMETERS",
    "FAMILIES",
    "Family",
    "ModelShape",
    "Serving",
    "family_named",
    "family_of",
    "load_identity_fields",
    "read_config",
    "require_servable",
    "shape_of",
    "supported_names",
]
