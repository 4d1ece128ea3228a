"""The API's token rule, in one place: a non-loopback bind needs ``KILN_API_TOKEN``.

Pure (no web framework): the API applies it when it is built, ``kiln serve`` before it starts
anything.
"""

from __future__ import annotations

import os
from typing import Any

from kiln.core.errors import ApiConfigurationError
from kiln.core.openenv.urls import is_loopback_host


def configured_token(settings: Any) -> str | None:
    """``settings.api_token`` when the field exists, else ``KILN_API_TOKEN``; blank means none."""
    token = getattr(settings, "api_token", None)
    if token is None:
        token = os.environ.get("KILN_API_TOKEN")
    if token is not None and hasattr(token, "get_secret_value"):
        token = token.get_secret_value()
    token = (token or "").strip()
    return token or None


def required_token(settings: Any) -> str | None:
    """The token every request must carry, or None on a loopback bind.

    Raises ``ApiConfigurationError`` for a non-loopback bind without a token.
    """
    host = str(getattr(settings, "api_host", "127.0.0.1"))
    token = configured_token(settings)
    if token is None and not is_loopback_host(host):
        raise ApiConfigurationError(
            f"refusing to serve the Kiln API on non-loopback host {host!r} without an access token",
            hint="set KILN_API_TOKEN (clients send it as 'Authorization: Bearer <token>'), or bind 127.0.0.1",
        )
    return token
