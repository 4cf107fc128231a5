"""Ready-queue simulator of one data-parallel training iteration on one device.

The simulator is independent of HLO. It takes a :class:`SimGraph` -- the per-device
program after a plan has been applied (fusion groups, duplicated producers and
AllReduce buckets already materialized as nodes), with a duration per node -- and
returns a :class:`SimResult` with the iteration time, per-node start/finish times,
stream busy times and the peak memory. It serves as the search's cost model
``Cost(H)`` (DisCo paper, section 4.4).

Scheduling model
================
Two resources, each running one node at a time, non-preemptively:

* the **compute stream** runs every node with ``is_comm == False`` (kernels,
  fusions);
* the **communication channel** runs every node with ``is_comm == True``
  (AllReduces or AllReduce buckets).

A node is *ready* once all its predecessors have finished; its ready time is
``ready(v) = max(finish(p) for p in preds(v))`` (0 for a node without
predecessors). Consumers of a communication node therefore wait for the
AllReduce to finish, and an AllReduce of a bucket waits for every tensor of the
bucket (all its predecessors).

Each resource is work-conserving with a fixed priority. When it becomes free at
time ``t`` it starts, among the nodes of its kind that are ready at ``t``, the
one with the smallest key; if none is ready it waits for the first one to become
ready. Start = max(resource free, ready); finish = start + duration (with
``overlap < 1`` a kernel can take longer, see below). The keys:

* compute stream: ``(ready time, index)`` -- the ready queue ordered by readiness
  time, ties in program order;
* channel: ``(ready time, index)`` -- AllReduces run in the order their gradient
  tensors are produced (the paper's rule), ties by index.

The implementation is event driven: each step takes the resource whose next
start is earlier (the compute stream on ties), so event start times never
decrease and a decision never depends on a node that becomes known later. The
keys do not depend on the order in which events are processed, which keeps the
C and Python implementations bit-identical and makes checkpoint/replay
(incremental re-simulation) sound.

Relation to the paper's FIFO queue. Without communication nodes and with
positive durations, the compute stream is never idle and every node popped
finishes strictly later than the previous one, so the nodes released by one pop
share one ready time that is larger than that of every node already queued.
Ordering by ``(ready time, index)`` is then exactly the paper's FIFO with the
successors of a node appended in index order. (With zero-duration nodes, nodes
released at the same instant by different pops are ordered by index instead of
by release order.) With communication, a compute node that consumes an
AllReduce enters the queue when the AllReduce finishes and is ordered by that
time -- it never blocks ready compute behind it, and it runs before compute
nodes that became ready after it.

Overlap calibration
===================
``overlap`` (phi, in [0, 1]) models how much computation progresses while an
AllReduce is in flight: *while the channel is busy, the compute stream runs at
rate phi*; the channel itself always runs at full speed. A kernel of duration
``w`` that spends ``o`` seconds under a running AllReduce and ``u`` seconds
without one finishes when ``phi * o + u == w``.

* ``phi = 1``: full overlap -- exactly the paper's model (GPU with NCCL streams).
  This case takes a branch that never rescales, so times are ``start + duration``
  bit for bit.
* ``phi = 0``: computation does not progress while an AllReduce runs: compute
  and communication serialize.
* In between, fit phi from one measurement of an AllReduce of time ``M`` that
  runs alongside independent compute of time ``C`` (with ``C >= phi * M``): the
  model predicts ``T = M + C - phi * M``, so ``phi = (M + C - T) / M``. One such
  measurement on XLA:CPU (M = 135 ms, C = 33 ms) gave phi ~ 0 with its default
  scheduler (T = 170 ms) and phi ~ 0.07 with the concurrency-optimized one
  (T = 158 ms).

Reported busy times follow the same model: ``compute_s`` is the time the compute
stream is occupied, so ``compute_s == sum(compute durations) + (1 - phi) *
overlap_s``.

Peak memory (DistIR rule)
=========================
The output of node ``i`` (``out_bytes[i]``) is live on the half-open interval
``[start[i], free[i])``, where ``free[i]`` is the finish of its last consumer, or
the end of the iteration if it has no consumer (a graph output such as a new
parameter value). Buffers freed at time ``t`` are released before buffers
allocated at ``t``; a zero-length lifetime (zero-duration producer and consumers)
counts at its instant. ``peak_bytes = persistent_bytes + max_t live(t)``.

Implementations
===============
The simulation exists twice with identical results: a small C kernel (compiled
with the system C compiler on first use into a cache directory and called
through ctypes; it also computes free times, the overlap and the peak memory in
O(N + E), by merging the finish-ordered compute and channel sequences) and a
pure-Python/numpy fallback, used when no compiler is available. The scheduling
arithmetic is the same expression by expression (the kernel is built with
``-ffp-contract=off``), so both return bit-identical results. Select with
``backend=`` or the ``DISCO_SIM_BACKEND`` environment variable (``auto`` | ``c``
| ``python``); the kernel (``simulator_kernel.c``) is built by :mod:`hlo_tools.native`
into :func:`hlo_tools.dirs.cache_dir`.

Incremental re-simulation (future work; the design allows it)
=============================================================
The loop state between two events is small and explicit (``state`` in the C
source): the two resources' free times, the running kernel's progress, the two
ready heaps, the per-node remaining-predecessor counters and ready times. The
priorities depend only on (ready time, index), never on processing history. So
for a neighbour plan, let ``t*`` be the earliest ready time (in the old
schedule) of any changed or removed node, and the earliest ready time of any
added node (from its predecessors' old finish times); every event starting
before ``t*`` is unchanged, and re-costing can restore the last checkpoint
before ``t*`` and replay only the suffix. This needs node indices that are
stable across plans (the graph builder should append new nodes, e.g.
duplicates, rather than renumber) and a caller-owned workspace holding the
loop's arrays instead of the kernel's per-call ``malloc``. An ``iteration_s``
cut-off for alpha-pruning fits the same loop: ``max(t_compute + remaining
compute work, t_channel + remaining comm work)`` is a lower bound at every event.
"""

