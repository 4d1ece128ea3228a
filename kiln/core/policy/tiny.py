"""Build the deterministic tiny Qwen3-architecture demo/test model (``kiln model tiny DIR``).

What gets written into ``out_dir`` (same bytes every run on the same machine kind):

* a byte-level BPE tokenizer trained in-process (:mod:`kiln.core.policy.tokenizer`, ~1k vocabulary)
  with Kiln's ChatML template supporting ``<think>`` (:mod:`kiln.core.policy.chat_template`);
* a ``Qwen3ForCausalLM`` with hidden size 64, 2 layers, 4 heads, 2 KV heads, intermediate size 128,
  tied embeddings, ``initializer_range`` 0.2, float32 (~0.6 MB of weights).

**Format warm-up.** A randomly initialised model never writes valid JSON, so an RL run on it could
learn nothing. After initialisation the model gets a short deterministic supervised warm-up (fixed
seed, one CPU thread, 130 AdamW steps of ~1.5k tokens, about 5-6 s) on synthetic ChatML
transcripts: varied generic system and user texts (state descriptions with numbers, requests for a
JSON reply; not only the counter's exact wording), 1 to 12 turns (one turn count per batch, so
later turns of long episodes keep the format); thinking on (the assistant turn continues the
template's ``<think>\\n`` generation prompt with an empty or short reasoning, ``</think>\\n\\n``,
then ``{"amount": N}``) or off (the JSON directly), always closed by ``<|im_end|>``. ``N`` is
uniform over 1..5 and independent of the text, so the warmed-up policy emits the action format
reliably (>90 % parseable at temperature 1) while its choice of amount stays roughly uniform:
there is something left for RL to learn (small amounts score best in the counter environment).
The loss covers the assistant-written tokens (weight 1) and the system and user/observation text
(weight ``CONTEXT_WEIGHT``), so the model also predicts observations: ECHO (which trains on them)
starts from a sensible cross-entropy instead of one worse than uniform. This is a demo/test model,
not a language model.
"""

from __future__ import annotations

from typing import Any

import json
import random
from pathlib import Path

from kiln.core.policy.random_model import TINY_WIDTH
from kiln.core.policy.tiny_formats import GUESS, WarmupFormat
from kiln.core.policy.chat_template import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    THINK_CLOSE,
    THINK_OPEN,
    render,
)

SEED = 20240611
VOCAB_SIZE = 1024
WARMUP_STEPS = 130
WARMUP_BATCH = 16
WARMUP_LR = 1e-2
MAX_WARMUP_TOKENS = 768
# Loss weight of system/user (observation) text in the warm-up: the model then predicts
# observations (ECHO's targets) about as well as it writes actions, instead of worse than uniform.
CONTEXT_WEIGHT = 0.5
TURNS = (1, 1, 2, 3, 4, 6, 8, 12)

_SYSTEMS = [
    "You are an agent acting in an environment.",
    "You control a game. Reply with one JSON action.",
    "Act in the environment. Answer only with a JSON object.",
    "You are a helpful assistant that plays a simple counting game.",
    "Choose the next action.",
    "You are a policy. Each turn, output an action as JSON.",
    "Follow the instructions of the environment.",
    "Be brief.",
]
_REQUESTS = [
    'Reply with {"amount": N} where N is 1-5.',
    'Answer with {"amount": N}, N between 1 and 5.',
    "Reply with a JSON object with an integer amount from 1 to 5.",
    "What amount do you add?",
    "Choose an amount (1-5) and reply in JSON.",
    "Your action?",
    "",
]
_STATES = [
    "Count is {a}. Target is {b}.",
    "The count is {a} and the target is {b}.",
    "State: count={a}, target={b}.",
    "Current value {a}, goal {b}.",
    "You are at {a}. Reach {b} without going over.",
    "Step {a} of {b}.",
    "Score {a}. Limit {b}.",
    "Observation: x = {a}, y = {b}.",
    "A new episode starts. Count is {a}.",
    "Welcome! The number is {a}.",
]
_REASONING = [
    "",
    "",
    "",
    "Small steps are safer.",
    "I will add an amount.",
    "Let me pick a number.",
    "The target is not reached yet.",
    "OK.",
    "Count up.",
    "I add some.",
]
_FILLER = [
    "The quick brown fox jumps over the lazy dog.",
    "Environment servers return observations and rewards.",
    "Reply with a JSON object. The action is applied and the next observation is returned.",
    "Reinforcement learning trains a policy from rewards.",
    "A small language model learns to follow a format before it learns to act well.",
    "Each episode starts with a reset and ends when the environment reports done.",
    "The agent reads the observation, thinks about the state, and chooses an action.",
    "Group relative policy optimization compares candidates sampled from the same prompt.",
    "Rewards are numbers; higher is better. Overshooting the target ends the game.",
    "Temporal workflows are durable: a worker can crash and the run resumes from history.",
    "Adapters are saved as safetensors files together with their configuration.",
    "Tokens are kept as identifiers from end to end, so masks never drift.",
    "Please answer the question in one short sentence, then stop.",
    "Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 42 and 100 appear often.",
    "The weather today is sunny with a light breeze from the north west.",
    "Python, JSON, HTTP and WebSocket are the protocols and languages used here.",
    "Errors carry a stable code, a message and an optional hint explaining the fix.",
    "Training runs on one machine or many; storage holds checkpoints and receipts.",
    "What is the next action? Think step by step, then reply with the answer only.",
    "Observations describe the world; actions change it; rewards score the change.",
    "The count increases by the chosen amount each turn until the target is reached.",
    "Evaluation uses fixed seeds so that two policies see exactly the same episodes.",
    "If the reply cannot be parsed, the harness records an invalid model action.",
    "Large models need accelerators, while the tiny model runs on a laptop CPU.",
    "Deterministic builds produce the same bytes every time they run.",
]


