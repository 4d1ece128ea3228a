"""OpenEnv protocol client: URLs, discovery and identity, action schema, WebSocket sessions,
Task API catalogs and bearer credentials. Pure I/O on asyncio; no Temporal, no torch."""

from kiln.core.openenv.actions import ActionParseError, ActionSchemaValidationError, parse_action_text
from kiln.core.openenv.discovery import identity_differences, inspect_environment
from kiln.core.openenv.rewards import training_reward
from kiln.core.openenv.schema import ActionValidator, policy_action_schema
from kiln.core.openenv.replies import RECOVERABLE_CODES, TERMINAL_CODES, StepResult
from kiln.core.openenv.session import EnvSession
from kiln.core.openenv.session_open import open_session_and_reset
from kiln.core.openenv.urls import EnvironmentUrl, normalize_url, require_allowed_host

__all__ = [
    "ActionParseError",
    "ActionSchemaValidationError",
    "ActionValidator",
    "EnvSession",
    "EnvironmentUrl",
    "RECOVERABLE_CODES",
    "StepResult",
    "TERMINAL_CODES",
    "identity_differences",
    "inspect_environment",
    "normalize_url",
    "open_session_and_reset",
    "parse_action_text",
    "policy_action_schema",
    "require_allowed_host",
    "training_reward",
]
