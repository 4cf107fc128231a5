"""The fusion space: the static facts about a graph that all of its plans share.

:func:`fusible_nodes` is the one rule of which nodes may join a fusion. A
:class:`FusionSpace` precomputes, once per graph, what the moves look up (distinct and
fusible operand lists, forbidden operand positions, compares and reduces) and caches what
they find (descendants of nodes and buckets, the C kernel's tables); :func:`_ar` gives its
all-reduce tables (:class:`_ArTables`).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hlo_tools.graph import DeviceGraph, NodeKind
from hlo_tools.opcodes import FUSED_OPERAND_POSITIONS, UNFUSIBLE_OPCODES

if TYPE_CHECKING:
    from collections.abc import Set


def fusible_nodes(graph: DeviceGraph, unfusible: Set[str] = UNFUSIBLE_OPCODES
                  ) -> tuple[bool, ...]:
    """Whether each node of ``graph`` may join a fusion group: the one rule of fusibility.

    Compute ops whose opcode is not in ``unfusible``, and constants; never parameters,
    collectives, control flow, custom-calls, side effects or tuple plumbing, nor a reduce
    or broadcast that is a reshape in disguise (see :func:`_reshape_in_disguise`).

    Args:
        graph: the per-device graph.
        unfusible: compute opcodes that are never fused (default:
            :data:`hlo_tools.opcodes.UNFUSIBLE_OPCODES`).

    Returns:
        ``[N]`` one flag per node.
    """
    return tuple(
        ((k == NodeKind.COMPUTE and op not in unfusible) or k == NodeKind.CONSTANT)
        and not _reshape_in_disguise(graph, i)
        for i, (k, op) in enumerate(zip(graph.kinds, graph.opcodes))
    )


class FusionSpace:
    """Static facts about a graph shared by all of its plans.

    Attributes:
        graph: the per-device graph.
        fusible: ``[N]`` whether a node may join a fusion group (:func:`fusible_nodes`).
        allreduces: the gradient all-reduces (the ones that may be combined), in print
            order; other all-reduces (the loss, statistics) stay alone, and so do
            one-element gradients (XLA:CPU's simplifier breaks their flat-buffer pieces,
            and they are too small to matter for bandwidth).
        ar_key: all-reduce node -> compatibility key (replica groups, reduction,
            element type, flags); only all-reduces with equal keys may share a bucket.
        grad_producer: all-reduce node -> node producing its operand.
        multi_output: whether a fusion group may have several outputs (the paper's
            non-duplicate fusion of a producer that has other users). Off by default:
            on jax/jaxlib 0.10.2 a tuple-shaped fusion written as HLO text aborts
            XLA:CPU's emitter (``Check failed: has_layout()``) and fails Shardy's sharding
            validation inside a shard_map body, so such producers are duplicated instead.
        shared_reduce_operands: whether a fused ``reduce`` may read a value computed in its
            fusion that has other users too. Off by default: XLA:CPU aborts on it.

    The attributes are read-only once built, except that ``allreduces``, ``ar_key`` and
    ``grad_producer`` may be reassigned (a subclass widening the combinable all-reduces
    does); the tables derived from them are then rebuilt on next use.
    """

    def __init__(self, graph: DeviceGraph, unfusible: frozenset[str] = UNFUSIBLE_OPCODES,
                 multi_output: bool = False,
                 fused_operand_positions: dict[str, frozenset[int]] | None = None,
                 shared_reduce_operands: bool = False):
        self.graph = graph
        self.multi_output = multi_output
        #: whether a fused reduce may read a fused value that has other users: on XLA:CPU
        #: such a shared, layout-less value aborts the emitter (vgg, plan_check seed 0)
        self.shared_reduce_operands = shared_reduce_operands
        self.fused_operand_positions = (FUSED_OPERAND_POSITIONS if fused_operand_positions
                                        is None else fused_operand_positions)
        self.n = graph.num_nodes
        self.operands = graph.operands
        self.users = graph.users
        self.fusible = fusible_nodes(graph, unfusible)
        self.allreduces = tuple(i for i in graph.gradient_allreduces
                                if graph.instruction(i).shape.num_elements > 1)
        self.ar_key = {i: _allreduce_key(graph, i) for i in self.allreduces}
        self.grad_producer = {i: graph.operands[i][0] for i in self.allreduces
                              if len(graph.operands[i]) == 1}
        self.compute_nodes = tuple(i for i in range(self.n) if self.fusible[i]
                                   and graph.kinds[i] == NodeKind.COMPUTE)
        self.root = graph.root
        fusible = self.fusible
        #: distinct operands of each node, in operand order
        self._dops = tuple(tuple(dict.fromkeys(ops)) for ops in graph.operands)
        #: distinct fusible operands of each node, in operand order
        self._fops = tuple(tuple(o for o in ops if fusible[o]) for ops in self._dops)
        #: operands each node may not read from inside its own fusion (or None)
        bad: list[frozenset[int] | None] = [None] * self.n
        for c, op in enumerate(graph.opcodes):
            allowed = self.fused_operand_positions.get(op)
            if allowed is not None:
                nodes = frozenset(o for k, o in enumerate(graph.operands[c]) if k not in allowed
                                  and not (op == "broadcast"
                                           and graph.kinds[o] == NodeKind.CONSTANT))
                bad[c] = nodes or None
            if op == "reduce" and not shared_reduce_operands:
                shared = frozenset(o for o in graph.operands[c] if len(graph.users[o]) > 1
                                   and graph.kinds[o] != NodeKind.CONSTANT)
                if shared:
                    bad[c] = (bad[c] or frozenset()) | shared
        self._bad = tuple(bad)
        self._any_bad = any(b is not None for b in bad)
        #: compare nodes (a compare may not read a duplicated copy: _compare_reads_copy)
        self._compare = tuple(op == "compare" for op in graph.opcodes)
        self._any_compare = any(self._compare)
        self._reduce = tuple(op == "reduce" for op in graph.opcodes)
        self._arange = np.arange(self.n, dtype=np.int32)
        self._descendants: dict[int, tuple[tuple[int, ...], bool]] = {}
        #: members of a bucket (``order`` bytes) -> their descendants (reach._bucket_descendants)
        self._buckets: dict[bytes, tuple | np.ndarray | None] = {}
        #: the C kernel and this space's tables for it, False without it (kernel._kernel)
        self._ks: tuple[Any, Any] | bool | None = None
        #: the kernel's all-reduce tables and the _ArTables they were made from
        self._kar: tuple[_ArTables, Any] | None = None
        #: like _buckets, as array('i') for the kernel (reach._descendants_i32)
        self._kbuckets: dict[bytes, array | None] = {}

    @property
    def allreduces(self) -> tuple[int, ...]:
        return self._allreduces

    @allreduces.setter
    def allreduces(self, value: tuple[int, ...]) -> None:
        self._allreduces = value
        self._ar_tables = None

    @property
    def ar_key(self) -> dict[int, tuple]:
        return self._ar_key

    @ar_key.setter
    def ar_key(self, value: dict[int, tuple]) -> None:
        self._ar_key = value
        self._ar_tables = None

    @property
    def grad_producer(self) -> dict[int, int]:
        return self._grad_producer

    @grad_producer.setter
    def grad_producer(self, value: dict[int, int]) -> None:
        self._grad_producer = value
        self._ar_tables = None


class _ArTables(NamedTuple):
    """Static all-reduce facts for combination moves (see
    :func:`~hlo_tools.plan.neighbours.allreduce_neighbours`)."""

    members: frozenset[int]  # the combinable all-reduces
    index: dict[int, int]  # all-reduce -> its index in space.allreduces
    rank: dict[int, int]  # all-reduce -> node whose position ranks it (its producer)
    by_rank: list  # [N] all-reduces ranked by a node, in space.allreduces order, or None
    rank_nodes: tuple[int, ...]
    is_allreduce: bytes  # [N] whether a node is an all-reduce
    key: dict[int, int]  # all-reduce -> id of its compatibility key
    skip_buckets: bool  # no rank node is an all-reduce: buckets hold none
    in_order: bool  # space.allreduces is ascending


def _ar(space: FusionSpace) -> _ArTables:
    """The space's :class:`_ArTables`, made on first use (and again after ``allreduces``,
    ``ar_key`` or ``grad_producer`` were reassigned)."""
    tables = space._ar_tables
    if tables is None:
        ars = space.allreduces
        rank = {b: space.grad_producer.get(b, b) for b in ars}
        by_rank: list = [None] * space.n
        for b in ars:
            r = rank[b]
            by_rank[r] = (by_rank[r] or ()) + (b,)
        ids: dict[tuple, int] = {}
        opcodes = space.graph.opcodes
        tables = space._ar_tables = _ArTables(
            frozenset(ars), {b: k for k, b in enumerate(ars)}, rank, by_rank,
            tuple(dict.fromkeys(rank.values())),
            bytes(op == "all-reduce" for op in opcodes),
            {b: ids.setdefault(space.ar_key[b], len(ids)) for b in ars},
            all(opcodes[r] != "all-reduce" for r in rank.values()),
            list(ars) == sorted(ars))
    return tables


def _reshape_in_disguise(graph: DeviceGraph, node: int) -> bool:
    """A reduce over size-1 dimensions or a broadcast adding only size-1 dimensions.

    XLA's simplifier turns these into reshapes, and inside a hand-written fusion (which
    has no layouts yet) that leaves a fused computation whose shape no longer matches
    its fusion: the compile fails. They are as unfusible as reshapes."""
    if graph.opcodes[node] not in ("reduce", "broadcast") or not graph.operands[node]:
        return False
    result = graph.instruction(node).shape
    operand = graph.instruction(graph.operands[node][0]).shape
    return result.is_array and operand.is_array and result.num_elements == operand.num_elements


def _allreduce_key(graph: DeviceGraph, node: int) -> tuple:
    """What two all-reduces must share to share a bucket: replica groups, device ids,
    channel, reduction, element types and operand count."""
    instr = graph.instruction(node)
    attrs = instr.attrs
    reducer = graph.module.computation(instr.called_computations[0])
    return (
        attrs.get("replica_groups", ""),
        attrs.get("use_global_device_ids", ""),
        "channel_id" in attrs,
        reducer.root.opcode,
        tuple(leaf.element_type for leaf in instr.shape.leaves()),
        len(graph.operands[node]),
    )