def _kiln_system_prompt(rng: random.Random) -> str:
    """A system prompt exactly as Kiln's collector writes it, for a counter-like environment."""
    from kiln.core.rollout.prompts import system_prompt

    top = rng.randint(3, 9)
    schema = {
        "additionalProperties": False,
        "properties": {
            "amount": {
                "description": rng.choice(["How much to add to the count (1-5)", "Amount to add", "Step size"]),
                "maximum": top,
                "minimum": 1,
                "title": "Amount",
                "type": "integer",
            }
        },
        "required": ["amount"],
        "title": rng.choice(["CounterAction", "StepAction", "Action"]),
        "type": "object",
    }
    metadata = {
        "name": rng.choice(["counter", "steps", "count-up", "adder"]),
        "description": rng.choice(
            [
                "Count up to the target without going over; small steps score more.",
                "Add numbers until the goal is reached.",
                "A counting game.",
            ]
        ),
    }
    return system_prompt(metadata, schema)


def _user_text(rng: random.Random) -> str:
    state = rng.choice(_STATES).format(a=rng.randint(0, 15), b=rng.randint(1, 20))
    request = rng.choice(_REQUESTS)
    return (state + " " + request).strip() if rng.random() < 0.9 else request or state


def _counter_user(rng: random.Random, turn: int, previous: dict[str, Any] | None) -> str:
    return _user_text(rng)


COUNTER = WarmupFormat(
    name="counter",
    kiln_system=_kiln_system_prompt,
    systems=_SYSTEMS,
    turns=TURNS,
    user=_counter_user,
    action=lambda rng: {"amount": rng.randint(1, 5)},
    reasoning=_REASONING,
    extra_corpus=list(_REQUESTS),
    steps=WARMUP_STEPS,
)
WARMUPS = {fmt.name: fmt for fmt in (COUNTER, GUESS)}


def _transcript(rng: random.Random, turns: int | None = None, fmt: WarmupFormat = COUNTER) -> tuple[list[dict], bool]:
    """One synthetic conversation (messages, thinking) of ``fmt``'s game, ending with an assistant turn."""
    thinking = rng.random() < 0.7
    messages: list[dict] = []
    roll = rng.random()
    if roll < 0.5:
        messages.append({"role": "system", "content": fmt.kiln_system(rng)})
    elif roll < 0.9:
        messages.append({"role": "system", "content": rng.choice(list(fmt.systems))})
    turns = turns or rng.choice(list(fmt.turns))
    previous: dict[str, Any] | None = None
    for turn in range(turns):
        messages.append({"role": "user", "content": fmt.user(rng, turn, previous)})
        reasoning = rng.choice(list(fmt.reasoning))
        previous = fmt.action(rng)
        messages.append({"role": "assistant", "reasoning_content": reasoning, "content": json.dumps(previous)})
    return messages, thinking


