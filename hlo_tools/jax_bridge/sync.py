"""Barriers and small exchanges between the processes of a ``jax.distributed`` job."""

from __future__ import annotations

import json
import time
from typing import Any

from hlo_tools.jax_bridge import internals

__all__ = ["POLL_MS", "Coordinator", "JobFailed"]

#: How often a wait of a failure-watching :class:`Coordinator` looks for a failure posted
#: by another process, milliseconds.
POLL_MS = 500


class JobFailed(RuntimeError):
    """Another process of the job posted a failure (:meth:`Coordinator.fail`) while this
    one waited for it; the message names the process and its reason."""


class Coordinator:
    """Barriers and small key-value exchanges between the processes of a
    ``jax.distributed`` job, through jax's coordination service.

    With ``watch_failures`` a process that fails calls :meth:`fail`, which posts its
    reason under the prefix; every wait of the others (a barrier, a shared or gathered
    value) then raises :class:`JobFailed` within :data:`POLL_MS` instead of waiting out
    ``timeout_ms`` for a process that will not come: the waits poll the value they want
    and the failure key in turn, and barriers are keys too (one per process), since the
    coordination service's own barrier cannot be left early.

    Args:
        prefix: the keys' prefix (distinct per use, e.g. ``"acc"``).
        timeout_ms: how long a barrier or a read waits for the other processes.
        watch_failures: waits end early on a failure another process posted.

    Raises:
        RuntimeError: ``jax.distributed.initialize()`` has not been called.
    """

    def __init__(self, prefix: str, timeout_ms: int = 600_000, *,
                 watch_failures: bool = False) -> None:
        import jax

        self.client = internals.coordination_client()
        if self.client is None:
            raise RuntimeError("jax.distributed.initialize() has not been called")
        self.prefix, self.timeout_ms = prefix, timeout_ms
        self.watch_failures = watch_failures
        self.pid, self.n = jax.process_index(), jax.process_count()
        self.count = 0

    def barrier(self, tag: str) -> None:
        """Waits until every process has reached the barrier ``tag``."""
        self.count += 1
        name = f"{self.prefix}_{tag}_{self.count}"
        if not self.watch_failures:
            self.client.wait_at_barrier(name, self.timeout_ms)
            return
        self.client.key_value_set(f"{self.prefix}/barrier/{name}/{self.pid}", "1")
        for i in range(self.n):
            self._get(f"{self.prefix}/barrier/{name}/{i}")

    def share(self, key: str, value: Any, pid: int) -> Any:
        """Process 0's ``value`` (JSON-serializable) on every process."""
        if pid == 0:
            self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value))
        return json.loads(self._get(f"{self.prefix}/{key}"))

    def share_bytes(self, key: str, value: bytes | None, pid: int, owner: int = 0) -> bytes:
        """Process ``owner``'s ``value`` (bytes, e.g. a serialized executable) on every
        process; the others pass None. A value posted again under the same key replaces
        the first (for keys that name their content, e.g. a program's digest)."""
        if pid == owner:
            if value is None:
                raise ValueError(f"process {owner} shares a value, not None")
            self.client.key_value_set_bytes(f"{self.prefix}/{key}", value,
                                            allow_overwrite=True)
            return value
        return self._get(f"{self.prefix}/{key}", binary=True)

    def all_values(self, key: str, value: Any, pid: int, n: int) -> list[Any]:
        """Every process's ``value`` (index = process id)."""
        self.client.key_value_set(f"{self.prefix}/{key}/{pid}", json.dumps(value))
        return [json.loads(self._get(f"{self.prefix}/{key}/{i}")) for i in range(n)]

    def fail(self, reason: str) -> None:
        """Posts this process's failure: the others' waits raise :class:`JobFailed`.
        The first failure of the job is kept (a later one is not an error)."""
        try:
            self.client.key_value_set(self._failure_key, json.dumps(
                {"process": self.pid, "reason": reason}))
        except Exception:  # noqa: BLE001 - another process posted first
            pass

    def failure(self) -> str | None:
        """The failure another process posted, in words (None: none)."""
        try:
            text = self.client.key_value_try_get(self._failure_key)
        except Exception:  # noqa: BLE001 - not found
            return None
        if text is None:
            return None
        posted = json.loads(text)
        return f"process {posted['process']} failed: {posted['reason']}"

    @property
    def _failure_key(self) -> str:
        return f"{self.prefix}/failed"

    def _get(self, key: str, *, binary: bool = False) -> Any:
        """``key``'s value once set (``binary``: as bytes); with ``watch_failures``
        raises :class:`JobFailed` as soon as another process has posted a failure."""
        get = (self.client.blocking_key_value_get_bytes if binary
               else self.client.blocking_key_value_get)
        if not self.watch_failures:
            return get(key, self.timeout_ms)
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            try:
                return get(key, max(1, min(POLL_MS, left_ms)))
            except Exception as err:  # jax's runtime error: a slice out, or the job broken
                if left_ms <= POLL_MS or "DEADLINE_EXCEEDED" not in str(err):
                    raise
            posted = self.failure()
            if posted is not None:
                raise JobFailed(posted)
