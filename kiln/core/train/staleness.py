"""Stale training data (opt-in asynchronous overlap): the behaviour policy's log-probs of every row.

With ``max_staleness: N`` an online run may train iteration k starting from adapter k−1 on groups
that adapter ``k−1−lag`` sampled (lag ≤ N; with N = 1, adapter k−2 while iteration k−1 trained;
:mod:`kiln.core.stale_pipeline` plans the pipeline and bounds the lag). The trainer's importance weights then need
``π_behaviour``: the log-probs of the policy that actually sampled each token. Kiln recomputes them
instead of trusting the recorded ones (with constrained decoding those are of the grammar-masked
distribution, which the trainer never scores): before the first step every row is scored once by
the behaviour policy itself — the same base model with the behaviour adapter loaded as a second,
frozen adapter, or with every adapter disabled when the behaviour policy is the bare base model —
at the recorded sampling temperature, through the same scoring code (and micro-batch packing) as
the trainer's own log-probs. Data that the starting policy sampled would get weights of exactly 1.

The weight itself, ``min(π_prox / π_behaviour, stale_is_max_weight)``, is applied in
:mod:`kiln.core.train.step`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kiln.core.errors import PolicyIdentityChanged, TrainingFailed
from kiln.core.train.batches import Row
from kiln.core.train.drift import frozen_adapter
from kiln.core.train.model import adapter_content_sha256
from kiln.core.train.step import StepSettings, score_rows

BEHAVIOR_ADAPTER = "kiln-behavior"


def stale_origin(
    staleness: int, behavior_adapter_dir: Path | None, expected_behavior_policy: dict | None
) -> dict[str, Any] | None:
    """The receipt's ``staleness`` block (None for on-policy data), after checking that the
    behaviour adapter is the one the data's behaviour identity names."""
    if staleness < 0:
        raise TrainingFailed(f"staleness must be >= 0, got {staleness}", code="staleness_invalid")
    if staleness == 0:
        if behavior_adapter_dir is not None:
            raise TrainingFailed(
                "behavior_adapter is only for stale data (staleness >= 1); on-policy data was "
                "sampled by the base adapter itself",
                code="staleness_invalid",
                hint="set staleness to how many iterations behind the data's policy is, or drop behavior_adapter",
            )
        return None
    sha = adapter_content_sha256(behavior_adapter_dir) if behavior_adapter_dir is not None else None
    if expected_behavior_policy is not None and expected_behavior_policy.get("adapter_sha256") != sha:
        raise PolicyIdentityChanged(
            "behavior_adapter is not the adapter that sampled the training data",
            stage="training",
            details={
                "behavior_adapter_sha256": sha,
                "data_adapter_sha256": expected_behavior_policy.get("adapter_sha256"),
            },
        )
    return {"staleness": staleness, "behavior_adapter_sha256": sha, "behavior_logprobs": "scored_with_behavior_policy"}


def _score(model: Any, rows: list[list[Row]], settings: StepSettings, device: torch.device) -> list[list[Row]]:
    scored: list[list[Row]] = []
    for group in rows:
        logprobs = score_rows(model, group, settings, device)
        scored.append([replace(row, behavior=logprobs[row.key]) for row in group])
    return scored


def score_behavior(
    model: Any, rows: list[list[Row]], behavior_adapter_dir: Path | None, settings: StepSettings, device: torch.device
) -> list[list[Row]]:
    """``rows`` with ``behavior`` set to the behaviour policy's log-probs (see the module
    docstring). Leaves the model as it found it: the training adapter active and trainable, the
    behaviour adapter deleted, the torch RNG untouched."""
    with torch.no_grad():  # scoring draws nothing; the adapter load forks the generator
        if behavior_adapter_dir is None:
            with model.disable_adapter():
                return _score(model, rows, settings, device)
        with frozen_adapter(model, behavior_adapter_dir, BEHAVIOR_ADAPTER, "behavior adapter"):
            model.set_adapter(BEHAVIOR_ADAPTER, inference_mode=True)
            return _score(model, rows, settings, device)