from __future__ import annotations

import ctypes
import heapq
import os
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

from hlo_tools import native

__all__ = [
    "SimGraph",
    "SimResult",
    "Backend",
    "check_graph",
    "full_overlap_bound",
    "simulate",
    "c_kernel_available",
    "synthetic_graph",
]

Backend = Literal["auto", "c", "python"]


class SimGraph(NamedTuple):
    """One iteration of the per-device program as the simulator sees it.

    N nodes in topological order: every predecessor of node ``i`` has an index
    ``< i``. Predecessors are stored in CSR form: the predecessors of node ``i``
    are ``pred_idx[pred_ptr[i]:pred_ptr[i + 1]]``.

    Attributes:
        names: [N] node names, used only for traces.
        is_comm: [N] bool. True: an AllReduce (or AllReduce bucket) that runs on
            the communication channel. False: a kernel on the compute stream.
        duration_s: [N] float64 seconds, >= 0: the node's execution time when
            run alone (for comm nodes: the AllReduce time, e.g. ``C * bytes + D``).
        out_bytes: [N] int64 bytes of the node's output buffer (0 for aliasing
            ops such as bitcasts, or for in-place AllReduces if desired).
        pred_ptr: [N + 1] int32 CSR offsets into ``pred_idx``; ``pred_ptr[0] == 0``
            and ``pred_ptr[N] == E``.
        pred_idx: [E] int32 predecessor node indices.
        persistent_bytes: bytes live for the whole iteration (parameters,
            optimizer state, inputs) that are not outputs of any node.
    """

    names: tuple[str, ...]
    is_comm: np.ndarray
    duration_s: np.ndarray
    out_bytes: np.ndarray
    pred_ptr: np.ndarray
    pred_idx: np.ndarray
    persistent_bytes: int = 0


