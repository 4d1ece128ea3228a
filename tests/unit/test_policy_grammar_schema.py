"""Constrained decoding of a discriminated union (issue 12): the discriminator and fixed values are
always written, strings are bounded, and the real pydantic action model accepts every answer."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Literal, Union

import pytest
from openenv.core.env_server.types import Action
from pydantic import BaseModel, Field

from kiln.core.openenv.schema import policy_action_schema
from kiln.core.policy.grammar_schema import DEFAULT_MAX_STRING_CHARS, grammar_schema
from tests.support.models import shared_tiny_model

pytestmark = pytest.mark.timeout(300)


class Move(BaseModel):
    kind: Literal["move"] = "move"
    direction: Literal["up", "down", "left", "right"]
    steps: int = Field(ge=1, le=3)


class Say(BaseModel):
    kind: Literal["say"] = "say"
    text: str
    channel: Literal["all"] = "all"


class UnionAction(Action):
    command: Annotated[Union[Move, Say], Field(discriminator="kind")]


SCHEMA = policy_action_schema(UnionAction.model_json_schema())
MESSAGES = [
    {"role": "system", "content": "Act in the world. Reply with one JSON action."},
    {"role": "user", "content": "You stand in a corridor."},
]


def test_tightened_schema_requires_fixed_values_and_bounds_strings() -> None:
    tight = grammar_schema(SCHEMA)
    defs = tight["$defs"]
    assert "kind" in defs["Move"]["required"] and "kind" in defs["Say"]["required"]
    assert "channel" in defs["Say"]["required"]  # a single-value Literal with a default
    assert defs["Say"]["properties"]["text"]["maxLength"] == DEFAULT_MAX_STRING_CHARS
    assert "required" not in SCHEMA["$defs"]["Say"] or "channel" not in SCHEMA["$defs"]["Say"]["required"]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    import torch

    from kiln.core.policy.runtime import PolicyRuntime

    torch.set_num_threads(1)
    return PolicyRuntime.load(shared_tiny_model(tmp_path_factory))


UNION_SAMPLES = 256


def union_samples(model_path: str) -> list[dict]:
    """The tiny model's ``UNION_SAMPLES`` constrained answers (seeds 0..n−1, T=1, thinking off) as
    JSON, computed in a ``background`` child process (``tests/support/background.py``)."""
    from kiln.core.policy.runtime import PolicyRuntime

    rt = PolicyRuntime.load(Path(model_path))
    prompt = rt.encode_prompt(MESSAGES, thinking=False)
    samples = rt.sample([prompt] * UNION_SAMPLES, list(range(UNION_SAMPLES)), max_new_tokens=192,
                        temperature=1.0, thinking=False, action_schema=SCHEMA)
    return [{"ids": s.ids, "finished": s.finished} for s in samples]


@pytest.mark.background("union_samples")
def test_discriminated_union_zero_invalid_of_256(rt, background_jobs) -> None:
    samples = [SimpleNamespace(**s) for s in background_jobs.result("union_samples", timeout_s=280)]
    assert len(samples) == UNION_SAMPLES
    invalid, kinds = 0, set()
    for sample in samples:
        _, answer = rt.split_action(sample.ids, thinking=False)
        try:
            parsed = json.loads(answer or "")
            UnionAction.model_validate(parsed)  # what the environment's server runs
            ok = sample.finished and "kind" in parsed["command"]
            kinds.add(parsed["command"]["kind"])
            if parsed["command"]["kind"] == "say":
                ok = ok and len(parsed["command"]["text"]) <= DEFAULT_MAX_STRING_CHARS
                ok = ok and parsed["command"]["channel"] == "all"
        except (ValueError, KeyError, TypeError):
            ok = False
        invalid += not ok
    assert invalid == 0
    assert kinds == {"move", "say"}
