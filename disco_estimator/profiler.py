"""Per-op times from real runs: profiler traces, op keys, a stored time DB, a fallback model.

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

Times are seconds, sizes bytes, work flops throughout.
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import hashlib
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

import numpy as np

from hlo_tools.dirs import write_atomic
from hlo_tools.opcodes import is_collective

__all__ = [
    "OP_CLASSES",
    "OpEvent",
    "OpKey",
    "OpInfo",
    "OpEstimate",
    "OpRecord",
    "LinearOpCost",
    "OpCostModel",
    "ProgramProfile",
    "OpProfile",
    "find_trace_file",
    "read_trace_events",
    "op_events",
    "iteration_order",
    "measured_chrome_trace",
    "per_device_samples",
    "execution_counts",
    "profile_program",
    "module_name",
    "summarize",
    "COMPUTE_TID",
    "COMM_TID",
    "analyze_module",
    "describe_instruction",
    "map_to_original",
    "opcode_class",
    "build_op_profile",
    "profile_ops",
]

PROFILE_SCHEMA = 1

#: Chrome-trace ``tid`` of compute kernels, in the trace layout shared by measured traces
#: (:func:`measured_chrome_trace`) and simulated ones (``disco_jax.costs.trace``, which takes
#: its thread ids from here).
COMPUTE_TID = 0
#: Chrome-trace ``tid`` of collectives (communication), in the same layout.
COMM_TID = 1

#: Opcode classes of the analytic fallback model.
OP_CLASSES = ("elementwise", "reduce", "dot-conv", "data-movement", "other")

_ELEMENTWISE = frozenset("""
abs add and atan2 cbrt ceil clamp compare complex convert cosine divide erf exponential
exponential-minus-one floor imag is-finite log log-plus-one logistic maximum minimum multiply
negate not or popcnt count-leading-zeros power real reduce-precision remainder
round-nearest-afz round-nearest-even rsqrt select shift-left shift-right-arithmetic
shift-right-logical sign sine sqrt stochastic-convert subtract tan tanh xor map
""".split())
_REDUCE = frozenset(["reduce", "reduce-window", "select-and-scatter", "sort", "scan"])
_DOT = frozenset(["dot", "convolution", "ragged-dot", "cholesky", "triangular-solve", "fft"])
_DATA = frozenset("""
copy transpose broadcast reshape slice concatenate dynamic-slice dynamic-update-slice pad
reverse gather scatter iota bitcast bitcast-convert copy-start copy-done
""".split())
#: Attributes that do not change what an op computes (left out of its key).
_KEY_SKIP_ATTRS = frozenset([
    "metadata", "sharding", "frontend_attributes", "channel_id", "statistics",
    "origin", "control-predecessors", "schedule_id",
])
_CALL_ATTRS = ("calls", "to_apply", "condition", "body", "branch_computations")
_MIN_TIME_S = 1e-7


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
    """One measured iteration as a Chrome trace in :mod:`disco_jax.costs.trace`'s format.

    The result has the layout of a simulated trace (``disco_jax.costs.trace.to_chrome_trace``),
    so that both can be opened side by side: one trace process per device (``pid`` =
    ``pid_offset`` + device ordinal), ``tid`` 0 for compute kernels and ``tid`` 1 for
    collectives, times in microseconds from the start of the iteration, and the same
    ``otherData`` keys (``iteration_us``, ``compute_us``, ``comm_us``, ``overlap_us``).
    XLA:CPU may run independent kernels at the same time; a kernel that starts before
    the previous one on its device has ended goes on ``tid`` 2, 3, ... ("compute
    (concurrent)"), so that no thread holds partially overlapping events.

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
    """"M" events naming each device's process and threads (as disco_jax.costs.trace does)."""
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


def _timed_calls(compiled: Any, args: Sequence[Any], n: int,
                 fresh: Callable[[], Sequence[Any]] | None) -> list[float]:
    """Runs ``compiled`` ``n`` times; returns each call's wall time in seconds."""
    import jax

    times = []
    for _ in range(n):
        call_args = jax.block_until_ready(fresh()) if fresh is not None else args
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*call_args))
        times.append(time.perf_counter() - t0)
    return times


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
    hlo_text = compiled.as_text()
    module = module_name(hlo_text)
    placed = _place_args(compiled, args)
    fresh = (lambda: jax.tree.map(lambda x: x.copy(), placed)) if donated else None
    _timed_calls(compiled, placed, warmup, fresh)
    tmp = trace_dir or tempfile.mkdtemp(prefix="disco_trace_")
    try:
        jax.profiler.start_trace(tmp)
        try:
            walls = _timed_calls(compiled, placed, iterations, fresh)
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


