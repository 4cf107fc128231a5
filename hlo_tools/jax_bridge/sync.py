"""Barriers and small exchanges between the processes of a ``jax.distributed`` job."""

from __future__ import annotations

import json
from typing import Any

from hlo_tools.jax_bridge import internals

__all__ = ["Coordinator"]


class Coordinator:
    """Barriers and small key-value exchanges between the processes of a
    ``jax.distributed`` job, through jax's coordination service.

    Args:
        prefix: the keys' prefix (distinct per use, e.g. ``"acc"``).
        timeout_ms: how long a barrier or a read waits for the other processes.

    Raises:
        RuntimeError: ``jax.distributed.initialize()`` has not been called.
    """

    def __init__(self, prefix: str, timeout_ms: int = 600_000) -> None:
        self.client = internals.coordination_client()
        if self.client is None:
            raise RuntimeError("jax.distributed.initialize() has not been called")
        self.prefix, self.timeout_ms = prefix, timeout_ms
        self.count = 0

    def barrier(self, tag: str) -> None:
        """Waits until every process has reached the barrier ``tag``."""
        self.count += 1
        self.client.wait_at_barrier(f"{self.prefix}_{tag}_{self.count}", self.timeout_ms)

    def share(self, key: str, value: Any, pid: int) -> Any:
        """Process 0's ``value`` (JSON-serializable) on every process."""
        if pid == 0:
            self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value))
        return json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{key}",
                                                             self.timeout_ms))

    def all_values(self, key: str, value: Any, pid: int, n: int) -> list[Any]:
        """Every process's ``value`` (index = process id)."""
        self.client.key_value_set(f"{self.prefix}/{key}/{pid}", json.dumps(value))
        return [json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{key}/{i}",
                                                              self.timeout_ms))
                for i in range(n)]
