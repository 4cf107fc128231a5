"""Chrome / Perfetto trace JSON of a simulated iteration.

The output follows the Chrome trace event format (the JSON object form,
``{"traceEvents": [...]}``) and loads in https://ui.perfetto.dev and
``chrome://tracing``: one complete ("X") event per node with ``ts``/``dur`` in
microseconds, ``pid`` = device, ``tid`` 0 = compute stream, ``tid`` 1 =
communication channel, plus metadata ("M") events naming the process and the
two threads. Traces of several devices can be combined by concatenating their
``traceEvents`` lists (give each a different ``pid``). The thread ids are those of
measured traces (:func:`disco_estimator.ops.measured_chrome_trace`), defined there and
re-exported here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from disco_estimator.costs.simulator import SimGraph, SimResult
from disco_estimator.ops import COMM_TID, COMPUTE_TID
from hlo_tools.dirs import write_atomic

__all__ = ["COMPUTE_TID", "COMM_TID", "to_chrome_trace", "write_trace"]

_US = 1e6  # microseconds per second


def _metadata(pid: int, label: str) -> list[dict[str, Any]]:
    """The "M" events naming the process (device) and its two threads."""
    names = ((COMPUTE_TID, "compute"), (COMM_TID, "communication"))
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}}
    ]
    for tid, name in names:
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        )
    return events


def to_chrome_trace(
    result: SimResult, graph: SimGraph, *, pid: int = 0, label: str | None = None
) -> dict[str, Any]:
    """Builds the trace of one device's simulated iteration.

    Args:
        result: the simulation of ``graph``.
        graph: the simulated graph (names, kinds, nominal durations, bytes).
        pid: the device number used as the trace process id.
        label: process name shown in the viewer (default ``"device {pid}"``).

    Returns:
        A JSON-serializable dict ``{"traceEvents": [...], "displayTimeUnit": "ms",
        "otherData": {...}}``; node ``i`` is the "X" event with ``ts =
        start_s[i] * 1e6`` and ``dur = (finish_s[i] - start_s[i]) * 1e6``.
    """
    is_comm = [bool(c) for c in graph.is_comm]
    start = result.start_s.tolist()
    finish = result.finish_s.tolist()
    nominal = [float(d) for d in graph.duration_s]
    nbytes = [int(b) for b in graph.out_bytes]
    events = _metadata(pid, label if label is not None else f"device {pid}")
    for i, name in enumerate(graph.names):
        events.append(
            {
                "name": name,
                "cat": "comm" if is_comm[i] else "compute",
                "ph": "X",
                "ts": start[i] * _US,
                "dur": (finish[i] - start[i]) * _US,
                "pid": pid,
                "tid": COMM_TID if is_comm[i] else COMPUTE_TID,
                "args": {"index": i, "nominal_us": nominal[i] * _US, "out_bytes": nbytes[i]},
            }
        )
    other = {
        "iteration_us": result.iteration_s * _US,
        "compute_us": result.compute_s * _US,
        "comm_us": result.comm_s * _US,
        "overlap_us": result.overlap_s * _US,
        "peak_bytes": result.peak_bytes,
        "overlap_param": result.overlap,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_trace(
    path: str | os.PathLike[str],
    result: SimResult,
    graph: SimGraph,
    *,
    pid: int = 0,
    label: str | None = None,
) -> Path:
    """Writes :func:`to_chrome_trace` as JSON, atomically (temp file + ``os.replace``).

    Args:
        path: destination file (``.json``); its directory must exist.
        result: the simulation of ``graph``.
        graph: the simulated graph.
        pid: device number (trace process id).
        label: process name shown in the viewer.

    Returns:
        The destination path. On error no partial file is left behind.
    """
    dest = Path(path)
    trace = to_chrome_trace(result, graph, pid=pid, label=label)
    write_atomic(dest, json.dumps(trace), mkdir=False)
    return dest
