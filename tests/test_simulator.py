"""Tests of the ready-queue simulator and its trace writer.

Every hand-built graph uses durations like 0.5, 1.0 and 2.0 so that the
arithmetic is exact and makespans are compared with ``==``. Node specs are
``(kind, duration_s, preds, out_bytes)`` with kind ``"k"`` (kernel on the compute
stream) or ``"c"`` (AllReduce on the channel); nodes are named by index.
"""

from __future__ import annotations

import collections
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from disco_estimator.costs import simulator as sim
from disco_estimator.costs.simulator import (
    Backend,
    SimGraph,
    check_graph,
    full_overlap_bound,
    simulate,
)
from disco_estimator.costs.trace import COMM_TID, COMPUTE_TID, to_chrome_trace, write_trace

Spec = tuple[str, float, Sequence[int], int]
BACKENDS = ["python", "c"]


def graph(specs: Sequence[Spec], persistent: int = 0) -> SimGraph:
    """Builds a SimGraph from ``(kind, duration, preds, bytes)`` specs."""
    ptr = np.zeros(len(specs) + 1, dtype=np.int32)
    np.cumsum([len(s[2]) for s in specs], out=ptr[1:])
    return SimGraph(
        names=tuple(f"n{i}" for i in range(len(specs))),
        is_comm=np.array([s[0] == "c" for s in specs], dtype=bool),
        duration_s=np.array([s[1] for s in specs], dtype=np.float64),
        out_bytes=np.array([s[3] for s in specs], dtype=np.int64),
        pred_ptr=ptr,
        pred_idx=np.array([p for s in specs for p in s[2]], dtype=np.int32),
        persistent_bytes=persistent,
    )


def k(dur: float, *preds: int, nbytes: int = 0) -> Spec:
    """A kernel spec."""
    return ("k", dur, preds, nbytes)


def c(dur: float, *preds: int, nbytes: int = 0) -> Spec:
    """An AllReduce spec."""
    return ("c", dur, preds, nbytes)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Runs a test with each backend; skips C where no compiler is available."""
    if request.param == "c" and not sim.c_kernel_available():
        pytest.skip("C kernel unavailable")
    return request.param


def run(specs: Sequence[Spec], backend: Backend, overlap: float = 1.0) -> sim.SimResult:
    """Simulates the specs' graph."""
    return simulate(graph(specs), overlap, backend=backend)


# ------------------------------------------------------------------ scheduling


def test_chain(backend: Backend) -> None:
    """a(1) -> b(2) -> c(0.5): a [0,1], b [1,3], c [3,3.5]; makespan 3.5."""
    r = run([k(1.0), k(2.0, 0), k(0.5, 1)], backend)
    assert r.iteration_s == 3.5
    assert r.start_s.tolist() == [0.0, 1.0, 3.0]
    assert r.finish_s.tolist() == [1.0, 3.0, 3.5]
    assert (r.compute_s, r.comm_s, r.overlap_s) == (3.5, 0.0, 0.0)


def test_diamond(backend: Backend) -> None:
    """a(1) -> {b(2), c(0.5)} -> d(1). b, c ready at 1; b first (index).

    a [0,1], b [1,3], c [3,3.5], d [3.5,4.5]; makespan 4.5.
    """
    r = run([k(1.0), k(2.0, 0), k(0.5, 0), k(1.0, 1, 2)], backend)
    assert r.start_s.tolist() == [0.0, 1.0, 3.0, 3.5]
    assert r.iteration_s == 4.5


def test_two_independent_chains_serialize(backend: Backend) -> None:
    """x1(1) -> x2(1) and y1(2) -> y2(0.5) on one stream (indices x1 x2 y1 y2).

    FIFO: queue [x1, y1]; x1 [0,1] appends x2 (ready 1); y1 (ready 0) [1,3]
    appends y2 (ready 3); x2 [3,4]; y2 [4,4.5]. Makespan 4.5 = total compute.
    """
    r = run([k(1.0), k(1.0, 0), k(2.0), k(0.5, 2)], backend)
    assert r.start_s.tolist() == [0.0, 3.0, 1.0, 4.0]
    assert r.iteration_s == 4.5


def test_allreduce_waits_for_channel(backend: Backend) -> None:
    """g1(1) -> ar1(comm 2); g1 -> g2(1) -> ar2(comm 2).

    g1 [0,1], ar1 [1,3], g2 [1,2]; ar2 ready at 2 but the channel is busy until
    3: ar2 [3,5]. Makespan 5; compute busy [0,2], channel [1,5] -> overlap 1.
    """
    r = run([k(1.0), c(2.0, 0), k(1.0, 0), c(2.0, 2)], backend)
    assert r.start_s.tolist() == [0.0, 1.0, 1.0, 3.0]
    assert r.iteration_s == 5.0
    assert (r.compute_s, r.comm_s, r.overlap_s) == (2.0, 4.0, 1.0)


