"""The value every step of the pipeline reads: a train step lowered and parsed once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from hlo_tools.graph import DeviceGraph
from hlo_tools.ir import HloModule

__all__ = ["Program", "lower_program"]


class Program(NamedTuple):
    """A data-parallel train step with its arguments, lowered and parsed once.

    Attributes:
        step: the step as every candidate compiles it: jitted (a jitted step keeps its
            ``jax.jit`` arguments), never the caller's own function object (jax caches
            lowerings per function; see :func:`hlo_tools.jax_bridge.fresh_function`).
        args: its positional arguments, placed as they run (arrays, never donated).
        text: the whole-program pre-optimization HLO text (``lowered.as_text``).
        module: ``text`` parsed (:func:`hlo_tools.parse`).
        graph: the per-device dataflow graph of ``module`` (:func:`hlo_tools.device_graph`).
        platform: the jax platform it runs on (``cpu``, ``gpu``, ...).
    """

    step: Callable[..., Any]
    args: tuple[Any, ...]
    text: str
    module: HloModule
    graph: DeviceGraph
    platform: str

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the gradient all-reduces together, per device."""
        return sum(int(self.graph.out_bytes[i]) for i in self.graph.gradient_allreduces)


def lower_program(step: Callable[..., Any], args: Sequence[Any]) -> Program:
    """Lowers ``step`` on ``args`` (through a fresh function or its own ``jax.jit``
    object), prints its module once and parses it once.

    Raises:
        ValueError: the step has no gradient all-reduce (not a ``shard_map`` + ``pmean``
            data-parallel step).
    """
    import jax

    import hlo_tools
    from hlo_tools.jax_bridge import fresh_function, lowered_text

    step = fresh_function(step)
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    text = lowered_text(jitted.lower(*args))
    module = hlo_tools.parse(text)
    graph = hlo_tools.device_graph(module)
    if not graph.gradient_allreduces:
        raise ValueError("the step has no gradient all-reduce (write the data-parallel step "
                         "with jax.shard_map and lax.pmean)")
    return Program(jitted, tuple(args), text, module, graph, jax.default_backend())