def _tokenizer_corpus(rng: random.Random, fmt: WarmupFormat = COUNTER) -> list[str]:
    corpus = list(_FILLER) * 3 + list(fmt.systems) + list(fmt.extra_corpus) + list(fmt.reasoning)
    for _ in range(400):
        messages, thinking = _transcript(rng, fmt=fmt)
        corpus.append(render(messages, thinking=thinking, add_generation_prompt=False))
    return corpus


def _encode_transcript(tok, messages: list[dict], thinking: bool) -> tuple[list[int], list[float]]:
    """Token ids and loss weights: 1 on what the assistant writes, ``CONTEXT_WEIGHT`` on system and
    user (observation) text, 0 on template markup. Pieces are encoded separately, as the runtime
    encodes an observation turn."""
    ids: list[int] = []
    mask: list[float] = []

    def add(text: str, train: bool | float) -> None:
        piece = tok.encode(text, add_special_tokens=False)
        ids.extend(piece)
        mask.extend([float(train)] * len(piece))

    for message in messages:
        if message["role"] == "assistant":
            add(IM_START + "assistant\n" + (THINK_OPEN + "\n" if thinking else ""), False)
            written = message["content"] + IM_END
            if thinking:
                written = message["reasoning_content"] + THINK_CLOSE + "\n\n" + written
            add(written, True)
            add("\n", False)
        else:
            add(IM_START + message["role"] + "\n", False)
            add(message["content"], CONTEXT_WEIGHT)
            add(IM_END + "\n", False)
    return ids, mask


def _warm_up(model, tok, rng: random.Random, fmt: WarmupFormat = COUNTER) -> None:
    import torch

    pad = tok.convert_tokens_to_ids(ENDOFTEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    model.train()
    for step in range(fmt.steps):
        # One turn count per batch (little padding); fewer rows for longer transcripts so every
        # step costs about the same number of tokens.
        turns = rng.choice(list(fmt.turns))
        rows = []
        for _ in range(max(2, (2 * WARMUP_BATCH) // (turns + 1))):
            ids, mask = _encode_transcript(tok, *_transcript(rng, turns, fmt))
            rows.append((ids[:MAX_WARMUP_TOKENS], mask[:MAX_WARMUP_TOKENS]))
        width = max(len(r[0]) for r in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, mask) in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            loss_mask[i, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
            attn[i, : len(ids)] = 1
        logits = model(input_ids=input_ids, attention_mask=attn).logits[:, :-1]
        targets = input_ids[:, 1:]
        weights = loss_mask[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        ).view_as(weights)
        loss = (nll * weights).sum() / weights.sum()
        lr_scale = min(1.0, (step + 1) / 20) * (1.0 - 0.8 * step / fmt.steps)
        for group in optimizer.param_groups:
            group["lr"] = WARMUP_LR * lr_scale
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


def tiny_qwen3_config(*, vocab_size: int, **overrides: Any) -> Any:
    """The tiny Qwen3 shape (hidden 64, 2 layers, 4 heads, 2 KV heads, tied, init 0.2)."""
    from transformers import Qwen3Config

    values: dict[str, Any] = {
        "vocab_size": vocab_size,
        **TINY_WIDTH,
        "num_hidden_layers": 2,
        "initializer_range": 0.2,
        "tie_word_embeddings": True,
    }
    values.update(overrides)
    return Qwen3Config(**values)


def build_tiny_model(out_dir: Path, *, head_dim: int | None = None, warmup: str = "counter") -> Path:
    """Write the tiny warmed-up model and its tokenizer into ``out_dir``; returns ``out_dir``.

    ``head_dim`` widens the attention heads (vLLM's CPU build refuses the tiny shape's 16; 32 is
    its narrowest): the same recipe, a different model. ``warmup`` names the game whose action
    format the warm-up teaches (:data:`WARMUPS`: ``counter``, the demo model, or ``guess``)."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen3ForCausalLM

    from kiln.core.policy.tokenizer import train_and_save

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    fmt = WARMUPS[warmup]
    tok = train_and_save(_tokenizer_corpus(rng, fmt), out_dir, VOCAB_SIZE)

    config = tiny_qwen3_config(
        vocab_size=len(tok),
        max_position_embeddings=4096,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
        pad_token_id=tok.convert_tokens_to_ids(ENDOFTEXT),
        use_cache=True,
        **({"head_dim": head_dim} if head_dim is not None else {}),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = Qwen3ForCausalLM(config).float()
            _warm_up(model, tok, rng, fmt)
        model.generation_config.do_sample = True
        model.save_pretrained(str(out_dir))
    finally:
        torch.set_num_threads(threads)
    return out_dir
