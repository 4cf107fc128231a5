"""The user's local dataset of labeled fused ops, and where its fine-tuned model goes.

Fused ops timed on the user's own machine (e.g. in a whole-program trace) are kept per
backend fingerprint (:func:`disco_estimator.ops.backend_fingerprint`) in one JSON-lines
file, one :meth:`Sample.to_json <disco_estimator.gnn.dataset.Sample.to_json>` per line
(data only: nothing executable, never pickle), oldest first:
``<cache_dir("gnn")>/local-v<LOCAL_VERSION>-<tag>.jsonl`` (:func:`local_dataset_path`;
the tag: :func:`fingerprint_tag`).

:func:`add_local_samples` merges new samples into it (a sample with the same
``(kind, key)`` replaces the older one: the newest label wins), keeps the newest
:data:`LOCAL_LIMIT`, and rewrites the whole file atomically
(:func:`hlo_tools.dirs.write_atomic`) under an exclusive ``fcntl.flock`` of a lock file
beside it, so concurrent writers merge and a killed one leaves the old file or the new
one. Readers (:func:`load_local_samples`) take no lock.

Importing this module imports neither jax nor the rest of the package (the dataset's
:func:`~disco_estimator.gnn.dataset.dataset_path` can use :func:`fingerprint_tag`).

``disco train-estimator --local`` fine-tunes a model on these samples and writes it to
:func:`local_checkpoint_path` only when it beats its base on the samples
:func:`held_out_split` holds out.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hlo_tools import dirs

if TYPE_CHECKING:
    from disco_estimator.gnn.dataset import Sample

__all__ = [
    "LOCAL_LIMIT",
    "LOCAL_VERSION",
    "add_local_samples",
    "fingerprint_tag",
    "held_out_split",
    "load_local_samples",
    "local_checkpoint_path",
    "local_dataset_path",
]

#: Version of the local dataset's file (part of its name).
LOCAL_VERSION = 1
#: Samples the local dataset keeps at most (the oldest are dropped).
LOCAL_LIMIT = 20000


def fingerprint_tag(fingerprint: dict[str, Any]) -> str:
    """16 hex digits of the sha256 of ``json.dumps(fingerprint, sort_keys=True)``: the
    part of a file name that says which backend fingerprint its samples belong to."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def _root(directory: str | os.PathLike | None) -> Path:
    return Path(directory) if directory is not None else dirs.cache_dir("gnn")


def local_dataset_path(fingerprint: dict[str, Any],
                       directory: str | os.PathLike | None = None) -> Path:
    """The local dataset of one backend fingerprint: ``<directory>/local-v<LOCAL_VERSION>-
    <tag>.jsonl`` (default directory: ``hlo_tools.dirs.cache_dir("gnn")``)."""
    return _root(directory) / f"local-v{LOCAL_VERSION}-{fingerprint_tag(fingerprint)}.jsonl"


def local_checkpoint_path(fingerprint: dict[str, Any],
                          directory: str | os.PathLike | None = None) -> Path:
    """Where ``disco train-estimator --local`` writes the model fine-tuned on the local
    dataset of ``fingerprint``: ``<directory>/local-<tag>.msgpack``."""
    return _root(directory) / f"local-{fingerprint_tag(fingerprint)}.msgpack"


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of a file's lines of this feature version (others skipped;
    a missing or unreadable file has none)."""
    from disco_estimator.gnn.features import FEATURE_VERSION

    try:
        data = path.read_bytes()
    except OSError:
        return
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("feature_version") == FEATURE_VERSION \
                and "key" in d:
            yield d


def load_local_samples(fingerprint: dict[str, Any],
                       directory: str | os.PathLike | None = None) -> list[Sample]:
    """The local samples of a backend fingerprint, oldest first.

    A missing or unreadable file gives ``[]``; lines that do not parse as a sample, or
    of another feature version, are skipped (a file that is not JSON lines at all gives
    ``[]``, never an exception).
    """
    from disco_estimator.gnn.dataset import Sample

    out = []
    for d in _lines(local_dataset_path(fingerprint, directory)):
        try:
            out.append(Sample.from_json(d))
        except (KeyError, TypeError, ValueError):
            continue
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``<path>.lock`` (held while the block runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):  # no advisory locks: the atomic replace still holds
            pass
        yield


def add_local_samples(samples: Iterable[Sample], fingerprint: dict[str, Any],
                      directory: str | os.PathLike | None = None,
                      limit: int = LOCAL_LIMIT) -> int:
    """Merges samples into the local dataset of ``fingerprint``.

    Under the dataset's lock: the stored samples are read, each new sample replaces a
    stored one of the same ``(kind, key)`` (the newest label wins) or is appended, the
    oldest are dropped beyond ``limit``, and the whole file is written atomically (the
    temporary files of writers killed while writing are removed).

    Args:
        samples: the new samples, oldest first.
        fingerprint: their backend fingerprint
            (:func:`disco_estimator.ops.backend_fingerprint`).
        directory: where the dataset lives (default: ``cache_dir("gnn")``).
        limit: samples kept at most.

    Returns:
        How many samples were new (no stored sample of their ``(kind, key)``).

    Raises:
        ValueError: ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    path = local_dataset_path(fingerprint, directory)
    with _locked(path):
        stored: dict[tuple[str, str], str] = {
            (str(d.get("kind", "plan")), str(d["key"])): json.dumps(d)
            for d in _lines(path)}
        known = set(stored)
        new = set()
        for s in samples:
            k = (s.kind, s.key)
            stored.pop(k, None)  # re-inserted last: the newest
            stored[k] = json.dumps(s.to_json())
            if k not in known:
                new.add(k)
        kept = list(stored.values())[-limit:]
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # of a writer that was killed
            stale.unlink(missing_ok=True)
        dirs.write_atomic(path, "".join(line + "\n" for line in kept))
    return len(new)


def held_out_split(samples: Sequence[Sample], fraction: float = 0.2, seed: int = 0
                   ) -> tuple[list[Sample], list[Sample]]:
    """``(training, held-out)`` samples, about ``fraction`` held out.

    Deterministic: a sample is held out when the sha256 of ``"<seed>:<key>"`` falls in
    the first ``fraction`` of its range, so a sample (any kind of it) is always on the
    same side for the same ``seed``, whatever else the dataset holds.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    cut = fraction * 2.0 ** 64
    train, held = [], []
    for s in samples:
        h = int.from_bytes(hashlib.sha256(f"{seed}:{s.key}".encode()).digest()[:8], "big")
        (held if h < cut else train).append(s)
    return train, held
