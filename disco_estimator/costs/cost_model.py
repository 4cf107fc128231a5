"""The cost model: what every node of a per-device graph costs on one backend.

A :class:`CostModel` gathers everything needed to cost a plan on one backend:

* **single-op times** (:class:`disco_estimator.ops.OpTimes`), by
  :class:`~disco_estimator.ops.keys.OpKey`: from a whole-program profile of the no-fusion
  program (the most faithful: measured in the real program's context), then from
  standalone runs (:mod:`disco_estimator.ops.standalone`, cached), then the analytic model
  of :mod:`disco_estimator.ops.table` fitted on those measurements (flagged *estimated*);
* a **fused-op estimator** (:class:`disco_estimator.interface.FusedOpEstimator`): the time of a
  fusion group from its members; by default
  :class:`disco_estimator.interface.FallbackFusedEstimator` over this model's
  :meth:`CostModel.node_costs`;
* the **AllReduce model** ``T = C * bytes + D`` of a hardware file
  (:func:`disco_estimator.hardware.load_hardware`);
* **backend constants** (:class:`BackendConstants`): the overlap phi of the simulator,
  the per-kernel launch overhead, the per-byte memory cost and the compute scale (host
  devices sharing the host's cores), from the hardware file's optional ``[costs]`` table
  or per-backend defaults.

Everything about a graph that no plan changes is computed once per graph in a
:class:`GraphCosts` (node times, bytes, operand CSR, the fallback rule's
:class:`~disco_estimator.interface.NodeCosts`, and a cache of fused-op estimates by group).
:mod:`disco_estimator.costs.lower` turns plans into simulator graphs with it.

Times are seconds and sizes bytes throughout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from disco_estimator.hardware import HardwareConfig, load_hardware
from disco_estimator.interface import (
    FallbackFusedEstimator,
    FusedOpEstimator,
    NodeCosts,
    memory_bound,
    split_times,
)
from disco_estimator.ops import (
    OpProfile,
    OpTimes,
    ProgramProfile,
    bench_ops,
    benchable_ops,
    fusion_computations,
    library_computations,
    module_view,
    op_status,
)
from hlo_tools.graph import DeviceGraph, NodeKind, device_graph
from hlo_tools.ir import HloComputation, HloInstruction, HloModule
from hlo_tools.loops import known_trip_count
from hlo_tools.opcodes import ASYNC_WRAPPER_OPCODES, READS_RESULT_SIZE_OPCODES
from hlo_tools.plan import fusible_nodes, group_outputs

__all__ = [
    "BackendConstants",
    "CostModel",
    "GraphCosts",
    "cover",
]

_K = TypeVar("_K")
_V = TypeVar("_V")


class _ByIdentity(Generic[_K, _V]):
    """A cache keyed by an object's identity (and an optional hashable sub-key).

    Each entry holds the object itself next to its value, so the object stays alive --
    and its ``id`` cannot be given to another object -- while the entry exists; a
    lookup also checks ``is``. With ``max_size`` the least recently used entries are
    dropped beyond it.
    """

    def __init__(self, max_size: int | None = None):
        self.max_size = max_size
        self._entries: OrderedDict[tuple[int, Any], tuple[Any, _V]] = OrderedDict()

    def get(self, obj: _K, sub: Any = None) -> _V | None:
        """The value stored for ``(obj, sub)``, or None."""
        key = (id(obj), sub)
        hit = self._entries.get(key)
        if hit is None or hit[0] is not obj:
            return None
        if self.max_size is not None:
            self._entries.move_to_end(key)
        return hit[1]

    def put(self, obj: _K, value: _V, sub: Any = None) -> _V:
        """Stores ``value`` for ``(obj, sub)``; returns it."""
        self._entries[(id(obj), sub)] = (obj, value)
        if self.max_size is not None:
            self._entries.move_to_end((id(obj), sub))
            while len(self._entries) > self.max_size:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        """Drops every entry."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# --------------------------------------------------------------------------- constants


#: A kernel of several ops costs at least this share of the fused-op estimator's time,
#: whatever share of the saving it is granted (:attr:`BackendConstants.saving_share`).
SAVING_FLOOR = 0.2


