"""Probe programs that measure what the simulator needs beyond single-op times.

Run inside a process whose jax devices form the setup (4 host devices in one process,
or one device per process of a ``jax.distributed`` job over gloo): every process runs
the same programs in the same order, so their collectives pair up.

* **In-program all-reduce latency** ``D``: a chain of ``k`` dependent ``pmean``\\ s of a
  small buffer inside one program against a chain of one; the slope per all-reduce is
  what a gradient all-reduce costs in a train step. On gloo it is far larger than an
  isolated microbenchmark's latency (one scheduler tick, about 3.8 ms on 2 vCPUs, against
  0.1 ms), which is why the hardware files carry it.
* **Per-buffer latency of a combined all-reduce**: one all-reduce of a tuple of buffers
  (as XLA's combiner writes them; XLA:CPU reduces each buffer on its own) against one
  flat buffer of the same bytes (:func:`tuple_allreduce_programs`,
  :func:`tuple_buffer_latency`). Back to back, each buffer pays the bare latency (gloo's
  in a job; in one process a rendezvous of device threads that have already met); a
  gradient all-reduce between computations pays more (the wait for the other process or
  the slowest device thread, a wakeup), so the two differ and the cost model needs both.
* **Overlap** ``phi``: a ``pmean`` program, an independent compute program (a chain of
  matmuls sized to take about as long), and one program computing both. In the
  simulator's model compute runs at rate ``phi`` while an all-reduce is in flight, so
  ``T_both = T_comm + T_comp - phi * T_comm`` when the compute outlasts ``phi * T_comm``:
  ``phi = (T_comm + T_comp - T_both) / T_comm``, clipped to [0, 1].

Times are medians over interleaved repeats (the three programs take turns).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ProbeResult",
    "TupleProbe",
    "latency_from_chains",
    "measure_probes",
    "overlap_from_times",
    "tuple_allreduce_programs",
    "tuple_buffer_latency",
]


class ProbeResult(NamedTuple):
    """What the probes measured in one process.

    Attributes:
        latency_s: seconds one small all-reduce adds to a program (slope of the chains).
        chain_s: ``{k: median seconds}`` of the chain programs.
        comm_s: median seconds of the ``pmean`` program.
        compute_s: median seconds of the compute program.
        both_s: median seconds of the program computing both.
        overlap: phi from those three (see :func:`overlap_from_times`).
        comm_bytes: bytes per device of the overlap probe's all-reduce.
        matmuls: matmuls in the compute chain.
    """

    latency_s: float
    chain_s: dict[int, float]
    comm_s: float
    compute_s: float
    both_s: float
    overlap: float
    comm_bytes: int
    matmuls: int

    def to_json(self) -> dict[str, Any]:
        return {**self._asdict(), "chain_s": {str(k): v for k, v in self.chain_s.items()}}


def overlap_from_times(comm_s: float, compute_s: float, both_s: float) -> float:
    """phi from the times of the comm program, the compute program and both together."""
    if comm_s <= 0:
        return 0.0
    return min(1.0, max(0.0, (comm_s + compute_s - both_s) / comm_s))


def latency_from_chains(chain_s: dict[int, float]) -> float:
    """Least-squares slope of seconds over chain length (seconds per all-reduce)."""
    ks = np.array(sorted(chain_s), dtype=np.float64)
    ts = np.array([chain_s[int(k)] for k in ks], dtype=np.float64)
    slope = np.polyfit(ks, ts, 1)[0] if len(ks) > 1 else ts[0] / ks[0]
    return max(0.0, float(slope))


def tuple_buffer_latency(tuple_s: float, flat_s: float, buffers: int) -> float:
    """Seconds each buffer of a combined all-reduce pays beyond the bytes it moves.

    One all-reduce of ``buffers`` buffers took ``tuple_s``; one flat buffer of the same
    bytes took ``flat_s``. With ``T_tuple = C * B + n * d`` and ``T_flat = C * B + d``
    (an all-reduce alone in its program pays the same bare latency as a buffer of a
    combined one): ``d = (T_tuple - T_flat) / (n - 1)``, at least 0.

    Raises:
        ValueError: fewer than 2 buffers (nothing to tell the two apart).
    """
    if buffers < 2:
        raise ValueError(f"need at least 2 buffers, got {buffers}")
    return max(0.0, (tuple_s - flat_s) / (buffers - 1))


class TupleProbe(NamedTuple):
    """The two programs of the tuple probe (:func:`tuple_allreduce_programs`).

    Attributes:
        run_tuple: dispatches the combined all-reduce once on its inputs (placed once)
            and returns its outputs.
        run_flat: the same for the flat all-reduce.
        tuple_text: the compiled (post-optimization) HLO text of the first program.
        flat_text: the same of the second.
    """

    run_tuple: Callable[[], Any]
    run_flat: Callable[[], Any]
    tuple_text: str
    flat_text: str


def tuple_allreduce_programs(buffer_bytes: Sequence[int]) -> TupleProbe:
    """Two programs on all of jax's devices (a 1-D mesh), compiled as ``jax.jit``
    compiles them: one ``pmean`` of ``float32`` buffers of ``buffer_bytes`` bytes per
    device each, which XLA's all-reduce combiner turns into all-reduces of tuples of
    buffers (one, below XLA's combine threshold; as in XLA's default compilation of a
    train step: the same buffers, the same combiner and threshold), and one ``pmean`` of
    a single flat buffer of the same bytes.

    Args:
        buffer_bytes: bytes per device of each buffer (rounded up to whole floats).
    """
    import jax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    sizes = [max(1, -(-int(b) // 4)) for b in buffer_bytes]

    def local(n: int) -> Any:
        return jax.make_array_from_process_local_data(
            sharding, np.ones((n * jax.local_device_count(),), np.float32))

    bufs = tuple(local(n) for n in sizes)
    flat = local(sum(sizes))
    tuple_c = jax.jit(jax.shard_map(lambda *xs: lax.pmean(xs, "d"), mesh=mesh,
                                    in_specs=P("d"), out_specs=P("d"))).lower(*bufs).compile()
    flat_c = jax.jit(jax.shard_map(lambda x: lax.pmean(x, "d"), mesh=mesh, in_specs=P("d"),
                                   out_specs=P("d"))).lower(flat).compile()
    return TupleProbe(lambda: tuple_c(*bufs), lambda: flat_c(flat), tuple_c.as_text(),
                      flat_c.as_text())


def _median_times(fns: Sequence[Callable[[], Any]], repeats: int, warmup: int) -> list[float]:
    """Median wall seconds of each function, calling them in turn ``repeats`` times."""
    import jax

    for fn in fns:
        for _ in range(warmup):
            jax.block_until_ready(fn())
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            out.append(time.perf_counter() - t0)
    return [statistics.median(s) for s in samples]


def measure_probes(comm_bytes: int = 4 << 20, chains: Sequence[int] = (1, 4, 8),
                   chain_bytes: int = 1024, repeats: int = 15, warmup: int = 2,
                   share: Callable[[int], int] | None = None) -> ProbeResult:
    """Runs the probes on all of jax's devices (a 1-D mesh) and returns their times.

    Args:
        comm_bytes: bytes per device of the overlap probe's all-reduce.
        chains: chain lengths of the latency probe.
        chain_bytes: bytes per device of each all-reduce of the chains.
        repeats: interleaved timed calls of each program.
        warmup: untimed calls of each program first.
        share: in a multi-process job, returns process 0's value of an int on every
            process (the matmul count must agree); None in one process.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    nd = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    spec = P("d")
    sharding = NamedSharding(mesh, spec)

    def global_array(local: np.ndarray) -> Any:
        shape = (nd * local.shape[0], *local.shape[1:])
        return jax.make_array_from_callback(shape, sharding,
                                            lambda idx: np.concatenate([local] * nd)[idx])

    def smap(fn: Callable, n_in: int, n_out: int = 1) -> Any:
        out_specs = spec if n_out == 1 else (spec,) * n_out
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * n_in,
                                     out_specs=out_specs, check_vma=False))

    # latency: chains of dependent small all-reduces
    small = global_array(np.ones(chain_bytes // 4, np.float32))

    def chain(k: int) -> Callable:
        def body(x):
            for _ in range(k):
                x = lax.pmean(x, "d") * 1.0001
            return x
        return smap(body, 1)

    chain_fns = {k: chain(k) for k in chains}
    chain_times = _median_times([lambda f=f: f(small) for f in chain_fns.values()],
                                repeats, warmup)
    chain_s = dict(zip(chain_fns, chain_times))

    # overlap: comm alone, compute alone, both in one program
    x = global_array(np.ones(comm_bytes // 4, np.float32))
    m = 256
    rng = np.random.default_rng(0)
    a = global_array(rng.standard_normal((m, m), dtype=np.float32) / np.sqrt(m))
    comm = smap(lambda v: lax.pmean(v, "d"), 1)

    def compute_fn(k: int) -> Callable:
        def body(u):
            for _ in range(k):
                u = jnp.tanh(u @ u)
            return u
        return body

    one = smap(compute_fn(8), 1)
    t_comm, t_eight = _median_times([lambda: comm(x), lambda: one(a)], max(3, repeats // 3),
                                    warmup)
    k = max(1, int(round(8 * t_comm / max(t_eight, 1e-9))))
    if share is not None:
        k = int(share(k))
    comp_body = compute_fn(k)
    comp = smap(comp_body, 1)
    both = smap(lambda v, u: (lax.pmean(v, "d"), comp_body(u)), 2, 2)
    comm_s, compute_s, both_s = _median_times(
        [lambda: comm(x), lambda: comp(a), lambda: both(x, a)], repeats, warmup)
    return ProbeResult(latency_from_chains(chain_s), chain_s, comm_s, compute_s, both_s,
                       overlap_from_times(comm_s, compute_s, both_s), comm_bytes, k)
