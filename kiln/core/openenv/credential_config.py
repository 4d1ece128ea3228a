"""Resolve a run's opaque ``credential_ids`` to bearer tokens, just before use.

Operators configure credentials once, for every Kiln process, in ``KILN_CREDENTIALS`` (JSON)::

    {"hub": {"origin": "https://env.example.com", "bearer_token_env": "HUB_TOKEN"}}

A request names only ``credential_ids`` (aligned with ``environment_urls``; null = public). Each id
must exist, its ``origin`` must equal the URL's canonical origin exactly, and the named variable
must hold a valid token. Only the id travels in requests and history; the token and the variable's
name never appear in errors, status or artifacts.
"""

from __future__ import annotations

from typing import Any, Mapping

from kiln.core.errors import InvalidCredential
from kiln.core.openenv.credentials import origin_matches, prepare_token, read_token_from_env, validate_env_name
from kiln.core.openenv.urls import EnvironmentUrl, normalize_url


def _entry(config: Mapping[str, Any], credential_id: str) -> dict[str, Any]:
    entry = config.get(credential_id)
    if (
        not isinstance(entry, Mapping)
        or not isinstance(entry.get("origin"), str)
        or not isinstance(entry.get("bearer_token_env"), str)
    ):
        raise InvalidCredential(
            f"credential id {credential_id!r} is not configured",
            hint='add it to KILN_CREDENTIALS as {"<id>": {"origin": "https://host", "bearer_token_env": "VAR"}}',
        )
    return dict(entry)


def check_credential(config: Mapping[str, Any], credential_id: str | None, url: str | EnvironmentUrl) -> None:
    """Admission-time check: the id exists and is authorised for the URL's origin (no secret read)."""
    if credential_id is None:
        return
    target = url if isinstance(url, EnvironmentUrl) else normalize_url(url)
    entry = _entry(config, credential_id)
    validate_env_name(entry["bearer_token_env"])
    if not origin_matches(entry["origin"], target):
        raise InvalidCredential(
            f"credential id {credential_id!r} is not authorized for origin {target.origin}",
            hint="a credential is bound to one exact origin (scheme, host, port)",
        )


def resolve_bearer_token(config: Mapping[str, Any], credential_id: str | None, url: str | EnvironmentUrl) -> str | None:
    """The validated token for ``credential_id`` at ``url`` (None = public)."""
    if credential_id is None:
        return None
    target = url if isinstance(url, EnvironmentUrl) else normalize_url(url)
    check_credential(config, credential_id, target)
    token = read_token_from_env(_entry(config, credential_id)["bearer_token_env"])
    return prepare_token(target, token)