def test_bucket_waits_for_all_producers(backend: Backend) -> None:
    """Bucket AllReduce(0.5) of g1(1) and g2(2): starts when the last gradient exists.

    g1 [0,1], g2 [1,3], bucket [3,3.5]; makespan 3.5.
    """
    r = run([k(1.0), k(2.0), c(0.5, 0, 1)], backend)
    assert r.start_s[2] == 3.0
    assert r.iteration_s == 3.5


def test_allreduce_waits_for_fused_producer(backend: Backend) -> None:
    """x(1) -> fused(3) -> ar(1): the AllReduce starts when the fusion ends, 4; makespan 5."""
    r = run([k(1.0), k(3.0, 0), c(1.0, 1)], backend)
    assert r.start_s[2] == 4.0
    assert r.iteration_s == 5.0


def test_compute_waits_for_allreduce_without_blocking(backend: Backend) -> None:
    """g(1) -> ar(comm 2) -> upd(0.5); g -> h(1) (index 3, after upd).

    g [0,1]; ar [1,3]; h ready at 1 runs [1,2] although upd has a smaller index
    (upd is not ready before 3); the stream idles 2..3; upd [3,3.5]. Makespan 3.5.
    """
    r = run([k(1.0), c(2.0, 0), k(0.5, 1), k(1.0, 0)], backend)
    assert r.start_s.tolist() == [0.0, 1.0, 3.0, 1.0]
    assert r.iteration_s == 3.5


def test_ready_time_beats_index(backend: Backend) -> None:
    """g(1); h1(2) <- g; h2(1) <- h1; ar(comm 1) <- g; upd(0.5) <- ar.

    g [0,1]; h1 [1,3]; ar [1,2] so upd is ready at 2; h2 is ready at 3. At 3 the
    stream takes upd (ready 2, index 4) before h2 (ready 3, index 2): upd [3,3.5],
    h2 [3.5,4.5]. Makespan 4.5.
    """
    r = run([k(1.0), k(2.0, 0), k(1.0, 1), c(1.0, 0), k(0.5, 3)], backend)
    assert r.start_s.tolist() == [0.0, 1.0, 3.5, 1.0, 3.0]
    assert r.iteration_s == 4.5


def test_comm_order_follows_gradient_production(backend: Backend) -> None:
    """x(1), y(1) roots; ar_y (index 2, comm 2) <- y; ar_x (index 3, comm 2) <- x.

    x [0,1] so ar_x is ready at 1, y [1,2] so ar_y at 2: ar_x [1,3] runs first
    despite its larger index, ar_y [3,5]. Makespan 5 (index order would give 6).
    """
    r = run([k(1.0), k(1.0), c(2.0, 1), c(2.0, 0)], backend)
    assert r.start_s[3] == 1.0
    assert r.start_s[2] == 3.0
    assert r.iteration_s == 5.0


def test_comm_after_comm(backend: Backend) -> None:
    """g(1) -> ar1(comm 1) -> ar2(comm 0.5) -> upd(1): [0,1], [1,2], [2,2.5], [2.5,3.5]."""
    r = run([k(1.0), c(1.0, 0), c(0.5, 1), k(1.0, 2)], backend)
    assert r.finish_s.tolist() == [1.0, 2.0, 2.5, 3.5]


# --------------------------------------------------------------------- overlap

SERIAL = [k(2.0), c(1.0, 0), k(2.0, 0), k(1.0, 1)]


@pytest.mark.parametrize(
    ("phi", "b_finish", "makespan"),
    [(1.0, 4.0, 5.0), (0.5, 4.5, 5.5), (0.0, 5.0, 6.0)],
)
def test_overlap_kernel_starting_under_comm(
    backend: Backend, phi: float, b_finish: float, makespan: float
) -> None:
    """a(2) -> g(comm 1) -> c(1); a -> b(2). g [2,3]; b starts at 2 under g.

    b progresses at rate phi in [2,3], then at 1: finish = 3 + (2 - phi).
    phi=1: b [2,4], c [4,5] -> 5 (the paper's model). phi=0.5: b ends 4.5,
    c [4.5,5.5] -> 5.5. phi=0: b ends 5, c [5,6] -> 6 = sum of all durations
    (full serialization). compute_s = 5 + (1 - phi) * overlap_s, overlap_s = 1.
    """
    r = run(SERIAL, backend, phi)
    assert r.finish_s[2] == b_finish
    assert r.iteration_s == makespan
    assert r.overlap_s == 1.0
    assert r.compute_s == 5.0 + (1.0 - phi) * 1.0