# --------------------------------------------------------------------------- op keys


@dataclasses.dataclass(frozen=True)
class OpKey:
    """What an op computes, independent of names: equal keys cost the same time.

    Attributes:
        opcode: HLO opcode; fusions as ``"fusion:kLoop"``.
        operand_shapes: operand shapes without layout, e.g. ``("f32[16,32]",)``.
        result_shape: result shape without layout.
        dtype: result element type (``"tuple"`` for tuple results).
        detail: hash of the attributes that change the computation (dimensions,
            contracting dims, the fused body, ...); empty if none.
    """

    opcode: str
    operand_shapes: tuple[str, ...]
    result_shape: str
    dtype: str
    detail: str = ""

    def encode(self) -> str:
        """A one-line string form, used as the JSON key."""
        return "|".join([self.opcode, ";".join(self.operand_shapes), self.result_shape,
                         self.dtype, self.detail])

    @classmethod
    def decode(cls, text: str) -> OpKey:
        """Inverse of :meth:`encode`."""
        opcode, operands, result, dtype, detail = text.split("|")
        return cls(opcode, tuple(operands.split(";")) if operands else (), result, dtype,
                   detail)


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """An op's key with the features of the fallback model.

    Attributes:
        key: the op key.
        cls: opcode class (one of :data:`OP_CLASSES`).
        bytes: operand plus result bytes.
        flops: estimated floating-point operations.
        op_names: ``metadata op_name`` of the op and of the ops fused into it: the
            original instruction names when the program came from HLO text.
    """

    key: OpKey
    cls: str
    bytes: int
    flops: float
    op_names: tuple[str, ...] = ()


def opcode_class(opcode: str) -> str:
    """Fallback-model class of a plain (non-fusion) opcode."""
    if opcode in _ELEMENTWISE:
        return "elementwise"
    if opcode in _REDUCE:
        return "reduce"
    if opcode in _DOT:
        return "dot-conv"
    if opcode in _DATA:
        return "data-movement"
    return "other"


def _shape_text(shape: Any) -> str:
    return str(shape.without_layout()) if hasattr(shape, "without_layout") else str(shape)


def _elements(shape: Any) -> int:
    return int(getattr(shape, "num_elements", 0) or 0)


def _dims_attr(text: str | None) -> list[int]:
    if not text:
        return []
    inner = text.strip().strip("{}").strip()
    return [int(x) for x in inner.split(",") if x.strip()]


class _ModuleView:
    """Lookup tables over a parsed ``hlo_tools.HloModule``."""

    def __init__(self, module: Any):
        self.module = module
        self.comps = {c.name: c for c in module.computations}
        self.instr = {i.name: i for c in module.computations for i in c.instructions}
        self._body_hash: dict[str, str] = {}

    def called(self, instr: Any) -> list[Any]:
        names = instr.called_computations if hasattr(instr, "called_computations") else []
        return [self.comps[n] for n in names if n in self.comps]

    def body_hash(self, comp: Any) -> str:
        """A name-free fingerprint of a computation (opcodes, shapes, wiring, attrs)."""
        if comp.name not in self._body_hash:
            index = {i.name: k for k, i in enumerate(comp.instructions)}
            parts = []
            for i in comp.instructions:
                ops = ",".join(str(index.get(o, o)) for o in i.operands)
                parts.append(f"{i.opcode}:{_shape_text(i.shape)}({ops}){self.attr_text(i)}")
            digest = hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]
            self._body_hash[comp.name] = digest
        return self._body_hash[comp.name]

    def attr_text(self, instr: Any) -> str:
        parts = []
        for k, v in instr.attrs.items():
            if k in _KEY_SKIP_ATTRS:
                continue
            if k in _CALL_ATTRS:
                v = ",".join(self.body_hash(c) for c in self.called(instr))
            parts.append(f"{k}={v}")
        if instr.opcode == "constant":
            parts.append(f"value={getattr(instr, 'payload', '')}")
        return ";".join(parts)


