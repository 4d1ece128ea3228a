"""A real ``openenv`` server whose steps answer recoverable errors, keys in the server's order.

The counter example's rules (``count += amount``, target from the seed), except:

* ``amount == 4``: the environment raises, so ``openenv`` answers ``EXECUTION_ERROR`` with data
  ``{"message", "code"}`` (message first, as ``openenv`` builds it);
* ``amount == 5``: the action fails a validator that the advertised schema does not show, so
  ``openenv`` answers ``VALIDATION_ERROR`` with ``{"message", "code", "errors": [{"type", "loc",
  "msg", "input", "ctx"}]}`` (pydantic's own key order, nested).

Run: ``python -m tests.support.error_env --port P``.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import uvicorn
from openenv.core.env_server.http_server import create_app
from pydantic import field_validator
from pydantic_core import PydanticCustomError

from examples.envs.counter.server import CounterAction, CounterEnvironment, CounterObservation, CounterState

JAM_AMOUNT = 4
REFUSED_AMOUNT = 5
JAM_MESSAGE = "the counter jammed at amount 4"


class JammingAction(CounterAction):
    @field_validator("amount")
    @classmethod
    def _refuse_five(cls, value: int) -> int:
        if value == REFUSED_AMOUNT:
            raise PydanticCustomError("amount_refused", "amount {amount} is refused today", {"amount": value})
        return value


class JammingCounterEnvironment(CounterEnvironment):
    def step(self, action: CounterAction, timeout_s: Optional[float] = None, **kwargs: Any) -> CounterObservation:
        if action.amount == JAM_AMOUNT:
            raise RuntimeError(JAM_MESSAGE)
        return super().step(action, timeout_s=timeout_s, **kwargs)


def build_app() -> Any:
    return create_app(
        JammingCounterEnvironment,
        JammingAction,
        CounterObservation,
        env_name="jamming-counter",
        max_concurrent_envs=8,
        state_cls=CounterState,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="counter that answers recoverable errors")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(build_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
