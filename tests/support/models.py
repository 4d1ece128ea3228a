"""Test helpers: build the tiny model once per process and share it between test modules.

Usage in a test module::

    @pytest.fixture(scope="session")
    def tiny_model_dir(tmp_path_factory):
        return shared_tiny_model(tmp_path_factory)

The first call builds into a fresh ``tmp_path_factory`` directory; later calls (from any module)
return the same path. Treat the directory as read-only: copy it before modifying files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_BUILT: Path | None = None


def shared_tiny_model(tmp_path_factory) -> Path:
    """The process-wide tiny model directory (built on first use)."""
    global _BUILT
    if _BUILT is None or not (_BUILT / "config.json").is_file():
        from kiln.core.policy.tiny import build_tiny_model

        _BUILT = build_tiny_model(Path(tmp_path_factory.mktemp("tiny-model")))
    return _BUILT


def tiny_model_digests(out_dir: str) -> dict[str, Any]:
    """Build the tiny model again into ``out_dir`` (``tests.support.background``): its files'
    digests and its content digest, to compare with the session's build."""
    from kiln.core.policy.identity import file_sha256, model_content_sha256
    from kiln.core.policy.tiny import build_tiny_model

    built = build_tiny_model(Path(out_dir))
    return {"files": {p.name: file_sha256(p) for p in sorted(built.iterdir()) if p.is_file()},
            "content": model_content_sha256(built)}


def make_lora_adapter(model_dir: Path, out_dir: Path, *, seed: int = 0, scale: float = 0.5) -> Path:
    """Save a LoRA adapter with non-zero random weights for ``model_dir`` into ``out_dir``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft_model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


_FAMILIES: dict[str, Path] = {}


def family_corpus(family: str) -> list[str]:
    """Renders of varied conversations with ``family``'s template (the BPE training corpus)."""
    import random

    from jinja2 import Environment

    from kiln.core.policy.templates import FAMILIES

    spec = FAMILIES[family]
    env = Environment()
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    template = env.from_string(spec.template)
    rng = random.Random(7)
    corpus = []
    for _ in range(200):
        messages = [{"role": "system", "content": "You are an agent acting in an environment."}]
        for turn in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": f"Count is {rng.randint(0, 12)}. Reply with JSON."})
            messages.append({"role": "assistant", "content": '{"amount": %d}' % rng.randint(1, 5)})
        corpus.append(template.render(messages=messages, bos_token=spec.bos or "", add_generation_prompt=False))
    return corpus


def family_tokenizer(family: str) -> tuple[Any, dict[str, int]]:
    """The in-process BPE tokenizer of template family ``family`` (its special tokens and chat
    template) and its ``eos_token_id`` / ``pad_token_id``."""
    from kiln.core.policy.templates import FAMILIES
    from kiln.core.policy.tokenizer import train_bpe, wrap_fast

    spec = FAMILIES[family]
    raw = train_bpe(family_corpus(family), 600, spec.special_tokens, spec.added_tokens)
    tok = wrap_fast(raw, chat_template=spec.template, eos=spec.eos, pad=spec.pad, bos=spec.bos)
    return tok, {"eos_token_id": tok.convert_tokens_to_ids(spec.eos), "pad_token_id": tok.convert_tokens_to_ids(spec.pad)}


def build_family_model(family: str, out_dir: Path) -> Path:
    """A tiny random model whose tokenizer and chat template are those of ``family``
    (``qwen3``, ``llama3``, ``gemma``): in-process BPE with the family's special tokens,
    a 2-layer Llama (llama3) or Qwen3 (others) with initializer_range 0.2."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3ForCausalLM

    from kiln.core.policy.tiny import tiny_qwen3_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, ids = family_tokenizer(family)
    tok.save_pretrained(str(out_dir))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        if family == "llama3":
            config = LlamaConfig(
                vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                tie_word_embeddings=True, **ids,
            )
            model = LlamaForCausalLM(config)
        else:
            model = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=len(tok), **ids))
    model.save_pretrained(str(out_dir))
    return out_dir


def shared_family_model(family: str, tmp_path_factory) -> Path:
    """The process-wide tiny model of a template family (built on first use)."""
    if family not in _FAMILIES:
        _FAMILIES[family] = build_family_model(family, Path(tmp_path_factory.mktemp(f"family-{family}")))
    return _FAMILIES[family]


_REAL_VOCAB: dict[str, Path] = {}


def shared_random_qwen(tmp_path_factory, *, shape: str = "qwen3-0.6b", layers: int = 2) -> Path:
    """A random-init model of a real Qwen3 shape with the real vocabulary (built on first use)."""
    key = f"{shape}-{layers}"
    if key not in _REAL_VOCAB:
        from kiln.core.policy.random_model import build_random_model

        folder = Path(tmp_path_factory.mktemp(f"random-{key}"))
        _REAL_VOCAB[key] = build_random_model(folder, shape=shape, layers=layers, dtype="bfloat16")
    return _REAL_VOCAB[key]