@dataclasses.dataclass(frozen=True)
class BackendConstants:
    """Per-backend constants of the cost model.

    Read from the optional ``[costs]`` table of a hardware file::

        [costs]
        overlap = 0.0             # phi of disco_estimator.costs.simulator, in [0, 1]
        kernel_launch_s = 1e-6    # fixed cost of one kernel (thunk), seconds
        mem_s_per_byte = 1e-10    # seconds per byte read or written by a kernel
        compute_scale = 2.0       # factor on every kernel time in the simulation
        saving_share = 1.0        # share of the estimated fusion saving a kernel gets
        copy_s_per_byte = 5e-11   # seconds per byte of a bucket's copies

    Attributes:
        overlap: how fast computation progresses while an AllReduce is in flight (phi).
        kernel_launch_s: fixed cost of one kernel, seconds; a fusion of k kernels saves
            up to ``k - 1`` of them.
        mem_s_per_byte: seconds per byte of memory traffic; caps the memory part of an
            op's measured time (the fused-op estimator's split) and prices the
            flat-buffer copies of AllReduce buckets unless ``copy_s_per_byte`` does.
        compute_scale: factor applied to every compute node of a simulated graph (>= 1
            slows kernels down). Several host devices of one process share the host's
            cores: with ``devices_per_process`` devices on ``host_cpus`` cores each
            device gets at most ``host_cpus / devices_per_process`` of them, while op
            times are measured with the host to themselves (profiles of a 4-device
            program show the same per-op times as standalone runs: a descheduled device
            shows up as gaps between its kernels, not in them). The default is
            therefore ``max(1, devices_per_process / host_cpus)`` on CPU, 1 elsewhere.
        source: where the values come from.
        saving_share: the share ``k`` of its estimated saving that a kernel of several
            ops gets -- a fusion XLA wrote or a plan's fusion group; not a single op XLA
            wrapped in a fusion, nor a library fusion's body. With ``S`` the sum of its
            members' times (and their duplicates') and ``R`` the fused-op estimator's
            time, the kernel costs ``max(S - k * (S - R), SAVING_FLOOR * R)``: 1 is the
            estimator's price, 0 prices the kernel at its unfused parts, above 1 fusion
            saves more than the estimator says. One share prices XLA's fusions and a
            plan's alike, so the search ranks its plans against XLA's program on the
            same scale (a factor on ``R`` did not: fitted above 1 it priced every plan
            fusion above its members, and capped at 1 for plans it priced plans up to 46%
            fast -- docs/findings.md, "A share of the saving"). Fitted in context to
            XLA's fused program (:func:`disco_jax.pipeline.fit.calibrate_in_context`); 1
            by default.
        copy_s_per_byte: seconds per byte read or written by the copies of an AllReduce
            bucket (the concatenate into its flat buffer, the slices out of it; None:
            ``mem_s_per_byte``). Measured in context on the one-bucket program
            (:func:`disco_jax.pipeline.fit.calibrate_in_context`): its copies stream through
            the caches at 19-25 GB/s here where the default per-byte cost says 10 GB/s,
            and standalone timings of the same 2.5 MB concatenate took 0.3-1.1 ms
            against 0.2 ms in the program.
    """

    overlap: float
    kernel_launch_s: float
    mem_s_per_byte: float
    source: str = "default"
    compute_scale: float = 1.0
    saving_share: float = 1.0
    copy_s_per_byte: float | None = None

    #: Defaults per platform family: ``(overlap, kernel_launch_s, mem_s_per_byte)``.
    #: CPU: phi ~ 0 (with XLA:CPU's default scheduler an AllReduce of M = 135 ms next to
    #: independent matmuls of C = 33 ms took 170 ms ~ M + C); ~1 us per thunk and
    #: ~10 GB/s per core from standalone op timings (scalar ops take 0.9-1.1 us, a 4 MiB
    #: f32 add ~1 ms for 12 MiB of traffic). GPU: NCCL streams overlap fully; ~5 us per kernel
    #: launch; HBM-class bandwidth (not measured).
    DEFAULTS = {
        "cpu": (0.0, 1e-6, 1e-10),
        "gpu": (1.0, 5e-6, 1.25e-12),
    }

    @classmethod
    def for_backend(cls, backend: str) -> BackendConstants:
        """The defaults of a jax platform (``cpu``, ``gpu``, ``cuda``, ``rocm``; the
        family from :func:`hlo_tools.jax_bridge.platform_family`, which imports jax);
        ``cpu`` for unknown platforms."""
        from hlo_tools.jax_bridge import platform_family

        key = platform_family(backend) or "cpu"
        overlap, launch, mem = cls.DEFAULTS[key]
        return cls(overlap, launch, mem, f"default:{key}")

    @classmethod
    def from_hardware(cls, hardware: HardwareConfig) -> BackendConstants:
        """The hardware file's ``[costs]`` values over its backend's defaults.

        Raises:
            ValueError: a value out of range (overlap outside [0, 1], negative costs).
        """
        hw = hardware.hardware
        base = cls.for_backend(str(hw.get("backend", "cpu")))
        shared = 1.0
        if base.source == "default:cpu" and int(hw.get("host_cpus", 0) or 0) > 0:
            per_process = int(hw.get("devices_per_process", 1) or 1)
            shared = max(1.0, per_process / int(hw["host_cpus"]))
        table = hardware.raw.get("costs") or {}
        out = cls(float(table.get("overlap", base.overlap)),
                  float(table.get("kernel_launch_s", base.kernel_launch_s)),
                  float(table.get("mem_s_per_byte", base.mem_s_per_byte)),
                  f"{hardware.name}.toml [costs]" if table else base.source,
                  float(table.get("compute_scale", shared)),
                  float(table.get("saving_share", 1.0)),
                  float(table["copy_s_per_byte"]) if "copy_s_per_byte" in table else None)
        if (not 0.0 <= out.overlap <= 1.0 or out.kernel_launch_s < 0 or out.mem_s_per_byte < 0
                or out.compute_scale <= 0 or not math.isfinite(out.saving_share)
                or (out.copy_s_per_byte is not None and out.copy_s_per_byte < 0)):
            raise ValueError(f"invalid [costs] in hardware {hardware.name!r}: {out}")
        return out


