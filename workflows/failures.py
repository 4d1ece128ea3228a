"""Run-status records shared by the run workflows: the failure object and the training summary."""

from __future__ import annotations

from typing import Any

from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

from kiln.records import TrainResult


def failure_from(err: BaseException, stage: str) -> dict[str, Any]:
    """``{code, message, stage, retryable, hint, details}`` from an activity/application failure."""
    cause: BaseException | None = err
    while isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    if isinstance(cause, ApplicationError):
        details = cause.details[0] if cause.details and isinstance(cause.details[0], dict) else {}
        if not details.get("code"):
            # Not a KilnError (those always carry their dict): an unexpected Python exception whose
            # ``type`` is its class name. Its code is ``internal_error``; the name stays in the message.
            return {
                "code": "internal_error",
                "message": f"{cause.type or 'error'}: {cause.message}",
                "stage": stage,
                "retryable": False,
            }
        return {
            "code": details["code"],
            "message": details.get("message") or cause.message,
            "stage": details.get("stage") or stage,
            "retryable": bool(details.get("retryable", False)),
            "hint": details.get("hint"),
            "details": details.get("details"),
        }
    if isinstance(cause, CancelledError):
        return {"code": "cancelled", "message": str(cause), "stage": stage, "retryable": False}
    return {"code": "internal_error", "message": str(cause or err), "stage": stage, "retryable": False}


def training_status(training: TrainResult) -> dict[str, Any]:
    return {
        "trained": training.trained,
        "steps": training.steps,
        "final_loss": training.final_loss,
        "adapter_sha256": training.adapter_sha256,
        "selection": training.selection,
        "skip_reason": training.skip_reason,
    }
