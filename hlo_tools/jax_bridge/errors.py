"""The bridge's errors: XLA rejected a module, or this process cannot run it."""

from __future__ import annotations

__all__ = ["DevicesUnavailableError", "HloCompileError"]


class HloCompileError(RuntimeError):
    """XLA rejected HLO text: parse, verification, MLIR conversion or compilation failed."""


class DevicesUnavailableError(HloCompileError):
    """This process's devices cannot run a module compiled from its text alone
    (:class:`~hlo_tools.jax_bridge.compile.FromText`): it needs more devices than the
    process has locally, e.g. a module of a multi-process job or one extracted on more
    host devices than this process was started with."""