class SimResult(NamedTuple):
    """The simulated iteration.

    Attributes:
        iteration_s: makespan in seconds (latest finish; 0 for an empty graph).
        compute_s: seconds the compute stream is occupied (the sum of compute
            durations when ``overlap == 1``; larger when kernels are slowed down
            by concurrent communication).
        comm_s: seconds the communication channel is busy (sum of comm durations).
        overlap_s: seconds during which both the stream and the channel are busy.
        start_s: [N] float64 start time of each node, seconds from iteration start.
        finish_s: [N] float64 finish time of each node.
        free_s: [N] float64 time each node's output buffer is freed (finish of its
            last consumer, or ``iteration_s`` if it has none).
        peak_bytes: peak live bytes, including ``persistent_bytes``.
        overlap: the overlap parameter phi the result was simulated with.
    """

    iteration_s: float
    compute_s: float
    comm_s: float
    overlap_s: float
    start_s: np.ndarray
    finish_s: np.ndarray
    free_s: np.ndarray
    peak_bytes: int
    overlap: float


# --------------------------------------------------------------------------- checks


def _arrays(graph: SimGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns the graph's arrays as contiguous arrays of the kernel's dtypes.

    Returns:
        (is_comm [N] bool, duration_s [N] float64, out_bytes [N] int64,
        pred_ptr [N+1] int32, pred_idx [E] int32); no copy when already right.
    """
    return (
        np.ascontiguousarray(graph.is_comm, dtype=np.bool_),
        np.ascontiguousarray(graph.duration_s, dtype=np.float64),
        np.ascontiguousarray(graph.out_bytes, dtype=np.int64),
        np.ascontiguousarray(graph.pred_ptr, dtype=np.int32),
        np.ascontiguousarray(graph.pred_idx, dtype=np.int32),
    )


def check_graph(graph: SimGraph) -> None:
    """Validates shapes, CSR structure, topological order and value ranges.

    Args:
        graph: the graph to check.

    Raises:
        ValueError: naming the first violated property.
    """
    n = len(graph.names)
    for field in ("is_comm", "duration_s", "out_bytes"):
        if np.shape(getattr(graph, field)) != (n,):
            raise ValueError(f"SimGraph.{field} must have shape [{n}] (len(names))")
    ptr = np.asarray(graph.pred_ptr)
    idx = np.asarray(graph.pred_idx)
    if ptr.shape != (n + 1,) or idx.ndim != 1:
        raise ValueError(f"SimGraph.pred_ptr must have shape [{n + 1}], pred_idx must be 1-D")
    if ptr[0] != 0 or ptr[-1] != idx.shape[0] or np.any(np.diff(ptr) < 0):
        raise ValueError("SimGraph.pred_ptr must start at 0, end at len(pred_idx), not decrease")
    if max(n, idx.shape[0]) >= 2**31:
        raise ValueError("SimGraph too large for int32 indices")
    dst = np.repeat(np.arange(n), np.diff(ptr))
    if np.any(idx < 0) or np.any(idx >= dst):
        raise ValueError("SimGraph is not topologically ordered (pred index >= node index)")
    dur = np.asarray(graph.duration_s, dtype=np.float64)
    if not np.all(np.isfinite(dur)) or np.any(dur < 0):
        raise ValueError("SimGraph.duration_s must be finite and >= 0")
    if np.any(np.asarray(graph.out_bytes) < 0) or graph.persistent_bytes < 0:
        raise ValueError("SimGraph byte counts must be >= 0")


def full_overlap_bound(graph: SimGraph) -> float:
    """The full-overlap (FO) lower bound on the iteration time.

    Computation and communication perfectly overlapped, dependencies ignored:
    ``max(sum of compute durations, sum of comm durations)``.

    Args:
        graph: the per-device program.

    Returns:
        The bound in seconds.
    """
    dur = np.asarray(graph.duration_s, dtype=np.float64)
    comm = np.asarray(graph.is_comm, dtype=np.bool_)
    return float(max(dur[~comm].sum(), dur[comm].sum(), 0.0))


# ------------------------------------------------------------------ Python kernel


class _Raw(NamedTuple):
    """What a kernel returns: [N] start/finish/free times, overlap seconds, peak live bytes."""

    start: np.ndarray
    finish: np.ndarray
    free: np.ndarray
    overlap_s: float
    peak_live: int


def _successors(pred_ptr: np.ndarray, pred_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Successor CSR from predecessor CSR.

    Args:
        pred_ptr: [N+1] int32 predecessor offsets.
        pred_idx: [E] int32 predecessor indices.

    Returns:
        (succ_ptr [N+1] int64, succ_idx [E] int64); each node's successors in
        increasing index order (with one entry per edge).
    """
    n = pred_ptr.shape[0] - 1
    dst = np.repeat(np.arange(n), np.diff(pred_ptr))
    order = np.argsort(pred_idx, kind="stable")
    succ_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(pred_idx, minlength=n), out=succ_ptr[1:])
    return succ_ptr, dst[order]