@pytest.mark.parametrize(("phi", "b_finish"), [(1.0, 5.0), (0.5, 6.0), (0.25, 6.5), (0.0, 7.0)])
def test_overlap_comm_starting_under_kernel(backend: Backend, phi: float, b_finish: float) -> None:
    """a(1); b(4) <- a; g(comm 2) <- a. At 1, b starts (compute wins the tie), then g [1,3].

    b does 2*phi of work during g, the rest (4 - 2*phi) after 3:
    finish = 7 - 2*phi: 5, 6, 6.5, 7 for phi = 1, 0.5, 0.25, 0.
    """
    r = run([k(1.0), k(4.0, 0), c(2.0, 0)], backend, phi)
    assert r.start_s.tolist() == [0.0, 1.0, 1.0]
    assert r.finish_s[1] == b_finish
    assert r.iteration_s == b_finish


def test_overlap_kernel_inside_comm(backend: Backend) -> None:
    """a(1); g(comm 4) <- a; b(1) <- a; phi = 0.5.

    b [1, 3] (1 s of work at half speed entirely under g [1,5]); makespan 5;
    overlap 2; compute_s = 2 + 0.5 * 2 = 3.
    """
    r = run([k(1.0), c(4.0, 0), k(1.0, 0)], backend, 0.5)
    assert r.finish_s.tolist() == [1.0, 5.0, 3.0]
    assert (r.iteration_s, r.overlap_s, r.compute_s) == (5.0, 2.0, 3.0)


def test_overlap_zero_serializes_random_graph(backend: Backend) -> None:
    """phi = 0: compute progresses only while the channel is idle.

    So iteration >= compute work + channel busy time, and the stream's busy time
    is the work plus the time it spends stalled under AllReduces.
    """
    g = sim.synthetic_graph(300, seed=3, durations=(0.5, 1.0, 2.0))
    r = simulate(g, 0.0, backend=backend)
    work = float(g.duration_s[~g.is_comm].sum())
    assert r.compute_s == pytest.approx(work + r.overlap_s)
    assert r.iteration_s >= (work + r.comm_s) * (1 - 1e-12)


# ---------------------------------------------------------------------- memory


def test_peak_memory(backend: Backend) -> None:
    """a(100 B) -> b(20 B) -> c(5 B) -> d(7 B), d also reads a; persistent 1000 B; all 1 s.

    Lifetimes: a [0,4) (last consumer d ends at 4), b [1,3), c [2,4), d [3,end]
    (no consumer). Live: 100, 120, 125 in [2,3); at 3 b is freed before d is
    allocated: 112. Peak 1000 + 125 = 1125 (1132 if frees came after allocations).
    """
    g = graph(
        [k(1.0, nbytes=100), k(1.0, 0, nbytes=20), k(1.0, 1, nbytes=5), k(1.0, 0, 2, nbytes=7)],
        persistent=1000,
    )
    r = simulate(g, backend=backend)
    assert r.free_s.tolist() == [4.0, 3.0, 4.0, 4.0]
    assert r.peak_bytes == 1125


def test_peak_memory_zero_length_lifetime(backend: Backend) -> None:
    """a(0 s, 50 B) -> b(0 s, 0 B); c(1 s, 10 B) a root. a [0,0], b [0,0], c [0,1].

    a's lifetime [0, 0) has zero length and counts at its instant, together with
    c allocated at 0: peak 60.
    """
    r = run([k(0.0, nbytes=50), k(0.0, 0), k(1.0, nbytes=10)], backend)
    assert r.start_s.tolist() == [0.0, 0.0, 0.0]
    assert r.peak_bytes == 60


def test_comm_output_memory(backend: Backend) -> None:
    """g(1, 8 B) -> ar(comm 2, 8 B) -> upd(1, 0 B). g [0,1] live until ar ends at 3;
    ar's buffer [1,4). Peak 16 in [1,3)."""
    r = run([k(1.0, nbytes=8), c(2.0, 0, nbytes=8), k(1.0, 1)], backend)
    assert r.free_s.tolist() == [3.0, 4.0, 4.0]
    assert r.peak_bytes == 16


# --------------------------------------------------------------- bounds, misc


