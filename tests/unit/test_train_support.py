"""Shared helpers for the training tests: a tiny random Qwen3 and synthetic seed groups.

(No tests here; the file name keeps it inside the training tests' namespace.)
"""

from __future__ import annotations

from pathlib import Path

X_TOKEN = 20  # rewarded action
Y_TOKEN = 21  # unrewarded action
END_TOKEN = 22
OBS_TOKENS = [30, 31, 32, 33, 34, 35]
WARNING_TOKENS = [40, 41, 42]

BEHAVIOR = {
    "base_model_sha256": "sha256:" + "0" * 64,
    "adapter_sha256": None,
    "runtime": {"kiln": "test"},
}


def build_tiny_qwen3(path: Path) -> Path:
    """A random tiny Qwen3 saved to ``path`` (seeded, float32)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from kiln.core.policy.tiny import tiny_qwen3_config

    torch.manual_seed(1234)
    config = tiny_qwen3_config(
        vocab_size=300, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(str(path))
    return path


def context(g: int) -> list[int]:
    return [3, 4 + (g % 5), 10]


def completion(
    g: int,
    action: int,
    *,
    turns: int = 2,
    warning: bool = False,
    harness_code: str | None = None,
    reward: float | None = None,
    logprobs: bool = True,
    behavior: dict | None = None,
) -> dict:
    """A multi-turn completion: context, then (action, observation) × turns."""
    pieces = [{"kind": "context", "ids": context(g)}]
    for t in range(turns):
        pieces.append(
            {"kind": "action", "ids": [action, END_TOKEN],
             **({"logprobs": [-1.5, -0.5]} if logprobs else {})}
        )
        if warning and t == 0:
            pieces.append({"kind": "observation", "ids": list(WARNING_TOKENS), "warning": True})
        pieces.append({"kind": "observation", "ids": list(OBS_TOKENS), "warning": False})
        pieces.append({"kind": "context", "ids": [11, 12]})
    r = (1.0 if action == X_TOKEN else 0.0) if reward is None else reward
    return {
        "text": f"action {action}",
        "reward": r,
        "trajectory": [],
        "openenv": {
            "behavior_policy": dict(behavior or BEHAVIOR),
            "episode_return": r,
            "termination": "done",
        },
        "harness_code": harness_code,
        "tokens": {"pieces": pieces},
    }


def bandit_groups(n_groups: int = 4, **kwargs) -> list[dict]:
    """Groups of 4 completions: two pick X (reward 1), two pick Y (reward 0)."""
    groups = []
    for g in range(n_groups):
        comps = [completion(g, a, **kwargs) for a in (X_TOKEN, Y_TOKEN, X_TOKEN, Y_TOKEN)]
        messages = [{"role": "user", "content": f"seed {g}"}]
        groups.append({"messages": messages, "completions": comps})
    return groups


def logprob_of(model, ids: list[int], target: int) -> float:
    """log p(target | ids) under ``model``."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False)
        return float(torch.log_softmax(out.logits[0, -1].float(), dim=-1)[target].item())
