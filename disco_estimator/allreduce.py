"""Linear AllReduce model ``T(bytes) = C * bytes + D``, its fit and its microbenchmarks.

What is measured: a jitted ``shard_map`` of ``lax.psum`` over every device of a float32
array of ``bytes`` bytes *per device* (the size the ``all-reduce`` instruction has in the
per-device HLO). Two times are taken per call:

* ``op``: the all-reduce instruction's own duration from a profiler trace (see
  :mod:`disco_estimator.ops.trace`). An all-reduce event lasts until every participant has
  arrived, so each participant's duration includes waiting for the late ones; per
  iteration the *minimum* over participants (the last to arrive) is the collective's cost,
  and the model is fitted on the median over iterations. This is the time the simulator
  charges one all-reduce op: launch/dispatch overhead of the program is not in it.
* ``wall``: host wall time of the whole call (dispatch to ready), also min over processes.
  It includes per-launch overhead (~0.1-0.2 ms on CPU) and is kept for reference.

Setups (see :data:`SETUPS`) run in child processes so that each gets its own device
configuration; ``gloo2-1gbit`` runs inside a private network namespace (``unshare -n``)
whose loopback is limited with ``tc``, so the host's network is never touched.

The fitted model is stored in hardware files, read and written by
:mod:`disco_estimator.hardware`; the process and network helpers of the child processes are in
:mod:`disco_estimator.gloo`. Times are seconds and sizes bytes throughout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from disco_estimator.gloo import child_env, run_bounded

__all__ = [
    "AllReduceModel",
    "AllReduceFit",
    "AllReducePoint",
    "MeasuredAllReduce",
    "Setup",
    "SetupResult",
    "SETUPS",
    "STATISTICS",
    "FULL_SIZES",
    "QUICK_SIZES",
    "fit_allreduce",
    "relative_errors",
    "measure_psum",
    "default_repeats",
    "combine_processes",
    "run_setup",
    "run_inproc",
    "run_gloo",
]

#: 4 B .. 64 MiB in powers of 4 (13 sizes).
FULL_SIZES: tuple[int, ...] = tuple(4 * 4**k for k in range(13))
#: 4 B .. 64 MiB in powers of 16 (7 sizes).
QUICK_SIZES: tuple[int, ...] = tuple(4 * 16**k for k in range(7))
_WORKER = "disco_estimator._gloo_worker"


# --------------------------------------------------------------------------- model and fit


@dataclasses.dataclass(frozen=True)
class AllReduceModel:
    """``T(bytes) = c_s_per_byte * bytes + d_s``, with a latency of its own for tiny
    buffers.

    gloo reduces a buffer of at most one element per process along a shorter path: on
    2-process gloo over 127.0.0.1 one of 4 or 8 bytes takes about 0.1 ms where one of
    12 bytes already pays the full latency of about 3.5 ms (measured with
    :func:`run_gloo`, processes pinned to their own CPUs). A train step's loss ``pmean``
    is such a scalar.

    Attributes:
        c_s_per_byte: seconds per byte of the per-device buffer (1 / effective bandwidth).
        d_s: fixed latency of one all-reduce, seconds.
        small_bytes: buffers of at most this many bytes pay ``d_small_s`` instead of
            ``d_s`` (0: no such path).
        d_small_s: latency of those tiny all-reduces, seconds.
        d_tuple_extra_s: what each buffer of a variadic (tuple-shaped) all-reduce pays on
            top of its own latency where the backend reduces every buffer on its own
            (XLA:CPU), seconds; may be negative down to minus that latency. On 2-process
            gloo inside a train step it was 0.3-0.9 ms beside a latency of 3.3-3.7 ms:
            XLA's combined all-reduce runs after the whole backward pass, where separate
            all-reduces wait beside other work. Fitted in context.
    """

    c_s_per_byte: float
    d_s: float
    small_bytes: int = 0
    d_small_s: float = 0.0
    d_tuple_extra_s: float = 0.0

    def time(self, nbytes: float) -> float:
        """Predicted time in seconds of one all-reduce of ``nbytes`` bytes per device."""
        return self.c_s_per_byte * float(nbytes) + self.latency(nbytes)

    def latency(self, nbytes: float) -> float:
        """The fixed part of :meth:`time` for a buffer of ``nbytes`` bytes, seconds."""
        return self.d_small_s if 0 < nbytes <= self.small_bytes else self.d_s

    def tuple_latency(self, nbytes: float) -> float:
        """The fixed part paid by one buffer of ``nbytes`` bytes of a variadic all-reduce
        on a backend that reduces each buffer on its own, seconds (never negative)."""
        return max(0.0, self.latency(nbytes) + self.d_tuple_extra_s)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Effective bandwidth ``1 / C`` in bytes per second (inf if C is 0)."""
        return math.inf if self.c_s_per_byte <= 0 else 1.0 / self.c_s_per_byte


