"""Quantities read from text (options, the environment) and written for people: sizes in
bytes and seconds.

Binary units throughout: ``k``/``KB``/``KiB`` = 1024 bytes, ``M``/``MB``/``MiB`` = 2**20,
``G``/``GB``/``GiB`` = 2**30, ``T``/``TB``/``TiB`` = 2**40 (case does not matter).
"""

from __future__ import annotations

import math
import os
import re

__all__ = ["env_bytes", "env_seconds", "format_bytes", "format_seconds", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
          "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str) -> int:
    """A size such as ``512MiB``, ``8GiB``, ``1.5g`` or ``1048576``, in bytes.

    Raises:
        ValueError: not a finite size > 0.
    """
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 512MiB, 8GiB, 1048576)")
    value = float(m.group(1)) * _UNITS[unit]
    if not 1 <= value < 2**63:
        raise ValueError(f"{text!r} must be at least 1 byte and finite")
    return int(value)


def env_bytes(name: str) -> int | None:
    """The environment variable ``name`` as a size in bytes (:func:`parse_bytes`; None:
    unset or empty).

    Raises:
        ValueError: it is set but not a size (the message starts with the variable).
    """
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return parse_bytes(value)
    except ValueError as err:
        raise ValueError(f"{name}={err}") from None


def env_seconds(name: str) -> float | None:
    """The environment variable ``name`` as a positive number of seconds (None: unset or
    empty).

    Raises:
        ValueError: it is set but not a number > 0 (the message names the variable).
    """
    value = os.environ.get(name)
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{name}={value!r} must be > 0 seconds")
    return seconds


def format_bytes(n: int | float) -> str:
    """``n`` bytes for people: ``1.50 GiB``, ``12.00 MiB``, ``3.25 KiB``, ``17 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_seconds(t: float) -> str:
    """``t`` seconds for people: ``1.234 s``, ``12.345 ms``, ``56.7 us`` (``inf`` and
    ``nan`` as Python writes them)."""
    if not math.isfinite(t):
        return str(t)
    if t >= 1.0:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"