def _fusion_class(view: _ModuleView, instr: Any) -> str:
    opcodes = _body_opcodes(view, instr)
    for cls in ("dot-conv", "reduce", "elementwise", "data-movement"):
        if any(opcode_class(o) == cls for o in opcodes):
            return cls
    return "other"


def _body_opcodes(view: _ModuleView, instr: Any) -> list[str]:
    out = []
    for comp in view.called(instr):
        for i in comp.instructions:
            out.extend(_body_opcodes(view, i) if i.opcode == "fusion" else [i.opcode])
    return out


def _flops(view: _ModuleView, instr: Any) -> float:
    """Rough flop count of one instruction (fusions: sum over the body)."""
    op = instr.opcode
    if op in ("fusion", "call"):
        return float(sum(_flops(view, i) for c in view.called(instr) for i in c.instructions))
    if op in _ELEMENTWISE:
        return float(_elements(instr.shape))
    if op in _REDUCE or op.startswith("all-reduce") or op == "reduce-scatter":
        return float(sum(_elements(view.instr[o].shape) for o in instr.operands
                         if o in view.instr))
    if op == "dot":
        return 2.0 * _elements(instr.shape) * _contracting_size(view, instr)
    if op == "convolution":
        return 2.0 * _elements(instr.shape) * _conv_window_size(view, instr)
    return 0.0


def _contracting_size(view: _ModuleView, instr: Any) -> int:
    lhs = view.instr.get(instr.operands[0]) if instr.operands else None
    if lhs is None:
        return 1
    dims = _dims_attr(instr.attrs.get("lhs_contracting_dims"))
    return math.prod(lhs.shape.dims[d] for d in dims if d < len(lhs.shape.dims))


def _conv_window_size(view: _ModuleView, instr: Any) -> int:
    """Kernel elements per output element (kernel size / output features)."""
    if len(instr.operands) < 2 or instr.operands[1] not in view.instr:
        return 1
    kernel = view.instr[instr.operands[1]].shape
    labels = instr.attrs.get("dim_labels", "")
    kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    out_feat = kernel.dims[kernel_labels.index("o")] if "o" in kernel_labels else 1
    return max(1, _elements(kernel) // max(1, out_feat))


def _op_names(view: _ModuleView, instr: Any) -> tuple[str, ...]:
    """``op_name`` metadata of the op and, for a fusion, of the ops fused into it."""
    fused = [i for c in view.called(instr) for i in c.instructions] if instr.opcode == "fusion" \
        else []
    names: list[str] = []
    for i in [instr] + fused:
        n = getattr(i, "op_name", None)
        if n and i.opcode != "parameter" and n not in names:
            names.append(n)
    return tuple(names)


def describe_instruction(view_or_module: Any, instr: Any) -> OpInfo:
    """Key, class, bytes and flops of one instruction of a parsed module.

    Args:
        view_or_module: the ``hlo_tools.HloModule`` holding ``instr`` (operands and
            called computations are looked up there).
        instr: an ``hlo_tools.HloInstruction``.

    Returns:
        The op's :class:`OpInfo` (bytes = operands + result).
    """
    view = view_or_module if isinstance(view_or_module, _ModuleView) else _ModuleView(
        view_or_module)
    operands = [view.instr[o] for o in instr.operands if o in view.instr]
    opcode = instr.opcode
    if opcode == "fusion":
        opcode = f"fusion:{instr.attrs.get('kind', '')}"
    key = OpKey(opcode, tuple(_shape_text(o.shape) for o in operands),
                _shape_text(instr.shape), instr.shape.element_type,
                _short_hash(view.attr_text(instr)))
    cls = _fusion_class(view, instr) if instr.opcode == "fusion" else opcode_class(opcode)
    nbytes = instr.shape.byte_size() + sum(o.shape.byte_size() for o in operands)
    return OpInfo(key, cls, int(nbytes), _flops(view, instr), _op_names(view, instr))


def map_to_original(op_names_by_instr: Mapping[str, Sequence[str]],
                    original: Any) -> dict[str, list[str]]:
    """Maps compiled instructions to the instructions of the program that was compiled.

    When a program is compiled from HLO text (HLO -> MLIR import), XLA records each
    original instruction name as ``op_name`` metadata, prefixed with the names of the
    inlined call sites: ``"shard_map.16/add.5"`` is instruction ``add.5`` of the body
    called by ``shard_map.16``. Only names that exist in ``original`` are kept.

    Args:
        op_names_by_instr: compiled instruction -> its ``op_name``s (the ``"op_names"`` of
            :attr:`OpProfile.instructions`, or :attr:`OpInfo.op_names`).
        original: the parsed ``hlo_tools.HloModule`` that was compiled.

    Returns:
        compiled instruction -> original instruction names (empty list if none).
    """
    known = {i.name for c in original.computations for i in c.instructions}
    out = {}
    for name, op_names in op_names_by_instr.items():
        found = [n.rsplit("/", 1)[-1] for n in op_names]
        out[name] = list(dict.fromkeys(n for n in found if n in known))
    return out


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12] if text else ""


