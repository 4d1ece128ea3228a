"""Token-level view of one completion: the full id sequence and its three disjoint masks. No torch.

A completion's ``tokens.pieces`` concatenate to the exact ids the policy saw and produced:

- ``context`` pieces (the prompt) are never trained;
- ``action`` pieces (sampled by the policy) are the GRPO targets and carry behaviour log-probs;
- ``observation`` pieces (environment text) are the ECHO targets, except ``warning`` pieces
  (harness/protocol-error text) when the echo warning filter is on.

``env_mask_mode`` (``env_only`` | ``full_obs``): the collector already splits template wrapping into
context pieces, so at token level both modes select the same observation tokens; the mode is
recorded in the receipt. All observation tokens (warning or not) form the "full observation length"
that normalises a sequence's ECHO cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import TrainingFailed

PIECE_KINDS = ("context", "action", "observation")


@dataclass(frozen=True)
class TokenizedCompletion:
    """Ids plus per-token flags (position i describes token ids[i])."""

    ids: list[int]
    is_action: list[bool]
    is_env_target: list[bool]
    is_observation: list[bool]
    # aligned with ids (0.0 off action tokens); None when some action piece has none
    behavior_logprobs: list[float] | None

    @property
    def observation_tokens(self) -> int:
        return sum(self.is_observation)


def _bad(message: str) -> TrainingFailed:
    return TrainingFailed(message, code="invalid_training_data")


def tokenize_completion(
    completion: dict[str, Any], *, warning_filter: bool, vocab_size: int | None = None
) -> TokenizedCompletion:
    """Flatten ``completion['tokens']['pieces']`` and validate it."""
    tokens = completion.get("tokens")
    pieces = tokens.get("pieces") if isinstance(tokens, dict) else None
    if not isinstance(pieces, list) or not pieces:
        raise _bad("completion has no tokens.pieces")
    ids: list[int] = []
    is_action: list[bool] = []
    is_env: list[bool] = []
    is_obs: list[bool] = []
    logprobs: list[float] = []
    have_logprobs = True
    for index, piece in enumerate(pieces):
        kind = piece.get("kind")
        if kind not in PIECE_KINDS:
            raise _bad(f"piece {index} has unknown kind {kind!r}")
        piece_ids = piece.get("ids")
        if not isinstance(piece_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in piece_ids
        ):
            raise _bad(f"piece {index} ids must be a list of non-negative integers")
        if vocab_size is not None and any(t >= vocab_size for t in piece_ids):
            raise _bad(f"piece {index} has a token id outside the model vocabulary ({vocab_size})")
        n = len(piece_ids)
        ids.extend(piece_ids)
        action = kind == "action"
        observation = kind == "observation"
        target = observation and not (warning_filter and bool(piece.get("warning", False)))
        is_action.extend([action] * n)
        is_obs.extend([observation] * n)
        is_env.extend([target] * n)
        if action:
            piece_lp = piece.get("logprobs")
            if isinstance(piece_lp, list) and len(piece_lp) == n:
                logprobs.extend(float(x) for x in piece_lp)
            else:
                have_logprobs = False
                logprobs.extend([0.0] * n)
        else:
            logprobs.extend([0.0] * n)
    return TokenizedCompletion(
        ids=ids,
        is_action=is_action,
        is_env_target=is_env,
        is_observation=is_obs,
        behavior_logprobs=logprobs if have_logprobs else None,
    )


def count_tokens(groups: list[dict[str, Any]], *, warning_filter: bool) -> dict[str, int]:
    """Receipt token counts over the training groups (each completion counted once)."""
    action = context = obs = warning = 0
    for group in groups:
        for completion in group["completions"]:
            for piece in completion["tokens"]["pieces"]:
                n = len(piece["ids"])
                if piece["kind"] == "action":
                    action += n
                elif piece["kind"] == "context":
                    context += n
                else:
                    obs += n
                    if warning_filter and piece.get("warning", False):
                        warning += n
    return {
        "action_tokens": action,
        "context_tokens": context,
        "env_tokens_before_warning_filter": obs,
        "warning_tokens_filtered": warning,
        "env_tokens_after_warning_filter": obs - warning,
        "env_tokens": obs - warning,
    }
