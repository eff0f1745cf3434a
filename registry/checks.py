"""The checks every side makes of a caller's values, each written once: a rank, and a wait in
seconds. A failed check raises the caller's own error type with a message that says what to
fix: the registry's ``InvalidRequest`` family for a remote caller's value, ``ValueError`` for a
constructor's or a config's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from registry.settings import MAX_WAIT_S

Raise = Callable[[str], Exception]


def check_rank(value: Any, error: Raise = ValueError, name: str = "rank") -> int:
    """``value`` as a rank: an integer >= 0 (``bool`` is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise error(f"{name} must be an integer >= 0, got {value!r}")
    return value


def check_seconds(value: Any, error: Raise = ValueError, name: str = "timeout_s", *, allow_zero: bool = True) -> float:
    """``value`` as a wait: a number of seconds from 0 (or, without ``allow_zero``, above 0)
    up to ``MAX_WAIT_S``, the longest any call may wait."""
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)
    if not number or value < 0 or (value == 0 and not allow_zero) or value > MAX_WAIT_S:
        span = f"between 0 and {MAX_WAIT_S:.0f}" if allow_zero else f"above 0, at most {MAX_WAIT_S:.0f}"
        raise error(f"{name} must be a number of seconds {span}, got {value!r}")
    return float(value)
