"""Resolve a run's opaque ``credential_ids`` to bearer tokens on the worker, just before use.

A credential id ``X`` names the worker environment variable ``KILN_CREDENTIAL_<X>`` (upper-cased,
``-`` → ``_``). Only the id travels in the request and in history; the token never does.
"""

from __future__ import annotations

from kiln.openenv.credentials import read_token_from_env


def credential_env_name(credential_id: str) -> str:
    return "KILN_CREDENTIAL_" + credential_id.upper().replace("-", "_")


def resolve_bearer_token(credential_id: str | None) -> str | None:
    """The token for ``credential_id`` (None = public), validated; raises InvalidCredential."""
    if credential_id is None:
        return None
    return read_token_from_env(credential_env_name(credential_id))