def _stretched_finish(tau: float, rho: float, t_m: float, phi: float) -> float:
    """Finish of a kernel with ``rho`` s of work left at ``tau``, channel busy until ``t_m``.

    The kernel progresses at rate ``phi`` until ``t_m`` and at rate 1 afterwards.
    The C kernel's ``stretched_finish`` evaluates the same expressions.
    """
    if tau >= t_m:
        return tau + rho
    span = phi * (t_m - tau)
    if rho <= span:
        return tau + rho / phi if phi > 0.0 else tau
    return t_m + (rho - span)


def _advance(tau: float, rho: float, t_m: float, now: float, phi: float) -> float:
    """Work left at ``now`` for a kernel with ``rho`` left at ``tau`` (channel busy to ``t_m``)."""
    busy = (t_m if t_m < now else now) - tau
    if busy < 0.0:
        busy = 0.0
    free = now - (tau if tau > t_m else t_m)
    if free < 0.0:
        free = 0.0
    rho = rho - phi * busy - free
    return rho if rho > 0.0 else 0.0


def _schedule_python(
    is_comm: np.ndarray,
    dur: np.ndarray,
    pred_ptr: np.ndarray,
    pred_idx: np.ndarray,
    phi: float,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Pure-Python scheduling loop (reference and fallback for the C kernel).

    Args:
        is_comm: [N] bool comm flags.
        dur: [N] float64 durations in seconds.
        pred_ptr: [N+1] int32 predecessor CSR offsets.
        pred_idx: [E] int32 predecessor indices.
        phi: overlap parameter in [0, 1].

    Returns:
        (start [N] float64 s, finish [N] float64 s, overlap_s). ``overlap_s`` is
        accumulated kernel by kernel, in the C kernel's order.
    """
    n = dur.shape[0]
    succ_ptr, succ_idx = _successors(pred_ptr, pred_idx)
    comm = is_comm.tolist()
    d = dur.tolist()
    sp = succ_ptr.tolist()
    si = succ_idx.tolist()
    remaining = np.diff(pred_ptr).tolist()
    ready = [0.0] * n
    start = [0.0] * n
    finish = [0.0] * n
    cq = [(0.0, v) for v in range(n) if remaining[v] == 0 and not comm[v]]
    mq = [(0.0, v) for v in range(n) if remaining[v] == 0 and comm[v]]
    push, pop = heapq.heappush, heapq.heappop
    corder: list[int] = []  # comm nodes in channel order
    slow = phi < 1.0
    t_c = t_m = tau = rho = overlap = 0.0
    run = -1  # kernel on the stream whose finish may still move
    cp = 0  # first comm in corder that may overlap the running kernel
    done = 0

    def release(k: int, f: float) -> None:
        for e in range(sp[k], sp[k + 1]):
            s = si[e]
            if f > ready[s]:
                ready[s] = f
            remaining[s] -= 1
            if remaining[s] == 0:
                push(mq if comm[s] else cq, (ready[s], s))

    def start_comm(j: int, s_m: float) -> float:
        fm = s_m + d[j]
        start[j] = s_m
        finish[j] = fm
        corder.append(j)
        return fm

    def kernel_overlap(s: float, f: float) -> float:
        nonlocal cp
        while cp < len(corder) and finish[corder[cp]] <= s:
            cp += 1
        acc = 0.0
        q = cp
        while q < len(corder) and start[corder[q]] < f:
            c = corder[q]
            lo = s if s > start[c] else start[c]
            hi = f if f < finish[c] else finish[c]
            if hi > lo:
                acc += hi - lo
            q += 1
        return acc

    while True:
        if run >= 0:
            f = finish[run]
            if mq:
                r, j = mq[0]
                s_m = t_m if t_m > r else r
                if s_m < f:  # an AllReduce starts while the kernel runs
                    pop(mq)
                    fm = start_comm(j, s_m)
                    if slow:
                        rho = _advance(tau, rho, t_m, s_m, phi)
                        tau = s_m
                        finish[run] = _stretched_finish(tau, rho, fm, phi)
                    t_m = fm
                    done += 1
                    release(j, fm)
                    continue
            t_c = f
            overlap += kernel_overlap(start[run], f)
            done += 1
            release(run, f)
            run = -1
            continue
        if cq:
            r, v = cq[0]
            s_c = t_c if t_c > r else r
            s_m = 0.0
            if mq:
                r2 = mq[0][0]
                s_m = t_m if t_m > r2 else r2
            if not mq or s_c <= s_m:
                pop(cq)
                start[v] = s_c
                if slow:
                    tau = s_c
                    rho = d[v]
                    finish[v] = _stretched_finish(tau, rho, t_m, phi)
                else:
                    finish[v] = s_c + d[v]
                run = v
                continue
        elif not mq:
            break
        r, j = pop(mq)
        fm = start_comm(j, t_m if t_m > r else r)
        t_m = fm
        done += 1
        release(j, fm)
    if done != n:
        raise ValueError("SimGraph has nodes that never became ready (not a DAG?)")
    return np.array(start, dtype=np.float64), np.array(finish, dtype=np.float64), overlap


def _free_times(
    finish: np.ndarray, pred_ptr: np.ndarray, pred_idx: np.ndarray, end: float
) -> tuple[np.ndarray, np.ndarray]:
    """When each output is freed.

    Returns:
        (free [N] float64: last consumer's finish, or ``end`` without consumers;
        has_consumer [N] bool).
    """
    free = np.full(finish.shape[0], -np.inf)
    np.maximum.at(free, pred_idx, np.repeat(finish, np.diff(pred_ptr)))
    orphan = np.isneginf(free)
    free[orphan] = end
    return free, ~orphan


def _peak_live(
    start: np.ndarray, free: np.ndarray, has_consumer: np.ndarray, nbytes: np.ndarray
) -> int:
    """Peak live bytes (without persistent bytes); lifetimes as in the module doc.

    The peak is reached right after an allocation; at an allocation time ``t`` the
    live bytes are: allocated at or before ``t``, minus consumed buffers freed at
    or before ``t`` (zero-length lifetimes: strictly before ``t``). Outputs with
    no consumer are never freed.
    """
    o = np.argsort(start)
    t = start[o]
    alloc = np.cumsum(nbytes[o])
    pos = has_consumer & (free > start)
    zero = has_consumer & ~pos
    freed = np.zeros(t.shape[0], dtype=np.int64)
    for mask, when, side in ((pos, free, "right"), (zero, start, "left")):
        o2 = np.argsort(when[mask])
        cum = np.concatenate([[0], np.cumsum(nbytes[mask][o2])])
        freed += cum[np.searchsorted(when[mask][o2], t, side=side)]
    return max(int((alloc - freed).max(initial=0)), 0)


def _run_python(
    is_comm: np.ndarray,
    dur: np.ndarray,
    nbytes: np.ndarray,
    pred_ptr: np.ndarray,
    pred_idx: np.ndarray,
    phi: float,
) -> _Raw:
    """Schedule + free times + peak memory, pure Python/numpy (same results as C)."""
    start, finish, overlap = _schedule_python(is_comm, dur, pred_ptr, pred_idx, phi)
    free, has_consumer = _free_times(finish, pred_ptr, pred_idx, float(finish.max(initial=0.0)))
    return _Raw(start, finish, free, overlap, _peak_live(start, free, has_consumer, nbytes))


# ----------------------------------------------------------------------- C kernel

#: The kernel's C source (package data beside this module; its text keys the build cache).
_C_SOURCE = Path(__file__).with_name("simulator_kernel.c").read_text()

_CFLAGS = ("-O2", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.disco_sim_run
    fn.restype = ctypes.c_int
    vp = ctypes.c_void_p
    fn.argtypes = [ctypes.c_int32, vp, vp, vp, vp, vp, ctypes.c_double, vp, vp, vp, vp, vp]


#: The C kernel, built by :mod:`hlo_tools.native` on first use.
KERNEL = native.SharedLibrary(_C_SOURCE, "simkernel", _CFLAGS, setup=_declare,
                              owner="disco_estimator simulator", fallback="simulator", stacklevel=4)
_load_kernel = KERNEL.load


def c_kernel_available() -> bool:
    """Whether the compiled C kernel can be used (builds it on first call)."""
    return _load_kernel() is not None


def _run_c(
    lib: ctypes.CDLL,
    is_comm: np.ndarray,
    dur: np.ndarray,
    nbytes: np.ndarray,
    pred_ptr: np.ndarray,
    pred_idx: np.ndarray,
    phi: float,
) -> _Raw:
    """Runs the C kernel; same arguments and results as :func:`_run_python`."""
    n = dur.shape[0]
    start = np.empty(n, dtype=np.float64)
    finish = np.empty(n, dtype=np.float64)
    free = np.empty(n, dtype=np.float64)
    overlap = ctypes.c_double(0.0)
    peak = ctypes.c_int64(0)
    rc = lib.disco_sim_run(
        n,
        is_comm.view(np.uint8).ctypes.data,
        dur.ctypes.data,
        pred_ptr.ctypes.data,
        pred_idx.ctypes.data,
        nbytes.ctypes.data,
        phi,
        start.ctypes.data,
        finish.ctypes.data,
        free.ctypes.data,
        ctypes.addressof(overlap),
        ctypes.addressof(peak),
    )
    if rc == 1:
        raise MemoryError("disco_estimator simulator kernel: out of memory")
    if rc != 0:
        raise ValueError("SimGraph has nodes that never became ready (not a DAG?)")
    return _Raw(start, finish, free, overlap.value, peak.value)


# ------------------------------------------------------------------------ public


def _pick_backend(backend: Backend | None) -> ctypes.CDLL | None:
    """The C library to use, or None for the Python loop."""
    return native.choose(backend or os.environ.get("DISCO_SIM_BACKEND", "auto"), "simulator",
                        _load_kernel)

def simulate(
    graph: SimGraph,
    overlap: float = 1.0,
    *,
    backend: Backend | None = None,
    check: bool = True,
) -> SimResult:
    """Simulates one iteration of ``graph`` (pure function; see the module doc for the model).

    Args:
        graph: the per-device program.
        overlap: phi in [0, 1], the compute rate while an AllReduce is in flight
            (1: full overlap, the paper's model; 0: compute and comm serialize).
        backend: ``"c"``, ``"python"`` or ``"auto"`` (C if it can be built);
            None reads ``$DISCO_SIM_BACKEND`` (default auto). Results are identical.
        check: validate the graph first (:func:`check_graph`). Only pass False for
            graphs built by trusted code: the C kernel does not bounds-check.

    Returns:
        The :class:`SimResult`.

    Raises:
        ValueError: for an invalid graph or overlap.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if check:
        check_graph(graph)
    is_comm, dur, nbytes, pred_ptr, pred_idx = _arrays(graph)
    lib = _pick_backend(backend)
    phi = float(overlap)
    if lib is not None:
        raw = _run_c(lib, is_comm, dur, nbytes, pred_ptr, pred_idx, phi)
    else:
        raw = _run_python(is_comm, dur, nbytes, pred_ptr, pred_idx, phi)
    busy = raw.finish - raw.start
    return SimResult(
        iteration_s=float(raw.finish.max(initial=0.0)),
        compute_s=float(busy[~is_comm].sum()),
        comm_s=float(busy[is_comm].sum()),
        overlap_s=raw.overlap_s,
        start_s=raw.start,
        finish_s=raw.finish,
        free_s=raw.free,
        peak_bytes=int(graph.persistent_bytes) + raw.peak_live,
        overlap=phi,
    )


# ------------------------------------------------------------- synthetic graphs


def synthetic_graph(
    n: int,
    *,
    seed: int = 0,
    comm_every: int = 10,
    window: int = 8,
    max_preds: int = 3,
    durations: tuple[float, ...] | None = None,
) -> SimGraph:
    """A random training-step-like DAG for tests and benchmarks.

    The first half of the nodes is a forward pass, the second half a backward
    pass; each node takes 1..``max_preds`` inputs from the previous ``window``
    nodes (plus its forward mirror in the backward pass). In the backward pass,
    every ``comm_every``-th node is an AllReduce of the previous node's gradient
    (sometimes of two gradients, a bucket), and a quarter of the AllReduces
    feed an optimizer-update kernel.

    Args:
        n: number of nodes.
        seed: RNG seed.
        comm_every: one comm node per this many backward nodes (0: none).
        window: how far back inputs are drawn from.
        max_preds: most inputs per node.
        durations: draw durations from these values (exact arithmetic in tests);
            None draws log-uniform times between 1 us and 1 ms.

    Returns:
        The graph (int32 CSR, topologically ordered).
    """
    rng = np.random.default_rng(seed)
    is_comm = np.zeros(n, dtype=np.bool_)
    half = n // 2
    if comm_every > 0:
        is_comm[half + 1 :: comm_every] = True
    preds: list[list[int]] = [[]]
    for v in range(1, n):
        lo = max(0, v - window)
        if is_comm[v]:
            chosen = {v - 1} | ({v - 2} if v >= 2 and rng.random() < 0.3 else set())
        else:
            k = int(rng.integers(1, max_preds + 1))
            chosen = {p for p in rng.integers(lo, v, size=k).tolist() if not is_comm[p]}
            if v > half and rng.random() < 0.5:
                chosen.add(n - 1 - v)  # forward activation used by the backward op
            if is_comm[v - 1] and rng.random() < 0.25:
                chosen.add(v - 1)  # optimizer update consuming the AllReduce
        preds.append(sorted(chosen) or [v - 1])
    if durations is None:
        dur = np.exp(rng.uniform(np.log(1e-6), np.log(1e-3), size=n))
    else:
        dur = rng.choice(np.asarray(durations, dtype=np.float64), size=n)
    ptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum([len(p) for p in preds], out=ptr[1:])
    idx = np.fromiter((p for ps in preds for p in ps), dtype=np.int32, count=int(ptr[-1]))
    return SimGraph(
        names=tuple(f"n{i}" for i in range(n)),
        is_comm=is_comm,
        duration_s=dur,
        out_bytes=rng.integers(0, 1 << 20, size=n, dtype=np.int64),
        pred_ptr=ptr,
        pred_idx=idx,
        persistent_bytes=1 << 24,
    )
