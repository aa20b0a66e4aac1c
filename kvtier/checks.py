"""Argument checks shared by every public entry point, so a bad argument gets the same clear error everywhere.

Python lets ``True`` pass for 1, ``0.5`` truncate to 0 and ``"1"`` compare oddly; numpy turns a ragged list into an
object array or a ``ValueError`` of its own. These checks refuse all of that with :class:`InvalidArgument` naming the
argument, before any state changes.
"""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument


def integer(value: Any, name: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int (Python or numpy integer, never bool), within [low, high) when given."""
    if type(value) is int and low is None and high is None:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise InvalidArgument(f"{name} must be >= {low}, got {value}")
    if high is not None and value >= high:
        raise InvalidArgument(f"{name} must be < {high}, got {value}")
    return value


def positive_number(value: Any, name: str, *, zero: bool = False, unit: str = "") -> float:
    """``value`` as a finite float > 0 (>= 0 with ``zero``): any real number type, never bool or a string, never an
    integer too large for a float. The error reads ``name=value: a finite number [of unit] > 0``."""
    what = f"a finite number{f' of {unit}' if unit else ''} {'>=' if zero else '>'} 0"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name}={value!r:.60}: {what}, not a {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        raise InvalidArgument(f"{name}={value!r:.30}...: {what}, not an integer too large for a float") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero):
        raise InvalidArgument(f"{name}={value!r}: {what}")
    return number


class Choice(str, enum.Enum):
    """A name from a fixed set; an unknown one is refused with the list of choices."""

    @classmethod
    def _missing_(cls, value: object) -> None:
        choices = ", ".join(repr(member.value) for member in cls)
        what = getattr(cls, "__what__", cls.__name__)
        raise InvalidArgument(f"unknown {what} {value!r}: choose one of {choices}")


INT64 = np.iinfo(np.int64)


def index_array(values: Any, name: str) -> np.ndarray:
    """A flat int64 array from a list, tuple, numpy array or torch tensor of integers (CPU or device)."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values                             # what allocate() hands out: nothing to check or convert
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        values = values.detach().cpu().numpy()
    if isinstance(values, (str, bytes)) or np.isscalar(values):
        raise InvalidArgument(f"{name} must be a sequence of integers, got {type(values).__name__} {values!r}")
    try:
        array = np.asarray(values)
    except ValueError as exc:
        raise InvalidArgument(f"{name} must be a flat sequence of integers: {exc}") from exc
    if array.size == 0:
        return np.empty(0, np.int64)
    if array.ndim != 1:
        raise InvalidArgument(f"{name} must be a flat sequence of integers, got shape {array.shape}")
    integral = array.dtype != np.bool_ and np.issubdtype(array.dtype, np.integer)
    if not integral and (array.dtype != object or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in array)):
        raise InvalidArgument(f"{name} must hold integers, got dtype {array.dtype} ({array[:4].tolist()}...)")
    if array.dtype.kind in "uO" and not INT64.min <= int(array.min()) <= int(array.max()) <= INT64.max:
        raise InvalidArgument(f"{name} holds values past the int64 range")
    return array.astype(np.int64, copy=False)
