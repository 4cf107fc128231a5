"""The job sync of the pipeline: barriers, process 0's values, everyone's values, over
``jax.distributed``'s coordination service; in one process (:data:`SOLO`) each exchange
passes the process's own value through, so the pipeline has one path for both.

A process whose part of the pipeline fails posts it (``fail``); every wait of the others
then raises :class:`~hlo_tools.jax_bridge.sync.JobFailed` within half a second, so the
whole job falls back at once instead of waiting out the timeout for a process that has
left the pipeline."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

__all__ = ["SOLO", "Sync", "job_sync"]


class Sync(Protocol):
    """The exchanges between the processes of a job that the pipeline needs.

    ``processes`` counts them; ``barrier(tag)`` waits for every process;
    ``share(key, value)`` returns process 0's JSON value everywhere; ``gather(key,
    value)`` returns every process's value; ``fail(reason)`` tells the others that this
    process left the pipeline (their waits raise
    :class:`~hlo_tools.jax_bridge.sync.JobFailed`); within ``compiles_shared()`` process
    0 compiles each program and the others load its executable
    (:func:`hlo_tools.jax_bridge.compiles_shared`).
    """

    processes: int

    def barrier(self, tag: str) -> None: ...

    def share(self, key: str, value: Any) -> Any: ...

    def gather(self, key: str, value: Any) -> list[Any]: ...

    def fail(self, reason: str) -> None: ...

    def compiles_shared(self) -> contextlib.AbstractContextManager[Any]: ...


class _Solo:
    """The job of one process: nothing to wait for, its own values are everyone's."""

    processes = 1

    def barrier(self, tag: str) -> None:
        pass

    def share(self, key: str, value: Any) -> Any:
        return value

    def gather(self, key: str, value: Any) -> list[Any]:
        return [value]

    def fail(self, reason: str) -> None:
        pass

    def compiles_shared(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


#: The :class:`Sync` of a one-process job.
SOLO: Sync = _Solo()


class _JobSync:
    def __init__(self, prefix: str, timeout_ms: int):
        import jax

        from hlo_tools.jax_bridge import Coordinator

        self._coord = Coordinator(prefix, timeout_ms, watch_failures=True)
        self._pid, self._n = jax.process_index(), jax.process_count()
        self.processes = self._n

    def barrier(self, tag: str) -> None:
        self._coord.barrier(tag)

    def share(self, key: str, value: Any) -> Any:
        return self._coord.share(key, value, self._pid)

    def gather(self, key: str, value: Any) -> list[Any]:
        return self._coord.all_values(key, value, self._pid, self._n)

    def fail(self, reason: str) -> None:
        self._coord.fail(reason)

    def compiles_shared(self) -> contextlib.AbstractContextManager[Any]:
        from hlo_tools.jax_bridge import compiles_shared

        return compiles_shared(self._coord)


def job_sync(prefix: str = "disco", timeout_ms: int = 900_000) -> Sync:
    """A :class:`Sync` over ``jax.distributed`` when the job has several processes, else
    :data:`SOLO`. ``prefix`` keeps the keys of separate uses apart."""
    import jax

    return _JobSync(prefix, timeout_ms) if jax.process_count() > 1 else SOLO
