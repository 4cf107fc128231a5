"""Intake of ``jax.profiler`` traces: per-instruction times of a compiled program.

How a CPU trace maps to instructions (checked on jax/jaxlib 0.10.2):

* ``jax.profiler.start_trace(dir)`` / ``stop_trace()`` writes
  ``dir/plugins/profile/<stamp>/<host>.trace.json.gz`` (Chrome trace format, ``ts``/``dur``
  in microseconds).
* Each executed thunk (an HLO instruction or fusion of the *compiled* module) is one
  ``ph == "X"`` event named after the compiled instruction, with
  ``args = {"hlo_op": name, "hlo_module": module, "device_ordinal": "0", "run_id": "..."}``.
  A nested ``"end: <name>"`` event (no ``hlo_op``) is ignored.
* Threads are *not* devices: the PjRt CPU client runs every device's program on a shared
  thread pool, so one thread may run device 1 of launch k and device 2 of launch k+1.
  The device is ``args.device_ordinal`` (local to the process) and the iteration is
  ``args.run_id`` (one id per launch, shared by all devices of that launch).
* An all-reduce event lasts until every device has arrived at the rendezvous, so its
  duration includes waiting for the slowest device (see :mod:`disco_estimator.allreduce`).

A GPU trace differs (read on jax/jaxlib 0.11.2 with an NVIDIA H200): each *kernel* is one
``ph == "X"`` event in a trace process named ``/device:GPU:<n>`` (its metadata event
``process_name``), with ``hlo_op`` and ``hlo_module`` but neither ``run_id`` nor
``device_ordinal``; the kernels of one execution of a program share ``scope_range_id``.
:func:`op_events` then keeps the device processes' events only, takes the device from
the process name and the launch from ``scope_range_id``.

Times are seconds throughout.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hlo_tools.opcodes import is_collective

__all__ = [
    "COMM_TID",
    "COMPUTE_TID",
    "OpEvent",
    "ProgramProfile",
    "execution_counts",
    "find_trace_file",
    "iteration_order",
    "measured_chrome_trace",
    "module_name",
    "op_events",
    "per_device_samples",
    "profile_calls",
    "profile_program",
    "read_trace_events",
    "summarize",
]

#: Chrome-trace ``tid`` of compute kernels, in the trace layout shared by measured traces
#: (:func:`measured_chrome_trace`) and simulated ones (``disco_estimator.costs.trace``, which
#: takes its thread ids from here).
COMPUTE_TID = 0
#: Chrome-trace ``tid`` of collectives (communication), in the same layout.
COMM_TID = 1


# --------------------------------------------------------------------------- trace reading


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One executed compiled instruction in a profiler trace.

    Attributes:
        name: compiled instruction name (``args.hlo_op``).
        module: compiled module name (``args.hlo_module``), e.g. ``"jit_train_step"``.
        device: device ordinal local to the traced process.
        run_id: launch id; all devices of one program launch share it.
        pid: trace process id (one per traced host process).
        start_s: start time in seconds (trace clock).
        dur_s: duration in seconds.
    """

    name: str
    module: str
    device: int
    run_id: str
    pid: int
    start_s: float
    dur_s: float


