"""Test-model builders: tiny random models of every model family, and the hub-layout ones (one module).

Every builder seeds its random init (same seed, same bytes on one machine) and keeps the family's
real layer pattern. Where a product shape exists it is the source: the Qwen3.5 hub builder reads
Qwen3.5-4B's sizes from ``kiln model random``'s shape table (:data:`kiln.core.policy.random_model.SHAPES`),
and ``kiln model random --shape qwen3.5-tiny / gpt-oss-tiny`` are the product's own tiny shapes.

- :data:`TINY` gives per case the transformers config class, the model class and the config values:
  hidden size 64, two to four layers, and the layer kinds the family really mixes (Qwen3.5: three
  Gated DeltaNet layers and one full-attention layer; granite: Mamba2 and attention layers with
  experts and a shared MLP; lfm2: short-convolution and attention layers; gpt-oss: sliding and full
  attention with experts; phi3: fused qkv and gate/up projections). ``qwen3_5`` is the hub's
  vision-language layout; ``qwen3_5_text`` the text-only ``Qwen3_5ForCausalLM``.
- :func:`build_family_folder` writes one as a model folder, with the tokenizer and chat template of
  a template family (:mod:`tests.support.models`) or copied from another model folder.
- :func:`family_model` returns one in memory (sampler tests; :data:`DECODE_FAMILIES` are the
  hybrid and mixture-of-experts cases), :func:`reference_decode` is the brute-force batch-of-one
  decode the tiled sampler is checked against: transformers' own ``DynamicCache`` and the model's
  own attention, one row, one token per forward.
- :func:`build_harmony_model`: the tiny gpt-oss with the harmony tokenizer and template, warmed
  up on the harmony turn format (a random model never reaches the final channel).
- :func:`build_qwen35_hub_model`, :func:`build_qwen3_moe_model`, :func:`build_qwen3_dense_model`:
  models for the vllm engine's tests, with Kiln's Qwen tokenizer (vocabulary 151,936), head size
  128 (vLLM's CPU attention refuses narrower heads) and ``initializer_range`` 0.2. The Qwen3.5 one
  is a checkpoint as the hub ships it (``Qwen3_5ForConditionalGeneration``, weights under
  ``model.language_model.*`` and ``model.visual.*``).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from kiln.core.policy import harmony
from kiln.core.policy.qwen_vocab import QWEN3_VOCAB_SIZE

_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_DENSE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, **_ATTN}
_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
_HYBRID4 = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]

# case -> (family, config class, model class, config values)
TINY: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(_DENSE)),
    "qwen3_5": ("qwen3_5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", {
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, **_ATTN, **_LINEAR,
                        "layer_types": _HYBRID4},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64}}),
    "qwen3_5_text": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, **_ATTN, **_LINEAR,
        "layer_types": _HYBRID4}),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, **_ATTN, **_LINEAR,
        "layer_types": _HYBRID4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32}),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **_DENSE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "gpt_oss": ("gpt_oss", "GptOssConfig", "GptOssForCausalLM", {
        **_DENSE, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(_DENSE)),
    "gemma3": ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_DENSE, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "mistral": ("mistral", "MistralConfig", "MistralForCausalLM", dict(_DENSE)),
    "smollm3": ("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", dict(_DENSE)),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}),
    "olmo2": ("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}),
    "granitemoehybrid": ("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": ["mamba", "mamba", "mamba", "attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
        "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16}),
    "lfm2": ("lfm2", "Lfm2Config", "Lfm2ForCausalLM", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "block_auto_adjust_ff_dim": False}),
}


def tiny_config(case: str, vocab_size: int = 256, **ids: Any) -> Any:
    """The config of ``case`` with ``vocab_size`` (and eos/pad ids) set where the family keeps them."""
    import transformers

    _, config_name, _, values = TINY[case]
    values = {**values}
    if "text_config" in values:
        values["text_config"] = {**values["text_config"], "vocab_size": vocab_size, **ids}
    else:
        values.update(vocab_size=vocab_size, initializer_range=0.2, **ids)
    return getattr(transformers, config_name)(**values)


def _tokenizer_into(out_dir: Path, template: str | None, tokenizer_dir: Path | None) -> tuple[int, dict[str, Any]]:
    """Write the tokenizer (of ``template``, or copied from ``tokenizer_dir``): its size and ids."""
    if template is not None:
        from tests.support.models import family_tokenizer

        tok, found = family_tokenizer(template)
        tok.save_pretrained(str(out_dir))
        return len(tok), {"bos_token_id": None, **found}
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        for path in Path(tokenizer_dir).iterdir():
            if path.is_file() and path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(path, out_dir / path.name)
        tok = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        return len(tok), {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
    return 256, {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def build_family_folder(case: str, out_dir: Path, *, template: str | None = None, tokenizer_dir: Path | None = None,
                        seed: int = 5) -> Path:
    """Write the tiny ``case`` model (float32) into ``out_dir``, with the tokenizer and chat template
    of ``template`` (a template family of :mod:`tests.support.models`: ``qwen3``, ``llama3``,
    ``gemma``, ``harmony``) or of the model folder ``tokenizer_dir`` (the tiny model's), else none."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, ids = _tokenizer_into(out_dir, template, tokenizer_dir)
    config = tiny_config(case, vocab, **ids)
    model_class = getattr(transformers, TINY[case][2])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class._from_config(config, attn_implementation="eager")
    model.to(torch.float32).save_pretrained(str(out_dir))
    return out_dir


# ----------------------------------------------------------------------------- in-memory models
VOCAB = 1024  # the in-memory models' vocabulary (the tiny model's tokenizer size)
DECODE_FAMILIES = ("qwen3_5_text", "qwen3_next", "granitemoehybrid", "lfm2", "qwen3_moe", "gpt_oss")


def family_model(case: str, *, seed: int = 5, overrides: dict[str, Any] | None = None, vocab_size: int = VOCAB,
                 eos: int = 2, pad: int = 0) -> Any:
    """The tiny ``case`` model in memory: eval mode, float32, frozen, with the attention
    implementation Kiln serves it with (``overrides``: config fields set after the table's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.core.policy.families import family_named

    config = tiny_config(case, vocab_size, eos_token_id=eos, pad_token_id=pad, bos_token_id=pad)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attention = family_named(config.model_type).attn_implementation
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model.eval()
    model.requires_grad_(False)
    return model


def reference_decode(model: Any, prompt: list[int], seed: int, max_new_tokens: int, stop_id: int
                     ) -> tuple[list[int], list[float]]:
    """One row decoded alone at temperature 1 through transformers' own ``DynamicCache``: its ids
    and log-probs. The token rule is Kiln's documented one (inverse CDF of the row's seeded
    float64 uniforms, drawn up front), written out here independently of the sampler."""
    import torch
    from transformers import DynamicCache

    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) % (1 << 64))
    uniforms = torch.rand(max_new_tokens, generator=gen, dtype=torch.float64)
    cache = DynamicCache(config=model.config)
    ids: list[int] = []
    lps: list[float] = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        for t in range(max_new_tokens):
            lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            cdf = lp.double().exp().cumsum(dim=-1)
            token = min(int(torch.searchsorted(cdf, uniforms[t] * cdf[-1], right=True)), cdf.shape[-1] - 1)
            ids.append(token)
            lps.append(float(lp[token]))
            if token == stop_id:
                break
            position = torch.tensor([[len(prompt) + t]])
            out = model(input_ids=torch.tensor([[token]]), position_ids=position, cache=cache, use_cache=True)
    return ids, lps


# ------------------------------------------------------------------ hub-layout models (vllm)
_SPECIAL_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
# Qwen3's vision token ids in its tokenizer (the hub's Qwen3.5 ids are those of its larger vocabulary)
_VISION_IDS = {"image_token_id": 151655, "video_token_id": 151656,
               "vision_start_token_id": 151652, "vision_end_token_id": 151653}


# Text-stack sizes of a Qwen3.5 checkpoint for the benchmark, read from the product's one shape
# table (``kiln model random --shape``, kiln/core/policy/random_model.py); its vocabulary of 248,320
# rows is kept, Kiln's Qwen tokenizer fills the first 151,669.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "linear_num_key_heads", "linear_num_value_heads")


def _real_text_sizes(name: str) -> dict[str, Any]:
    from kiln.core.policy.random_model import SHAPES

    text = SHAPES[name].text or {}
    return {**{key: text[key] for key in _SHAPE_KEYS}, "initializer_range": 0.02}


QWEN35_SHAPES: dict[str, dict[str, Any]] = {"qwen3.5-4b": _real_text_sizes("qwen3.5-4b")}


def _mrope_section(head_dim: int) -> list[int]:
    """The multimodal rotary sections of a head of ``head_dim`` with a quarter of it rotated: they
    cover half the rotated dims ([11, 11, 10] for the shipped 256, as vLLM checks)."""
    half = int(head_dim * 0.25) // 2
    third, rest = divmod(half, 3)
    return [third + (1 if i < rest else 0) for i in range(3)]


def qwen35_hub_config(*, hidden_size: int = 256, groups: int = 1, shape: str | None = None) -> Any:
    """The composite ``Qwen3_5Config``: ``groups`` × (3 linear-attention + 1 full-attention) text
    layers of width ``hidden_size`` (or of ``shape``'s sizes, a key of :data:`QWEN35_SHAPES`), and
    a one-block vision tower."""
    from transformers import Qwen3_5Config

    text = {
        **_SPECIAL_IDS, "vocab_size": QWEN3_VOCAB_SIZE, "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size, "num_hidden_layers": 4 * groups,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 8192, "initializer_range": 0.2, "tie_word_embeddings": True,
        **(QWEN35_SHAPES[shape] if shape else {}),
    }
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": _mrope_section(text["head_dim"]), "mrope_interleaved": True}
    vision = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
              "out_hidden_size": text["hidden_size"], "num_position_embeddings": 64, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **_VISION_IDS)


def _save(model: Any, out_dir: Path, tokenizer: Any) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer
    if tok is None:
        from kiln.core.policy.qwen_vocab import build_qwen_tokenizer

        tok = build_qwen_tokenizer()
    tok.save_pretrained(str(out_dir))
    model.generation_config.do_sample = True
    model.generation_config.eos_token_id = _SPECIAL_IDS["eos_token_id"]
    model.generation_config.pad_token_id = _SPECIAL_IDS["pad_token_id"]
    model.save_pretrained(str(out_dir))
    return out_dir


def build_qwen35_hub_model(out_dir: Path, *, hidden_size: int = 256, groups: int = 1, seed: int = 0,
                           tokenizer: Any = None, shape: str | None = None, dtype: str = "float32") -> Path:
    """A random ``Qwen3_5ForConditionalGeneration`` checkpoint in the hub layout, in ``dtype``."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    from kiln.core.policy.device import TORCH_DTYPES

    config = qwen35_hub_config(hidden_size=hidden_size, groups=groups, shape=shape)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(TORCH_DTYPES[dtype])
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3_5ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    return _save(model, Path(out_dir), tokenizer)


def build_qwen3_dense_model(out_dir: Path, *, hidden_size: int = 256, layers: int = 2, seed: int = 0,
                            tokenizer: Any = None) -> Path:
    """A random ``Qwen3ForCausalLM`` of the same small sizes as the MoE model, float32."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **_SPECIAL_IDS, vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        max_position_embeddings=8192, initializer_range=0.2, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return _save(model, Path(out_dir), tokenizer)


def build_qwen3_moe_model(out_dir: Path, *, hidden_size: int = 256, layers: int = 2, experts: int = 4,
                          seed: int = 0, tokenizer: Any = None) -> Path:
    """A random ``Qwen3MoeForCausalLM``: ``experts`` experts per layer, 2 active, float32."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **_SPECIAL_IDS, vocab_size=QWEN3_VOCAB_SIZE, hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_experts=experts,
        num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=8192,
        initializer_range=0.2, tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    return _save(model, Path(out_dir), tokenizer)


# ------------------------------------------------------------- a tiny gpt-oss that speaks harmony
# A random-weight model never closes its analysis message, so its rollouts never reach the final
# channel. build_harmony_model writes the tiny gpt_oss case with the in-process harmony tokenizer
# and Kiln's harmony template, then teaches it the turn format on synthetic counter-game
# transcripts (the tiny demo model's generator, kiln.core.policy.tiny._transcript) encoded exactly
# as the runtime appends them: the prompt opens the analysis channel (thinking) or the final one,
# the policy writes REASONING<|end|><|start|>assistant<|channel|>final<|message|>{"amount": N}
# <|return|>, the next turn is <|start|>user<|message|>…<|end|> + the next prompt. The loss covers
# what the policy writes.
HARMONY_STEPS = 120  # format warm-up steps of build_harmony_model
_ROWS = 8
_MAX_TOKENS = 384


def _harmony_encode(tok: Any, messages: list[dict], thinking: bool) -> tuple[list[int], list[float]]:
    """Ids and loss weights (1 on the policy's tokens) of one transcript, as the runtime builds them."""
    ids: list[int] = []
    weights: list[float] = []

    def add(text: str, weight: float) -> None:
        piece = tok.encode(text, add_special_tokens=False)
        ids.extend(piece)
        weights.extend([weight] * len(piece))

    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    head = tok.apply_chat_template(messages[: first_user + 1], tokenize=False, add_generation_prompt=True)
    add(head + harmony.channel_header(thinking), 0.0)
    for message in messages[first_user + 1 :]:
        if message["role"] == "assistant":
            reasoning = message["reasoning_content"] + harmony.END + harmony.START + "assistant" + harmony.FINAL_HEADER
            add((reasoning if thinking else "") + message["content"] + harmony.RETURN, 1.0)
        else:
            add(harmony.START + "user" + harmony.MESSAGE + message["content"] + harmony.END + harmony.START + "assistant", 0.0)
            add(harmony.channel_header(thinking), 0.0)
    return ids, weights


def _harmony_warm_up(model: Any, tok: Any, rng: random.Random, steps: int) -> None:
    import torch

    from kiln.core.policy.tiny import _transcript

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    for step in range(steps):
        rows = []
        for _ in range(_ROWS):
            messages, thinking = _transcript(rng, rng.choice((1, 1, 2, 3)))
            ids, weights = _harmony_encode(tok, messages, thinking)
            rows.append((ids[:_MAX_TOKENS], weights[:_MAX_TOKENS]))
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.float32)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, weights) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = torch.tensor(weights)
            attn[i, : len(ids)] = 1
        logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none"
        ).view(len(rows), -1)
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 * min(1.0, (step + 1) / 10) * (1.0 - 0.8 * step / steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


def build_harmony_model(out_dir: Path, *, steps: int = HARMONY_STEPS, seed: int = 5) -> Path:
    """The tiny gpt-oss model with the harmony tokenizer, warmed up on the harmony turn format."""
    import torch
    from transformers import AutoTokenizer, GptOssForCausalLM

    folder = build_family_folder("gpt_oss", Path(out_dir), template="harmony", seed=seed)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = GptOssForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            _harmony_warm_up(model, tok, random.Random(seed), steps)
    finally:
        torch.set_num_threads(threads)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids([harmony.RETURN, harmony.CALL])
    model.save_pretrained(str(folder))
    (folder / "warm_up.json").write_text(json.dumps({"steps": steps, "seed": seed}))
    return folder



__all__ = [
    "DECODE_FAMILIES",
    "HARMONY_STEPS",
    "QWEN35_SHAPES",
    "TINY",
    "VOCAB",
    "build_family_folder",
    "build_harmony_model",
    "build_qwen35_hub_model",
    "build_qwen3_dense_model",
    "build_qwen3_moe_model",
    "family_model",
    "qwen35_hub_config",
    "reference_decode",
    "tiny_config",
]
