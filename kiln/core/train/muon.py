"""Kiln's Muon optimizer: momentum, then a float32 Newton–Schulz orthogonalisation of each update.

The update of a 2-D parameter ``W`` with gradient ``G`` and momentum buffer ``M`` (momentum μ):

- ``M ← μ·M + (1 − μ)·G``; the direction is ``D = (1 − μ)·G + μ·M`` with Nesterov, else ``M``;
- ``O = NS₅(D)``: ``X₀ = D / ‖D‖_F`` on the wide side (``rows ≤ cols``), then five steps of the
  quintic ``X ← a·X + (b·A + c·A²)·X`` with ``A = X·Xᵀ`` and (a, b, c) = (3.4445, −4.7750, 2.0315),
  which drive every singular value of ``X`` towards 1 (to within about ±0.3);
- ``W ← W·(1 − lr·wd) − lr·0.2·√max(rows, cols)·O`` (``match_rms_adamw``: the update's RMS is
  about ``0.2·lr`` for every shape, as AdamW's is in steady state).

That is the algorithm ``torch.optim.Muon`` runs, with one difference: torch iterates in bfloat16,
Kiln in float32 (float64 for float64 weights). bfloat16 keeps 8 bits, so two gradients that differ
only in float rounding — a gradient summed over 2 ranks against the same sum on 1 rank, or over
micro-batches in another order — round to different bfloat16 updates (6e-3 relative on the adapter
after a few steps); in float32 they stay within 1e-5. LoRA matrices are thin (``r`` rows on the
wide side), so the Gram matrices are ``r × r`` and float32 costs next to nothing.

The state per parameter is ``momentum_buffer`` and the parameter groups carry torch's keys
(``ns_coefficients``, ``eps``, ``adjust_lr_fn``), so a checkpoint or continuation state
(:mod:`kiln.core.train.continuation`) of either optimizer loads into the other: a training
checkpointed by an earlier release resumes here, and one checkpointed here resumes after a rollback.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPE = "float32"
ADJUST_LR_FN = "match_rms_adamw"  # the only scaling Kiln's Muon applies (torch's name for it)


def orthogonalise(
    update: torch.Tensor,
    steps: int,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """:math:`NS_{steps}` of a 2-D ``update`` in float32 (float64 kept): about ``U·Vᵀ`` of its
    SVD ``U·S·Vᵀ``, in the update's shape and the working dtype."""
    a, b, c = coefficients
    work = update.to(torch.float64 if update.dtype == torch.float64 else torch.float32)
    tall = work.size(0) > work.size(1)
    x = work.T if tall else work
    x = x / x.norm().clamp_min(eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def rms_matched_lr(lr: float, shape: torch.Size) -> float:
    """``lr·0.2·√max(rows, cols)``: the step size that gives the orthogonal update AdamW's RMS."""
    return lr * 0.2 * math.sqrt(max(int(shape[0]), int(shape[1])))


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters (module docstring); ``step`` takes no closure."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        weight_decay: float,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "weight_decay": weight_decay,
            "ns_coefficients": NS_COEFFICIENTS,
            "eps": NS_EPS,
            "adjust_lr_fn": ADJUST_LR_FN,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() != 2:
                    raise ValueError(f"Muon needs 2-D parameters; got shape {tuple(param.shape)}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        if closure is not None:
            raise ValueError("Kiln's Muon takes no closure")
        for group in self.param_groups:
            if group["adjust_lr_fn"] != ADJUST_LR_FN:  # a state loaded from another scaling's optimizer
                raise ValueError(f"Kiln's Muon scales by {ADJUST_LR_FN}, not {group['adjust_lr_fn']}")
            momentum = group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1.0 - momentum)
                direction = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalise(direction, group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"])
                param.mul_(1.0 - group["lr"] * group["weight_decay"])
                param.add_(update.to(param.dtype), alpha=-rms_matched_lr(group["lr"], param.shape))