# --------------------------------------------------------------------------- graph costs


class GraphCosts:
    """Everything about a graph's costs that no plan changes (computed once per graph).

    Attributes:
        graph: the graph.
        time_s: ``[N]`` seconds of each node run as its own kernel: measured single-op
            time, fused-op estimate of an as-written ``fusion``, summed body of control
            flow, AllReduce model time of a collective; 0 for ops without a kernel.
        estimated: ``[N]`` whether ``time_s`` came from the analytic model or a guess.
        source: ``[N]`` where each time came from (``profile``, ``op_bench``,
            ``model:<class>``, ``free``, ``allreduce``, ``fusion``, ``control``).
        is_comm: ``[N]`` nodes that run on the communication channel.
        pays_d: ``[N]`` collectives priced with one latency ``D``: a gradient all-reduce
            of one buffer (not a tuple of them, not the tiny buffers' short path).
        ops: ``[N]`` how many of the step's ops each node's kernel runs: 1 for an op that
            takes time alone, its body's ops for an as-written ``fusion``, 0 for nodes
            without a kernel and for collectives.
        out_bytes: ``[N]`` bytes of each node's output buffer (0: aliases or persistent).
        write_bytes: ``[N]`` bytes each node writes when run alone.
        traffic: ``[N]`` bytes each node reads and writes when run alone.
        launch_s, mem_s, compute_s: ``[N]`` the split of ``time_s`` used by the fallback
            rule (:func:`disco_estimator.interface.split_times`).
        nodes: the arrays above as the fallback rule reads them
            (:class:`~disco_estimator.interface.NodeCosts`).
        persistent_bytes: parameters and constants (live for the whole iteration; a
            constant fused into a group is part of the kernel instead).
        constant_bytes: ``[N]`` bytes of each constant node (0 for other nodes).
        op_ptr, op_idx: CSR of each node's distinct operands (``[N + 1]`` int64,
            ``[E]`` int32); ``edge_dst``: ``[E]`` int32 reading node of each edge.
        read_bytes: ``[E]`` bytes node reads through each operand edge.
        fusible: ``[N]`` whether a node may join a fusion group (the plan package's
            rule, computed on first use).
        fused_cache: ``(members, copies[, outputs])`` -> ``(seconds, output bytes,
            name)`` of the fusion groups costed so far.
    """

    def __init__(self, graph: DeviceGraph, costs: CostModel):
        self.graph = graph
        self.costs = costs
        n = graph.num_nodes
        self.n = n
        ops = [tuple(dict.fromkeys(o)) for o in graph.operands]
        self.op_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(o) for o in ops], out=self.op_ptr[1:])
        self.op_idx = np.fromiter((o for os_ in ops for o in os_), dtype=np.int32,
                                  count=int(self.op_ptr[-1]))
        self.edge_dst = np.repeat(np.arange(n, dtype=np.int32), np.diff(self.op_ptr))
        #: CSR of the edges that read each node: ``use_edge[use_ptr[p]:use_ptr[p + 1]]``
        self.use_edge = np.argsort(self.op_idx, kind="stable")
        self.use_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(self.op_idx, minlength=n), out=self.use_ptr[1:])
        self.names_arr = np.array(graph.names, dtype=object)
        self.slice_names = np.array([f"{name}.slice" for name in graph.names], dtype=object)
        self.root = graph.root
        self.distinct_operands = ops
        self._measure(graph, costs)
        self.launch_s, self.mem_s, self.compute_s = split_times(
            self.time_s, self.traffic, costs.constants.kernel_launch_s,
            costs.constants.mem_s_per_byte, memory_bound(graph.opcodes))
        self.nodes = NodeCosts(self.launch_s, self.mem_s, self.compute_s, self.traffic,
                               self.write_bytes, self.op_ptr, self.op_idx, self.read_bytes,
                               costs.constants.mem_s_per_byte)
        self.users = graph.users
        #: (members, copies[, outputs]) -> (seconds, output bytes, name)
        self.fused_cache: dict[tuple, tuple[float, int, str]] = {}
        #: the share of a kernel's estimated saving it gets: the fitted share on a fusion
        #: XLA wrote and on a plan's groups, the estimator's price (1) inside a library
        #: fusion's body (:attr:`BackendConstants.saving_share`)
        f, name = costs.constants.saving_share, graph.computation.name
        self.saving_share = 1.0 if name in costs._library_bodies(graph.module) else f

    # -- static arrays

    def _measure(self, graph: DeviceGraph, costs: CostModel) -> None:
        n = self.n
        instrs = graph.computation.instructions
        self.time_s = np.zeros(n, dtype=np.float64)
        self.estimated = np.zeros(n, dtype=np.bool_)
        self.is_comm = np.zeros(n, dtype=np.bool_)
        self.pays_d = np.zeros(n, dtype=np.bool_)
        self.ops = np.zeros(n, dtype=np.int64)
        self.out_bytes = np.zeros(n, dtype=np.int64)
        self.write_bytes = np.array([i.shape.byte_size() for i in instrs], dtype=np.int64)
        self.source: list[str] = [""] * n
        persistent = 0
        for k, instr in enumerate(instrs):
            t, est, src, comm, out = costs.node_cost(graph, k, instr)
            self.time_s[k], self.estimated[k], self.source[k] = t, est, src
            self.is_comm[k], self.out_bytes[k] = comm, out
            if comm:
                self.pays_d[k] = costs.pays_latency(instr)
            elif t > 0:
                self.ops[k] = costs.kernel_ops(graph.module, instr)
            if graph.kinds[k] in (NodeKind.PARAMETER, NodeKind.CONSTANT):
                persistent += self.write_bytes[k]
        self.persistent_bytes = int(persistent)
        self.constant_bytes = np.where([k == NodeKind.CONSTANT for k in graph.kinds],
                                       self.write_bytes, 0)
        wb = self.write_bytes
        reads = np.asarray(wb[self.op_idx], dtype=np.int64) if self.op_idx.size else \
            np.zeros(0, dtype=np.int64)
        for k in np.flatnonzero([op in READS_RESULT_SIZE_OPCODES for op in graph.opcodes]):
            a, b = self.op_ptr[k], self.op_ptr[k + 1]
            reads[a:b] = np.minimum(reads[a:b], wb[k])
        free = np.array([s == "free" for s in self.source], dtype=np.bool_)
        reads[free[self.edge_dst]] = 0
        self.read_bytes = reads
        self.traffic = np.where(free, 0, wb) + np.bincount(
            self.edge_dst, weights=reads, minlength=n).astype(np.int64)

    @functools.cached_property
    def fusible(self) -> np.ndarray:
        """``[N]`` bool: whether a node may join a fusion group -- the one rule of the plan
        package (:func:`hlo_tools.plan.fusible_nodes`), computed on first use."""
        return np.array(fusible_nodes(self.graph), dtype=np.bool_)

    # -- fusion groups

    def outputs(self, members: Sequence[int]) -> list[int]:
        """Members read outside the group (or the root): the fused op's outputs
        (:func:`hlo_tools.plan.group_outputs` without a plan)."""
        return list(group_outputs(self.graph, None, members))

    def fused(self, members: Sequence[int], copies: Sequence[int] = (),
              outputs: Sequence[int] | None = None) -> tuple[float, int, str]:
        """``(seconds, output bytes, name)`` of a fusion group, cached by group (and by
        ``outputs`` when given, see :class:`~disco_estimator.interface.FusedOpEstimator`)."""
        key: tuple = (tuple(members), tuple(copies))
        if outputs is not None:
            key += (tuple(outputs),)
        hit = self.fused_cache.get(key)
        if hit is None:
            if outputs is None:
                t = self.costs.fused.predict(self.graph, list(members), list(copies))
            else:
                t = self.costs.fused.predict(self.graph, list(members), list(copies),
                                             outputs=list(outputs))
            hit = self._entry(key, float(t))
        return hit

    def _entry(self, key: tuple, t: float) -> tuple[float, int, str]:
        members = key[0]
        outs = self.outputs(members) if len(key) == 2 else key[2]
        out = int(sum(self.write_bytes[m] for m in outs))
        if self.saving_share != 1.0 and (
                len(key[1]) or np.count_nonzero(self.time_s[list(members)]) > 1):
            # a kernel of several ops (not one op XLA wrapped): its parts less the share
            whole = float(self.time_s[[*members, *key[1]]].sum())
            t = max(whole - self.saving_share * (whole - t), SAVING_FLOOR * t)
        hit = (t, out, f"fusion({self.graph.names[members[-1]]})")
        self.fused_cache[key] = hit
        return hit

    def prefetch(self, groups: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """Predicts uncached groups in one batch when the estimator supports it."""
        est = self.costs.fused
        todo = [g for g in dict.fromkeys(groups) if g not in self.fused_cache]
        if len(todo) < 2 or not hasattr(est, "predict_batch"):
            return
        times = est.predict_batch(self.graph, [(list(m), list(c)) for m, c in todo])
        for key, t in zip(todo, times):
            self._entry(key, float(t))

    def summary(self) -> dict[str, Any]:
        """Counts of nodes per time source, and how many times are estimated."""
        counts: dict[str, int] = {}
        for s in self.source:
            counts[s] = counts.get(s, 0) + 1
        return {"sources": dict(sorted(counts.items())),
                "estimated_nodes": int(self.estimated.sum())}


# --------------------------------------------------------------------------- cost model


class CostModel:
    """Op times, fused-op estimator, AllReduce model and backend constants of one setup.

    Args:
        hardware: a loaded hardware file, or its name or path
            (:func:`disco_estimator.hardware.load_hardware`).
        op_times: measured single-op times (empty: every op from the analytic model).
        constants: backend constants (default: the hardware file's ``[costs]``).
        fused: the fused-op estimator (default:
            :class:`~disco_estimator.interface.FallbackFusedEstimator` over this model).
        allreduce: ``"linear"`` (``T = C * bytes + D``) or ``"measured"`` (interpolate
            the file's measured points; linear beyond them).

    Everything derived from a graph or module is cached by the object's identity; a cache
    entry holds the object, so a later object can never be served another's entry.
    """

    #: How many graphs' :class:`GraphCosts` are kept (fused computations included).
    MAX_GRAPHS = 4096

    def __init__(self, hardware: HardwareConfig | str | os.PathLike = "inproc4", *,
                 op_times: OpTimes | None = None, constants: BackendConstants | None = None,
                 fused: FusedOpEstimator | None = None, allreduce: str = "linear"):
        self.hardware = hardware if isinstance(hardware, HardwareConfig) else \
            load_hardware(hardware)
        self.op_times = op_times if op_times is not None else OpTimes()
        self.constants = constants or BackendConstants.from_hardware(self.hardware)
        self.fused: FusedOpEstimator = fused or FallbackFusedEstimator(self)
        if allreduce not in ("linear", "measured"):
            raise ValueError(f"allreduce must be 'linear' or 'measured', got {allreduce!r}")
        measured = self.hardware.measured() if allreduce == "measured" else None
        self._allreduce = measured or self.hardware.allreduce
        self._graphs: _ByIdentity[DeviceGraph, GraphCosts] = _ByIdentity(self.MAX_GRAPHS)
        self._views: _ByIdentity[HloModule, Any] = _ByIdentity()
        self._libraries: _ByIdentity[HloModule, frozenset[str]] = _ByIdentity()
        self._fusions: _ByIdentity[HloModule, frozenset[str]] = _ByIdentity()
        #: (module, computation name) -> (seconds, estimated)
        self._comp_times: _ByIdentity[HloModule, tuple[float, bool]] = _ByIdentity()
        #: (module, computation name) -> its graph
        self._bodies: _ByIdentity[HloModule, DeviceGraph] = _ByIdentity()
        #: module -> measured seconds per execution of its instructions, by name
        self._node_times: _ByIdentity[HloModule, Mapping[str, float]] = _ByIdentity()

    @classmethod
    def for_module(cls, module: HloModule, hardware: HardwareConfig | str = "inproc4", *,
                   profile: OpProfile | ProgramProfile | None = None,
                   profiled_module: HloModule | None = None, bench: bool = True,
                   replicas: int = 1, progress: bool | None = None,
                   **kwargs: Any) -> CostModel:
        """A cost model whose op times cover ``module``'s ops.

        Sources in priority order: ``profile`` (whole-program, in context), then
        standalone timings of the module's single ops (``bench``; cached on disk, ops
        never seen before are run on this machine), then the analytic model.

        Args:
            module: the module whose ops need times.
            hardware: hardware file (object, name or path).
            profile: a whole-program profile (``ProgramProfile``, best: the no-fusion
                program) or a stored ``OpProfile``.
            profiled_module: the module the profiled program was compiled from (maps a
                ``ProgramProfile``'s kernels to its instructions by name; see
                :meth:`disco_estimator.ops.OpTimes.add_program_profile`).
            bench: time the module's single ops standalone
                (:mod:`disco_estimator.ops.standalone`).
            replicas: devices running each timed op at once.
            progress: show the standalone timings' counter (default: when stderr is a
                terminal).
            **kwargs: passed to :class:`CostModel`.
        """
        times = OpTimes()
        if isinstance(profile, ProgramProfile):
            times.add_program_profile(profile, original=profiled_module)
        elif profile is not None:
            times.add_op_profile(profile)
        if bench:
            times.add_timings(bench_ops(module, replicas=replicas, progress=progress))
        return cls(hardware, op_times=times, **kwargs)

    # -- constants

    @property
    def overlap(self) -> float:
        """phi of the simulator for this backend."""
        return self.constants.overlap

    def allreduce_time(self, nbytes: float, buffers: Sequence[float] = ()) -> float:
        """Seconds of one AllReduce of ``nbytes`` bytes per device.

        ``buffers``: the byte sizes of the separate arrays of a variadic (tuple-shaped)
        all-reduce, as XLA's combiner writes them; on CPU each pays its own latency, as
        XLA:CPU's collectives reduce each buffer on its own (measured:
        ``benchmarks/simulator_accuracy.py``); elsewhere (NCCL groups the buffers of
        one collective) the tuple pays one latency. Our own buckets are one flat buffer.
        """
        model = self._allreduce
        if len(buffers) <= 1 or self.hardware.hardware.get("backend", "cpu") != "cpu":
            return float(model.time(nbytes))
        linear = getattr(model, "linear", model)  # MeasuredAllReduce keeps its fit
        return linear.c_s_per_byte * float(nbytes) + sum(linear.tuple_latency(b)
                                                         for b in buffers)

    @property
    def fused_wait_s(self) -> float:
        """Seconds of an all-reduce's in-context latency ``D`` beyond the tuple probe's
        latency per buffer (``-d_tuple_extra_s`` where positive) in a job of several
        XLA:CPU processes; 0 elsewhere. ``D`` is fitted on the no-fusion program, whose
        gradient all-reduces each wait beside hundreds of small kernels; in a gloo job
        XLA's fused programs do not show that wait: their separate all-reduces measure
        about as fast as the same gradients combined. In one process of several
        devices they do not, and off XLA:CPU a tuple pays one latency
        (docs/findings.md, "The wait between unfused kernels").
        :func:`~disco_estimator.costs.lower.sim_graph` takes it off a program's
        all-reduces by the share of its ops that run fused."""
        hw = self.hardware.hardware
        if hw.get("backend", "cpu") != "cpu" or int(hw.get("num_processes", 1)) < 2:
            return 0.0
        linear = getattr(self._allreduce, "linear", self._allreduce)
        return max(0.0, -linear.d_tuple_extra_s)

    def pays_latency(self, instr: HloInstruction) -> bool:
        """Whether a collective is priced with one latency ``D``: an all-reduce of one
        buffer above the tiny buffers' short path."""
        if not instr.opcode.startswith("all-reduce") or instr.opcode.endswith("-done") \
                or instr.shape.is_tuple:
            return False
        linear = getattr(self._allreduce, "linear", self._allreduce)
        return linear.latency(instr.shape.byte_size()) == linear.d_s

    def kernel_ops(self, module: HloModule, instr: HloInstruction) -> int:
        """How many of the step's ops the kernel of ``instr`` runs: an as-written
        fusion's body ops that take time alone (at least 1), else 1."""
        if instr.opcode not in ("fusion", "fusion-start"):
            return 1
        comp = module.computation(instr.called_computations[0])
        body = self.graph_costs(self._body_graph(module, comp))
        return max(1, int(np.count_nonzero(body.time_s)))

    def copy_time(self, nbytes: float) -> float:
        """Seconds of one copy kernel moving ``nbytes`` (read once, written once)."""
        c = self.constants
        rate = c.mem_s_per_byte if c.copy_s_per_byte is None else c.copy_s_per_byte
        return c.kernel_launch_s + 2.0 * rate * float(nbytes)

    def set_overlap(self, overlap: float, source: str) -> None:
        """Sets the compute/communication overlap phi over the hardware file's (e.g. a
        user's ``--overlap``); ``source`` says where it came from in :meth:`describe`."""
        self.constants = dataclasses.replace(self.constants, overlap=float(overlap),
                                             source=source)

    def set_fused_estimator(self, estimator: FusedOpEstimator) -> None:
        """Swaps in another fused-op estimator (e.g. the GNN) and drops cached costs."""
        self.fused = estimator
        self._graphs.clear()
        self._comp_times.clear()

    def set_node_times(self, module: HloModule, times: Mapping[str, float]) -> None:
        """Prices ``module``'s instructions at measured times: seconds per execution by
        instruction name (e.g. XLA's compiled module timed in context as written,
        :func:`disco_jax.pipeline.profile.profile_compiled_in_context`), fusions and
        collectives included; instructions without a time keep the model's rule. Drops
        cached costs."""
        self._node_times.put(module, dict(times))
        self._graphs.clear()
        self._comp_times.clear()

    def node_times(self, module: HloModule) -> Mapping[str, float] | None:
        """The measured times :meth:`set_node_times` gave ``module`` (None: none)."""
        return self._node_times.get(module)

    # -- per-graph costs

    def graph_costs(self, graph: DeviceGraph) -> GraphCosts:
        """The :class:`GraphCosts` of ``graph`` (built on first use; the
        :attr:`MAX_GRAPHS` most recently used graphs, fused computations included, are
        kept)."""
        hit = self._graphs.get(graph)
        if hit is None:
            hit = self._graphs.put(graph, GraphCosts(graph, self))
        return hit

    def node_costs(self, graph: DeviceGraph) -> NodeCosts:
        """The fallback rule's node arrays of ``graph`` (makes this model an
        :class:`disco_estimator.interface.NodeCostSource`)."""
        return self.graph_costs(graph).nodes

    def view(self, module: HloModule) -> Any:
        """The op-key lookup tables of ``module`` (built once)."""
        hit = self._views.get(module)
        if hit is None:
            hit = self._views.put(module, module_view(module))
        return hit

    def _fusion_bodies(self, module: HloModule) -> frozenset[str]:
        """Names of the fused computations of ``module``'s fusions (cached)."""
        hit = self._fusions.get(module)
        if hit is None:
            hit = self._fusions.put(module, fusion_computations(module))
        return hit

    def _library_bodies(self, module: HloModule) -> frozenset[str]:
        """Names of the fused computations of ``module``'s library fusions (cached)."""
        hit = self._libraries.get(module)
        if hit is None:
            hit = self._libraries.put(module, library_computations(module))
        return hit

    def node_cost(self, graph: DeviceGraph, k: int, instr: HloInstruction
                  ) -> tuple[float, bool, str, bool, int]:
        """``(seconds, estimated, source, is_comm, out_bytes)`` of node ``k`` run alone:
        its measured time where :meth:`set_node_times` gave one (a node the rule holds
        free stays free), else the rule's."""
        ruled = self._rule_cost(graph, k, instr)
        measured = self._node_times.get(graph.module)
        if measured is None or instr.name not in measured or ruled[2] == "free":
            return ruled
        return measured[instr.name], False, "in context", ruled[3], ruled[4]

    def _rule_cost(self, graph: DeviceGraph, k: int, instr: HloInstruction
                   ) -> tuple[float, bool, str, bool, int]:
        kind, op = graph.kinds[k], instr.opcode
        nbytes = instr.shape.byte_size()
        if kind in (NodeKind.PARAMETER, NodeKind.CONSTANT):
            return 0.0, False, "free", False, 0
        if kind == NodeKind.COLLECTIVE:
            if op.endswith("-done"):
                return 0.0, False, "free", False, 0
            est = not op.startswith("all-reduce")
            buffers = [leaf.byte_size() for leaf in instr.shape.tuple_shapes]
            return self.allreduce_time(nbytes, buffers), est, "allreduce", True, nbytes
        if op == "fusion":  # multi-output fusions are classified as tuple plumbing
            t, est = self._fusion_cost(graph.module, instr)
            return t, est, "fusion", False, nbytes
        if op == "fusion-start":  # an asynchronous fusion's kernel (its -done is free)
            t, est = self._fusion_cost(graph.module, instr)
            return t, est, "fusion", False, instr.shape.tuple_shapes[1].byte_size()
        if kind == NodeKind.CONTROL_FLOW:
            t, est = self._control_cost(graph.module, graph.computation, instr)
            return t, est, "control", False, nbytes
        status, _ = op_status(instr)
        if status == "free":
            return 0.0, False, "free", False, 0
        library = graph.computation.name in self._library_bodies(graph.module)
        e = self.op_times.estimate(self.view(graph.module), instr, library)
        return e.time_s, e.estimated, e.source, False, nbytes

    def _fusion_cost(self, module: HloModule, instr: HloInstruction) -> tuple[float, bool]:
        """An as-written fusion: the fused-op estimator on its fused computation (the
        ops of a library fusion at their library times, see
        :meth:`disco_estimator.ops.OpTimes.estimate`)."""
        comp = module.computation(instr.called_computations[0])
        body = self._body_graph(module, comp)
        gc = self.graph_costs(body)
        members = [i for i, kind in enumerate(body.kinds) if kind != NodeKind.PARAMETER]
        t = gc.fused(members, ())[0]
        return t, bool(gc.estimated[members].any())

    def _body_graph(self, module: HloModule, comp: HloComputation) -> DeviceGraph:
        """The graph of a called computation (built once; its costs are cached by graph)."""
        hit = self._bodies.get(module, comp.name)
        if hit is None:
            hit = self._bodies.put(module, device_graph(module, comp), comp.name)
        return hit

    def computation_time(self, module: HloModule, comp: HloComputation) -> tuple[float, bool]:
        """Seconds of running every instruction of ``comp`` one after the other."""
        hit = self._comp_times.get(module, comp.name)
        if hit is None:
            gc = self.graph_costs(self._body_graph(module, comp))
            hit = self._comp_times.put(
                module, (float(gc.time_s.sum()), bool(gc.estimated.any())), comp.name)
        return hit

    def _control_cost(self, module: HloModule, comp: HloComputation, instr: HloInstruction
                      ) -> tuple[float, bool]:
        """while: trip count x (condition + body); conditional: slowest branch; call:
        the callee. The trip count is XLA's (post-optimization ``known_trip_count``) or
        read off a counted loop (:func:`hlo_tools.loops.known_trip_count`); an unknown
        one counts once and is flagged as estimated."""
        if instr.opcode in ASYNC_WRAPPER_OPCODES:
            return 0.0, False
        comps = [module.computation(c) for c in instr.called_computations]
        times = [self.computation_time(module, c) for c in comps]
        est = any(e for _, e in times)
        if instr.opcode == "conditional":
            return max((t for t, _ in times), default=0.0), est
        total = sum(t for t, _ in times)
        if instr.opcode == "while":
            trips = known_trip_count(module, comp, instr)
            return total * (1 if trips is None else trips), est or trips is None
        return total, est

    def describe(self) -> dict[str, Any]:
        """The model's settings, for reports."""
        c = self.constants
        return {"hardware": self.hardware.name, "overlap": c.overlap,
                "kernel_launch_s": c.kernel_launch_s, "mem_s_per_byte": c.mem_s_per_byte,
                "compute_scale": c.compute_scale, "saving_share": c.saving_share,
                "copy_s_per_byte": c.copy_s_per_byte,
                "constants_source": c.source, "measured_op_keys": len(self.op_times),
                "fused_estimator": type(self.fused).__name__,
                "allreduce": {"c_s_per_byte": self.hardware.allreduce.c_s_per_byte,
                              "d_s": self.hardware.allreduce.d_s,
                              "d_tuple_extra_s": self.hardware.allreduce.d_tuple_extra_s}}


def cover(costs: CostModel, module: HloModule, progress: bool | None = False) -> int:
    """Times standalone (cached) the ops of ``module`` that ``costs`` has no time for --
    e.g. the ops of XLA's compiled plans, inside its library fusions timed as the library
    runs them; returns how many were added."""
    todo = [instr for key, (instr, _) in benchable_ops(module).items()
            if key not in costs.op_times.times]
    if not todo:
        return 0
    return costs.op_times.add_timings(bench_ops(module, todo, replicas=1,
                                                progress=progress))
