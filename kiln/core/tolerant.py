"""Reading what one release newer wrote: the one rule by which Kiln's models ignore unknown fields.

Every model that crosses Temporal (activity inputs and results, a run's status, the run request
inside them) or that a client reads from the API forbids unknown fields when it validates a
user's input: a misspelt request field is an error. But during a rolling deploy in either
direction a worker of release N decodes what a worker of release N+1 wrote (a result with a field
N does not have yet), and a client of release N reads an API of N+1. Those decodes validate with
:data:`TOLERANT_CONTEXT`, under which :class:`Tolerant` drops the fields the model does not
know, at every depth, before validating the rest as strictly as ever. Kiln's Temporal data
converter (``workers.converter``) passes it on every payload it reads; ``kiln.client`` on every
view it parses. Nothing else does, so API input stays strict.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationInfo, model_validator

TOLERANT = "kiln.tolerate_unknown_fields"
TOLERANT_CONTEXT: dict[str, Any] = {TOLERANT: True}


def known_keys(model: type[BaseModel]) -> set[str]:
    """The keys ``model`` reads: its field names and their aliases."""
    keys = set(model.model_fields)
    for field in model.model_fields.values():
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                keys.add(alias)
    return keys


class Tolerant(BaseModel):
    """A model that, under :data:`TOLERANT_CONTEXT` only, ignores the fields it does not know."""

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_fields(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or not (info.context or {}).get(TOLERANT):
            return data
        known = known_keys(cls)
        return {key: value for key, value in data.items() if key in known}