@dataclasses.dataclass(frozen=True)
class MeasuredAllReduce:
    """Interpolation of measured times, for when one line is too coarse.

    Between measured sizes, times are interpolated linearly (after making them
    non-decreasing); below the smallest size the smallest time is used; above the
    largest, the linear model's slope extends the last point.

    Attributes:
        bytes: measured sizes in bytes, increasing.
        times_s: measured times in seconds.
        linear: the fitted linear model (its slope extrapolates).
    """

    bytes: tuple[int, ...]
    times_s: tuple[float, ...]
    linear: AllReduceModel

    def time(self, nbytes: float) -> float:
        """Time in seconds of one all-reduce of ``nbytes`` bytes per device."""
        t = np.maximum.accumulate(np.asarray(self.times_s, dtype=float))
        if nbytes >= self.bytes[-1]:
            return float(t[-1] + self.linear.c_s_per_byte * (nbytes - self.bytes[-1]))
        return float(np.interp(nbytes, self.bytes, t))


@dataclasses.dataclass(frozen=True)
class AllReduceFit:
    """A fitted model with its relative errors on the points it was fitted on.

    Attributes:
        model: the fitted model.
        mean_rel_err: mean of ``|pred - t| / t``.
        max_rel_err: max of ``|pred - t| / t``.
        weighting: ``"relative"`` (residuals divided by t) or ``"none"``.
    """

    model: AllReduceModel
    mean_rel_err: float
    max_rel_err: float
    weighting: str


def relative_errors(model: AllReduceModel, nbytes: Sequence[float],
                    times: Sequence[float]) -> np.ndarray:
    """``|model.time(b) - t| / t`` for each point."""
    b = np.asarray(nbytes, dtype=float)
    t = np.asarray(times, dtype=float)
    return np.abs(model.c_s_per_byte * b + model.d_s - t) / t


def fit_allreduce(nbytes: Sequence[float], times: Sequence[float],
                  weighting: str = "relative") -> AllReduceFit:
    """Fits ``T = C * bytes + D`` with ``C, D >= 0`` by (weighted) least squares.

    Args:
        nbytes: message sizes in bytes.
        times: measured times in seconds (> 0).
        weighting: ``"relative"`` minimizes the sum of squared relative errors (weights
            1/T, so small messages count as much as big ones); ``"none"`` the plain
            squared errors (dominated by the biggest messages).

    Returns:
        The fit and its mean/max relative error.
    """
    from scipy.optimize import nnls

    b = np.asarray(nbytes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(b) < 2 or np.any(t <= 0):
        raise ValueError("need >= 2 points with positive times")
    w = 1.0 / t if weighting == "relative" else np.ones_like(t)
    scale = max(float(b.max()), 1.0)
    a = np.column_stack([b / scale, np.ones_like(b)]) * w[:, None]
    coef, _ = nnls(a, t * w)
    model = AllReduceModel(float(coef[0] / scale), float(coef[1]))
    err = relative_errors(model, b, t)
    return AllReduceFit(model, float(err.mean()), float(err.max()), weighting)


# --------------------------------------------------------------------------- measurement


@dataclasses.dataclass
class AllReducePoint:
    """Measurements of one message size.

    Attributes:
        bytes: per-device buffer size in bytes.
        op_times_s: per iteration, the all-reduce op's trace duration (min over
            participants).
        wall_times_s: per iteration, the call's wall time (min over processes).
    """

    bytes: int
    op_times_s: list[float]
    wall_times_s: list[float]

    @property
    def op_time_s(self) -> float:
        """Median op time in seconds."""
        return statistics.median(self.op_times_s)

    @property
    def wall_time_s(self) -> float:
        """Median wall time in seconds."""
        return statistics.median(self.wall_times_s)

    def op_time(self, stat: str = "median") -> float:
        """Op time in seconds by statistic (see :data:`STATISTICS`)."""
        return _statistic(self.op_times_s, stat)

    def wall_time(self, stat: str = "median") -> float:
        """Wall time in seconds by statistic (see :data:`STATISTICS`)."""
        return _statistic(self.wall_times_s, stat)

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "op_time_s": self.op_time_s,
                "op_p25_s": self.op_time("p25"), "wall_time_s": self.wall_time_s,
                "op_times_s": self.op_times_s, "wall_times_s": self.wall_times_s}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AllReducePoint:
        return cls(int(d["bytes"]), list(d["op_times_s"]), list(d["wall_times_s"]))