def test_full_overlap_bound() -> None:
    """Compute 2+2+1 = 5, comm 1 -> FO 5; comm-heavy variant: compute 2, comm 3+4 -> 7."""
    assert full_overlap_bound(graph(SERIAL)) == 5.0
    assert full_overlap_bound(graph([k(2.0), c(3.0, 0), c(4.0, 0)])) == 7.0
    assert full_overlap_bound(graph([])) == 0.0


def test_fo_bound_is_a_lower_bound(backend: Backend) -> None:
    """Random graphs: FO <= simulated iteration for any overlap."""
    for seed in range(5):
        g = sim.synthetic_graph(200, seed=seed, comm_every=3)
        for phi in (0.0, 0.5, 1.0):
            r = simulate(g, phi, backend=backend)
            assert full_overlap_bound(g) <= r.iteration_s * (1 + 1e-12)


def test_empty_graph(backend: Backend) -> None:
    """No nodes: everything is 0, peak = persistent bytes."""
    r = simulate(graph([], persistent=7), backend=backend)
    assert (r.iteration_s, r.compute_s, r.comm_s, r.overlap_s, r.peak_bytes) == (0, 0, 0, 0, 7)
    assert r.start_s.shape == (0,)


def paper_fifo(g: SimGraph) -> np.ndarray:
    """Section 4.4 literally, for compute-only graphs: FIFO ready queue; returns start times."""
    n = len(g.names)
    preds = [g.pred_idx[g.pred_ptr[v] : g.pred_ptr[v + 1]].tolist() for v in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        for p in preds[v]:
            succs[p].append(v)
    left = [len(p) for p in preds]
    queue = collections.deque(v for v in range(n) if left[v] == 0)
    start, finish = np.zeros(n), np.zeros(n)
    free = 0.0
    while queue:
        v = queue.popleft()
        start[v] = max([free, *(finish[p] for p in preds[v])])
        finish[v] = free = start[v] + g.duration_s[v]
        for s in succs[v]:
            left[s] -= 1
            if left[s] == 0:
                queue.append(s)
    return start


def test_reduces_to_paper_fifo_without_comm(backend: Backend) -> None:
    """Without AllReduces and with positive durations the schedule is the paper's FIFO."""
    for seed in range(10):
        g = sim.synthetic_graph(400, seed=seed, comm_every=0, window=[3, 20][seed % 2])
        r = simulate(g, backend=backend)
        assert np.array_equal(r.start_s, paper_fifo(g))


def check_invariants(g: SimGraph, r: sim.SimResult) -> None:
    """Asserts the model's rules on a simulated graph (see the simulator module doc)."""
    n = len(g.names)
    ready = np.zeros(n)
    for v in range(n):
        preds = g.pred_idx[g.pred_ptr[v] : g.pred_ptr[v + 1]]
        ready[v] = r.finish_s[preds].max(initial=0.0)
    assert np.all(r.start_s >= ready)
    for mask in (~g.is_comm, g.is_comm):
        nodes = np.flatnonzero(mask)
        # execution order: by start; zero-length nodes before a longer one starting with them
        order = nodes[np.lexsort((nodes, ready[nodes], r.finish_s[nodes], r.start_s[nodes]))]
        s, f = r.start_s[order], r.finish_s[order]
        assert np.all(s[1:] >= f[:-1])  # one node at a time
        prev = np.concatenate([[0.0], f[:-1]])
        assert np.array_equal(s, np.maximum(prev, ready[order]))  # work-conserving
        for i, v in enumerate(order):  # priority: no later node had a smaller key and was ready
            later = order[i + 1 :]
            waiting = later[ready[later] <= s[i]]
            assert all((ready[u], u) > (ready[v], v) for u in waiting)


def test_schedule_invariants(backend: Backend) -> None:
    """Random graphs, all overlaps: dependencies, exclusivity, work conservation, priority."""
    for seed in range(12):
        g = sim.synthetic_graph(
            150, seed=seed, comm_every=[1, 4][seed % 2], durations=[(0.0, 0.5, 1.0), None][seed % 2]
        )
        for phi in (1.0, 0.5, 0.0):
            r = simulate(g, phi, backend=backend)
            check_invariants(g, r)
            if phi == 1.0:
                assert np.array_equal(r.finish_s, r.start_s + g.duration_s)


def test_c_and_python_agree_exactly() -> None:
    """Random graphs (ties, zero durations, comm chains, buckets): identical results."""
    if not sim.c_kernel_available():
        pytest.skip("C kernel unavailable")
    for seed in range(60):
        g = sim.synthetic_graph(
            [7, 60, 300][seed % 3],
            seed=seed,
            comm_every=[1, 2, 5, 0][seed % 4],
            window=[2, 6, 25][seed % 3],
            durations=[(0.0, 0.5, 1.0, 2.0), None][seed % 2],
        )
        for phi in (1.0, 0.0, 0.5, 0.37):
            a = simulate(g, phi, backend="c")
            b = simulate(g, phi, backend="python")
            for x, y in zip(a, b, strict=True):
                if isinstance(x, np.ndarray):
                    assert np.array_equal(x, y), (seed, phi)
                else:
                    assert x == y, (seed, phi)


def test_python_fallback_when_no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler: one warning, the Python loop is used; backend='c' then raises."""

    def no_cc() -> None:
        raise OSError("no C compiler (cc) found")

    monkeypatch.setattr(sim.KERNEL, "library", None)
    monkeypatch.setattr(sim.KERNEL, "tried", False)
    monkeypatch.setattr(sim.KERNEL, "build", no_cc)
    with pytest.warns(RuntimeWarning, match="pure-Python"):
        r = simulate(graph([k(1.0), k(2.0, 0)]))
    assert r.iteration_s == 3.0
    with pytest.raises(RuntimeError):
        simulate(graph([k(1.0)]), backend="c")


def test_kernel_builds_into_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The kernel compiles into $DISCO_CACHE_DIR and is reused from there."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path))
    path = sim.KERNEL.build()
    assert path.parent == tmp_path and path.suffix == ".so"
    assert sim.KERNEL.build() == path
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp leftovers


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda g: g._replace(pred_idx=np.array([1], np.int32)), "topologically"),
        (lambda g: g._replace(pred_ptr=np.array([0, 0, 2], np.int32)), "pred_ptr"),
        (lambda g: g._replace(duration_s=np.array([1.0, -1.0])), "duration"),
        (lambda g: g._replace(duration_s=np.array([1.0, np.nan])), "duration"),
        (lambda g: g._replace(is_comm=np.array([False])), "is_comm"),
        (lambda g: g._replace(out_bytes=np.array([1, -1])), "byte"),
    ],
)
def test_check_graph_rejects(mutate: Callable[[SimGraph], SimGraph], message: str) -> None:
    """Invalid graphs raise ValueError naming the problem."""
    g = graph([k(1.0), k(1.0, 0)])
    check_graph(g)
    with pytest.raises(ValueError, match=message):
        simulate(mutate(g))


def test_overlap_out_of_range() -> None:
    """overlap must be within [0, 1]."""
    with pytest.raises(ValueError, match="overlap"):
        simulate(graph([k(1.0)]), 1.5)


# ----------------------------------------------------------------------- trace


def test_chrome_trace_events(backend: Backend) -> None:
    """One "X" event per node, ts/dur in microseconds, tid 0 compute / 1 comm.

    Graph of test_allreduce_waits_for_channel: g1 [0,1], ar1 [1,3], g2 [1,2],
    ar2 [3,5] -> ts 0, 1e6, 1e6, 3e6 and dur 1e6, 2e6, 1e6, 2e6.
    """
    g = graph([k(1.0), c(2.0, 0), k(1.0, 0), c(2.0, 2)])
    r = simulate(g, backend=backend)
    trace = to_chrome_trace(r, g, pid=3)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in xs] == list(g.names)
    assert [e["ts"] for e in xs] == [0.0, 1e6, 1e6, 3e6]
    assert [e["dur"] for e in xs] == [1e6, 2e6, 1e6, 2e6]
    assert [e["tid"] for e in xs] == [COMPUTE_TID, COMM_TID, COMPUTE_TID, COMM_TID]
    assert {e["pid"] for e in trace["traceEvents"]} == {3}
    assert json.loads(json.dumps(trace)) == trace


def test_write_trace_is_atomic(tmp_path: Path) -> None:
    """write_trace leaves exactly the JSON file (no temp file), loadable as a trace."""
    g = sim.synthetic_graph(50, seed=1)
    r = simulate(g)
    out = write_trace(tmp_path / "sim.json", r, g)
    assert [p.name for p in tmp_path.iterdir()] == ["sim.json"]
    data = json.loads(out.read_text())
    assert sum(e["ph"] == "X" for e in data["traceEvents"]) == 50


def test_write_trace_failure_leaves_nothing(tmp_path: Path) -> None:
    """An unserializable trace raises and leaves no file behind."""
    g = graph([k(1.0)])
    r = simulate(g)._replace(peak_bytes=object())  # not JSON-serializable
    with pytest.raises(TypeError):
        write_trace(tmp_path / "bad.json", r, g)
    assert list(tmp_path.iterdir()) == []
