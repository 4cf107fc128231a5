"""Fused-op estimators: the protocol every estimator implements, and the fallback rule.

A *fused-op estimator* predicts the execution time of one fusion group -- a set of
nodes of a :class:`~hlo_tools.graph.DeviceGraph` that become one kernel -- from its
members. The cost model of ``disco_jax`` calls it for every fusion group of every plan
it costs; the GNN estimator of the roadmap implements the same protocol.

This module holds:

* :class:`FusedOpEstimator` and :class:`BatchedFusedOpEstimator`, the protocols;
* :class:`NodeCosts`, the per-node arrays of a graph that the fallback rule reads
  (the cost model computes them once per graph);
* the fallback rule itself: :func:`split_times` (each node's measured time split into
  launch, memory and compute parts; :func:`memory_bound` says which ops compute
  nothing worth pricing) and :func:`fallback_fused_time` (the time of a group from
  those parts, its arithmetic in :func:`fused_parts_time`), as pure functions over
  :class:`NodeCosts`;
* :class:`FallbackFusedEstimator`, the rule as an estimator over any
  :class:`NodeCostSource` (an object with ``node_costs(graph)``, e.g.
  ``disco_estimator.costs.cost_model.CostModel``).

Times are seconds and sizes bytes throughout. Importing this module does not import jax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from disco_estimator.ops.keys import opcode_class
from hlo_tools.graph import DeviceGraph
from hlo_tools.plan import group_outputs

__all__ = [
    "BatchedFusedOpEstimator",
    "FallbackFusedEstimator",
    "FusedOpEstimator",
    "NodeCostSource",
    "NodeCosts",
    "fallback_fused_time",
    "fused_parts_time",
    "memory_bound",
    "split_times",
]


# --------------------------------------------------------------------------- protocols


@runtime_checkable
class FusedOpEstimator(Protocol):
    """Predicts the execution time of one fused op from its members.

    ``members`` are node indices of ``graph`` that become one fusion; ``copies`` are
    producers duplicated into it (computed again inside, their originals stay). The
    fusion's inputs are the values its members and copies read from outside. Its outputs
    are ``outputs`` when given, else every member read by a node outside ``members`` (or
    the graph's root, see :func:`hlo_tools.plan.group_outputs`); a plan passes
    ``outputs`` only in the rare case where a member's outside readers all hold their
    own copy of it.
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
        """Seconds for each ``(members, copies)`` group, shape ``[len(groups)]`` float64."""
        ...


# --------------------------------------------------------------------------- node arrays


class NodeCosts(NamedTuple):
    """The per-node arrays of one graph that the fallback rule reads.

    N is the graph's node count and E the number of distinct operand edges (an operand
    read twice by one node counts once).

    Attributes:
        launch_s: ``[N]`` float64, launch part of each node's time, seconds.
        mem_s: ``[N]`` float64, memory part of each node's time, seconds.
        compute_s: ``[N]`` float64, compute part of each node's time, seconds; the three
            parts add up to the node's time run alone (see :func:`split_times`).
        traffic: ``[N]`` int64, bytes each node reads and writes when run alone.
        write_bytes: ``[N]`` int64, bytes each node writes (its result).
        op_ptr: ``[N + 1]`` int64, CSR row pointers: node ``i``'s distinct operands are
            ``op_idx[op_ptr[i]:op_ptr[i + 1]]``.
        op_idx: ``[E]`` int32, operand node of each edge.
        read_bytes: ``[E]`` int64, bytes the reading node reads through each edge (a
            ``slice``-like op reads only the bytes of its result; 0 for ops without a
            kernel).
        mem_s_per_byte: the backend's seconds per byte of memory traffic, the slowest a
            fused kernel of several ops streams its inputs and outputs (None: as slowly
            as its members streamed alone).
    """

    launch_s: np.ndarray
    mem_s: np.ndarray
    compute_s: np.ndarray
    traffic: np.ndarray
    write_bytes: np.ndarray
    op_ptr: np.ndarray
    op_idx: np.ndarray
    read_bytes: np.ndarray
    mem_s_per_byte: float | None = None


class NodeCostSource(Protocol):
    """Anything that gives the :class:`NodeCosts` of a graph (e.g. the cost model)."""

    def node_costs(self, graph: DeviceGraph) -> NodeCosts:
        """The node arrays of ``graph``."""
        ...


# --------------------------------------------------------------------------- the rule


def split_times(time_s: np.ndarray, traffic: np.ndarray, kernel_launch_s: float,
                mem_s_per_byte: float, streams: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits each node's time into launch, memory and compute parts.

    Each part is >= 0 and they add up to ``t_i`` exactly::

        l_i = min(L, t_i)                          L = kernel_launch_s
        m_i = min(b * traffic_i, t_i - l_i)        b = mem_s_per_byte
        c_i = t_i - l_i - m_i

    except for a memory-bound op (``streams``, :func:`memory_bound`: a broadcast,
    transpose, copy, slice... or arithmetic of a few cycles per element), whose time
    beyond its launch is all memory traffic: ``m_i = t_i - l_i``, ``c_i = 0`` however
    slowly it streamed. A broadcast that materializes its result, or a multiply over
    arrays that left the caches, runs far below the rate ``b`` alone (the
    write-allocate reads the destination too); counting the excess as compute would
    keep it in every fusion, where the broadcast costs nothing and the multiply's
    operands stream through registers.

    Args:
        time_s: ``[N]`` float64 seconds of each node run alone.
        traffic: ``[N]`` bytes each node reads and writes.
        kernel_launch_s: fixed cost of one kernel, seconds.
        mem_s_per_byte: seconds per byte of memory traffic.
        streams: ``[N]`` bool, the memory-bound nodes (:func:`memory_bound`; None:
            none).

    Returns:
        ``(launch_s, mem_s, compute_s)``, each ``[N]`` float64 seconds.
    """
    launch = np.minimum(kernel_launch_s, time_s)
    mem = np.minimum(mem_s_per_byte * traffic, time_s - launch)
    if streams is not None:
        mem = np.where(streams, time_s - launch, mem)
    return launch, mem, time_s - launch - mem


#: Elementwise opcodes that spend many cycles per element (division, roots,
#: transcendental functions): their time beyond the memory traffic is compute.
_COMPUTING = frozenset("""
atan2 cbrt cosine divide erf exponential exponential-minus-one log log-plus-one logistic
map power remainder rsqrt sine sqrt tan tanh
""".split())


def memory_bound(opcodes: Sequence[str]) -> np.ndarray:
    """``[N]`` bool: which opcodes compute nothing worth pricing, for :func:`split_times`:
    the ``data-movement`` class of :func:`disco_estimator.ops.keys.opcode_class`, and the
    elementwise ops of a few cycles per element (add, multiply, select, convert...;
    not those of :data:`_COMPUTING`)."""
    return np.array([opcode_class(op) == "data-movement"
                     or (opcode_class(op) == "elementwise" and op not in _COMPUTING)
                     for op in opcodes], dtype=np.bool_)


def fallback_fused_time(nodes: NodeCosts, members: Sequence[int], copies: Sequence[int],
                        outputs: Sequence[int]) -> float:
    """The fallback rule's time of one fusion group, seconds.

    A fused kernel launches once, streams only its own inputs and outputs, and does all
    the members' compute::

        t_fused = max_i l_i + io * r + sum_i c_i

    over the members and copies ``i`` (parts from :func:`split_times`). ``io`` = bytes
    the fused kernel reads (each outside value once, its largest read) plus the bytes
    of ``outputs``. ``r`` is the members' own average cost per byte,
    ``sum_i m_i / sum_i traffic_i``, but no more than the backend's ``b``
    (``nodes.mem_s_per_byte``) when two or more members take time: members that
    streamed slower than ``b`` alone did so because they materialized what the fused
    kernel keeps in registers (a broadcast of a scalar) or read arrays that had left
    the caches, and a fused loop does neither; averaged in, their rate would price
    a fusion by how many broadcasts XLA put into it.

    Consequences: a single op is predicted as exactly its measured time; a fused op is
    never faster than one launch, nor than the compute of its members, nor slower than
    the sum of its members.

    Args:
        nodes: the graph's node arrays.
        members: node indices of the group.
        copies: producers duplicated into the group (they count as members that are
            never outputs).
        outputs: members whose values leave the group.
    """
    inside = set(members) | set(copies)
    ptr, idx, reads = nodes.op_ptr, nodes.op_idx, nodes.read_bytes
    external: dict[int, int] = {}
    for i in inside:
        for e in range(ptr[i], ptr[i + 1]):
            o = int(idx[e])
            if o not in inside and reads[e] > external.get(o, -1):
                external[o] = int(reads[e])
    io = sum(external.values()) + int(sum(nodes.write_bytes[m] for m in outputs))
    order = list(inside)
    return fused_parts_time(nodes.launch_s[order], nodes.mem_s[order], nodes.compute_s[order],
                            nodes.traffic[order], io, nodes.mem_s_per_byte)


def fused_parts_time(launch_s: np.ndarray, mem_s: np.ndarray, compute_s: np.ndarray,
                     traffic: np.ndarray, io: float, mem_s_per_byte: float | None) -> float:
    """The arithmetic of :func:`fallback_fused_time` on the members' parts, seconds.

    Args:
        launch_s, mem_s, compute_s: ``[M]`` the members' parts (:func:`split_times`).
        traffic: ``[M]`` bytes each member reads and writes run alone.
        io: bytes the fused kernel reads and writes.
        mem_s_per_byte: ``b``, the slowest the kernel streams when two or more members
            take time (None: no bound).
    """
    total, mem = float(np.sum(traffic)), float(np.sum(mem_s))
    if total > 0:
        rate = mem / total
        if mem_s_per_byte is not None and np.count_nonzero(launch_s + mem_s + compute_s) > 1:
            rate = min(rate, mem_s_per_byte)
        mem = min(mem, rate * io)
    return float(np.max(launch_s, initial=0.0)) + mem + float(np.sum(compute_s))


class FallbackFusedEstimator:
    """The simple fused-op rule used until the GNN estimator lands.

    Every member's measured single-op time is split into a launch part, a memory part
    and a compute part (:func:`split_times`); the fused kernel launches once, moves only
    its own inputs and outputs and does all the members' compute
    (:func:`fallback_fused_time`). Its outputs, unless given, are the members read
    outside the group (:func:`hlo_tools.plan.group_outputs`). Reads of
    ``slice``/``dynamic-slice``/``gather`` count only the bytes of their result.

    Args:
        source: gives the :class:`NodeCosts` of a graph (``source.node_costs(graph)``),
            e.g. ``disco_estimator.costs.cost_model.CostModel``.
    """

    def __init__(self, source: NodeCostSource):
        self.source = source

    def predict(self, graph: DeviceGraph, members: Sequence[int],
                copies: Sequence[int] = (), outputs: Sequence[int] | None = None) -> float:
        """Seconds of one execution of the fused op (see :class:`FusedOpEstimator`)."""
        nodes = self.source.node_costs(graph)
        outs = list(group_outputs(graph, None, members)) if outputs is None else outputs
        return fallback_fused_time(nodes, members, copies, outs)

    def predict_batch(self, graph: DeviceGraph,
                      groups: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
        """Seconds for each ``(members, copies)`` group, shape ``[len(groups)]`` float64."""
        return np.array([self.predict(graph, m, c) for m, c in groups], dtype=np.float64)
