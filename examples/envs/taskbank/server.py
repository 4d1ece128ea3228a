"""Taskbank: a single-step question/answer environment that exposes the OpenEnv Task API.

Splits: ``train`` (3 tasks), ``test`` (2) and ``holdout`` (1, type ``validation``, with an extra
provider field). ``reset(split=..., index=...)`` selects a task (default ``train``/0, or by seed
when no index is given); the action ``{"answer": "<text>"}`` ends the episode with reward ``1.0``
when it equals the task's answer, else ``0.0``. ``get_task(index 99)`` raises IndexError, which the
openenv server turns into HTTP 400.

Run: ``python -m examples.envs.taskbank.server --port P``.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

TASKS: dict[str, list[dict[str, Any]]] = {
    "train": [
        {"id": "t0", "question": "2+2", "answer": "4"},
        {"id": "t1", "question": "3*3", "answer": "9"},
        {"id": "t2", "question": "10-7", "answer": "3"},
    ],
    "test": [
        {"id": "s0", "question": "5+5", "answer": "10"},
        {"id": "s1", "question": "6/2", "answer": "3"},
    ],
    "holdout": [{"id": "h0", "question": "7+1", "answer": "8"}],
}
SPLITS = [
    {"name": "train", "type": "train"},
    {"name": "test", "type": "test"},
    {"name": "holdout", "type": "validation", "provider": "reference"},
]


class AnswerAction(Action):
    answer: str = Field(max_length=64, description="The answer to the question")


class QuestionObservation(Observation):
    question: str = ""
    input_text: str = ""


class TaskbankState(State):
    split: str = "train"
    index: int = 0


def _rows(split: str) -> list[dict[str, Any]]:
    if split not in TASKS:
        raise ValueError(f"unknown split {split!r}")
    return TASKS[split]


class TaskbankEnvironment(Environment[AnswerAction, QuestionObservation, TaskbankState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = TaskbankState(episode_id=None, step_count=0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="TaskbankEnvironment", description="Answer one question per episode.",
            version="0.1.0", author="kiln",
        )

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        split: str = "train",
        index: Optional[int] = None,
        **kwargs: Any,
    ) -> QuestionObservation:
        rows = _rows(split)
        chosen = index if index is not None else (seed or 0) % len(rows)
        self._state = TaskbankState(
            episode_id=episode_id or f"{split}-{chosen}", step_count=0, split=split, index=chosen
        )
        question = rows[chosen]["question"]
        return QuestionObservation(
            question=question, input_text=f'What is {question}? Reply {{"answer": "..."}}.', reward=None
        )

    def step(self, action: AnswerAction, timeout_s: Optional[float] = None, **kwargs: Any) -> QuestionObservation:
        self._state.step_count += 1
        row = _rows(self._state.split)[self._state.index]
        reward = 1.0 if action.answer.strip() == row["answer"] else 0.0
        return QuestionObservation(question=row["question"], input_text="Episode over.", reward=reward, done=True)

    @property
    def state(self) -> TaskbankState:
        return self._state

    # ---- Task API (discovered by openenv's create_app through these method names) ----
    def list_splits(self) -> list[dict[str, Any]]:
        return [dict(s) for s in SPLITS]

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return _rows(split)

    def num_tasks(self, split: str) -> int:
        return len(_rows(split))

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        rows = _rows(split)
        if index < 0 or index >= len(rows):
            raise IndexError(index)
        return rows[index]

    def get_task_range(self, split: str, start: Optional[int] = None, stop: Optional[int] = None) -> list:
        return _rows(split)[start:stop]


def build_app(*, max_concurrent_envs: int = 8, schema_variant: int = 1) -> Any:
    """The FastAPI app (``schema_variant`` is accepted for the shared example-env CLI and ignored)."""
    return create_app(
        TaskbankEnvironment,
        AnswerAction,
        QuestionObservation,
        env_name="taskbank",
        max_concurrent_envs=max_concurrent_envs,
        state_cls=TaskbankState,
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve the taskbank example environment.")
    parser.add_argument("--port", type=int, default=8991)
    parser.add_argument("--max-concurrent-envs", type=int, default=8)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(max_concurrent_envs=args.max_concurrent_envs), host="127.0.0.1",
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
