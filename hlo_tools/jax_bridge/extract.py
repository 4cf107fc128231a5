"""From a jax function to its whole-program pre-optimization HLO text."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from hlo_tools.jax_bridge import internals

__all__ = ["extract", "fresh_function", "jitted", "lowered_text"]


def jitted(fn: Callable[..., Any]) -> Any:
    """Returns ``fn`` if it is already jit-wrapped (has ``.lower``), else ``jax.jit(fn)``."""
    return fn if hasattr(fn, "lower") else jax.jit(fn)


def lowered_text(lowered: jax.stages.Lowered, *, metadata: bool = False) -> str:
    """Prints the pre-optimization HLO module of a ``Lowered`` as re-parsable text.

    Args:
        lowered: Result of ``jax.jit(fn).lower(...)``.
        metadata: Also print jax's ``metadata={op_name=...}``. Leave False to have XLA
            report each instruction's own name as its op_name once compiled.

    Returns:
        HLO text accepted by XLA's parser, large constants included (never ``{...}``).
    """
    module = lowered.compiler_ir("hlo").as_hlo_module()
    return module.to_string(internals.print_options(metadata))


def extract(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Whole-program pre-optimization HLO text of ``fn`` lowered on ``args``.

    Args:
        fn: A plain function or an already ``jax.jit``-wrapped one.
        *args: Positional arguments (pytrees of arrays or ``ShapeDtypeStruct``).
        **kwargs: Keyword arguments passed to ``lower``.

    Returns:
        HLO text equal to ``jax.jit(fn).lower(...).as_text(dialect="hlo")``.
    """
    return lowered_text(jitted(fn).lower(*args, **kwargs))


def fresh_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object that calls ``fn`` (a jit-wrapped ``fn`` is returned as is).

    jax caches the lowering of a function per argument signature, and writing a text
    into that cached lowering would make afterwards ``jax.jit(fn)``, ``extract(fn, ...)``
    and compiling ``None`` in place of ``fn`` all see the text instead of ``fn``'s own program.
    Lowering a fresh wrapper keeps the baselines from reading, or leaving behind, such a
    text.
    """
    if hasattr(fn, "lower"):
        return fn

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return step