#: Statistics over iterations a fit can use: ``median`` (default), ``p25`` (25th
#: percentile: robust to a busy shared machine, where a share of the iterations waits a
#: scheduler slice, ~4 ms, for a CPU) and ``min``.
STATISTICS = ("median", "p25", "min")


def _statistic(values: Sequence[float], stat: str) -> float:
    if stat == "median":
        return statistics.median(values)
    if stat == "p25":
        return float(np.percentile(values, 25))
    if stat == "min":
        return min(values)
    raise ValueError(f"unknown statistic {stat!r}; choose from {STATISTICS}")


def default_repeats(nbytes: int, quick: bool = False) -> int:
    """Timed iterations for a size: more for small (noisy) messages, fewer for big ones."""
    n = 30 if nbytes <= 256 * 1024 else 10 if nbytes <= 4 * 1024 * 1024 else 5
    return max(3, n // 2) if quick else n


def _psum_program(mesh: Any, nbytes: int) -> Any:
    """A jitted psum of ``nbytes`` per device over mesh axis ``"d"``; module is unique."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec

    def body(x: Any) -> Any:
        return lax.psum(x, "d")

    body.__name__ = body.__qualname__ = f"allreduce_{nbytes}B"
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("d"),
                                 out_specs=PartitionSpec()))


def _global_input(mesh: Any, n_per_device: int) -> Any:
    """A float32 array of ``n_per_device`` elements on each device of ``mesh``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    shape = (mesh.devices.size * n_per_device,)
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    return jax.make_array_from_callback(
        shape, sharding, lambda idx: np.ones((n_per_device,), np.float32))


@dataclasses.dataclass
class _Case:
    nbytes: int
    compiled: Any
    module: str
    ar_names: frozenset[str]
    x: Any
    repeats: int
    walls: list[float] = dataclasses.field(default_factory=list)


def _make_case(mesh: Any, nbytes: int, quick: bool) -> _Case:
    import hlo_tools
    from disco_estimator.ops import module_name

    n = max(1, nbytes // 4)
    x = _global_input(mesh, n)
    compiled = _psum_program(mesh, 4 * n).lower(x).compile()
    text = compiled.as_text()
    names = frozenset(i.name for _, i in hlo_tools.parse(text).instructions()
                      if i.opcode.startswith("all-reduce"))
    return _Case(4 * n, compiled, module_name(text), names, x, default_repeats(4 * n, quick))


def _call(case: _Case) -> float:
    import time

    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(case.compiled(case.x))
    return time.perf_counter() - t0


def _op_times(case: _Case, events: Sequence[Any]) -> list[float]:
    """Per iteration, the all-reduce time of the participant that waited least."""
    from disco_estimator.ops import op_events, per_device_samples

    evs = [e for e in op_events(events, case.module) if e.name in case.ar_names]
    per_dev = per_device_samples(evs)
    series = [[sum(v) for v in zip(*names.values(), strict=True)] for names in per_dev.values()]
    return [min(vals) for vals in zip(*series, strict=False)]


def measure_psum(sizes: Sequence[int], quick: bool = False, warmup: int = 2,
                 progress: Callable[[str], None] | None = None) -> list[AllReducePoint]:
    """Measures psum over all (global) devices of this process's jax runtime.

    Sizes are run interleaved (round r runs every size that still needs a repeat), so
    slow drifts of a shared machine hit every size alike. In a multi-process job every
    process must call this with the same arguments.

    Args:
        sizes: per-device message sizes in bytes (rounded down to a multiple of 4, >= 4).
        quick: fewer repeats (see :func:`default_repeats`).
        warmup: untimed calls per size before tracing.
        progress: called with a line of text per finished size.

    Returns:
        One point per size; op times are min over this process's local devices.
    """
    import jax
    from jax.sharding import Mesh

    from disco_estimator.ops import find_trace_file, read_trace_events

    mesh = Mesh(np.array(jax.devices()), ("d",))
    cases = [_make_case(mesh, b, quick) for b in sizes]
    for case in cases:
        for _ in range(warmup):
            _call(case)
    with tempfile.TemporaryDirectory(prefix="disco_ar_trace_") as tmp:
        jax.profiler.start_trace(tmp)
        try:
            for r in range(max(c.repeats for c in cases)):
                for case in (c for c in cases if r < c.repeats):
                    case.walls.append(_call(case))
        finally:
            jax.profiler.stop_trace()
        events = read_trace_events(find_trace_file(tmp))
    points = [AllReducePoint(c.nbytes, _op_times(c, events), c.walls) for c in cases]
    for p in points:
        if progress is not None:
            progress(f"{_fmt_bytes(p.bytes):>9}  op {p.op_time_s * 1e3:9.3f} ms  "
                     f"wall {p.wall_time_s * 1e3:9.3f} ms  ({len(p.op_times_s)} it)")
    return points


def combine_processes(per_process: Sequence[Sequence[AllReducePoint]]) -> list[AllReducePoint]:
    """Merges the points of the processes of one job: per iteration, min over processes."""
    out = []
    for pts in zip(*per_process, strict=True):
        op = [min(v) for v in zip(*(p.op_times_s for p in pts), strict=False)]
        wall = [min(v) for v in zip(*(p.wall_times_s for p in pts), strict=False)]
        out.append(AllReducePoint(pts[0].bytes, op, wall))
    return out


def _fmt_bytes(n: int) -> str:
    for unit, k in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:g} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- setups


@dataclasses.dataclass(frozen=True)
class Setup:
    """One measured configuration.

    Attributes:
        name: setup name (also the hardware file name).
        kind: ``"inproc"`` (N host devices in one process) or ``"gloo"`` (N processes).
        num_devices: devices taking part in the all-reduce.
        num_processes: processes of the job.
        rate: loopback rate limit for ``tc`` (e.g. ``"1gbit"``), or None for unlimited.
        description: what it models.
    """

    name: str
    kind: str
    num_devices: int
    num_processes: int
    rate: str | None
    description: str


SETUPS: dict[str, Setup] = {
    "inproc4": Setup("inproc4", "inproc", 4, 1, None,
                     "4 XLA:CPU host devices in one process (in-memory rendezvous)"),
    "gloo2": Setup("gloo2", "gloo", 2, 2, None,
                   "2 processes x 1 CPU device, gloo over TCP on 127.0.0.1 (no limit)"),
    "gloo2-1gbit": Setup("gloo2-1gbit", "gloo", 2, 2, "1gbit",
                         "2 processes x 1 CPU device, gloo over TCP on a private loopback "
                         "limited by tc tbf rate 1gbit burst 1mb latency 100ms"),
}


@dataclasses.dataclass
class SetupResult:
    """Measured points of one setup with the fits of op and wall times.

    Attributes:
        setup: the setup.
        points: one per size.
        fit: fit of the op times (the model to use).
        wall_fit: fit of the wall times (reference).
        facts: measured facts about the run (jax version, devices, qdisc, ...).
        stat: statistic over iterations that was fitted (see :data:`STATISTICS`).
        probes: per process, :meth:`disco_estimator.probes.ProbeResult.to_json` (or None).
    """

    setup: Setup
    points: list[AllReducePoint]
    fit: AllReduceFit
    wall_fit: AllReduceFit
    facts: dict[str, Any]
    stat: str = "median"
    probes: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"setup": dataclasses.asdict(self.setup), "facts": self.facts,
                "statistic": self.stat,
                "fit": _fit_json(self.fit), "wall_fit": _fit_json(self.wall_fit),
                "points": [p.to_json() for p in self.points]}


