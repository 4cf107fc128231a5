"""Random draws of the moves: the very numbers ``random.Random`` draws, without its layers.

A search applies tens of thousands of moves, and ``rng.choice`` / ``rng.choices`` cost two
or three Python method calls per draw. When ``rng`` draws as :class:`random.Random` does,
the moves draw through the functions here instead, which copy what CPython's ``random``
module does internally (``Random._randbelow_with_getrandbits`` and the bisection of
``Random.choices``) and so make exactly the same draws: a plan depends only on the seed,
whichever backend (Python or the C kernel, which draws through ``rng.getrandbits`` the
same way) makes the moves. Everything else falls back to the rng's own methods.

This is the only place that relies on ``random``'s internals; ``tests/test_plan.py``
checks it against ``rng.choice`` and ``rng.choices``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import accumulate
from typing import Any

#: ``random.Random.choices``, to tell whether an rng overrides it.
_CHOICES = random.Random.choices


def _bits(rng: random.Random) -> Callable[[int], int] | None:
    """``rng.getrandbits`` when ``rng.choice`` draws as :class:`random.Random`'s does
    (``choice`` picks ``seq[_randbelow(len(seq))]``, and ``_randbelow`` draws
    ``n.bit_length()`` bits until they are below ``n``), else None."""
    cls = type(rng)
    if (cls.choice is not random.Random.choice
            or cls._randbelow is not random.Random._randbelow_with_getrandbits):
        return None
    return rng.getrandbits


def _chooser(rng: random.Random) -> Callable[[Sequence], Any]:
    """``rng.choice``, or when ``rng`` draws as :class:`random.Random` does, a function
    making exactly the same draws without its two method calls (see :func:`_bits`)."""
    bits = _bits(rng)
    if bits is None:
        return rng.choice

    def choice(seq):
        # random.Random._randbelow_with_getrandbits(len(seq)), then seq[r]
        n = len(seq)
        if not n:
            raise IndexError("Cannot choose from an empty sequence")
        k = n.bit_length()
        r = bits(k)
        while r >= n:
            r = bits(k)
        return seq[r]
    return choice


def _cumulative(weights, count: int) -> tuple[list[float], float] | None:
    """The cumulative weights and their total as ``random.Random.choices`` computes them
    for ``count`` items, or None if it would raise (cached for hashable weights: a search
    makes one move at a time). ``rng.choices(items, weights)[0]`` is then
    ``items[bisect_right(cum, rng.random() * total, 0, count - 1)]``."""
    try:
        return _cumulative_cached(weights, count)
    except TypeError:  # unhashable
        pass
    try:
        return _cumulative_cached.__wrapped__(weights, count)
    except TypeError:  # not numbers: rng.choices raises
        return None


@lru_cache(maxsize=16)
def _cumulative_cached(weights, count: int) -> tuple[list[float], float] | None:
    cum = list(accumulate(weights))
    total = cum[-1] + 0.0 if cum else 0.0
    if len(cum) != count or not 0.0 < total < float("inf"):
        return None
    return cum, total