def analyze_module(module: Any) -> dict[str, OpInfo]:
    """:class:`OpInfo` of every instruction of a parsed module, keyed by name."""
    view = _ModuleView(module)
    return {name: describe_instruction(view, instr) for name, instr in view.instr.items()}


# --------------------------------------------------------------------------- fallback model


@dataclasses.dataclass(frozen=True)
class LinearOpCost:
    """``time = a_s + b_s_per_byte * bytes + c_s_per_flop * flops`` (all coefficients >= 0).

    Attributes:
        a_s: fixed cost per op, seconds.
        b_s_per_byte: seconds per byte moved (operands + result).
        c_s_per_flop: seconds per flop.
        n_samples: ops the coefficients were fitted on (0: defaults).
        floor_s: smallest time ever predicted, seconds (> 0).
    """

    a_s: float
    b_s_per_byte: float
    c_s_per_flop: float
    n_samples: int = 0
    floor_s: float = _MIN_TIME_S

    def predict(self, nbytes: float, flops: float) -> float:
        """Predicted time in seconds (never below ``floor_s``)."""
        t = self.a_s + self.b_s_per_byte * nbytes + self.c_s_per_flop * flops
        return max(t, self.floor_s, _MIN_TIME_S)


#: Used for a class with no profiled op: ~2 us launch, ~5 GB/s, ~10 GFLOP/s (one CPU core).
DEFAULT_OP_COST = LinearOpCost(2e-6, 2e-10, 1e-10, 0, _MIN_TIME_S)


def _fit_linear(rows: Sequence[tuple[float, float, float]]) -> LinearOpCost:
    """Non-negative least squares on relative error of ``(bytes, flops, time)`` rows.

    If the rows show no size dependence (both slopes fit to zero, e.g. a single op), the
    default bandwidth term is kept so that bigger unseen ops never come out as cheap as
    the measured small ones.
    """
    from scipy.optimize import nnls

    data = np.asarray(rows, dtype=float)
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    t = np.maximum(data[:, 2], _MIN_TIME_S)
    scale = np.maximum(x.max(axis=0), 1e-30)
    coef, _ = nnls(x / scale / t[:, None], np.ones(len(data)))
    coef = coef / scale
    floor = max(float(t.min()) * 0.5, _MIN_TIME_S)
    b = float(coef[1]) if coef[1] > 0 or coef[2] > 0 else DEFAULT_OP_COST.b_s_per_byte
    return LinearOpCost(float(coef[0]), b, float(coef[2]), len(data), floor)


