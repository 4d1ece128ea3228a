"""The Temporal client every Kiln process uses (API, workers, CLI): one connection recipe.

Owns: the connection options (address, namespace, TLS/mTLS PEM files, Temporal Cloud API key,
Kiln's data converter, ``workers.converter``) and the bounded, logged retry a worker does at start. Secrets (the
API key, the private key's bytes) are passed to the SDK only; messages name settings and paths.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from temporalio.client import Client
from temporalio.service import RetryConfig, TLSConfig
from temporalio.runtime import Runtime

from kiln.core.errors import TemporalConfigInvalid, TemporalUnavailable
from kiln.core.settings import Settings
from workers.converter import kiln_data_converter

log = logging.getLogger("kiln.workers")

FIRST_RETRY_DELAY_S = 0.5
MAX_RETRY_DELAY_S = 10.0


def _read_pem(setting: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise TemporalConfigInvalid(
            f"{setting}={path} cannot be read ({err.strerror or type(err).__name__})",
            hint=f"point {setting} at a readable PEM file, or unset it",
        ) from None


def temporal_tls(settings: Settings) -> TLSConfig | bool:
    """TLS for the Temporal connection: a TLSConfig from the PEM files, True for an API key alone."""
    cert = _read_pem("KILN_TEMPORAL_TLS_CERT", settings.temporal_tls_cert)
    key = _read_pem("KILN_TEMPORAL_TLS_KEY", settings.temporal_tls_key)
    ca = _read_pem("KILN_TEMPORAL_TLS_CA", settings.temporal_tls_ca)
    if (cert is None) != (key is None):
        raise TemporalConfigInvalid(
            "KILN_TEMPORAL_TLS_CERT and KILN_TEMPORAL_TLS_KEY must be set together (mTLS client pair)",
            hint="set both to the client certificate and its private key, or neither",
        )
    if cert is None and ca is None:
        return settings.temporal_api_key is not None  # Temporal Cloud API keys need TLS
    return TLSConfig(server_root_ca_cert=ca, client_cert=cert, client_private_key=key)


async def connect_client(
    settings: Settings, *, runtime: Runtime | None = None, retry_config: RetryConfig | None = None
) -> Client:
    """Connect to the configured Temporal frontend with Kiln's pydantic data converter.

    ``runtime``: a Temporal runtime exporting SDK metrics (see ``kiln.core.telemetry.prometheus``);
    ``retry_config``: how long each call retries an unreachable server (the SDK's default if None).
    """
    api_key = settings.temporal_api_key.get_secret_value() if settings.temporal_api_key else None
    return await Client.connect(
        settings.effective_temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=kiln_data_converter,
        tls=temporal_tls(settings),
        api_key=api_key,
        runtime=runtime,
        retry_config=retry_config,
    )


async def connect_with_retry(
    settings: Settings, *, timeout_s: float | None = None, runtime: Runtime | None = None
) -> Client:
    """:func:`connect_client`, retried with exponential backoff (logged) for a bounded time.

    A worker started before Temporal is up (compose, a reboot) waits instead of crashing; after
    ``KILN_TEMPORAL_CONNECT_TIMEOUT_S`` it fails with ``temporal_unavailable``.
    """
    budget = settings.temporal_connect_timeout_s if timeout_s is None else timeout_s
    address = settings.effective_temporal_address
    deadline = time.monotonic() + budget
    delay = FIRST_RETRY_DELAY_S
    attempt = 0
    while True:
        attempt += 1
        try:
            return await connect_client(settings, runtime=runtime)
        except TemporalConfigInvalid:
            raise
        except Exception as err:  # noqa: BLE001 - the SDK raises RuntimeError for any connect failure
            reason = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
            left = deadline - time.monotonic()
            if left <= 0:
                raise TemporalUnavailable(
                    f"could not connect to Temporal at {address} (namespace "
                    f"{settings.temporal_namespace}) after {attempt} attempts in {budget:.0f}s: {reason}",
                    hint="check KILN_TEMPORAL_ADDRESS, the TLS/API-key settings and that the server runs",
                ) from None
            wait = min(delay, left)
            log.warning(
                "Temporal at %s not reachable (attempt %d: %s); retrying in %.1fs", address, attempt, reason, wait
            )
            await asyncio.sleep(wait)
            delay = min(delay * 2, MAX_RETRY_DELAY_S)
