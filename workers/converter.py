"""Kiln's Temporal data converter: pydantic JSON, read tolerantly.

The SDK's pydantic converter, except that every payload it reads validates under
``kiln.core.tolerant.TOLERANT_CONTEXT``: a field written by one release newer (a result of a
newer worker, a status of a newer workflow) is ignored rather than failing the decode, so a
rolling deploy in either direction does not fail runs in flight (docs/upgrading.md). What it
writes is unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import TypeAdapter
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter
from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
)

from kiln.core.tolerant import TOLERANT_CONTEXT

_cached_adapter = functools.lru_cache(maxsize=1024)(TypeAdapter)


def _adapter(hint: Any) -> TypeAdapter[Any]:
    try:
        hash(hint)
    except TypeError:
        return TypeAdapter(hint)
    return _cached_adapter(hint)


class TolerantJSONConverter(PydanticJSONPlainPayloadConverter):
    """Writes as the SDK's pydantic JSON converter; reads ignoring unknown fields."""

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        return _adapter(type_hint if type_hint is not None else Any).validate_json(
            payload.data, context=TOLERANT_CONTEXT
        )


class KilnPayloadConverter(CompositePayloadConverter):
    """The SDK's default encodings, with :class:`TolerantJSONConverter` for JSON."""

    def __init__(self) -> None:
        json_converter = TolerantJSONConverter()
        super().__init__(
            *(
                json_converter if isinstance(c, JSONPlainPayloadConverter) else c
                for c in DefaultPayloadConverter.default_encoding_payload_converters
            )
        )


kiln_data_converter = DataConverter(payload_converter_class=KilnPayloadConverter)