def _enough(rows: Sequence[tuple[float, float, float]]) -> bool:
    """A class gets its own fit with >= 3 ops of >= 2 distinct sizes (else the global fit)."""
    return len(rows) >= 3 and len({r[0] for r in rows}) >= 2


@dataclasses.dataclass
class OpCostModel:
    """Per-class analytic fallback for ops with no measured time.

    Attributes:
        classes: opcode class -> cost fitted on that class's profiled ops.
        default: cost for classes with too few profiled ops: fitted on all profiled ops,
            or :data:`DEFAULT_OP_COST` if there are none.
    """

    classes: dict[str, LinearOpCost]
    default: LinearOpCost = DEFAULT_OP_COST

    @classmethod
    def fit(cls, samples: Iterable[tuple[str, float, float, float]]) -> OpCostModel:
        """Fits from ``(class, bytes, flops, time_s)`` samples of profiled ops."""
        by_cls: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        for c, nbytes, flops, t in samples:
            if t > 0:
                by_cls[c].append((float(nbytes), float(flops), float(t)))
        rows = [r for rs in by_cls.values() for r in rs]
        default = _fit_linear(rows) if rows else DEFAULT_OP_COST
        own = {c: _fit_linear(rs) for c, rs in by_cls.items() if _enough(rs)}
        return cls(own, default)

    def predict(self, cls: str, nbytes: float, flops: float) -> float:
        """Predicted time (seconds, > 0) of an op of class ``cls``."""
        return self.classes.get(cls, self.default).predict(nbytes, flops)


# --------------------------------------------------------------------------- stored profiles


@dataclasses.dataclass(frozen=True)
class OpEstimate:
    """A time for one op.

    Attributes:
        time_s: seconds (> 0).
        estimated: False if measured for this key, True if from the fallback model.
        source: ``"measured"`` or ``"model:<class>"``.
    """

    time_s: float
    estimated: bool
    source: str


@dataclasses.dataclass
class OpRecord:
    """Measured time of one op key.

    Attributes:
        key: the op key.
        time_s: seconds of one execution, median over the instructions with this key.
        cls: opcode class.
        bytes: operand + result bytes.
        flops: estimated flops.
        count: instructions that contributed.
    """

    key: OpKey
    time_s: float
    cls: str
    bytes: int
    flops: float
    count: int = 1


