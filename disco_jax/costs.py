"""Costs for the simulator: op times, fused-op estimates, AllReduce times -> :class:`SimGraph`.

A :class:`CostModel` gathers everything the simulator needs to cost a plan on one
backend:

* **single-op times** (:class:`OpTimes`), by :class:`~estimator.profiler.OpKey`: from a
  whole-program profile of the no-fusion program (the most faithful: measured in the real
  program's context), then from standalone runs (:mod:`estimator.op_bench`, cached), then
  the analytic model of :mod:`estimator.profiler` fitted on those measurements (flagged
  *estimated*);
* a **fused-op estimator** (:class:`FusedOpEstimator`): the time of a fusion group from
  its members. :class:`FallbackFusedEstimator` is a simple documented rule; the GNN of the
  roadmap implements the same protocol;
* the **AllReduce model** ``T = C * bytes + D`` of a hardware file
  (``configs/hardware/NAME.toml``);
* **backend constants** (:class:`BackendConstants`): the overlap phi of the simulator,
  the per-kernel launch overhead, the per-byte memory cost and the compute scale (host
  devices sharing the host's cores), from the hardware file's optional ``[costs]`` table
  or per-backend defaults.

:func:`sim_graph` turns a plan over a :class:`~hlo_tools.graph.DeviceGraph` into a
:class:`~disco_jax.simulator.SimGraph` -- one node per group in the plan's schedule
order -- and is on the search's hot path: everything that does not depend on the plan is
computed once per graph in a :class:`GraphCosts`, fused-op estimates are cached by
group, and the per-plan work is a handful of numpy passes over the N nodes.
:func:`sim_graph_from_module` simulates a module *as written* (e.g. XLA's own plan from
``lowered.compile().as_text()``): every instruction is a kernel, ``fusion``
instructions are predicted by the fused-op estimator from their fused computations
(never measured as fusions), and all-reduces -- also tuple-shaped ones from XLA's
combiner, and ``all-reduce-start``/``-done`` -- are communication nodes.

Times are seconds and sizes bytes throughout.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from disco_jax.simulator import SimGraph, SimResult, simulate
from estimator import op_bench
from estimator import profiler as pr
from estimator.allreduce import HardwareConfig, load_hardware
from hlo_tools.graph import DeviceGraph, NodeKind, device_graph
from hlo_tools.ir import HloComputation, HloInstruction, HloModule
from hlo_tools.loops import known_trip_count
from hlo_tools.opcodes import ASYNC_WRAPPER_OPCODES, READS_RESULT_SIZE_OPCODES, UNFUSIBLE_OPCODES
from hlo_tools.plan import Plan, copy_readers, group_outputs, initial_plan

__all__ = [
    "BackendConstants",
    "BatchedFusedOpEstimator",
    "CostModel",
    "FallbackFusedEstimator",
    "FusedOpEstimator",
    "GraphCosts",
    "OpTimes",
    "sim_graph",
    "sim_graph_from_module",
    "simulate_plan",
]



# --------------------------------------------------------------------------- constants


@dataclasses.dataclass(frozen=True)
class BackendConstants:
    """Per-backend constants of the cost model.

    Read from the optional ``[costs]`` table of a hardware file::

        [costs]
        overlap = 0.0             # phi of disco_jax.simulator, in [0, 1]
        kernel_launch_s = 1e-6    # fixed cost of one kernel (thunk), seconds
        mem_s_per_byte = 1e-10    # seconds per byte read or written by a kernel
        compute_scale = 2.0       # factor on every kernel time in the simulation

    Attributes:
        overlap: how fast computation progresses while an AllReduce is in flight (phi).
        kernel_launch_s: fixed cost of one kernel, seconds; a fusion of k kernels saves
            up to ``k - 1`` of them.
        mem_s_per_byte: seconds per byte of memory traffic; prices the flat-buffer copies
            of AllReduce buckets and caps the memory part of an op's measured time.
        compute_scale: factor applied to every compute node of a simulated graph (>= 1
            slows kernels down). Several host devices of one process share the host's
            cores: with ``devices_per_process`` devices on ``host_cpus`` cores each
            device gets at most ``host_cpus / devices_per_process`` of them, while op
            times are measured with the host to themselves (profiles of a 4-device
            program show the same per-op times as standalone runs: a descheduled device
            shows up as gaps between its kernels, not in them). The default is
            therefore ``max(1, devices_per_process / host_cpus)`` on CPU, 1 elsewhere.
        source: where the values come from.
    """

    overlap: float
    kernel_launch_s: float
    mem_s_per_byte: float
    source: str = "default"
    compute_scale: float = 1.0

    #: Defaults per jax backend. CPU: phi ~ 0 from DESIGN.md's measurement of XLA:CPU's
    #: default scheduler (an AllReduce and independent matmuls took M + C); ~1 us per
    #: thunk and ~10 GB/s per core from op_bench runs on this host (scalar ops take
    #: 0.9-1.1 us, a 4 MiB f32 add ~1 ms for 12 MiB of traffic). GPU: NCCL streams
    #: overlap fully; ~5 us per kernel launch; HBM-class bandwidth (not measured here).
    DEFAULTS = {
        "cpu": (0.0, 1e-6, 1e-10),
        "gpu": (1.0, 5e-6, 1.25e-12),
    }

    @classmethod
    def for_backend(cls, backend: str) -> BackendConstants:
        """The defaults of a backend (``cpu`` for unknown ones)."""
        key = "gpu" if backend in ("gpu", "cuda", "rocm") else "cpu"
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
                  float(table.get("compute_scale", shared)))
        if (not 0.0 <= out.overlap <= 1.0 or out.kernel_launch_s < 0 or out.mem_s_per_byte < 0
                or out.compute_scale <= 0):
            raise ValueError(f"invalid [costs] in hardware {hardware.name!r}: {out}")
        return out


# --------------------------------------------------------------------------- op times


class OpTimes:
    """Single-op times by :class:`~estimator.profiler.OpKey`, with the analytic fallback.

    Sources are added in priority order: the first time stored for a key wins. Times of
    multi-op fusions are never stored (a fusion is always predicted from its members);
    a profiled single-op fusion (XLA:CPU's ``wrapped_<op>``) counts as its op.
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.sources: dict[str, str] = {}
        self._rows: list[tuple[str, float, float, float]] = []
        self._wrapped: dict[str, float] = {}
        self._fallback: pr.OpCostModel | None = None

    def add(self, key: str, time_s: float, source: str, cls: str = "other",
            nbytes: float = 0.0, flops: float = 0.0) -> bool:
        """Stores a measured time unless the key has one; returns whether it was stored."""
        if key in self.times or not math.isfinite(time_s) or time_s < 0:
            return False
        self.times[key] = float(time_s)
        self.sources[key] = source
        if time_s > 0:
            self._rows.append((cls, float(nbytes), float(flops), float(time_s)))
        self._fallback = None
        return True

    def add_timings(self, timings: Mapping[str, op_bench.OpTiming],
                    source: str = "op_bench") -> int:
        """Adds standalone timings (failed ones are skipped); returns how many were new."""
        return sum(self.add(k, t.time_s, source, t.cls, t.bytes, t.flops)
                   for k, t in timings.items() if t.ok)

    def add_op_profile(self, profile: pr.OpProfile, source: str = "profile") -> int:
        """Adds the records of a stored profile (``disco profile`` / ``OpProfile.save``).

        Plain ops are stored by key; single-op fusions are matched later, when an op is
        looked up, by the key its XLA:CPU wrapper fusion would have (multi-op fusions
        can never match: their bodies differ from every wrapper's).
        """
        added = 0
        for key, rec in profile.records.items():
            if not rec.key.opcode.startswith("fusion"):
                added += self.add(key, rec.time_s, source, rec.cls, rec.bytes, rec.flops)
            elif key not in self._wrapped and rec.time_s > 0:
                self._wrapped[key] = rec.time_s
                self._rows.append((rec.cls, float(rec.bytes), float(rec.flops), rec.time_s))
                added += 1
        self._fallback = None
        return added

    def add_program_profile(self, profile: pr.ProgramProfile,
                            original: HloModule | None = None, source: str = "profile") -> int:
        """Adds the per-execution times of a whole-program profile, each keyed by the
        single op it ran (multi-op fusions are skipped).

        Args:
            profile: a profile of a program compiled without fusion (``exact=True``).
            original: the module that program was compiled from. Its instructions are
                found through the ``op_name`` XLA records (see
                :func:`estimator.profiler.map_to_original`), so ops XLA reshaped while
                compiling (a 3-D dot run as a 2-D one, a transpose run as a copy) still
                get their in-context time, keyed as in ``original``. Without it, or for
                ops not found, the compiled op's own key is used.

        Returns:
            How many keys got a time.
        """
        import hlo_tools

        compiled = hlo_tools.parse(profile.hlo_text)
        view = op_bench.module_view(compiled)
        by_key: dict[str, list[float]] = {}
        infos: dict[str, pr.OpInfo] = {}
        mapped = _map_single_ops(profile, view, original)
        for key_info, one in mapped:
            by_key.setdefault(key_info.key.encode(), []).append(one)
            infos.setdefault(key_info.key.encode(), key_info)
        for name, total in profile.times_s.items():
            instr = view.instr.get(name)
            inner = _single_op(compiled, instr) if instr is not None else None
            if inner is None or op_bench.op_status(inner)[0] != "bench":
                continue
            info = pr.describe_instruction(view, inner)
            if op_bench.is_library_fusion(instr):
                info = op_bench.library_info(info)
            one = total / max(profile.counts.get(name, 1.0), 1.0)
            by_key.setdefault(info.key.encode(), []).append(one)
            infos.setdefault(info.key.encode(), info)
        added = 0
        for key, times in by_key.items():
            info = infos[key]
            added += self.add(key, float(np.median(times)), source, info.cls, info.bytes,
                              info.flops)
        return added

    def fallback_model(self) -> pr.OpCostModel:
        """The analytic model fitted on every measured time (cached)."""
        if self._fallback is None:
            self._fallback = pr.OpCostModel.fit(self._rows)
        return self._fallback

    def estimate(self, view: Any, instr: HloInstruction, library: bool = False
                 ) -> pr.OpEstimate:
        """The time of one op: measured if any source has its key, else the fallback.

        ``library``: the op runs inside a library fusion of XLA's plan; its time as the
        library runs it (:func:`estimator.op_bench.library_key`) is used when known,
        else the op's own time, as if it ran unwrapped.
        """
        info = pr.describe_instruction(view, instr)
        if library:
            key = op_bench.library_key(info.key).encode()
            if key in self.times:
                return pr.OpEstimate(self.times[key], False, self.sources[key])
        key = info.key.encode()
        t = self.times.get(key)
        if t is not None:
            return pr.OpEstimate(t, False, self.sources[key])
        if self._wrapped:
            t = self._wrapped.get(_wrapped_key(view, instr))
            if t is not None:
                return pr.OpEstimate(t, False, "profile")
        return pr.OpEstimate(self.fallback_model().predict(info.cls, info.bytes, info.flops),
                             True, f"model:{info.cls}")

    def __len__(self) -> int:
        return len(self.times)


def _map_single_ops(profile: pr.ProgramProfile, compiled: Any,
                    original: HloModule | None) -> list[tuple[pr.OpInfo, float]]:
    """``(info of the original op, seconds per execution)`` for every op of ``original``
    that ran as single-op kernels (times of several kernels of one op are summed).

    Args:
        profile: the profile.
        compiled: :func:`estimator.op_bench.module_view` of the compiled module.
        original: the module that was compiled (None: nothing is mapped).
    """
    if original is None:
        return []
    view = op_bench.module_view(original)
    users: dict[str, list[str]] = {}
    for _, instr in compiled.module.instructions():
        for o in instr.operands:
            users.setdefault(o, []).append(instr.name)
    totals: dict[str, float] = {}
    library: set[str] = set()
    for name, total in profile.times_s.items():
        target = _original_name(compiled, users, name)
        if target not in view.instr:
            continue
        one = total / max(profile.counts.get(name, 1.0), 1.0)
        totals[target] = totals.get(target, 0.0) + one
        if op_bench.is_library_fusion(compiled.instr[name]):
            library.add(target)
    out = []
    for target, one in totals.items():
        instr = view.instr[target]
        if op_bench.op_status(instr)[0] == "bench":
            info = pr.describe_instruction(view, instr)
            if target in library:
                info = op_bench.library_info(info)
            out.append((info, one))
    return out


def _original_name(compiled: Any, users: Mapping[str, list[str]], name: str) -> str | None:
    """The original instruction a compiled single-op kernel came from (its ``op_name``).

    A kernel without ``op_name`` that XLA split off an op (e.g. the ``reduce-window``
    of a tree reduction) belongs to the op of its only user chain."""
    for _ in range(8):
        instr = compiled.instr.get(name)
        inner = _single_op(compiled.module, instr) if instr is not None else None
        if inner is None:
            return None
        if inner.op_name:
            return inner.op_name.rsplit("/", 1)[-1]
        if len(users.get(name, ())) != 1:
            return None
        name = users[name][0]
    return None


def _single_op(module: HloModule, instr: HloInstruction) -> HloInstruction | None:
    """The op a compiled instruction runs: itself, or the only op of a wrapper fusion."""
    if instr.opcode != "fusion":
        return instr
    comps = [module.computation(c) for c in instr.called_computations]
    body = [i for c in comps for i in c.instructions if i.opcode != "parameter"]
    if len(body) != 1 or body[0].opcode == "fusion":
        return None
    return body[0]


def _wrapped_key(view: Any, instr: HloInstruction) -> str:
    """The key XLA:CPU's ``fusion-wrapper`` gives the single-op fusion around ``instr``.

    The wrapper's computation has one parameter per distinct operand followed by the op;
    the fusion is ``kind=kLoop`` with the distinct operands.
    """
    Instr = HloInstruction
    by_name = view.instr
    distinct = list(dict.fromkeys(instr.operands))
    params = [Instr(f"w.p{k}", "parameter", by_name[o].shape, payload=str(k))
              for k, o in enumerate(distinct)]
    rename = {o: p.name for o, p in zip(distinct, params)}
    op = instr.copy(name="w.op", operands=[rename[o] for o in instr.operands])
    body = HloComputation("w.body", [*params, op], "w.op")
    outer = [Instr(o, "parameter", by_name[o].shape, payload=str(k))
             for k, o in enumerate(distinct)]
    fusion = Instr("w.fusion", "fusion", instr.shape, distinct,
                   {"kind": "kLoop", "calls": "w.body"})
    entry = HloComputation("w.entry", [*outer, fusion], "w.fusion", is_entry=True)
    callees = [view.comps[c] for c in dict.fromkeys(_callees(view.comps, instr))]
    wrapper = HloModule("w", {}, [*callees, body, entry])
    return pr.describe_instruction(wrapper, fusion).key.encode()


def _callees(comps: Mapping[str, HloComputation], instr: HloInstruction) -> Iterable[str]:
    stack = list(instr.called_computations)
    while stack:
        name = stack.pop()
        if name in comps:
            yield name
            stack.extend(n for i in comps[name].instructions for n in i.called_computations)


# --------------------------------------------------------------------------- estimators


@runtime_checkable
class FusedOpEstimator(Protocol):
    """Predicts the execution time of one fused op from its members.

    ``members`` are node indices of ``graph`` that become one fusion; ``copies`` are
    producers duplicated into it (computed again inside, their originals stay). The
    fusion's inputs are the values its members and copies read from outside. Its outputs
    are ``outputs`` when given, else every member read by a node outside ``members`` (or
    the graph's root); a plan passes ``outputs`` only in the rare case where a member's
    outside readers all hold their own copy of it.
    """

    def predict(self, graph: DeviceGraph, members: Sequence[int], copies: Sequence[int],
                outputs: Sequence[int] | None = None) -> float:
        """Seconds of one execution of the fused op."""
        ...


@runtime_checkable
class BatchedFusedOpEstimator(FusedOpEstimator, Protocol):
    """An estimator that is faster on many groups at once (the GNN batches them)."""

    def predict_batch(self, graph: DeviceGraph,
                      groups: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
        """Seconds for each ``(members, copies)`` group, as a float64 array."""
        ...


class FallbackFusedEstimator:
    """The simple fused-op rule used until the GNN estimator lands.

    Every member's measured single-op time ``t_i`` is split into a launch part, a memory
    part and a compute part, each >= 0 and adding up to ``t_i`` exactly::

        l_i = min(L, t_i)                          L = kernel_launch_s
        m_i = min(b * traffic_i, t_i - l_i)        b = mem_s_per_byte,
                                                   traffic_i = bytes the op reads + writes
        c_i = t_i - l_i - m_i

    A fused kernel launches once, moves only its own inputs and outputs, and does all the
    members' compute::

        t_fused = max_i l_i + (sum_i m_i) * io / (sum_i traffic_i) + sum_i c_i

    ``io`` = bytes the fused kernel reads (each outside value once, the largest read of
    it) plus bytes it writes (members read outside the group, or the root). Equivalently:
    *the sum of the member times, minus the launch overheads saved, minus the memory
    traffic saved* (intermediates neither written nor read back, shared inputs read once),
    priced at the members' own average cost per byte. Copies of duplicated producers
    count as members that are never outputs. Consequences: a single op is predicted as
    exactly its measured time; a fused op is never faster than one launch, and never
    faster than the compute of its members; memory-bound members merge into one
    roofline-like kernel. Reads of ``slice``/``dynamic-slice``/``gather`` count only
    the bytes of their result.
    """

    def __init__(self, costs: CostModel):
        self.costs = costs

    def predict(self, graph: DeviceGraph, members: Sequence[int],
                copies: Sequence[int] = (), outputs: Sequence[int] | None = None) -> float:
        gc = self.costs.graph_costs(graph)
        return gc.fallback_fused(members, copies, outputs)

    def predict_batch(self, graph: DeviceGraph,
                      groups: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
        gc = self.costs.graph_costs(graph)
        return np.array([gc.fallback_fused(m, c) for m, c in groups], dtype=np.float64)


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
        out_bytes: ``[N]`` bytes of each node's output buffer (0: aliases or persistent).
        write_bytes: ``[N]`` bytes each node writes when run alone.
        traffic: ``[N]`` bytes each node reads and writes when run alone.
        launch_s, mem_s, compute_s: ``[N]`` the split of ``time_s`` used by
            :class:`FallbackFusedEstimator`.
        persistent_bytes: parameters and constants (live for the whole iteration; a
            constant fused into a group is part of the kernel instead).
        constant_bytes: ``[N]`` bytes of each constant node (0 for other nodes).
        op_ptr, op_idx: CSR of each node's distinct operands.
        read_bytes: ``[E]`` bytes node reads through each operand edge.
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
        self._split(costs.constants)
        self.users = graph.users
        #: (members, copies[, outputs]) -> (seconds, output bytes, name)
        self.fused_cache: dict[tuple, tuple[float, int, str]] = {}

    # -- static arrays

    def _measure(self, graph: DeviceGraph, costs: CostModel) -> None:
        n = self.n
        instrs = graph.computation.instructions
        self.time_s = np.zeros(n, dtype=np.float64)
        self.estimated = np.zeros(n, dtype=np.bool_)
        self.is_comm = np.zeros(n, dtype=np.bool_)
        self.out_bytes = np.zeros(n, dtype=np.int64)
        self.write_bytes = np.array([i.shape.byte_size() for i in instrs], dtype=np.int64)
        self.source: list[str] = [""] * n
        persistent = 0
        for k, instr in enumerate(instrs):
            t, est, src, comm, out = costs.node_cost(graph, k, instr)
            self.time_s[k], self.estimated[k], self.source[k] = t, est, src
            self.is_comm[k], self.out_bytes[k] = comm, out
            if graph.kinds[k] in (NodeKind.PARAMETER, NodeKind.CONSTANT):
                persistent += self.write_bytes[k]
        self.persistent_bytes = int(persistent)
        self.constant_bytes = np.where([k == NodeKind.CONSTANT for k in graph.kinds],
                                       self.write_bytes, 0)
        #: ``[N]`` whether a node may join a fusion (the rule of hlo_tools.plan.FusionSpace)
        self.fusible = np.array([
            (kind == NodeKind.COMPUTE and op not in UNFUSIBLE_OPCODES) or kind == NodeKind.CONSTANT
            for kind, op in zip(graph.kinds, graph.opcodes)], dtype=np.bool_)
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

    def _split(self, constants: BackendConstants) -> None:
        t = self.time_s
        self.launch_s = np.minimum(constants.kernel_launch_s, t)
        self.mem_s = np.minimum(constants.mem_s_per_byte * self.traffic, t - self.launch_s)
        self.compute_s = t - self.launch_s - self.mem_s

    # -- fusion groups

    def outputs(self, members: Sequence[int]) -> list[int]:
        """Members read outside the group (or the root): the fused op's outputs."""
        return list(group_outputs(self.graph, None, members))

    def fallback_fused(self, members: Sequence[int], copies: Sequence[int] = (),
                       outputs: Sequence[int] | None = None) -> float:
        """:class:`FallbackFusedEstimator`'s rule (see its docstring), seconds."""
        inside = set(members) | set(copies)
        ptr, idx, reads = self.op_ptr, self.op_idx, self.read_bytes
        external: dict[int, int] = {}
        for i in inside:
            for e in range(ptr[i], ptr[i + 1]):
                o = int(idx[e])
                if o not in inside and reads[e] > external.get(o, -1):
                    external[o] = int(reads[e])
        outs = self.outputs(members) if outputs is None else outputs
        io = sum(external.values()) + int(sum(self.write_bytes[m] for m in outs))
        nodes = list(inside)
        traffic = float(self.traffic[nodes].sum())
        mem = float(self.mem_s[nodes].sum())
        scale = io / traffic if traffic > 0 else 1.0
        return (float(self.launch_s[nodes].max(initial=0.0)) + mem * min(scale, 1.0)
                + float(self.compute_s[nodes].sum()))

    def fused(self, members: Sequence[int], copies: Sequence[int] = (),
              outputs: Sequence[int] | None = None) -> tuple[float, int, str]:
        """``(seconds, output bytes, name)`` of a fusion group, cached by group (and by
        ``outputs`` when given, see :class:`FusedOpEstimator`)."""
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
        hardware: a loaded hardware file, or its name/path (``configs/hardware``).
        op_times: measured single-op times (empty: every op from the analytic model).
        constants: backend constants (default: the hardware file's ``[costs]``).
        fused: the fused-op estimator (default: :class:`FallbackFusedEstimator`).
        allreduce: ``"linear"`` (``T = C * bytes + D``) or ``"measured"`` (interpolate
            the file's measured points; linear beyond them).
    """

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
        self._graphs: OrderedDict[int, tuple[DeviceGraph, GraphCosts]] = OrderedDict()
        self._views: dict[int, tuple[HloModule, Any]] = {}
        self._libraries: dict[int, tuple[HloModule, frozenset[str]]] = {}
        self._comp_times: dict[tuple[int, str], tuple[float, bool]] = {}
        self._bodies: dict[tuple[int, str], tuple[HloModule, DeviceGraph]] = {}

    @classmethod
    def for_module(cls, module: HloModule, hardware: HardwareConfig | str = "inproc4", *,
                   profile: pr.OpProfile | pr.ProgramProfile | None = None,
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
                :meth:`OpTimes.add_program_profile`).
            bench: time the module's single ops standalone (:mod:`estimator.op_bench`).
            replicas: devices running each timed op at once.
            progress: show op_bench's counter (default: when stderr is a terminal).
            **kwargs: passed to :class:`CostModel`.
        """
        times = OpTimes()
        if isinstance(profile, pr.ProgramProfile):
            times.add_program_profile(profile, original=profiled_module)
        elif profile is not None:
            times.add_op_profile(profile)
        if bench:
            times.add_timings(op_bench.bench_ops(module, replicas=replicas, progress=progress))
        return cls(hardware, op_times=times, **kwargs)

    # -- constants

    @property
    def overlap(self) -> float:
        """phi of the simulator for this backend."""
        return self.constants.overlap

    def allreduce_time(self, nbytes: float, buffers: Sequence[float] = ()) -> float:
        """Seconds of one AllReduce of ``nbytes`` bytes per device.

        ``buffers``: the byte sizes of the separate arrays of a variadic (tuple-shaped)
        all-reduce, as XLA's combiner writes them; each pays its own latency, as
        XLA:CPU's collectives reduce each buffer on its own (measured:
        ``benchmarks/simulator_accuracy.py``). Our own buckets are one flat buffer.
        """
        model = self._allreduce
        if len(buffers) <= 1:
            return float(model.time(nbytes))
        linear = getattr(model, "linear", model)  # MeasuredAllReduce keeps its fit
        return linear.c_s_per_byte * float(nbytes) + sum(linear.latency(b) for b in buffers)

    def copy_time(self, nbytes: float) -> float:
        """Seconds of one copy kernel moving ``nbytes`` (read once, written once)."""
        c = self.constants
        return c.kernel_launch_s + 2.0 * c.mem_s_per_byte * float(nbytes)

    def set_fused_estimator(self, estimator: FusedOpEstimator) -> None:
        """Swaps in another fused-op estimator (e.g. the GNN) and drops cached costs."""
        self.fused = estimator
        self._graphs.clear()
        self._comp_times.clear()

    # -- per-graph costs

    def graph_costs(self, graph: DeviceGraph) -> GraphCosts:
        """The :class:`GraphCosts` of ``graph`` (built on first use; the 4096 most recently
        used graphs, fused computations included, are kept)."""
        hit = self._graphs.get(id(graph))
        if hit is not None and hit[0] is graph:
            self._graphs.move_to_end(id(graph))
            return hit[1]
        gc = GraphCosts(graph, self)
        self._graphs[id(graph)] = (graph, gc)
        while len(self._graphs) > 4096:
            self._graphs.popitem(last=False)
        return gc

    def view(self, module: HloModule) -> Any:
        """The op-key lookup tables of ``module`` (built once)."""
        hit = self._views.get(id(module))
        if hit is None or hit[0] is not module:
            hit = (module, op_bench.module_view(module))
            self._views[id(module)] = hit
        return hit[1]

    def _library_bodies(self, module: HloModule) -> frozenset[str]:
        """Names of the fused computations of ``module``'s library fusions (cached)."""
        hit = self._libraries.get(id(module))
        if hit is None or hit[0] is not module:
            hit = (module, op_bench.library_computations(module))
            self._libraries[id(module)] = hit
        return hit[1]

    def node_cost(self, graph: DeviceGraph, k: int, instr: HloInstruction
                  ) -> tuple[float, bool, str, bool, int]:
        """``(seconds, estimated, source, is_comm, out_bytes)`` of node ``k`` run alone."""
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
        if kind == NodeKind.CONTROL_FLOW:
            t, est = self._control_cost(graph.module, graph.computation, instr)
            return t, est, "control", False, nbytes
        status, _ = op_bench.op_status(instr)
        if status == "free":
            return 0.0, False, "free", False, 0
        library = graph.computation.name in self._library_bodies(graph.module)
        e = self.op_times.estimate(self.view(graph.module), instr, library)
        return e.time_s, e.estimated, e.source, False, nbytes

    def _fusion_cost(self, module: HloModule, instr: HloInstruction) -> tuple[float, bool]:
        """An as-written fusion: the fused-op estimator on its fused computation (the
        ops of a library fusion at their library times, see :meth:`OpTimes.estimate`)."""
        comp = module.computation(instr.called_computations[0])
        body = self._body_graph(module, comp)
        gc = self.graph_costs(body)
        members = [i for i, kind in enumerate(body.kinds) if kind != NodeKind.PARAMETER]
        t = gc.fused(members, ())[0]
        return t, bool(gc.estimated[members].any())

    def _body_graph(self, module: HloModule, comp: HloComputation) -> DeviceGraph:
        """The graph of a called computation (built once; its costs are cached by graph)."""
        key = (id(module), comp.name)
        hit = self._bodies.get(key)
        if hit is None or hit[0] is not module:
            hit = (module, device_graph(module, comp))
            self._bodies[key] = hit
        return hit[1]

    def computation_time(self, module: HloModule, comp: HloComputation) -> tuple[float, bool]:
        """Seconds of running every instruction of ``comp`` one after the other."""
        key = (id(module), comp.name)
        hit = self._comp_times.get(key)
        if hit is None:
            gc = self.graph_costs(self._body_graph(module, comp))
            hit = (float(gc.time_s.sum()), bool(gc.estimated.any()))
            self._comp_times[key] = hit
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
                "compute_scale": c.compute_scale,
                "constants_source": c.source, "measured_op_keys": len(self.op_times),
                "fused_estimator": type(self.fused).__name__,
                "allreduce": {"c_s_per_byte": self.hardware.allreduce.c_s_per_byte,
                              "d_s": self.hardware.allreduce.d_s}}


# --------------------------------------------------------------------------- plan -> SimGraph


def _runs(plan: Plan, n: int) -> tuple[np.ndarray, ...]:
    """Group runs of the schedule: (order, group, start positions, lengths, run of pos)."""
    order = np.frombuffer(plan.order, dtype=np.int32) if plan.order.itemsize == 4 else \
        np.asarray(plan.order, dtype=np.int32)
    group = np.frombuffer(plan.group, dtype=np.int32) if plan.group.itemsize == 4 else \
        np.asarray(plan.group, dtype=np.int32)
    g_ord = group[order]
    head = np.ones(n, dtype=np.bool_)
    head[1:] = g_ord[1:] != g_ord[:-1]
    starts = np.flatnonzero(head)
    lens = np.diff(starts, append=n)
    run_of_pos = np.cumsum(head) - 1
    return order, group, starts, lens, run_of_pos


def sim_graph(graph: DeviceGraph, plan: Plan, costs: CostModel) -> SimGraph:
    """The :class:`SimGraph` of ``plan``: one node per group, in the plan's schedule order.

    * a singleton keeps its own time (a collective runs on the channel);
    * a fusion group (two or more compute nodes, or a group holding copies of
      duplicated producers) is one compute node timed by the fused-op estimator;
    * an AllReduce bucket of k all-reduces becomes, as :func:`hlo_tools.rewrite.apply_plan`
      writes it, a compute node concatenating the gradients into a flat buffer, one
      communication node ``T = C * bytes + D`` for the whole buffer, and k compute nodes
      slicing each gradient back out (the reshapes are bitcasts); the copies are priced
      by :meth:`CostModel.copy_time`.

    Dependencies follow the plan's group-contracted graph. Parameters and constants are
    zero-time nodes whose bytes are persistent; tuples, ``get-tuple-element``, bitcasts
    and reshapes take no time and no memory. Every compute duration is multiplied by
    :attr:`BackendConstants.compute_scale`. Groups that duplicate fusion left without
    readers (every reader holds its own copy) cost nothing: XLA deletes them.

    Node ``k`` of the result is the ``k``-th group of the schedule (a bucket takes
    ``k + 2`` nodes), so the nodes of a schedule prefix that two plans share have the
    same indices and durations in both SimGraphs.

    Cost: a few numpy passes over the N nodes and E edges plus a dict lookup per fusion
    group (fused-op estimates are cached per group in the graph's :class:`GraphCosts`).

    Args:
        graph: the per-device graph.
        plan: a plan over ``graph``.
        costs: the cost model.

    Returns:
        The SimGraph (topologically ordered, int32 CSR).
    """
    gc = costs.graph_costs(graph)
    n = graph.num_nodes
    if n == 0:
        empty = np.zeros(0, dtype=np.int32)
        return SimGraph((), np.zeros(0, np.bool_), np.zeros(0), np.zeros(0, np.int64),
                        np.zeros(1, np.int32), empty, gc.persistent_bytes)
    order, group, starts, lens, run_of_pos = _runs(plan, n)
    heads = order[starts]
    copies = _copies_by_group(plan)
    multi = lens > 1
    bucket = multi & gc.is_comm[heads]
    fusion = multi & ~bucket
    if copies:
        has_copies = np.zeros(n, dtype=np.bool_)
        has_copies[list(copies)] = True
        fusion |= has_copies[group[heads]]
    width = 1 + bucket * (1 + lens)
    sim_start = np.cumsum(width) - width
    size = int(sim_start[-1] + width[-1]) if n else 0
    pos_in_run = np.arange(n) - starts[run_of_pos]
    in_bucket = bucket[run_of_pos]
    out = np.empty(n, dtype=np.int32)
    out[order] = sim_start[run_of_pos] + np.where(in_bucket, 2 + pos_in_run, 0)
    reader = np.empty(n, dtype=np.int32)
    reader[order] = sim_start[run_of_pos]
    src, dst = _edges(gc, plan, group, out, reader, copies)
    dur = np.zeros(size, dtype=np.float64)
    comm = np.zeros(size, dtype=np.bool_)
    nbytes = np.zeros(size, dtype=np.int64)
    names = np.empty(size, dtype=object)
    single = ~multi & ~fusion
    at, hd = sim_start[single], heads[single]
    dur[at], comm[at], nbytes[at], names[at] = (gc.time_s[hd], gc.is_comm[hd],
                                                gc.out_bytes[hd], gc.names_arr[hd])
    _fill_fusions(gc, plan, order, starts, lens, sim_start, np.flatnonzero(fusion), copies,
                  dur, nbytes, names)
    extra = _fill_buckets(gc, costs, order, starts, lens, sim_start, np.flatnonzero(bucket),
                          dur, comm, nbytes, names)
    if extra[0].size:
        src, dst = np.concatenate([src, extra[0]]), np.concatenate([dst, extra[1]])
    if costs.constants.compute_scale != 1.0:
        dur[~comm] *= costs.constants.compute_scale
    edges = dst.astype(np.int64) * size + src
    edges.sort()
    if edges.size > 1:  # drop duplicate edges (several members reading one value)
        edges = edges[np.concatenate(([True], edges[1:] != edges[:-1]))]
    dst = edges // size
    src = edges - dst * size
    gone = fusion[run_of_pos]  # constants fused into a kernel (or dropped with it)
    if plan.dups:
        dead = _dead_nodes(gc, plan, group, heads, sim_start, reader, src, dst, size)
        if dead.size:  # XLA deletes them and apply_plan does not write them
            dur[dead], nbytes[dead] = 0.0, 0
            keep = ~np.isin(dst, dead)
            src, dst = src[keep], dst[keep]
            runs = np.searchsorted(sim_start, dead)
            gone = gone | np.isin(run_of_pos, runs)
    ptr = np.zeros(size + 1, dtype=np.int32)
    np.cumsum(np.bincount(dst, minlength=size), out=ptr[1:])
    persistent = gc.persistent_bytes - int(gc.constant_bytes[order[gone]].sum())
    return SimGraph(tuple(names.tolist()), comm, dur, nbytes, ptr, src.astype(np.int32),
                    persistent)


def _dead_nodes(gc: GraphCosts, plan: Plan, group: np.ndarray, heads: np.ndarray,
                sim_start: np.ndarray, reader: np.ndarray, src: np.ndarray, dst: np.ndarray,
                size: int) -> np.ndarray:
    """Sim nodes of compute groups nobody reads any more because every reader holds its
    own copy: :func:`hlo_tools.plan.dead_groups` on the sim edges, where a copy reads
    another copy held by its group rather than the original (as apply_plan writes it)."""
    by_src = np.argsort(src, kind="stable")
    succ, succ_ptr = dst[by_src], np.zeros(size + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=size), out=succ_ptr[1:])
    pred_ptr = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=size), out=pred_ptr[1:])
    fusible = np.zeros(size, dtype=np.bool_)
    fusible[sim_start] = gc.fusible[group[heads]]
    root = int(reader[gc.root])
    dead: set[int] = set()
    todo = {int(reader[p]) for p, _ in plan.dups}
    while todo:
        s = todo.pop()
        if s in dead or s == root or not fusible[s]:
            continue
        if all(d in dead for d in succ[succ_ptr[s]:succ_ptr[s + 1]].tolist()):
            dead.add(s)
            todo.update(src[pred_ptr[s]:pred_ptr[s + 1]].tolist())
            todo.update(d for d in dead if d != s)  # readers of earlier candidates may be gone
    return np.array(sorted(dead), dtype=np.int64)


def _copies_by_group(plan: Plan) -> dict[int, tuple[int, ...]]:
    out: dict[int, list[int]] = {}
    for p, g in plan.dups:
        out.setdefault(g, []).append(p)
    return {g: tuple(sorted(ps)) for g, ps in out.items()}


def _csr_rows(ptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entries of the CSR rows ``rows``: (entry indices, position in ``rows`` of each)."""
    counts = ptr[rows + 1] - ptr[rows]
    which = np.repeat(np.arange(rows.size), counts)
    first = np.repeat(ptr[rows] - (np.cumsum(counts) - counts), counts)
    return first + np.arange(which.size), which


def _edges(gc: GraphCosts, plan: Plan, group: np.ndarray, out: np.ndarray, reader: np.ndarray,
           copies: Mapping[int, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Sim edges ``src -> dst`` between groups (a copy's reads belong to its group)."""
    e_dst, e_src = gc.edge_dst, gc.op_idx
    mask = group[e_dst] != group[e_src]
    if not plan.dups:
        return out[e_src[mask]], reader[e_dst[mask]]
    dups = np.array(sorted(plan.dups), dtype=np.int64).reshape(-1, 2)
    dup_p, dup_g = dups[:, 0], dups[:, 1]
    # a group holding a copy of p reads the copy, not p: cut p's edges into the group
    edges, which = _csr_rows(gc.use_ptr, dup_p)
    edges = gc.use_edge[edges]
    mask[edges[group[e_dst[edges]] == dup_g[which]]] = False
    src, dst = out[e_src[mask]], reader[e_dst[mask]]
    # ... and the copy reads p's operands, unless they are in the group or copies too
    ops, which = _csr_rows(gc.op_ptr, dup_p)
    o, g = e_src[ops], dup_g[which]
    keep = (group[o] != g) & ~np.isin(o * gc.n + g, dup_p * gc.n + dup_g)
    return (np.concatenate([src, out[o[keep]]]),
            np.concatenate([dst, reader[g[keep]]]))


def _fill_fusions(gc: GraphCosts, plan: Plan, order: np.ndarray, starts: np.ndarray,
                  lens: np.ndarray, sim_start: np.ndarray, runs: np.ndarray,
                  copies: Mapping[int, tuple[int, ...]], dur: np.ndarray, nbytes: np.ndarray,
                  names: np.ndarray) -> None:
    """Times, output bytes and names of the fusion groups' nodes."""
    if not runs.size:
        return
    order_l = order.tolist()
    first = starts[runs]
    spans = zip(first.tolist(), (first + lens[runs]).tolist())
    groups = [tuple(order_l[a:b]) for a, b in spans]
    if copies:
        group = plan.group
        keys = [(g, copies.get(group[g[0]], ())) for g in groups]
        readers = copy_readers(gc.graph, plan)
        special = {p for p, _ in plan.dups} | set(readers)
        for k, (g, c) in enumerate(keys):
            if not special.isdisjoint(g):
                keys[k] = (g, c, group_outputs(gc.graph, plan, g, readers))
    else:
        keys = [(g, ()) for g in groups]
    hits = list(map(gc.fused_cache.get, keys))
    if None in hits:
        gc.prefetch([key for key, hit in zip(keys, hits) if hit is None and len(key) == 2])
        hits = [hit or gc.fused(*key) for key, hit in zip(keys, hits)]
    at = sim_start[runs]
    t, ob, nm = zip(*hits)
    dur[at], nbytes[at], names[at] = t, ob, nm


def _fill_buckets(gc: GraphCosts, costs: CostModel, order: np.ndarray, starts: np.ndarray,
                  lens: np.ndarray, sim_start: np.ndarray, runs: np.ndarray, dur: np.ndarray,
                  comm: np.ndarray, nbytes: np.ndarray, names: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate / AllReduce / slice nodes of each bucket; returns their edges."""
    src: list[int] = []
    dst: list[int] = []
    for r in runs.tolist():
        s, k, at = int(starts[r]), int(lens[r]), int(sim_start[r])
        members = order[s:s + k]
        sizes = gc.write_bytes[members]
        total = int(sizes.sum())
        first = gc.names_arr[members[0]]
        dur[at], nbytes[at], names[at] = costs.copy_time(total), total, f"{first}.buffer"
        dur[at + 1], comm[at + 1], nbytes[at + 1] = costs.allreduce_time(total), True, total
        names[at + 1] = f"{first}.bucket"
        dur[at + 2:at + 2 + k] = [costs.copy_time(b) for b in sizes.tolist()]
        nbytes[at + 2:at + 2 + k] = sizes
        names[at + 2:at + 2 + k] = gc.slice_names[members]
        src += [at] + [at + 1] * k
        dst += [at + 1] + list(range(at + 2, at + 2 + k))
    return np.asarray(src, dtype=np.int32), np.asarray(dst, dtype=np.int32)


def sim_graph_from_module(module: HloModule, costs: CostModel) -> SimGraph:
    """The :class:`SimGraph` of a module as written.

    Every instruction of the per-device computation (the shard_map body, else ENTRY) is
    its own node: ``fusion`` instructions are timed by the fused-op estimator from their
    fused computations' single ops (never measured as fusions), collectives (tuple-shaped
    combined all-reduces and ``all-reduce-start`` included; ``-done`` is free) run on
    the channel, control flow costs its bodies. Use it on ``lowered.compile().as_text()``
    to simulate XLA's own plan.
    """
    graph = device_graph(module)
    return sim_graph(graph, initial_plan(graph), costs)


def simulate_plan(graph: DeviceGraph, plan: Plan, costs: CostModel) -> SimResult:
    """Simulates ``plan`` with the cost model's overlap phi."""
    return simulate(sim_graph(graph, plan, costs), costs.overlap, check=False)
