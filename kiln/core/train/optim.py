"""Optimizers (Muon or AdamW) and the learning-rate schedule (warm-up, then constant/cosine).

Muon is Kiln's own (:mod:`kiln.core.train.muon`: torch's algorithm, its Newton–Schulz iteration in
float32 rather than bfloat16, so the update does not depend on how a gradient's sum was ordered;
momentum 0.95, Nesterov, 5 iterations, weight decay 0); it orthogonalises the update of each 2-D
parameter, which every LoRA ``A``/``B`` matrix is. Its learning-rate adjustment is
``match_rms_adamw`` (``lr·0.2·√max(rows, cols)``): the update's RMS is about ``0.2·lr`` for every
shape, as an AdamW update's is in steady state, so one learning rate means the same for both. torch's default (``original``, ``lr·√max(1, rows/cols)``)
would scale LoRA ``B`` (``out × r``) by √(out/r), 8–14× on Qwen3-0.6B shapes, and leave ``A`` at
an RMS of ``lr/√max(rows, cols)``. AdamW uses betas (0.9, 0.999), eps 1e-8, weight
decay 0. The schedule is a pure function of the step number, so a resumed run continues it exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.core.errors import TrainingFailed
from kiln.core.train.muon import ADJUST_LR_FN, NS_DTYPE, Muon

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
MUON_MOMENTUM = 0.95
MUON_NESTEROV = True
MUON_NS_STEPS = 5
MUON_IMPLEMENTATION = "kiln.core.train.muon"  # torch.optim.Muon before (bfloat16 Newton–Schulz)
WEIGHT_DECAY = 0.0


def build_optimizer(config: Any, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer, dict]:
    """The configured optimizer over ``params`` and its receipt description."""
    lr = config.resolved_learning_rate()
    if config.optimizer == "muon":
        bad = [tuple(p.shape) for p in params if p.dim() != 2]
        if bad:
            raise TrainingFailed(f"Muon needs 2-D parameters; got shapes {bad[:3]}", code="optimizer_unavailable")
        optimizer: torch.optim.Optimizer = Muon(
            params,
            lr=lr,
            weight_decay=WEIGHT_DECAY,
            momentum=MUON_MOMENTUM,
            nesterov=MUON_NESTEROV,
            ns_steps=MUON_NS_STEPS,
        )
        described = {
            "name": "muon",
            "momentum": MUON_MOMENTUM,
            "nesterov": MUON_NESTEROV,
            "ns_iters": MUON_NS_STEPS,
            "ns_dtype": NS_DTYPE,
            "adjust_lr_fn": ADJUST_LR_FN,
            "implementation": MUON_IMPLEMENTATION,
        }
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
        described = {"name": "adamw", "betas": list(ADAM_BETAS), "eps": ADAM_EPS}
    described.update(
        {
            "learning_rate": lr,
            "learning_rate_source": "config" if config.learning_rate is not None else "optimizer_default",
            "weight_decay": WEIGHT_DECAY,
            "schedule": config.lr_schedule,
            "warmup_steps": config.warmup_steps,
        }
    )
    return optimizer, described


def learning_rate_at(step: int, total_steps: int, base: float, *, warmup_steps: int, schedule: str) -> float:
    """Learning rate of 1-based ``step``: linear warm-up over ``warmup_steps``, then constant or a
    cosine decay ``0.5·(1 + cos(π·k / (total − warmup)))`` for the k-th step after warm-up (k from 0)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return base * step / warmup_steps
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps - 1) / span)
        return base * 0.5 * (1.0 + math.cos(math.pi * progress))
    return base


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