def _fit_json(fit: AllReduceFit) -> dict[str, Any]:
    return {"c_s_per_byte": fit.model.c_s_per_byte, "d_s": fit.model.d_s,
            "mean_rel_err": fit.mean_rel_err, "max_rel_err": fit.max_rel_err,
            "weighting": fit.weighting}


def _size_args(sizes: Sequence[int]) -> list[str]:
    return ["--sizes", ",".join(str(int(s)) for s in sizes)]


def run_inproc(num_devices: int, sizes: Sequence[int], quick: bool = False,
               timeout_s: float = 300.0, tag: str = "inproc",
               probes: bool = False) -> dict[str, Any]:
    """Measures psum over ``num_devices`` host devices in a child process.

    Returns:
        The worker's JSON: ``{"facts": {...}, "processes": [[point, ...]]}``.
    """
    with tempfile.TemporaryDirectory(prefix="disco_ar_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", _WORKER, "measure", "--out", str(out), "--tag", tag,
               "--devices", str(num_devices), *_size_args(sizes)] + (["--quick"] * quick) + (
                   ["--probes"] * probes)
        run_bounded(cmd, child_env(num_devices), timeout_s)
        return json.loads(out.read_text())


def run_gloo(num_processes: int, sizes: Sequence[int], rate: str | None = None,
             quick: bool = False, timeout_s: float = 300.0, tag: str = "gloo",
             pin_cpus: bool = False, probes: bool = False) -> dict[str, Any]:
    """Measures psum between ``num_processes`` gloo processes on 127.0.0.1.

    Args:
        num_processes: processes (one CPU device each).
        sizes: per-device message sizes in bytes.
        rate: if set (``"1gbit"``), the job runs in a private network namespace
            (``unshare -n``, needs root) whose loopback ``tc`` limits to this rate.
        quick: fewer repeats.
        timeout_s: the whole job is killed after this many seconds.
        tag: label of the progress lines.
        pin_cpus: pin each process to a CPU of its own
            (:func:`disco_estimator.gloo.pin_to_own_cpu`).
        probes: also run :mod:`disco_estimator.probes` in every process.

    Returns:
        The launcher's JSON: ``{"facts": {...}, "processes": [[point, ...], ...]}``
        (and ``"probes": [result, ...]``, one per process, with ``probes``).
    """
    with tempfile.TemporaryDirectory(prefix="disco_ar_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", _WORKER, "launch", "--out", str(out), "--tag", tag,
               "--num-processes", str(num_processes), "--timeout", str(timeout_s - 5),
               *_size_args(sizes)] + (["--quick"] * quick) + (["--pin-cpus"] * pin_cpus) + (
                   ["--probes"] * probes)
        if rate:
            netns = os.readlink("/proc/self/ns/net")
            cmd = ["unshare", "-n", *cmd, "--rate", rate, "--parent-netns", netns]
        run_bounded(cmd, child_env(1), timeout_s)
        return json.loads(out.read_text())


