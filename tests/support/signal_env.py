"""A real ``openenv`` server whose groups carry reward variation or not, by seed (dynamic sampling).

Episodes are one step: add ``amount`` (1-5). The reward does not depend on the action:

* an even seed, or any seed reset with the option ``flat: true``, pays ``FLAT_REWARD`` on every
  episode, so its group has no reward variation;
* an odd seed pays ``n % 2`` on the n-th step this server process takes for that seed (0, 1, 0 …),
  so any group of two or more candidates of that seed holds both 0 and 1.

Run: ``python -m tests.support.signal_env --port P``.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field

from tests.support.server_main import serve_main

FLAT_REWARD = 0.5

_steps: dict[int, int] = {}  # steps taken per odd seed, across every session of this process
_lock = threading.Lock()


class SignalAction(Action):
    amount: int = Field(ge=1, le=5, description="Any amount (1-5)")


class SignalObservation(Observation):
    input_text: str = ""


class SignalState(State):
    seed: Optional[int] = None
    flat: bool = False


class SignalEnvironment(Environment[SignalAction, SignalObservation, SignalState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = SignalState(episode_id=None, step_count=0)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="signal", description="Odd seeds vary, even seeds pay the same.", version="0.1.0", author="kiln"
        )

    def reset(
        self, seed: Optional[int] = None, episode_id: Optional[str] = None, flat: bool = False, **kwargs: Any
    ) -> SignalObservation:
        self._state = SignalState(episode_id=f"seed-{seed}", step_count=0, seed=seed, flat=bool(flat))
        return SignalObservation(input_text="Pick an amount from 1 to 5.")

    def step(self, action: SignalAction, timeout_s: Optional[float] = None, **kwargs: Any) -> SignalObservation:
        self._state.step_count += 1
        seed = self._state.seed
        if self._state.flat or seed is None or seed % 2 == 0:
            reward = FLAT_REWARD
        else:
            with _lock:
                reward = float(_steps.get(seed, 0) % 2)
                _steps[seed] = _steps.get(seed, 0) + 1
        return SignalObservation(input_text=f"You said {action.amount}.", done=True, reward=reward)

    @property
    def state(self) -> SignalState:
        return self._state


def build_app(max_concurrent_envs: int = 8) -> Any:
    return create_app(
        SignalEnvironment, SignalAction, SignalObservation, env_name="signal", max_concurrent_envs=max_concurrent_envs
    )


def main(argv: list[str] | None = None) -> None:
    serve_main(build_app, __doc__, argv)


if __name__ == "__main__":
    main()
