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

_BUILT: Path | None = None


def shared_tiny_model(tmp_path_factory) -> Path:
    """The process-wide tiny model directory (built on first use)."""
    global _BUILT
    if _BUILT is None or not (_BUILT / "config.json").is_file():
        from kiln.policy.tiny import build_tiny_model

        _BUILT = build_tiny_model(Path(tmp_path_factory.mktemp("tiny-model")))
    return _BUILT


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
