"""Where a result came from, and the one writer of ``benchmarks/results/``.

:func:`provenance` says when, from which commit, on which machine and with which command a
result was measured; :func:`write_result` writes a result JSON (atomically) with that
record under its ``"provenance"`` key. Every benchmark script writes through it. Import it
after putting the repository root on ``sys.path`` (a script run as
``python benchmarks/x.py`` has ``benchmarks/`` there instead)::

    ROOT = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(ROOT))
    from benchmarks.provenance import write_result  # noqa: E402

Standard library only: jax is asked for its backend and device kind only when the process
has imported it already (no backend is started for this), and its versions are read from
the installed packages' metadata.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from hlo_tools.dirs import write_atomic

__all__ = ["provenance", "write_result"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = "benchmarks/results/"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Processor"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, ValueError, OSError):
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _machine() -> dict[str, Any]:
    uname = platform.uname()
    machine: dict[str, Any] = {
        "os": f"{uname.system} {uname.release}", "arch": uname.machine,
        "cpu": _cpu_model(), "logical_cores": os.cpu_count(), "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "jax": _version("jax"), "jaxlib": _version("jaxlib"),
    }
    jax = sys.modules.get("jax")
    if jax is not None:  # only a process that uses jax already: no backend started here
        try:
            machine["backend"] = jax.default_backend()
            devices = jax.devices()
            machine["device_kind"] = devices[0].device_kind if devices else None
        except Exception as e:  # noqa: BLE001 - provenance never fails a result
            machine["backend"] = f"unknown ({type(e).__name__})"
    return machine


def _changed_path(porcelain_line: str) -> str:
    """The path of a ``git status --porcelain`` line (``XY path``, ``XY old -> new``)."""
    return porcelain_line[3:].split(" -> ")[-1].strip('"')


def provenance() -> dict[str, Any]:
    """``{"date", "commit", "dirty", "machine", "command"}`` of this process, now.

    ``date`` is UTC ISO 8601; ``commit`` is the repository's ``HEAD`` (None outside a git
    checkout) and ``dirty`` whether tracked or new files differ from it, results under
    ``benchmarks/results/`` not counted; ``machine`` names OS, kernel, CPU, cores, memory,
    Python and jax (backend and device kind only if jax is imported); ``command`` is
    ``sys.argv`` joined.
    """
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if head else None
    dirty = None if status is None else any(
        not _changed_path(line).startswith(RESULTS_DIR)
        for line in status.splitlines() if line.strip())
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": head.strip() if head else None,
        "dirty": dirty,
        "machine": _machine(),
        "command": " ".join(sys.argv),
    }


def write_result(path: str | os.PathLike[str], record: dict[str, Any], *,
                 indent: int | None = 1, sort_keys: bool = False) -> Path:
    """Writes ``record`` as JSON to ``path`` atomically, with ``record["provenance"]``
    set to :func:`provenance` unless it has one already (``record`` is not changed).

    Args:
        path: the result file (parent directories are created).
        record: the result; a JSON object.
        indent, sort_keys: as ``json.dumps``.

    Returns:
        ``path`` as a ``Path``.
    """
    if "provenance" not in record:
        record = {**record, "provenance": provenance()}
    return write_atomic(path, json.dumps(record, indent=indent, sort_keys=sort_keys) + "\n")