def find_trace_file(log_dir: str | os.PathLike[str]) -> Path:
    """Returns the newest ``plugins/profile/*/*.trace.json.gz`` under ``log_dir``.

    Raises:
        FileNotFoundError: if the directory holds no trace.
    """
    files = sorted(Path(log_dir).glob("plugins/profile/*/*.trace.json.gz"),
                   key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no plugins/profile/*/*.trace.json.gz under {log_dir}")
    return files[-1]


def read_trace_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads the ``traceEvents`` list of a (gzipped) Chrome trace JSON file."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


#: Trace process name of a GPU's kernels: ``/device:GPU:<ordinal>``.
_GPU_PROCESS = re.compile(r"/device:GPU:(\d+)")


def op_events(events: Iterable[Mapping[str, Any]], module: str | None = None) -> list[OpEvent]:
    """Extracts compiled-instruction events, optionally only those of one module.

    Works on CPU traces (one event per thunk, launch in ``args.run_id``) and GPU traces
    (one event per kernel in a ``/device:GPU:<n>`` process, launch in
    ``args.scope_range_id``; see the module docstring).

    Args:
        events: raw trace events.
        module: keep only events whose ``args.hlo_module`` equals this name.

    Returns:
        The instruction events sorted by start time.
    """
    events = list(events)
    gpus: dict[Any, int] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            found = _GPU_PROCESS.search(str((e.get("args") or {}).get("name", "")))
            if found:
                gpus[e.get("pid")] = int(found.group(1))
    out = []
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args:
            continue
        if gpus:
            if e.get("pid") not in gpus:
                continue
            run, device = args.get("run_id", args.get("scope_range_id")), gpus[e.get("pid")]
        else:
            run, device = args.get("run_id"), int(args.get("device_ordinal", 0))
        if run is None or (module is not None and args.get("hlo_module") != module):
            continue
        out.append(OpEvent(
            name=args["hlo_op"], module=args.get("hlo_module", ""), device=device,
            run_id=str(run), pid=int(e.get("pid", 0)), start_s=float(e["ts"]) * 1e-6,
            dur_s=float(e.get("dur", 0.0)) * 1e-6,
        ))
    out.sort(key=lambda ev: ev.start_s)
    return out


def iteration_order(events: Sequence[OpEvent]) -> list[str]:
    """Run ids in the order their launches started (one run id per iteration)."""
    first: dict[str, float] = {}
    for ev in events:
        first[ev.run_id] = min(first.get(ev.run_id, math.inf), ev.start_s)
    return sorted(first, key=first.__getitem__)


def per_device_samples(events: Sequence[OpEvent]) -> dict[int, dict[str, list[float]]]:
    """Per device and instruction, one time per iteration (seconds).

    Events of the same instruction in the same launch (a loop body run many times) are
    summed, so each sample is the instruction's total time in that iteration. Samples are
    in iteration order; an instruction that did not run in an iteration has no sample.
    """
    totals: dict[tuple[int, str, str], float] = defaultdict(float)
    for ev in events:
        totals[(ev.device, ev.name, ev.run_id)] += ev.dur_s
    order = {rid: i for i, rid in enumerate(iteration_order(events))}
    per: dict[int, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for (dev, name, rid), t in totals.items():
        per[dev][name].append((order[rid], t))
    return {dev: {n: [t for _, t in sorted(s)] for n, s in names.items()}
            for dev, names in sorted(per.items())}


def execution_counts(events: Sequence[OpEvent]) -> dict[str, float]:
    """Per instruction, how often it runs per iteration and device (median; >1 in loops)."""
    counts: dict[tuple[int, str, str], int] = defaultdict(int)
    for ev in events:
        counts[(ev.device, ev.name, ev.run_id)] += 1
    per_name: dict[str, list[int]] = defaultdict(list)
    for (_, name, _), c in counts.items():
        per_name[name].append(c)
    return {n: float(statistics.median(c)) for n, c in sorted(per_name.items())}


def _iteration_spans(events: Sequence[OpEvent]) -> list[float]:
    """Per iteration, seconds from the first instruction start to the last end."""
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    for ev in events:
        lo[ev.run_id] = min(lo.get(ev.run_id, math.inf), ev.start_s)
        hi[ev.run_id] = max(hi.get(ev.run_id, -math.inf), ev.start_s + ev.dur_s)
    return [hi[r] - lo[r] for r in iteration_order(events)]


def measured_chrome_trace(events: Sequence[OpEvent], *, run_id: str | None = None,
                          comm: Iterable[str] | None = None, label: str | None = None,
                          pid_offset: int = 0) -> dict[str, Any]:
    """One measured iteration as a Chrome trace in :mod:`disco_estimator.costs.trace`'s format.

    The result has the layout of a simulated trace
    (``disco_estimator.costs.trace.to_chrome_trace``), so that both can be opened side by
    side: one trace process per device (``pid`` = ``pid_offset`` + device ordinal), ``tid``
    0 for compute kernels and ``tid`` 1 for collectives, times in microseconds from the
    start of the iteration, and the same ``otherData`` keys (``iteration_us``,
    ``compute_us``, ``comm_us``, ``overlap_us``). XLA:CPU may run independent kernels at
    the same time; a kernel that starts before the previous one on its device has ended
    goes on ``tid`` 2, 3, ... ("compute (concurrent)"), so that no thread holds partially
    overlapping events.

    Args:
        events: instruction events of one program (:func:`op_events`, one module).
        run_id: the iteration to keep (default: the first in start order).
        comm: names of the compiled instructions that are collectives (default: names
            starting with a collective opcode, e.g. ``all-reduce.3``).
        label: process name shown in the viewer (default ``"device N (measured)"``).
        pid_offset: added to the device ordinal to form the trace ``pid``.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.

    Raises:
        ValueError: no event of the requested iteration.
    """
    order = iteration_order(events)
    rid = run_id if run_id is not None else (order[0] if order else None)
    evs = sorted((e for e in events if e.run_id == rid), key=lambda e: e.start_s)
    if not evs:
        raise ValueError(f"no events of iteration {rid!r}")
    names = frozenset(comm) if comm is not None else None
    is_comm = [e.name in names if names is not None else is_collective(e.name)
               for e in evs]
    t0 = evs[0].start_s
    out: list[dict[str, Any]] = []
    lanes: dict[int, list[float]] = {}
    for e, c in zip(evs, is_comm):
        ends = lanes.setdefault(e.device, [])
        tid = COMM_TID if c else _lane(ends, e.start_s, e.start_s + e.dur_s, COMPUTE_TID)
        out.append({"name": e.name, "cat": "comm" if c else "compute", "ph": "X",
                    "ts": (e.start_s - t0) * 1e6, "dur": e.dur_s * 1e6,
                    "pid": pid_offset + e.device, "tid": tid,
                    "args": {"run_id": e.run_id, "module": e.module}})
    meta = _trace_metadata(evs, lanes, pid_offset, label, COMPUTE_TID, COMM_TID)
    return {"traceEvents": meta + out, "displayTimeUnit": "ms",
            "otherData": _trace_totals(evs, is_comm)}


def _lane(ends: list[float], start: float, end: float, compute_tid: int) -> int:
    """The first compute lane free at ``start`` (lane 0 is ``compute_tid``, then 2, 3, ...);
    ``ends[k]`` is when lane ``k`` becomes free (extended in place)."""
    for k, free_at in enumerate(ends):
        if free_at <= start + 1e-9:
            ends[k] = end
            return compute_tid if k == 0 else k + 1
    ends.append(end)
    return compute_tid if len(ends) == 1 else len(ends)


def _trace_metadata(evs: Sequence[OpEvent], lanes: Mapping[int, list[float]], pid_offset: int,
                    label: str | None, compute_tid: int, comm_tid: int) -> list[dict[str, Any]]:
    """"M" events naming each device's process and threads (as disco_estimator.costs.trace does)."""
    meta: list[dict[str, Any]] = []
    for dev in sorted({e.device for e in evs}):
        pid = pid_offset + dev
        name = label if label is not None else f"device {dev} (measured)"
        threads = [(compute_tid, "compute"), (comm_tid, "communication")]
        threads += [(k + 1, "compute (concurrent)") for k in range(1, len(lanes.get(dev, [])))]
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"name": name}})
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                  "args": {"name": tname}} for tid, tname in threads]
    return meta


def _busy_intervals(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of ``[start, end)`` intervals as sorted disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _trace_totals(evs: Sequence[OpEvent], is_comm: Sequence[bool]) -> dict[str, float]:
    """Iteration span, busy compute, busy communication and their overlap, microseconds."""
    comp = _busy_intervals((e.start_s, e.start_s + e.dur_s) for e, c in zip(evs, is_comm)
                           if not c)
    comm = _busy_intervals((e.start_s, e.start_s + e.dur_s) for e, c in zip(evs, is_comm) if c)
    both = 0.0
    for a, b in comp:
        for x, y in comm:
            both += max(0.0, min(b, y) - max(a, x))
    span = max(e.start_s + e.dur_s for e in evs) - evs[0].start_s
    return {"iteration_us": span * 1e6, "compute_us": sum(b - a for a, b in comp) * 1e6,
            "comm_us": sum(b - a for a, b in comm) * 1e6, "overlap_us": both * 1e6,
            "kernels": sum(1 for c in is_comm if not c), "source": "measured"}


# --------------------------------------------------------------------------- running


@dataclasses.dataclass
class ProgramProfile:
    """Measured times of one compiled program (seconds).

    Attributes:
        module: compiled module name.
        hlo_text: the compiled (post-optimization) HLO text the names refer to.
        times_s: per compiled instruction, the median over devices of the per-device
            medians over iterations.
        per_device_s: device ordinal -> instruction -> median over iterations.
        samples_s: device ordinal -> instruction -> per-iteration times.
        counts: instruction -> executions per iteration (> 1 inside loops); the times
            above are totals per iteration, ``times_s[n] / counts[n]`` is one execution.
        wall_times_s: host wall time of each profiled call (dispatch to ready).
        trace_iteration_s: per iteration, first instruction start to last end.
    """

    module: str
    hlo_text: str
    times_s: dict[str, float]
    per_device_s: dict[int, dict[str, float]]
    samples_s: dict[int, dict[str, list[float]]]
    counts: dict[str, float]
    wall_times_s: list[float]
    trace_iteration_s: list[float]


def _compile(fn: Any, args: Sequence[Any]) -> Any:
    """Returns a ``jax.stages.Compiled`` for a jitted function or an already compiled one.

    Also accepts a wrapper holding one as ``.compiled`` (``hlo_tools.jax_bridge.CompiledHlo``).
    """
    inner = getattr(fn, "compiled", None)
    if inner is not None and hasattr(inner, "as_text"):
        return inner
    if hasattr(fn, "lower"):
        return fn.lower(*args).compile()
    if hasattr(fn, "as_text") and callable(fn):
        return fn
    raise TypeError(f"expected a jitted function or a Compiled, got {type(fn).__name__}")


def module_name(hlo_text: str) -> str:
    """The module name of HLO text (its ``HloModule <name>`` header line), e.g. of
    ``Compiled.as_text()``: the ``hlo_module`` its trace events carry.

    Raises:
        ValueError: the text does not start with an ``HloModule`` header.
    """
    first = hlo_text.lstrip().split("\n", 1)[0]
    if not first.startswith("HloModule "):
        raise ValueError("compiled text does not start with an HloModule header")
    return first.split()[1].rstrip(",")


def _place_args(compiled: Any, args: Sequence[Any]) -> tuple[Any, ...]:
    """Puts arguments on the devices/shardings the program expects (no transfer per call)."""
    import jax

    shardings = compiled.input_shardings[0]
    return tuple(jax.device_put(a, s) for a, s in zip(args, shardings, strict=True))


def profile_program(fn: Any, *args: Any, iterations: int = 10, warmup: int = 3,
                    trace_dir: str | None = None, donated: bool = False) -> ProgramProfile:
    """Profiles a jitted function (or ``Compiled``) and returns per-instruction times.

    Args:
        fn: a ``jax.jit`` function (lowered and compiled with ``args``) or a ``Compiled``.
        *args: positional arguments of the program.
        iterations: profiled iterations (the medians are over these).
        warmup: untraced iterations run first.
        trace_dir: where to write the trace (kept); a temporary directory if None.
        donated: set if the program donates its inputs; each call then gets a copy.

    Returns:
        The profile; ``times_s`` is keyed by compiled instruction name.

    Raises:
        RuntimeError: if the trace holds no instruction events of the program.
    """
    import jax

    compiled = _compile(fn, args)
    placed = _place_args(compiled, args)
    fresh = (lambda: jax.tree.map(lambda x: x.copy(), placed)) if donated else None
    return profile_calls(compiled, compiled.as_text(), inputs=fresh, iterations=iterations,
                         warmup=warmup, trace_dir=trace_dir, args=placed)


def profile_calls(call: Callable[..., Any], hlo_text: str, *, args: Sequence[Any] = (),
                  inputs: Callable[[], Sequence[Any]] | None = None, iterations: int = 10,
                  warmup: int = 3, trace_dir: str | None = None) -> ProgramProfile:
    """Profiles a program run by ``call(*args)`` (one execution, its inputs already
    placed) and returns per-instruction times.

    Args:
        call: runs the program once and returns its result (waited for here).
        hlo_text: the compiled module's text (its name picks the trace's events).
        args: the placed inputs of every call.
        inputs: makes each call's inputs instead (untimed; e.g. copies of ``args`` for a
            program that donates them).
        iterations: profiled iterations (the medians are over these).
        warmup: untraced iterations run first.
        trace_dir: where to write the trace (kept); a temporary directory if None.

    Returns:
        The profile; ``times_s`` is keyed by compiled instruction name.

    Raises:
        RuntimeError: if the trace holds no instruction events of the program.
    """
    import jax

    def timed(n: int) -> list[float]:
        times = []
        for _ in range(n):
            given = jax.block_until_ready(inputs()) if inputs is not None else args
            t0 = time.perf_counter()
            jax.block_until_ready(call(*given))
            times.append(time.perf_counter() - t0)
        return times

    module = module_name(hlo_text)
    timed(warmup)
    tmp = trace_dir or tempfile.mkdtemp(prefix="disco_trace_")
    try:
        jax.profiler.start_trace(tmp)
        try:
            walls = timed(iterations)
        finally:
            jax.profiler.stop_trace()
        events = op_events(read_trace_events(find_trace_file(tmp)), module)
    finally:
        if trace_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    if not events:
        raise RuntimeError(f"trace has no instruction events of module {module!r}")
    return summarize(module, hlo_text, events, walls)


def summarize(module: str, hlo_text: str, events: Sequence[OpEvent],
              walls: list[float]) -> ProgramProfile:
    """A :class:`ProgramProfile` from a program's instruction events.

    Args:
        module: the module name (:func:`module_name`).
        hlo_text: the compiled module's text.
        events: its instruction events (:func:`op_events`), any number of iterations and
            devices.
        walls: wall time per call in seconds (may be empty).

    Returns:
        The profile: per device the median over iterations of each instruction, and
        across devices the median of those.
    """
    samples = per_device_samples(events)
    per_dev = {d: {n: statistics.median(s) for n, s in names.items()}
               for d, names in samples.items()}
    names = sorted({n for d in per_dev.values() for n in d})
    times = {n: statistics.median([d[n] for d in per_dev.values() if n in d]) for n in names}
    return ProgramProfile(module, hlo_text, times, per_dev, samples, execution_counts(events),
                          walls, _iteration_spans(events))

