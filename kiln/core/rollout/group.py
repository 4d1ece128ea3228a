"""Collect one seed group: every candidate of one seed, all turns, against one environment.

The group is the durable unit of collection. Candidates run in waves that fit what the
environment grants (``kiln.core.openenv.capacity``): ``min(concurrency, group_size, capacity)``, and a
wave's sessions are all closed before the next opens; within a wave, each turn samples every live candidate in ONE batched policy call,
then steps every session concurrently. Token ids are kept end to end: a candidate's next prompt is
its previous ids plus the new observation's ids, never a re-rendered conversation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.canonical import canonical_json
from kiln.core.contracts import EpisodeSettings
from kiln.core.errors import CollectionFailed, EnvironmentIdentityChanged, RunCancelled
from kiln.core.jsondiff import differing_paths
from kiln.core.openenv.tool_calls import action_contract
from kiln.core.openenv.replies import TERMINAL_CODES
from kiln.core.openenv.session import EnvSession
from kiln.core.openenv.urls import normalize_url
from kiln.core.rollout.context import served_context
from kiln.core.rollout.episode import TURN_BREAK, CandidateEpisode, now_ms
from kiln.core.rollout.exchange import NO_OUTPUT, judge_answer, truncation_outcome
from kiln.core.rollout.policy_port import PolicyPort
from kiln.core.rollout.prompts import initial_messages
from kiln.core.rollout.provenance import (  # noqa: F401  (ROLLOUT_SCHEMA, environment_name re-exported)
    ROLLOUT_SCHEMA,
    environment_name,
    provenance_of,
    rollout_record,
)
from kiln.core.rollout.seeds import generation_seed
from kiln.core.rollout.sessions import SessionPlanner

log = logging.getLogger(__name__)

GROUP_SCHEMA = "kiln.openenv-group.v1"


@dataclass(frozen=True)
class GroupTask:
    group_index: int
    environment_index: int
    seed: int
    reset_payload: dict[str, Any]
    inspection: dict[str, Any]
    settings: EpisodeSettings
    behavior_policy: dict[str, Any]
    adapter_dir: Path | None = None
    bearer_token: str | None = None
    run_id: str = ""  # whose sessions these are (capacity figures are per run)
    decode_tile: int | None = None  # the hf engine's tile the run was admitted at (None: the worker's)


class GroupCollector:
    """Runs one seed group; construct per group, call :meth:`run` once."""

    def __init__(
        self,
        task: GroupTask,
        policy: PolicyPort,
        *,
        should_cancel: Callable[[], bool] | None = None,
        heartbeat: Callable[[dict[str, Any]], None] | None = None,
        attempt_capacity_wait_s: float | None = None,
    ) -> None:
        """``attempt_capacity_wait_s`` set (the activity path): wait at most that long for a
        first session, then raise ``EnvironmentAtCapacity`` so the workflow waits with no slot
        held; None (local tools): wait the whole ``capacity_wait_seconds`` here."""
        self.task = task
        self.policy = policy
        self.settings = task.settings
        self.should_cancel = should_cancel or (lambda: False)
        self.heartbeat = heartbeat or (lambda _details: None)
        identity = task.inspection["identity"]
        self.identity = identity
        self.url = normalize_url(identity["base_url"])
        # MCP environments: one call variant per listed tool, each call checked against its tool.
        self.shown_schema, self.validator = action_contract(task.inspection)
        self.episodes: list[CandidateEpisode] = []
        self.final_states: dict[int, dict[str, Any] | None] = {}
        self.messages: list[dict[str, Any]] | None = None
        self.reset_wire: dict[str, Any] | None = None
        self.planner = SessionPlanner(
            self.url,
            task.reset_payload,
            bearer_token=task.bearer_token,
            group_index=task.group_index,
            group_size=self.settings.group_size,
            capacity_wait_s=float(self.settings.capacity_wait_seconds),
            attempt_capacity_wait_s=attempt_capacity_wait_s,
            should_cancel=self.should_cancel,
            heartbeat=self.heartbeat,
            holder=task.run_id,
        )
        self.context_limit = served_context(policy)  # None: the policy does not say (unchecked)
        self.nondeterministic_fields: set[str] = set()
        self.own_resets: dict[int, dict[str, Any]] = {}
        self.waves = 0
        self.steps_done = 0  # turns completed in the current wave (heartbeat details)

    # ------------------------------------------------------------------ public
    async def run(self) -> dict[str, Any]:
        """Collect every candidate in waves that fit what the environment grants.

        A wave opens ``min(concurrency, group_size, advertised capacity)`` sessions at once, all
        or nothing (see ``SessionPlanner.open_wave``): a busy environment is waited for holding
        no session. Every session of a wave is closed before the next wave opens.
        """
        size = self.settings.group_size
        await self._check_tools()
        pending = list(range(size))
        while pending:
            self._check_cancel()
            width = self.planner.wave_size(self.settings.concurrency)
            ran = await self._run_wave(pending[:width])
            self.waves += 1 if ran else 0  # a refused wave ran nothing
            pending = [index for index in pending if index not in ran]
        return self._document()

    async def _check_tools(self) -> None:
        """MCP environments: list the tools again before the episodes; they must be the inspected
        ones (the prompt and identity digests were built from them)."""
        if not self.identity.get("tools"):
            return
        from kiln.core.openenv.discovery import inspect_environment

        live = await inspect_environment(self.url, bearer_token=self.task.bearer_token)
        if canonical_json(live["identity"].get("tools")) != canonical_json(self.identity["tools"]):
            raise EnvironmentIdentityChanged(
                f"{self.url.base_url}: the MCP tools differ from the inspected ones",
                details={"environment_url": self.url.base_url, "changed_fields": ["identity.tools"]},
            )

    # ------------------------------------------------------------------ waves
    async def _run_wave(self, candidates: list[int]) -> list[int]:
        opened_here: list[EnvSession] = []
        try:
            granted = await self.planner.open_wave(candidates, opened_here, self.settings.concurrency)
            sessions = {item[0]: item[1] for item in granted}
            episodes = [self._episode_for(item[0], item) for item in granted]
            self.episodes.extend(episodes)
            await self._run_turns(episodes, sessions)
            await asyncio.gather(*(self._finish(ep, sessions[ep.candidate_index]) for ep in episodes))
            return [item[0] for item in granted]
        finally:
            # Every socket this wave opened (registered the moment it opened) is closed here:
            # on success, failure, RunCancelled and asyncio cancellation alike.
            await asyncio.gather(*(self.planner.release(s) for s in opened_here), return_exceptions=True)

    def capacity_observed(self) -> dict[str, Any]:
        """What the environment granted (for run status, never the artifacts)."""
        return self.planner.observed(self.waves)

    def _episode_for(self, index: int, opened: tuple[int, EnvSession, Any, int]) -> CandidateEpisode:
        _, _session, result, _retries = opened
        if result.kind != "observation":
            code = (result.error or {}).get("code")
            raise CollectionFailed(
                f"group {self.task.group_index} candidate {index}: reset failed with "
                f"OpenEnv error {code} at {self.url.websocket_url}",
                code="environment_protocol_error",
                retryable=False,
            )
        wire = result.observation
        if result.done:
            raise CollectionFailed(
                f"group {self.task.group_index}: reset(seed={self.task.seed}) returned done=true; "
                "a rollout needs at least one action",
                retryable=False,
            )
        messages = initial_messages(
            self.identity.get("metadata") or {},
            self.shown_schema,
            wire,
            self.identity.get("tools"),
            self.identity.get("tool_calls"),
        )
        if self.messages is None:
            self.messages, self.reset_wire = messages, wire
        elif canonical_json(wire) != canonical_json(self.reset_wire):
            self._reset_differs(index, wire)
        prompt_ids = self.policy.encode_prompt(messages, thinking=self.settings.thinking)
        return CandidateEpisode(
            candidate_index=index,
            prompt_ids=prompt_ids,
            protocol_error_reward=self.settings.protocol_error_reward,
            max_recoverable_errors=self.settings.max_recoverable_errors,
            context_limit=self.context_limit,
            max_action_tokens=self.settings.max_action_tokens,
            penalise_context=self.settings.context_policy == "end_penalised",
            window=self.settings.context_policy == "window",
        )

    def _reset_differs(self, index: int, wire: dict[str, Any]) -> None:
        """Candidates of one group saw different resets: fail naming the fields (strict), or record
        them and let this candidate act on its own observation (``reset_determinism: warn``)."""
        fields = differing_paths(self.reset_wire, wire, "reset_observation")
        if self.settings.reset_determinism != "warn":
            raise CollectionFailed(
                f"group {self.task.group_index} candidate {index}: reset(seed={self.task.seed}) is not "
                f"deterministic — candidates of one group saw different {', '.join(fields[:8])}",
                hint="the environment ignores the seed for these fields; set reset_determinism: "
                '"warn" to collect anyway (each candidate then acts on its own reset, recorded)',
                retryable=False,
                details={
                    "group_index": self.task.group_index,
                    "candidate_index": index,
                    "seed": self.task.seed,
                    "fields": fields[:64],
                },
            )
        self.nondeterministic_fields.update(fields)
        self.own_resets[index] = wire
        log.warning(
            "group %d candidate %d: reset(seed=%d) differs in %s (reset_determinism: warn)",
            self.task.group_index,
            index,
            self.task.seed,
            ", ".join(fields[:8]),
        )

    # ------------------------------------------------------------------ turns
    async def _run_turns(self, episodes: list[CandidateEpisode], sessions: dict[int, EnvSession]) -> None:
        settings = self.settings
        for step in range(settings.max_steps):
            live = [ep for ep in episodes if ep.check_context()]
            if not live:
                return
            self._check_cancel()
            seeds = [generation_seed(self.task.seed, ep.candidate_index, step) for ep in live]
            options: dict[str, Any] = {"action_schema": self.shown_schema} if settings.constrained_actions else {}
            if self.task.decode_tile is not None:
                options["decode_tile"] = self.task.decode_tile
            started = now_ms()
            sampling = asyncio.ensure_future(
                asyncio.to_thread(
                    self.policy.sample,
                    [ep.context_ids for ep in live],
                    seeds,
                    max_new_tokens=settings.max_action_tokens,
                    temperature=settings.temperature,
                    adapter_dir=self.task.adapter_dir,
                    stop_after_think_budget=settings.thinking_budget_tokens,
                    thinking=settings.thinking,
                    **options,
                )
            )
            samples = await self._await_with_keepalive(sampling, [sessions[ep.candidate_index] for ep in live])
            latency = now_ms() - started
            await asyncio.gather(
                *(
                    self._apply(ep, sample, latency / len(live), sessions[ep.candidate_index])
                    for ep, sample in zip(live, samples)
                )
            )
            self.steps_done = step + 1
            self.heartbeat(
                {
                    "group_index": self.task.group_index,
                    "step": self.steps_done,
                    "live": sum(1 for ep in episodes if ep.live),
                }
            )
        for ep in episodes:
            if ep.live:
                ep.termination = "max_steps"

    async def _await_with_keepalive(self, task: asyncio.Future[Any], sessions: list[EnvSession]) -> Any:
        """Await the policy while every session answers pings and stays fresh, and the activity
        keeps heartbeating (a long generation on a slow model is not a dead worker)."""
        # Most samples are done well inside one keepalive interval: skip the keepalive machinery
        # for those (a frame that arrives meanwhile still poisons the session via its reader).
        done, _ = await asyncio.wait({task}, timeout=_FAST_SAMPLE_S)
        if task in done:
            for session in sessions:
                if hasattr(session, "run_with_keepalive"):
                    session._check_usable()
            return task.result()
        ticker = asyncio.ensure_future(self._heartbeat_until(task))
        try:
            keepers = [s.run_with_keepalive(task) for s in sessions if hasattr(s, "run_with_keepalive")]
            if keepers:
                results = await asyncio.gather(*keepers)
                return results[0]
            return await task
        finally:
            ticker.cancel()

    async def _heartbeat_until(self, task: asyncio.Future[Any], every_s: float = 1.0) -> None:
        while not task.done():
            await asyncio.wait({task}, timeout=every_s)
            if not task.done():
                # The progress so far stays in the details (the last heartbeat is what a
                # retried attempt and the Web UI see).
                self.heartbeat({"group_index": self.task.group_index, "step": self.steps_done, "phase": "sampling"})

    async def _apply(self, ep: CandidateEpisode, sample: Any, latency_ms: float, session: EnvSession) -> None:
        thinking = self.settings.thinking
        ids = list(sample.ids)
        text_ids = ids[:-1] if sample.finished and ids else ids
        text = self.policy.decode(text_ids)
        ep.record_action(ids, list(sample.logprobs), text, latency_ms)
        _reasoning, answer = self.policy.split_action(ids, thinking=thinking)
        action, harness = judge_answer(answer, self.validator)
        if harness is not None:
            if harness[0] != NO_OUTPUT:
                harness = truncation_outcome(*harness, len(ids), self.settings.max_action_tokens)
            content = ep.record_harness_error(*harness)
            # No answer (generation ended inside reasoning, or empty): the unfinished text is
            # kept as is, no turn follows and the completion never reaches the optimizer.
            if harness[0] != NO_OUTPUT:
                self._append_turn(ep, content, warning=True)
            return
        assert action is not None
        result = await session.step(action)
        observation = result.observation
        if result.kind == "observation" and observation is not None:
            content = ep.record_observation(action, observation, result.reward_value)
            self._append_turn(ep, content, warning=False)
        else:
            content = ep.record_protocol_error(action, dict(result.error or {}))
            self._append_turn(ep, content, warning=True)

    def _append_turn(self, ep: CandidateEpisode, content: str, *, warning: bool) -> None:
        ep.append_observation_tokens(
            self.policy.encode_observation_turn(content, thinking=self.settings.thinking),
            warning=warning,
        )

    async def _finish(self, ep: CandidateEpisode, session: EnvSession) -> None:
        """Final ``state`` unless the episode ended on a terminal protocol error."""
        if not (ep.termination == "protocol_error" and ep.protocol_error_code in TERMINAL_CODES):
            ep.final_state = await session.state()
        await session.close()

    def _check_cancel(self) -> None:
        if self.should_cancel():
            raise RunCancelled("collection cancelled", stage="collection")

    # ------------------------------------------------------------------ output
    def _provenance(self, ep: CandidateEpisode) -> dict[str, Any]:
        return provenance_of(
            self.task.inspection,
            reset_payload=self.task.reset_payload,
            seed=self.task.seed,
            steps=ep.steps,
            episode_return=ep.episode_return,
            termination=ep.termination,
            protocol_error_code=ep.protocol_error_code,
            behavior_policy=self.task.behavior_policy,
            context_policy=self.settings.context_policy,
        )

    def _document(self) -> dict[str, Any]:
        episodes = sorted(self.episodes, key=lambda ep: ep.candidate_index)
        completions = [
            {
                "text": TURN_BREAK.join(ep.action_texts()),
                "reward": ep.episode_return,
                "trajectory": ep.trajectory,
                "openenv": self._provenance(ep),
                "harness_code": ep.harness_code,
                "tokens": {"pieces": ep.pieces},
            }
            for ep in episodes
        ]
        replay_candidates = []
        records = []
        for ep in episodes:
            candidate = {
                "candidate_index": ep.candidate_index,
                "exchanges": ep.exchanges,
                "episode_return": ep.episode_return,
                "terminal_done": ep.terminal_done,
                "termination": ep.termination,
                "recoverable_protocol_errors": ep.recoverable_errors,
                "model_tokens": ep.model_tokens,
            }
            if ep.final_state is not None:
                candidate["final_state"] = ep.final_state
            if ep.context_exhausted is not None:
                candidate["context"] = ep.context_exhausted
            if ep.candidate_index in self.own_resets:
                candidate["reset_observation"] = self.own_resets[ep.candidate_index]
            replay_candidates.append(candidate)
            records.append(
                rollout_record(
                    self.identity,
                    group_index=self.task.group_index,
                    candidate_index=ep.candidate_index,
                    seed=self.task.seed,
                    steps=ep.steps,
                    episode_return=ep.episode_return,
                    termination=ep.termination,
                    protocol_error_code=ep.protocol_error_code,
                    recoverable_protocol_errors=ep.recoverable_errors,
                    model_tokens=ep.model_tokens,
                    harness_code=ep.harness_code,
                    context_windowed=ep.slides > 0,
                )
            )
        replay = {
            "group_index": self.task.group_index,
            "environment_index": self.task.environment_index,
            "seed": self.task.seed,
            "reset_payload": self.task.reset_payload,
            "reset_observation": self.reset_wire,
            "candidates": replay_candidates,
        }
        if self.context_limit is not None:
            replay["context_tokens"] = self.context_limit
        if self.nondeterministic_fields:
            replay["reset_nondeterministic_fields"] = sorted(self.nondeterministic_fields)
        return {
            "schema": GROUP_SCHEMA,
            "group_index": self.task.group_index,
            "environment_index": self.task.environment_index,
            "seed": self.task.seed,
            "line": {"messages": self.messages, "completions": completions},
            "replay": replay,
            "records": records,
        }

    def timings(self) -> dict[str, float]:
        """Wall-clock measurements: reported in status, never in the reproducible artifacts."""
        return {
            "model_latency_ms": round(sum(ep.model_latency_ms for ep in self.episodes), 3),
        }


_FAST_SAMPLE_S = 0.05


async def collect_group(
    task: GroupTask,
    policy: PolicyPort,
    *,
    should_cancel: Callable[[], bool] | None = None,
    heartbeat: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Collect one seed group and return its group document (``kiln.openenv-group.v1``)."""
    return await GroupCollector(task, policy, should_cancel=should_cancel, heartbeat=heartbeat).run()