@dataclasses.dataclass
class OpProfile:
    """Measured per-op times of a program on one backend, storable as JSON.

    Attributes:
        backend: ``jax.default_backend()`` when measured.
        device_kind: ``device_kind`` of the first device.
        jax_version: jax version when measured.
        program_hash: sha256 prefix of the compiled HLO text.
        module: compiled module name.
        created: ISO timestamp.
        records: ``OpKey.encode()`` -> measured record (time of one execution).
        instructions: compiled instruction -> ``{"key", "time_s", "count",
            "per_device_s", "op_names"}``; ``time_s`` and ``per_device_s`` are totals per
            iteration (``count`` executions).
        iteration_times_s: host wall time per profiled iteration.
        trace_iteration_s: per iteration, first instruction start to last end.
    """

    backend: str
    device_kind: str
    jax_version: str
    program_hash: str
    module: str
    created: str
    records: dict[str, OpRecord]
    instructions: dict[str, dict[str, Any]]
    iteration_times_s: list[float]
    trace_iteration_s: list[float]
    _model: OpCostModel | None = dataclasses.field(default=None, repr=False, compare=False)

    def cost_model(self) -> OpCostModel:
        """The fallback model fitted on this profile's records (cached)."""
        if self._model is None:
            self._model = OpCostModel.fit(
                (r.cls, r.bytes, r.flops, r.time_s) for r in self.records.values())
        return self._model

    def estimate(self, info: OpInfo) -> OpEstimate:
        """Measured time of ``info.key`` if profiled, else the fallback model's (flagged)."""
        rec = self.records.get(info.key.encode())
        if rec is not None and rec.time_s > 0:
            return OpEstimate(rec.time_s, False, "measured")
        t = self.cost_model().predict(info.cls, info.bytes, info.flops)
        return OpEstimate(t, True, f"model:{info.cls}")

    def merge(self, other: OpProfile) -> None:
        """Adds the other profile's records for keys this one has not measured."""
        for k, rec in other.records.items():
            self.records.setdefault(k, rec)
        self._model = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (schema :data:`PROFILE_SCHEMA`)."""
        recs = {k: {"time_s": r.time_s, "class": r.cls, "bytes": r.bytes, "flops": r.flops,
                    "count": r.count} for k, r in sorted(self.records.items())}
        return {"schema": PROFILE_SCHEMA, "backend": self.backend,
                "device_kind": self.device_kind, "jax_version": self.jax_version,
                "program_hash": self.program_hash, "module": self.module,
                "created": self.created, "iteration_times_s": self.iteration_times_s,
                "trace_iteration_s": self.trace_iteration_s, "op_times": recs,
                "instructions": self.instructions}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OpProfile:
        """Inverse of :meth:`to_json`."""
        if data.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"unsupported profile schema {data.get('schema')!r}")
        recs = {k: OpRecord(OpKey.decode(k), float(v["time_s"]), v["class"], int(v["bytes"]),
                            float(v["flops"]), int(v.get("count", 1)))
                for k, v in data["op_times"].items()}
        return cls(data["backend"], data["device_kind"], data["jax_version"],
                   data["program_hash"], data["module"], data["created"], recs,
                   dict(data["instructions"]), list(data["iteration_times_s"]),
                   list(data["trace_iteration_s"]))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the profile as JSON atomically (temporary file + ``os.replace``)."""
        write_atomic(path, json.dumps(self.to_json(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> OpProfile:
        """Reads a profile written by :meth:`save`."""
        with open(path) as f:
            return cls.from_json(json.load(f))


def _records(times: Mapping[str, float], counts: Mapping[str, float],
             infos: Mapping[str, OpInfo]) -> dict[str, OpRecord]:
    """Time of one execution per op key (median over instructions with the same key)."""
    grouped: dict[str, list[tuple[OpInfo, float]]] = defaultdict(list)
    for name, t in times.items():
        if name in infos and t > 0:
            one = t / max(counts.get(name, 1.0), 1.0)
            grouped[infos[name].key.encode()].append((infos[name], one))
    out = {}
    for k, items in grouped.items():
        info = items[0][0]
        med = statistics.median(t for _, t in items)
        out[k] = OpRecord(info.key, med, info.cls, info.bytes, info.flops, len(items))
    return out


def build_op_profile(prof: ProgramProfile) -> OpProfile:
    """Keys a :class:`ProgramProfile`'s instruction times by op (needs ``hlo_tools``)."""
    import jax

    import hlo_tools

    infos = analyze_module(hlo_tools.parse(prof.hlo_text))
    instrs = {}
    for name, t in prof.times_s.items():
        info = infos.get(name)
        instrs[name] = {
            "key": info.key.encode() if info else None, "time_s": t,
            "count": prof.counts.get(name, 1.0),
            "per_device_s": {str(d): v[name] for d, v in prof.per_device_s.items() if name in v},
            "op_names": list(info.op_names) if info else [],
        }
    return OpProfile(
        backend=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
        jax_version=jax.__version__,
        program_hash=hashlib.sha256(prof.hlo_text.encode()).hexdigest()[:16],
        module=prof.module, created=datetime.datetime.now().isoformat(timespec="seconds"),
        records=_records(prof.times_s, prof.counts, infos), instructions=instrs,
        iteration_times_s=prof.wall_times_s, trace_iteration_s=prof.trace_iteration_s)


def profile_ops(fn: Any, *args: Any, iterations: int = 10, warmup: int = 3,
                donated: bool = False) -> OpProfile:
    """Profiles a program and returns its times keyed by op (see :func:`profile_program`)."""
    prof = profile_program(fn, *args, iterations=iterations, warmup=warmup, donated=donated)
    return build_op_profile(prof)
