"""Group selection before training. Pure Python: no torch.

Artifacts keep every completion; only the trainer's view is filtered:

- a completion whose harness code is ``MODEL_ACTION_NO_OUTPUT`` (the model produced no final action,
  e.g. it exhausted its thinking budget) is handled by ``on_no_output``: ``penalty`` (the
  ``TrainingConfig`` default) keeps it with its recorded reward, which includes the harness penalty
  for a missing action (``protocol_error_reward``, −1 by default), so training pushes back on it;
  ``zero_reward`` keeps it with reward 0.0; ``drop`` removes it from its group;
- a completion that ended at the model's context under ``context_policy: end`` is left out
  (:func:`kiln.core.rollout.context.trained_on`);
- a group with no completion left is skipped ("produced no final model actions");
- a group whose remaining rewards are all exactly equal is skipped (no reward variation: its
  group-normalised advantages are all zero, so training on it is zero-gradient work);
- a kept group that lost some no-output completions gets a warning.
"""

from __future__ import annotations

from typing import Any

from kiln.core.rollout.context import trained_on

NO_OUTPUT_CODE = "MODEL_ACTION_NO_OUTPUT"


def _no_output_view(completions: list[dict[str, Any]], on_no_output: str) -> list[dict[str, Any]]:
    if on_no_output == "drop":
        return [c for c in completions if c.get("harness_code") != NO_OUTPUT_CODE]
    if on_no_output == "zero_reward":
        return [{**c, "reward": 0.0} if c.get("harness_code") == NO_OUTPUT_CODE else c for c in completions]
    return completions


def select_groups(
    groups: list[dict[str, Any]], on_no_output: str = "penalty", too_stale: dict[int, str] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return ``(kept_groups, selection)``; ``too_stale``: positions refused before any other check
    (data past ``max_staleness``, :mod:`kiln.core.stale_pipeline`), each with its warning.

    Kept groups are shallow copies with filtered completions.

    Group numbers in warnings are 0-based positions in ``groups`` (as ``group_index`` in
    receipts and artifacts).
    """
    kept: list[dict[str, Any]] = []
    warnings: list[str] = []
    rollouts = 0
    discarded = 0
    no_usable = 0
    no_gradient = 0
    context_excluded = 0
    for number, group in enumerate(groups):
        completions = list(group.get("completions") or [])
        rollouts += len(completions)
        if too_stale and number in too_stale:
            warnings.append(too_stale[number])
            continue
        inside = [c for c in completions if trained_on(c)]
        context_excluded += len(completions) - len(inside)
        completions = inside
        usable = _no_output_view(completions, on_no_output)
        dropped = len(completions) - len(usable)
        discarded += dropped
        if not usable:
            no_usable += 1
            warnings.append(f"group {number} produced no final model actions; skipped")
            continue
        rewards = [float(c["reward"]) for c in usable]
        if all(r == rewards[0] for r in rewards):
            no_gradient += 1
            warnings.append(
                f"group {number} has no reward variation (all rewards {rewards[0]!r}); zero-gradient work skipped"
            )
            continue
        if dropped:
            warnings.append(
                f"group {number}: dropped {dropped} of {len(completions)} completions "
                "that produced no final model action"
            )
        kept.append({**group, "completions": usable})
    selection = {
        "groups_submitted": len(groups),
        "rollouts_submitted": rollouts,
        "no_output_rollouts_discarded": discarded,
        "no_usable_output_groups_skipped": no_usable,
        "no_reward_gradient_groups_skipped": no_gradient,
        "warnings": warnings,
    }
    if context_excluded:
        selection["context_exhausted_rollouts_excluded"] = context_excluded
    if too_stale:
        selection["stale_groups_dropped"] = len(too_stale)
    return kept, selection
