"""Wire reward → training value.

Owns: the one mapping from an OpenEnv reward (null, bool, int or finite float, type preserved in
artifacts) to the float added to an episode return.
"""

from __future__ import annotations

import math

from kiln.core.errors import EnvironmentProtocolError


def is_valid_wire_reward(value: object) -> bool:
    """True for null, a bool, an int, or a finite float."""
    if value is None or isinstance(value, (bool, int)):
        return True
    return isinstance(value, float) and math.isfinite(value)


def training_reward(value: object) -> float:
    """None→0.0, False→0.0, True→1.0, int→float, finite float→itself; anything else fails."""
    if value is None or value is False:
        return 0.0
    if value is True:
        return 1.0
    if isinstance(value, int):
        try:
            converted = float(value)
        except OverflowError:
            converted = math.inf
        if not math.isfinite(converted):
            raise EnvironmentProtocolError("environment reward is an integer too large for a float")
        return converted
    if isinstance(value, float):
        if not math.isfinite(value):
            raise EnvironmentProtocolError("environment reward is not a finite number")
        return value
    raise EnvironmentProtocolError(f"environment reward has type {type(value).__name__}; expected null, bool or number")