def run_setup(setup: Setup | str, sizes: Sequence[int] | None = None, quick: bool = False,
              timeout_s: float = 300.0, stat: str = "median", probes: bool = False,
              pin_cpus: bool = False) -> SetupResult:
    """Measures one setup in child processes and fits the linear model.

    Args:
        setup: a :class:`Setup` or a name in :data:`SETUPS`.
        sizes: message sizes in bytes; :data:`QUICK_SIZES` or :data:`FULL_SIZES` if None.
        quick: fewer sizes and repeats.
        timeout_s: bound on the whole setup's run, seconds.
        stat: statistic over iterations to fit (see :data:`STATISTICS`).
        probes: also measure the in-program all-reduce latency and the overlap
            (:mod:`disco_estimator.probes`; ``SetupResult.probes``).
        pin_cpus: gloo setups: pin each process to a CPU of its own.
    """
    s = SETUPS[setup] if isinstance(setup, str) else setup
    sizes = sizes or (QUICK_SIZES if quick else FULL_SIZES)
    if s.kind == "inproc":
        raw = run_inproc(s.num_devices, sizes, quick, timeout_s, s.name, probes=probes)
    else:
        raw = run_gloo(s.num_processes, sizes, s.rate, quick, timeout_s, s.name,
                       pin_cpus=pin_cpus, probes=probes)
    per_proc = [[AllReducePoint.from_json(p) for p in pts] for pts in raw["processes"]]
    points = combine_processes(per_proc)
    b = [p.bytes for p in points]
    fit = fit_allreduce(b, [p.op_time(stat) for p in points])
    wall_fit = fit_allreduce(b, [p.wall_time(stat) for p in points])
    return SetupResult(s, points, fit, wall_fit, raw["facts"], stat, raw.get("probes"))
