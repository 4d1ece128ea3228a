"""A tiny gpt-oss model that speaks harmony: random init, then a short format warm-up.

A random-weight model never closes its analysis message, so a rollout of one never reaches the
final channel. :func:`build_harmony_model` writes the tiny gpt-oss case (sliding + full attention
with sinks, routed experts; :mod:`tests.support.family_models`) with the in-process harmony
tokenizer and Kiln's harmony template, then teaches it the turn format on synthetic counter-game
transcripts (the tiny demo model's generator, :func:`kiln.core.policy.tiny._transcript`), encoded
exactly as the runtime appends them: the prompt opens the analysis channel (thinking) or the
final one, the policy writes ``REASONING<|end|><|start|>assistant<|channel|>final<|message|>``
+ ``{"amount": N}<|return|>``, and the next turn is ``<|start|>user<|message|>…<|end|>`` + the
next prompt. The loss covers what the policy writes. Same seed, same bytes on one machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from kiln.core.policy import harmony as h

STEPS = 120
ROWS = 8
MAX_TOKENS = 384


def _encode(tok: Any, messages: list[dict], thinking: bool) -> tuple[list[int], list[float]]:
    """Ids and loss weights (1 on the policy's tokens) of one transcript, as the runtime builds them."""
    ids: list[int] = []
    weights: list[float] = []

    def add(text: str, weight: float) -> None:
        piece = tok.encode(text, add_special_tokens=False)
        ids.extend(piece)
        weights.extend([weight] * len(piece))

    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    head = tok.apply_chat_template(messages[: first_user + 1], tokenize=False, add_generation_prompt=True)
    add(head + h.channel_header(thinking), 0.0)
    for message in messages[first_user + 1 :]:
        if message["role"] == "assistant":
            reasoning = message["reasoning_content"] + h.END + h.START + "assistant" + h.FINAL_HEADER
            add((reasoning if thinking else "") + message["content"] + h.RETURN, 1.0)
        else:
            add(h.START + "user" + h.MESSAGE + message["content"] + h.END + h.START + "assistant", 0.0)
            add(h.channel_header(thinking), 0.0)
    return ids, weights


def _warm_up(model: Any, tok: Any, rng: random.Random, steps: int) -> None:
    import torch

    from kiln.core.policy.tiny import _transcript

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model.train()
    for step in range(steps):
        rows = []
        for _ in range(ROWS):
            messages, thinking = _transcript(rng, rng.choice((1, 1, 2, 3)))
            ids, weights = _encode(tok, messages, thinking)
            rows.append((ids[:MAX_TOKENS], weights[:MAX_TOKENS]))
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


def build_harmony_model(out_dir: Path, *, steps: int = STEPS, seed: int = 5) -> Path:
    """The tiny gpt-oss model with the harmony tokenizer, warmed up on the harmony turn format."""
    import torch
    from transformers import AutoTokenizer, GptOssForCausalLM

    from tests.support.family_models import build_family_folder

    folder = build_family_folder("gpt_oss", Path(out_dir), template="harmony", seed=seed)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = GptOssForCausalLM.from_pretrained(str(folder), attn_implementation="eager", dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            _warm_up(model, tok, random.Random(seed), steps)
    finally:
        torch.set_num_threads(threads)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids([h.RETURN, h.CALL])
    model.save_pretrained(str(folder))
    (folder / "warm_up.json").write_text(json.dumps({"steps": steps, "seed": seed}))
    return folder


__all__ = ["build_harmony_model"]
