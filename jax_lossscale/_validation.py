"""Checks on hyperparameters, made once when a loss scale is constructed.

Each check returns the value as a plain Python `float`, `int` or `bool`, so that
loss-scale objects compare, hash and serialize the same however a number was
written (`2**15`, `32768.0`, `np.float32(32768)`). Real numbers are rounded to
float32, the precision the state computes in, so that the checks and the
config see the very values the update rule uses.
"""

import math
import numbers
from typing import Any, NoReturn

import numpy as np

from jax_lossscale._tree import safe_repr

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)
INT32_MAX = int(np.iinfo(np.int32).max)


def fail(
    owner: str, name: str, value: Any, requirement: str, error: type[Exception] = ValueError
) -> NoReturn:
    """Raises `error` with a message that names the argument and the value received."""
    raise error(f"{owner}({name}={describe(value)}): {name} must be {requirement}")


def describe(value: Any, limit: int = 80) -> str:
    """`repr(value)`, shortened in the middle when longer than `limit` characters."""
    text = safe_repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}...{text[-(limit // 4) :]}"


def real(owner: str, name: str, value: Any) -> float:
    """A finite real number that float32 can hold, rounded to float32."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(owner, name, value, "a real number", TypeError)
    try:
        number = float(value)
    except OverflowError:  # an int or Fraction beyond every float
        fail(owner, name, value, f"at most the float32 maximum ({FLOAT32_MAX!r})")
    if not math.isfinite(number):
        fail(owner, name, value, "finite")
    if abs(number) > FLOAT32_MAX:
        fail(owner, name, value, f"at most the float32 maximum ({FLOAT32_MAX!r})")
    return float(np.float32(number))


def positive_real(owner: str, name: str, value: Any) -> float:
    """A real number > 0 and not subnormal in float32: XLA on CPU flushes subnormals to zero."""
    number = real(owner, name, value)
    if number <= 0:
        fail(owner, name, value, "> 0")
    if number < FLOAT32_SMALLEST_NORMAL:
        fail(owner, name, value, f">= the smallest normal float32 ({FLOAT32_SMALLEST_NORMAL!r})")
    return number


def integer(owner: str, name: str, value: Any) -> int:
    """An integer in [1, 2**31 - 1], the range of the int32 counters in the state."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(owner, name, value, "an integer >= 1", TypeError)
    number = int(value)
    if not 1 <= number <= INT32_MAX:
        fail(owner, name, value, f"an integer >= 1 and <= {INT32_MAX}")
    return number


def boolean(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        fail(owner, name, value, "a bool", TypeError)
    return bool(value)
