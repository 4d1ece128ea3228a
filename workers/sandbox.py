"""The workflow sandbox every Kiln worker (and the history replayer) runs workflows in.

Temporal's sandbox re-imports a workflow's non-passthrough modules for each run it starts. A
process in which some library installed an import hook of ``beartype.claw`` (fastmcp's key-value
store does, for its own package) runs every such import through beartype's loader, and that
loader imports parts of beartype again inside the sandbox: measured on a 2-core machine, a small
run's workflow tasks took twice as long. ``beartype`` is passed through (imported once, shared);
it is a type checker with no workflow-visible state, so determinism is unchanged.
"""

from __future__ import annotations

from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

__all__ = ["workflow_runner"]

PASSED_THROUGH = ("beartype",)


def workflow_runner() -> SandboxedWorkflowRunner:
    """The sandboxed runner with the default restrictions plus ``PASSED_THROUGH``."""
    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(*PASSED_THROUGH))
