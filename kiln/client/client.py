"""``Client``: drive Kiln from Python over its REST API, with typed answers and Kiln errors.

One HTTP layer, which the CLI stands on too (``kiln.client.http.ApiClient``: ``KILN_API_URL`` or
the API's host and port, bearer token, no redirects, error envelopes turned back into
``KilnError`` subclasses with the same ``code``, retries through a Temporal outage). Downloads are
``kiln.client.downloads`` (verified, atomic); following is ``kiln.client.follow.watch``; ``verify``
is the offline verifier of ``kiln openenv verify --run``. ``AsyncClient`` runs the same calls in a
worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from kiln.client.downloads import download_run
from kiln.client.events import RunEnded, RunEvent, events_between
from kiln.client.follow import watch
from kiln.client.http import ApiClient, Closing
from kiln.core.contracts import RunRequest, parse_run_request
from kiln.core.training_config import TrainingConfig
from kiln.core.errors import UNCLAIMED_HINT, KilnError, RunCancelled, RunUnclaimed, error_from_dict
from kiln.core.run_view import RunList, RunView
from kiln.core.tolerant import TOLERANT_CONTEXT


def _view(answer: Any) -> RunView:
    return answer if isinstance(answer, RunView) else RunView.model_validate(answer, context=TOLERANT_CONTEXT)


def _request(kind: str, environments: str | list[str], fields: dict[str, Any]) -> RunRequest:
    urls = [environments] if isinstance(environments, str) else list(environments)
    config = fields.get("training_config")
    if isinstance(config, TrainingConfig):
        fields["training_config"] = config.model_dump(mode="json", by_alias=True)
    return parse_run_request({"kind": kind, "environment_urls": urls, **fields})


def raise_for_outcome(view: RunView) -> RunView:
    """``view`` when the run completed; its failure as the ``KilnError`` of the same code when
    it failed; ``RunCancelled`` (``cancelled``) when it was cancelled; ``RunTerminated``
    (``run_terminated``, naming who and why) when it was terminated through Temporal."""
    if view.state == "completed":
        return view
    if view.state == "cancelled":
        raise RunCancelled(
            f"run {view.run_id} was cancelled during {view.cancelled_stage or 'its run'}", stage=view.cancelled_stage
        )
    failure = view.failure
    if failure is None:
        raise KilnError(f"run {view.run_id} is {view.state}", code="internal_error")
    error = failure.model_dump()
    if not isinstance(error.get("details"), dict):
        error["details"] = {"value": error["details"]} if error.get("details") is not None else None
    raise error_from_dict(error)


class Client(Closing):
    """A Kiln API client. ``Client()`` reaches ``KILN_API_URL``, else the API's own host and port
    (``KILN_API_HOST``/``KILN_API_PORT``, default http://127.0.0.1:8780), with ``KILN_API_TOKEN``;
    ``Client(url, token)`` names them."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 30.0) -> None:
        self._api = ApiClient(url, timeout_s=timeout_s, token=token)
        self.url = self._api.base_url

    def __repr__(self) -> str:  # never shows the token
        return f"Client({self.url!r})"

    def close(self) -> None:
        self._api.close()

    # ------------------------------------------------------------------ submit
    def start(self, request: RunRequest | dict[str, Any], *, preflight: bool = True) -> RunView:
        """Submit a run request; the new (or, for a retried ``idempotency_key``, existing) run.
        ``preflight=False`` skips the API's submit-time ``/health`` check of the environments."""
        typed = request if isinstance(request, RunRequest) else parse_run_request(request)
        body = typed.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        body.setdefault("kind", typed.kind)
        _code, answer = self._api.submit(body, preflight=preflight)
        return _view(answer)

    def train(
        self,
        environments: str | list[str],
        *,
        output_adapter: str,
        wait: bool = True,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        preflight: bool = True,
        **fields: Any,
    ) -> RunView:
        """Collect seed groups on ``environments`` and train ``output_adapter`` on them.

        ``fields`` are ``RunRequest`` fields (``groups``, ``group_size``, ``model``, ``training_config``
        as a ``TrainingConfig`` or a dict, …). With ``wait`` (the default) returns the completed run
        or raises its failure's ``KilnError``; otherwise the submitted run."""
        request = _request("train", environments, {"output_adapter": output_adapter, **fields})
        view = self.start(request, preflight=preflight)
        return self.wait(view.run_id, poll_s=poll_s, timeout_s=timeout_s) if wait else view

    def rollout(
        self,
        environments: str | list[str],
        *,
        wait: bool = True,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        preflight: bool = True,
        **fields: Any,
    ) -> RunView:
        """Collect seed groups on ``environments`` (no training); as :meth:`train` otherwise."""
        view = self.start(_request("rollout", environments, fields), preflight=preflight)
        return self.wait(view.run_id, poll_s=poll_s, timeout_s=timeout_s) if wait else view

    # ------------------------------------------------------------------ read
    def status(self, run_id: str) -> RunView:
        return _view(self._api.status(run_id))

    def runs(self, state: str | None = None) -> RunList:
        """Runs newest first, optionally only those ``running|completed|failed|cancelled|terminated``."""
        return self._api.runs(state)

    def follow(self, run_id: str, *, poll_s: float = 1.0, timeout_s: float | None = None) -> Iterator[RunEvent]:
        """Events of run ``run_id`` until it ends (the last one is ``RunEnded``). A status query
        that timed out (no worker answered) yields nothing; the next real view continues. A run
        that no worker picks up raises its ``unclaimed`` message (``run_unclaimed``)."""
        previous: RunView | None = None
        for current in watch(lambda: self.status(run_id), poll_s=poll_s, timeout_s=timeout_s):
            yield from events_between(previous, current)
            previous = current
        if previous is not None and previous.unclaimed and not previous.terminal:
            raise RunUnclaimed(previous.unclaimed, hint=UNCLAIMED_HINT)
        if previous is None or not previous.terminal:
            raise TimeoutError(f"run {run_id} did not end within {timeout_s} s")

    def wait(self, run_id: str, *, poll_s: float = 1.0, timeout_s: float | None = None) -> RunView:
        """Follow the run to its end: the completed run, or its failure raised (see
        :func:`raise_for_outcome`)."""
        for event in self.follow(run_id, poll_s=poll_s, timeout_s=timeout_s):
            if isinstance(event, RunEnded):
                return raise_for_outcome(event.view)
        raise KilnError(f"run {run_id}: the follow ended without an outcome")  # pragma: no cover

    def cancel(self, run_id: str) -> RunView:
        """Request cancellation; ``openenv_run_not_cancellable`` when the run already ended."""
        return _view(self._api.cancel(run_id))

    # ------------------------------------------------------------------ artifacts
    def download(self, run_id: str, directory: str | Path, *, force: bool = False) -> list[Path]:
        """The run's manifest and every artifact into ``directory`` (each size and SHA-256 checked
        against the manifest the run recorded, written atomically); the files written."""
        receipts = download_run(self._api, run_id, Path(directory), force=force)
        return [Path(r["output_path"]) for r in receipts] + [Path(directory).absolute() / "manifest.json"]

    @staticmethod
    def verify(directory: str | Path) -> dict[str, Any]:
        """Verify a downloaded run offline (``kiln openenv verify --run``): the report, or
        ``openenv_verification_failed`` naming the file and field."""
        from kiln.core.rollout.verify.run import verify_run

        return verify_run(Path(directory))


class AsyncClient:
    """``Client``'s calls for asyncio code (each runs in a worker thread; one HTTP layer)."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 30.0) -> None:
        self.sync = Client(url, token, timeout_s=timeout_s)

    def __repr__(self) -> str:
        return f"AsyncClient({self.sync.url!r})"

    async def start(self, request: RunRequest | dict[str, Any], *, preflight: bool = True) -> RunView:
        return await asyncio.to_thread(self.sync.start, request, preflight=preflight)

    async def train(self, environments: str | list[str], *, output_adapter: str, **kwargs: Any) -> RunView:
        return await asyncio.to_thread(self.sync.train, environments, output_adapter=output_adapter, **kwargs)

    async def rollout(self, environments: str | list[str], **kwargs: Any) -> RunView:
        return await asyncio.to_thread(self.sync.rollout, environments, **kwargs)

    async def status(self, run_id: str) -> RunView:
        return await asyncio.to_thread(self.sync.status, run_id)

    async def runs(self, state: str | None = None) -> RunList:
        return await asyncio.to_thread(self.sync.runs, state)

    async def cancel(self, run_id: str) -> RunView:
        return await asyncio.to_thread(self.sync.cancel, run_id)

    async def wait(self, run_id: str, **kwargs: Any) -> RunView:
        return await asyncio.to_thread(self.sync.wait, run_id, **kwargs)

    async def follow(
        self, run_id: str, *, poll_s: float = 1.0, timeout_s: float | None = None
    ) -> AsyncIterator[RunEvent]:
        """``Client.follow``'s events (the same loop, stepped in a worker thread)."""
        events = self.sync.follow(run_id, poll_s=poll_s, timeout_s=timeout_s)
        end = object()
        while (event := await asyncio.to_thread(next, events, end)) is not end:
            yield event  # type: ignore[misc]  # not ``end``: the loop stops on it

    async def download(self, run_id: str, directory: str | Path, *, force: bool = False) -> list[Path]:
        return await asyncio.to_thread(self.sync.download, run_id, directory, force=force)

    @staticmethod
    async def verify(directory: str | Path) -> dict[str, Any]:
        return await asyncio.to_thread(Client.verify, directory)


__all__ = ["AsyncClient", "Client", "raise_for_outcome"]
