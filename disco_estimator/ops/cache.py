"""The on-disk cache of single-op times: :class:`OpTiming` by op key, per backend.

The cache is one JSON file per backend fingerprint (jax/jaxlib version, platform,
device kind, host CPU count, replicas; :func:`backend_fingerprint`) under
``$DISCO_CACHE_DIR/ops`` (default ``~/.cache/disco_jax/ops``), written atomically
(temporary file + ``os.replace``) under an advisory file lock, merged with what other
processes wrote meanwhile. Its times come from standalone runs
(:mod:`disco_estimator.ops.standalone`).

Times are seconds and sizes bytes throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hlo_tools import dirs

__all__ = [
    "OP_BENCH_VERSION",
    "OP_CACHE_SCHEMA",
    "OpTimeCache",
    "OpTiming",
    "backend_fingerprint",
    "cache_dir",
]

OP_CACHE_SCHEMA = 1
#: Version of how standalone ops are built and timed; part of the cache fingerprint, so
#: bumping it re-times everything (failed ops included).
OP_BENCH_VERSION = 1


@dataclasses.dataclass(frozen=True)
class OpTiming:
    """Measured time of one op key (or why it could not be measured).

    Attributes:
        time_s: median seconds of one execution (NaN when ``error`` is set).
        p25_s: 25th percentile, seconds.
        p75_s: 75th percentile, seconds.
        samples: timed executions (over runs and replicas).
        cls: opcode class of the analytic model.
        bytes: operand + result bytes.
        flops: estimated flops.
        error: why the op could not be timed ("" when it was).
    """

    time_s: float
    p25_s: float
    p75_s: float
    samples: int
    cls: str
    bytes: int
    flops: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and math.isfinite(self.time_s)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (NaN times as null, so the file is strict JSON)."""
        data = dataclasses.asdict(self)
        for k in ("time_s", "p25_s", "p75_s"):
            if not math.isfinite(data[k]):
                data[k] = None
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OpTiming:
        """Inverse of :meth:`to_json`."""
        def num(k: str) -> float:
            return math.nan if data[k] is None else float(data[k])

        return cls(num("time_s"), num("p25_s"), num("p75_s"), int(data["samples"]),
                   str(data["cls"]), int(data["bytes"]), float(data["flops"]),
                   str(data.get("error", "")))


def cache_dir() -> Path:
    """Where single-op timings are cached: ``ops`` in :func:`hlo_tools.dirs.cache_dir`."""
    return dirs.cache_dir("ops")


def backend_fingerprint(replicas: int = 1, platform: str | None = None,
                        pinned: bool = False) -> dict[str, Any]:
    """What measured op times depend on (part of the cache file name and content);
    ``pinned`` (times from :class:`~disco_estimator.ops.standalone.PinnedTimer`) adds
    ``"pinned": True``."""
    from hlo_tools import jax_bridge

    info = jax_bridge.backend_info(platform)
    out = {"schema": OP_CACHE_SCHEMA, "version": OP_BENCH_VERSION,
           "jax": info["jax"], "jaxlib": info["jaxlib"],
           "platform": info["platform"], "device_kind": info["device_kind"],
           "cpu_count": info["cpu_count"], "replicas": int(replicas)}
    if pinned:
        out["pinned"] = True
    return out


class OpTimeCache:
    """Measured op times of one backend fingerprint, stored as one JSON file.

    File: ``<directory>/<sha256(fingerprint)[:16]>.json`` holding
    ``{"schema", "fingerprint", "ops": {OpKey.encode(): OpTiming}}``.
    """

    def __init__(self, fingerprint: Mapping[str, Any], directory: str | os.PathLike | None = None):
        self.fingerprint = dict(fingerprint)
        self.directory = Path(directory) if directory is not None else cache_dir()
        tag = json.dumps(self.fingerprint, sort_keys=True).encode()
        self.path = self.directory / f"{hashlib.sha256(tag).hexdigest()[:16]}.json"
        self.entries: dict[str, OpTiming] = self._read()

    @classmethod
    def for_backend(cls, replicas: int = 1, directory: str | os.PathLike | None = None,
                    pinned: bool = False) -> OpTimeCache:
        """The cache of the current jax backend (of pinned timings with ``pinned``)."""
        return cls(backend_fingerprint(replicas, pinned=pinned), directory)

    def _read(self) -> dict[str, OpTiming]:
        """Entries on disk; a missing, corrupt or foreign file reads as empty."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            if data.get("schema") != OP_CACHE_SCHEMA or data.get("fingerprint") != \
                    self.fingerprint:
                return {}
            return {k: OpTiming.from_json(v) for k, v in data["ops"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def get(self, key: str) -> OpTiming | None:
        return self.entries.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def update(self, timings: Mapping[str, OpTiming]) -> None:
        """Adds timings in memory (call :meth:`save` to store them)."""
        self.entries.update(timings)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a+") as lock:
            try:
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)
            except (ImportError, OSError):  # no advisory locks: atomic rename still holds
                pass
            yield

    def save(self) -> Path:
        """Merges with the file's current content (ours win) and writes it atomically."""
        with self._locked():
            merged = {**self._read(), **self.entries}
            data = {"schema": OP_CACHE_SCHEMA, "fingerprint": self.fingerprint,
                    "ops": {k: merged[k].to_json() for k in sorted(merged)}}
            dirs.write_atomic(self.path, json.dumps(data, indent=0, allow_nan=False))
            self.entries = merged
        return self.path

