"""Token-level view of one completion: the full id sequence and its three disjoint masks. No torch.

A completion's ``tokens.pieces`` concatenate to the exact ids the policy saw and produced:

- ``context`` pieces (the prompt) are never trained;
- ``action`` pieces (sampled by the policy) are the GRPO targets and carry behaviour log-probs;
- ``observation`` pieces (environment text) are the ECHO targets, except ``warning`` pieces
  (harness/protocol-error text) when the echo warning filter is on.

``env_mask_mode`` picks the ECHO targets:

- ``env_only`` (default): the ``observation`` pieces (what the environment wrote);
- ``full_obs``: the whole observation turn, i.e. also the template wrapping around it, which the
  collector splits into ``context`` pieces: every context piece after the first action piece is
  then an ECHO target and part of the observation span (the prompt before the first action never
  is).

Either way warning pieces are left out when the warning filter is on, and the sequence's ECHO
cross-entropy is normalised by its whole observation span (all observation tokens, warning or not,
plus the wrapping in ``full_obs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.errors import TrainingFailed

PIECE_KINDS = ("context", "action", "observation")
ENV_MASK_MODES = ("env_only", "full_obs")


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
    completion: dict[str, Any],
    *,
    warning_filter: bool,
    vocab_size: int | None = None,
    env_mask_mode: str = "env_only",
) -> TokenizedCompletion:
    """Flatten ``completion['tokens']['pieces']`` and validate it."""
    if env_mask_mode not in ENV_MASK_MODES:
        raise ValueError(f"env_mask_mode must be one of {ENV_MASK_MODES}, got {env_mask_mode!r}")
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
    acted = False  # an action piece came before: a later context piece wraps an observation
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
        observation = kind == "observation" or (env_mask_mode == "full_obs" and kind == "context" and acted)
        acted = acted or action
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


def _wrapping(pieces: list[dict[str, Any]], env_mask_mode: str) -> list[bool]:
    """Per piece: a context piece that ``full_obs`` trains as part of an observation turn."""
    out, acted = [], False
    for piece in pieces:
        out.append(env_mask_mode == "full_obs" and piece["kind"] == "context" and acted)
        acted = acted or piece["kind"] == "action"
    return out


def count_tokens(
    groups: list[dict[str, Any]], *, warning_filter: bool, env_mask_mode: str = "env_only"
) -> dict[str, int]:
    """Receipt token counts over the training groups (each completion counted once). With
    ``full_obs`` the observation turns' template wrapping counts as environment tokens (it is
    trained as such), not as context."""
    action = context = obs = warning = 0
    for group in groups:
        for completion in group["completions"]:
            pieces = completion["tokens"]["pieces"]
            for piece, wrapping in zip(pieces, _wrapping(pieces, env_mask_mode)):
                n = len(piece["ids"])
                if piece["kind"] == "action":
                    action += n
                elif piece["kind"] == "context" and not wrapping:
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
