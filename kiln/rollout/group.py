"""Collect one seed group: every candidate of one seed, all turns, against one environment.

The group is the durable unit of collection. Candidates run in waves of ``min(concurrency,
group_size)``; within a wave, each turn samples every live candidate in ONE batched policy call,
then steps every session concurrently. Token ids are kept end to end: a candidate's next prompt is
its previous ids plus the new observation's ids, never a re-rendered conversation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln.canonical import canonical_json
from kiln.contracts import EpisodeSettings  # noqa: F401  (re-exported: collection settings live in contracts)
from kiln.errors import CollectionFailed, RunCancelled
from kiln.openenv.schema import ActionValidator, policy_action_schema
from kiln.openenv.session import TERMINAL_CODES, EnvSession, open_session_and_reset
from kiln.openenv.urls import normalize_url
from kiln.rollout.episode import TURN_BREAK, CandidateEpisode, now_ms
from kiln.rollout.exchange import NO_OUTPUT, judge_answer
from kiln.rollout.policy_port import PolicyPort
from kiln.rollout.prompts import initial_messages
from kiln.rollout.provenance import (  # noqa: F401  (ROLLOUT_SCHEMA, environment_name re-exported)
    ROLLOUT_SCHEMA,
    environment_name,
    provenance_of,
    rollout_record,
)
from kiln.rollout.seeds import generation_seed

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


class GroupCollector:
    """Runs one seed group; construct per group, call :meth:`run` once."""

    def __init__(
        self,
        task: GroupTask,
        policy: PolicyPort,
        *,
        should_cancel: Callable[[], bool] | None = None,
        heartbeat: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.task = task
        self.policy = policy
        self.settings = task.settings
        self.should_cancel = should_cancel or (lambda: False)
        self.heartbeat = heartbeat or (lambda _details: None)
        identity = task.inspection["identity"]
        self.identity = identity
        self.url = normalize_url(identity["base_url"])
        action_schema = task.inspection["schema"]["action"]
        self.validator = ActionValidator.compile(action_schema)
        self.shown_schema = policy_action_schema(action_schema)
        self.episodes: list[CandidateEpisode] = []
        self.final_states: dict[int, dict[str, Any] | None] = {}
        self.messages: list[dict[str, Any]] | None = None
        self.reset_wire: dict[str, Any] | None = None

    # ------------------------------------------------------------------ public
    async def run(self) -> dict[str, Any]:
        size = self.settings.group_size
        wave = max(1, min(self.settings.concurrency, size))
        for start in range(0, size, wave):
            self._check_cancel()
            await self._run_wave(list(range(start, min(size, start + wave))))
        return self._document()

    # ------------------------------------------------------------------ waves
    async def _run_wave(self, candidates: list[int]) -> None:
        sessions: dict[int, EnvSession] = {}
        try:
            opened = await asyncio.gather(
                *(self._open(index) for index in candidates), return_exceptions=True
            )
            failures = [item for item in opened if isinstance(item, BaseException)]
            for item in opened:
                if not isinstance(item, BaseException):
                    sessions[item[0]] = item[1]
            if failures:
                raise failures[0]
            episodes = [self._episode_for(index, opened_item) for index, opened_item in zip(candidates, opened)]
            self.episodes.extend(episodes)
            await self._run_turns(episodes, sessions)
            await asyncio.gather(*(self._finish(ep, sessions[ep.candidate_index]) for ep in episodes))
        finally:
            await asyncio.gather(*(session.close() for session in sessions.values()), return_exceptions=True)

    async def _open(self, index: int) -> tuple[int, EnvSession, Any, int]:
        session, result, retries = await open_session_and_reset(
            self.url,
            self.task.reset_payload,
            capacity_wait_s=float(self.settings.capacity_wait_seconds),
            bearer_token=self.task.bearer_token,
            should_cancel=self.should_cancel,
            on_wait=lambda retries: self.heartbeat(
                {"group_index": self.task.group_index, "candidate_index": index, "capacity_retries": retries}
            ),
        )
        return index, session, result, retries

    def _episode_for(self, index: int, opened: tuple[int, EnvSession, Any, int]) -> CandidateEpisode:
        _, _session, result, retries = opened
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
        messages = initial_messages(self.identity.get("metadata") or {}, self.shown_schema, wire)
        if self.messages is None:
            self.messages, self.reset_wire = messages, wire
        elif canonical_json(messages) != canonical_json(self.messages) or canonical_json(
            wire
        ) != canonical_json(self.reset_wire):
            raise CollectionFailed(
                f"group {self.task.group_index} candidate {index}: reset(seed={self.task.seed}) "
                "must be deterministic — candidates of one group saw different reset observations",
                retryable=False,
            )
        prompt_ids = self.policy.encode_prompt(messages, thinking=self.settings.thinking)
        return CandidateEpisode(
            candidate_index=index,
            prompt_ids=prompt_ids,
            protocol_error_reward=self.settings.protocol_error_reward,
            max_recoverable_errors=self.settings.max_recoverable_errors,
            capacity_retries=retries,
        )

    # ------------------------------------------------------------------ turns
    async def _run_turns(self, episodes: list[CandidateEpisode], sessions: dict[int, EnvSession]) -> None:
        settings = self.settings
        for step in range(settings.max_steps):
            live = [ep for ep in episodes if ep.live]
            if not live:
                return
            self._check_cancel()
            seeds = [generation_seed(self.task.seed, ep.candidate_index, step) for ep in live]
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
                    **({"action_schema": self.shown_schema} if settings.constrained_actions else {}),
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
            self.heartbeat(
                {
                    "group_index": self.task.group_index,
                    "step": step + 1,
                    "live": sum(1 for ep in episodes if ep.live),
                }
            )
        for ep in episodes:
            if ep.live:
                ep.termination = "max_steps"

    async def _await_with_keepalive(self, task: "asyncio.Future[Any]", sessions: list[EnvSession]) -> Any:
        """Await the policy while every session answers pings and stays fresh, and the activity
        keeps heartbeating (a long generation on a slow model is not a dead worker)."""
        ticker = asyncio.ensure_future(self._heartbeat_until(task))
        try:
            keepers = [s.run_with_keepalive(task) for s in sessions if hasattr(s, "run_with_keepalive")]
            if keepers:
                results = await asyncio.gather(*keepers)
                return results[0]
            return await task
        finally:
            ticker.cancel()

    async def _heartbeat_until(self, task: "asyncio.Future[Any]", every_s: float = 1.0) -> None:
        while not task.done():
            await asyncio.wait({task}, timeout=every_s)
            if not task.done():
                self.heartbeat({"group_index": self.task.group_index, "phase": "sampling"})

    async def _apply(self, ep: CandidateEpisode, sample: Any, latency_ms: float, session: EnvSession) -> None:
        thinking = self.settings.thinking
        ids = list(sample.ids)
        text_ids = ids[:-1] if sample.finished and ids else ids
        text = self.policy.decode(text_ids)
        ep.record_action(ids, list(sample.logprobs), text, latency_ms)
        _reasoning, answer = self.policy.split_action(ids, thinking=thinking)
        action, harness = judge_answer(answer, self.validator)
        if harness is not None:
            content = ep.record_harness_error(*harness)
            # No answer (generation ended inside reasoning, or empty): the unfinished text is
            # kept as is, no turn follows and the completion never reaches the optimizer.
            if harness[0] != NO_OUTPUT:
                self._append_turn(ep, content, warning=True)
            return
        assert action is not None
        result = await session.step(action)
        if result.kind == "observation":
            content = ep.record_observation(action, result.observation, result.reward_value)
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
        """R3.15: final ``state`` unless the episode ended on a terminal protocol error."""
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
                "capacity_retries": ep.capacity_retries,
                "model_tokens": ep.model_tokens,
            }
            if ep.final_state is not None:
                candidate["final_state"] = ep.final_state
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
                    capacity_retries=ep.capacity_retries,
                    model_tokens=ep.model_tokens,
                )
            )
        return {
            "schema": GROUP_SCHEMA,
            "group_index": self.task.group_index,
            "environment_index": self.task.environment_index,
            "seed": self.task.seed,
            "line": {"messages": self.messages, "completions": completions},
            "replay": {
                "group_index": self.task.group_index,
                "environment_index": self.task.environment_index,
                "seed": self.task.seed,
                "reset_payload": self.task.reset_payload,
                "reset_observation": self.reset_wire,
                "candidates": replay_candidates,
            },
            "records": records,
        }

    def timings(self) -> dict[str, float]:
        """Wall-clock measurements: reported in status, never in the reproducible artifacts."""
        return {
            "model_latency_ms": round(sum(ep.model_latency_ms for ep in self.episodes), 3),
        }



async def collect_group(
    task: GroupTask,
    policy: PolicyPort,
    *,
    should_cancel: Callable[[], bool] | None = None,
    heartbeat: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Collect one seed group and return its group document (``kiln.openenv-group.v1``)."""
    return await GroupCollector(task, policy, should_cancel=should_cancel, heartbeat=heartbeat).run()
