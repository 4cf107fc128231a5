"""Plans: op fusion, duplicate fusion and AllReduce combination over an immutable graph.

A :class:`Plan` partitions the nodes of a :class:`~hlo_tools.graph.DeviceGraph` into
*groups*. A group of compute nodes becomes one ``fusion`` instruction; a group of
all-reduce nodes becomes one variadic ``all-reduce`` (a *bucket*); singletons stay as
they are. A plan also records *duplicated producers*: ``(p, g)`` means group ``g``
holds its own copy of producer ``p`` while the original ``p`` still serves its other
users (DisCo's duplicate fusion, section 2.2 of the paper).

Every plan keeps a topological order of its group-contracted graph in which each group
is contiguous. That order makes the cycle check of a merge local: a path between two
groups can only pass through nodes placed between them, so only that *window* is
searched (never a walk of the whole graph), and it is also the schedule in which
:func:`hlo_tools.rewrite.apply_plan` prints the module.

Plans are immutable values (``array`` copies cost well under a microsecond per thousand
nodes), so the search can keep thousands of them and derive neighbours cheaply. All
plan functions take a :class:`FusionSpace`, the static facts about the graph that every
plan of it shares.

Speed (a search applies tens of thousands of moves): everything static is precomputed
in the :class:`FusionSpace` (distinct and fusible operand lists, forbidden operand
positions, all-reduce rank tables, descendants); each plan carries private facts its
moves keep up to date instead of recomputing (an index of its copies, the gradient
producers in schedule order); a group's members are read off the contiguous run of
``order`` around it; the usual reasons to refuse a move are checked first; a merge
rewrites only its window (slices of the three arrays, positions renumbered with numpy
when the window is long; adjacent groups keep the arrays); and the groups a bucket reaches
come from the graph's static descendants (cached per bucket, their positions sorted in C
and cut into runs by bisection). Plans also carry, for all-reduce moves, their rank nodes
in schedule order and the all-reduces each fused group ranks (:class:`_ArState`); long
runs (buckets) are measured by galloping; a plan made by duplication builds its copy index
only when it is moved from; random draws skip ``random.Random``'s method layers while
drawing the very same numbers (:func:`_chooser`). The moves decide exactly what the
original, straightforward implementation decided, down to the random draws and the
iteration order of ``dups`` (``tests/test_plan.py`` checks this against fingerprints
recorded from it).

The tries of the three moves and the arrays of their merges run in a C kernel
(``_plan_kernel.c``, a CPython extension built with the system C compiler on first use,
see :mod:`hlo_tools._plan_kernel`) when it can be built: it makes the same draws through
the rng's own ``getrandbits`` and the same decisions as the Python code here, which stays
the reference and runs otherwise (or with ``DISCO_PLAN_BACKEND=python``); it calls back
that code for the rare cases it leaves to it (groups holding copies), and the Python code
keeps the plans' private facts (copy index, all-reduce state, ``dups``). The tests run
both.
"""

from __future__ import annotations

import random
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import accumulate, chain
from operator import sub
from typing import Any, NamedTuple

import numpy as np

from hlo_tools import _plan_kernel
from hlo_tools.graph import DeviceGraph, NodeKind
from hlo_tools.opcodes import FUSED_OPERAND_POSITIONS, UNFUSIBLE_OPCODES

__all__ = [
    "Decision",
    "FusionSpace",
    "Plan",
    "initial_plan",
    "members",
    "dead_groups",
    "copy_readers",
    "group_outputs",
    "group_operands",
    "group_users",
    "can_fuse",
    "can_duplicate",
    "can_combine",
    "fuse",
    "duplicate",
    "combine",
    "op_fusion_move",
    "duplicate_fusion_move",
    "allreduce_move",
    "random_moves",
    "random_plan",
    "UNFUSIBLE_OPCODES",
    "c_kernel_available",
]

#: Likewise a fused ``reduce`` may not read a value computed in its fusion if that value
#: has other users too (see ``FusionSpace.shared_reduce_operands``).


class Decision(NamedTuple):
    """A legality answer that carries its reason (truthy when legal)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


LEGAL = Decision(True, "legal")
#: Refusals of a duplicate move (made once: the move often refuses).
_NO_OTHER_USERS = Decision(False, "producer has no other users: use plain fusion")
_EXPOSES_MEMBER = Decision(False, "the copy would read a value inside another fusion, giving "
                           "that fusion a second output (multi-output fusion is disabled)")
_LAYOUT_UNSAFE = Decision(False, "the consumer reads the producer at an operand position this "
                          "backend cannot fuse (e.g. a select's on-true/on-false value)")

_COMPARES_COPY = Decision(False, "a compare in the fusion would read a duplicated copy (or a "
                          "value computed from one): a copy recomputed inside a fusion may "
                          "differ from the original in the last bit (XLA:CPU contracts a "
                          "multiply and an add into one FMA there), and a compare of the two "
                          "versions can take the other branch")

# Where the work of a merge moves from Python loops to numpy (the results are the same).
_I32 = np.dtype(np.int32)
#: Windows longer than this are renumbered with numpy.
_NUMPY_WINDOW = 24
#: With more reached groups than this, a merge partitions its window node by node, with
#: numpy when the window is longer than _PYTHON_PARTITION.
_NUMPY_GROUPS = 12
_PYTHON_PARTITION = 160
#: Above this many descendants to look up, :func:`_descendant_groups` uses numpy.
_NUMPY_DESCENDANTS = 256
#: How many buckets' descendants a space keeps (it forgets them all when full).
_BUCKET_CACHE = 512


class FusionSpace:
    """Static facts about a graph shared by all of its plans.

    Attributes:
        graph: the per-device graph.
        fusible: ``[N]`` whether a node may join a fusion group (compute ops and
            constants; never parameters, collectives, control flow, custom-calls,
            side effects, tuples or the opcodes in :data:`UNFUSIBLE_OPCODES`).
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
        self.fusible = tuple(
            ((k == NodeKind.COMPUTE and op not in unfusible) or k == NodeKind.CONSTANT)
            and not _reshape_in_disguise(graph, i)
            for i, (k, op) in enumerate(zip(graph.kinds, graph.opcodes))
        )
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
                nodes = frozenset(o for k, o in enumerate(graph.operands[c]) if k not in allowed)
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
        #: members of a bucket (``order`` bytes) -> their descendants (_bucket_descendants)
        self._buckets: dict[bytes, tuple | np.ndarray | None] = {}
        #: the C kernel and this space's tables for it, False without it (see _kernel)
        self._ks: tuple[Any, Any] | bool | None = None
        #: the kernel's all-reduce tables and the _ArTables they were made from
        self._kar: tuple[_ArTables, Any] | None = None
        #: like _buckets, as array('i') for the kernel (_descendants_i32)
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
    """Static all-reduce facts for combination moves (see :func:`allreduce_neighbours`)."""

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


class _PlanFields(NamedTuple):
    order: array
    pos: array
    group: array
    dups: frozenset[tuple[int, int]] = frozenset()


class Plan(_PlanFields):
    """One candidate strategy: groups, duplicated producers and the schedule.

    Attributes:
        order: ``[N]`` node indices in a topological order of the group-contracted
            graph, every group contiguous.
        pos: ``[N]`` inverse of ``order`` (``order[pos[i]] == i``).
        group: ``[N]`` group id of each node: the smallest node index in its group.
        dups: ``(producer, group id)`` pairs: the group holds a copy of the producer.

    A plan is an immutable 4-tuple of these fields. Plans made by this module also carry
    private derived facts that moves keep up to date instead of recomputing (an index of
    ``dups``, see :func:`_index`; the producers of the gradients in schedule order; flags);
    they are not part of its value: a plan made otherwise, copied or unpickled works the
    same, the facts being rebuilt on first use.
    """

    def __reduce__(self):
        return Plan, tuple(self)

    def key(self) -> tuple[bytes, frozenset]:
        """A hashable identity: the partition and the duplicates (not the schedule)."""
        return self.group.tobytes(), self.dups

    def groups(self) -> dict[int, list[int]]:
        """Group id -> members in schedule order, for every group that rewrites something:
        two or more members, or a copy of a duplicated producer."""
        out: dict[int, list[int]] = {}
        for node in self.order:
            out.setdefault(self.group[node], []).append(node)
        with_copies = {g for _, g in self.dups}
        return {g: ms for g, ms in out.items() if len(ms) > 1 or g in with_copies}

    @property
    def num_groups(self) -> int:
        return sum(1 for i, g in enumerate(self.group) if i == g)


_new_tuple = tuple.__new__
#: The index of a plan without duplicates; its dicts are never modified.
_NO_COPIES: tuple[dict, dict] = ({}, {})


def _plan(order: array, pos: array, group: array, dups: frozenset,
          index: tuple[dict, dict] | _AddedCopy, single: bool, ar_state: _ArState | None,
          stable: bool = False) -> Plan:
    """A new plan with its private attributes: the copy index (see :func:`_index`), the
    single-output flag (:func:`_single_output`), the all-reduce state (:func:`_ar_state`)
    and whether ``dups`` is stable (:func:`_merged_dups`)."""
    plan = _new_tuple(Plan, (order, pos, group, dups))
    plan._ix = index
    plan._single = single
    plan._stable = stable
    if ar_state is not None:
        plan._ars = ar_state
    return plan


def _single_output(plan: Plan) -> bool:
    """Whether every fusion group of ``plan`` was built by this module's moves under the
    single-output rules (``multi_output=False``): each group then has at most one member
    whose value leaves it, and every member reaches that one. Group-level reachability is
    then node-level reachability, which :func:`_combine_plan` uses. False for plans made
    in another way (or with multi-output fusions)."""
    return getattr(plan, "_single", False)


class _AddedCopy(NamedTuple):
    """The copy index of a plan made by :func:`_with_copy`, not built yet: the index of the
    plan it was made from and the copy it added (many such plans are never moved from)."""

    index: tuple[dict, dict]
    producer: int
    gid: int

    def build(self) -> tuple[dict, dict]:
        held, holders = self.index
        held, holders = dict(held), dict(holders)
        held[self.gid] = held.get(self.gid, ()) + (self.producer,)
        holders[self.producer] = holders.get(self.producer, ()) + (self.gid,)
        return held, holders


def _index(plan: Plan) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """The plan's copy index: (group -> producers it holds copies of, producer -> groups
    holding a copy of it). The tuples are in no particular order."""
    try:
        index = plan._ix
    except AttributeError:
        pass
    else:
        if index.__class__ is _AddedCopy:
            index = plan._ix = index.build()
        return index
    held: dict[int, tuple[int, ...]] = {}
    holders: dict[int, tuple[int, ...]] = {}
    for p, g in plan.dups:
        held[g] = held.get(g, ()) + (p,)
        holders[p] = holders.get(p, ()) + (g,)
    index = (held, holders) if held else _NO_COPIES
    try:
        plan._ix = index
    except AttributeError:  # not a Plan instance
        pass
    return index


def initial_plan(graph: DeviceGraph) -> Plan:
    """The plan that changes nothing: every node its own group, print order."""
    n = graph.num_nodes
    order = array("i", range(n))
    return _plan(order, array("i", order), array("i", order), frozenset(), _NO_COPIES, True, None)


def _span(plan: Plan, gid: int) -> tuple[int, int]:
    """Positions ``[start, end)`` of group ``gid``'s run in ``plan.order``."""
    order, group = plan.order, plan.group
    p = plan.pos[gid]
    n = len(order)
    s = p if not p or group[order[p - 1]] != gid else _run_edge(order, group, gid, p - 1, -1)
    e = p + 1 if p + 1 == n or group[order[p + 1]] != gid else _run_edge(order, group, gid,
                                                                         p + 1, n) + 1
    return s, e


def _run_edge(order: array, group: array, gid: int, inside: int, outside: int) -> int:
    """The last position of group ``gid``'s run from position ``inside`` (in the run)
    towards ``outside`` (-1 or ``len(order)``): runs are contiguous, so membership along
    the way is monotone, and galloping then bisecting takes O(log length) steps (buckets
    are long)."""
    step = 1 if outside > inside else -1
    while True:  # gallop
        probe = inside + step
        if (probe >= outside) if step > 0 else (probe <= outside):
            probe = outside
            break
        if group[order[probe]] != gid:
            break
        inside = probe
        step *= 2
    while abs(probe - inside) > 1:  # bisect: inside is in the run, probe is not
        mid = (inside + probe) // 2
        if group[order[mid]] == gid:
            inside = mid
        else:
            probe = mid
    return inside


def _alone(plan: Plan, node: int) -> bool:
    """Whether ``node`` is the only member of its group."""
    order, group = plan.order, plan.group
    g, p = group[node], plan.pos[node]
    return ((not p or group[order[p - 1]] != g)
            and (p + 1 == len(order) or group[order[p + 1]] != g))


def members(plan: Plan, gid: int) -> list[int]:
    """Members of group ``gid`` in schedule order (a contiguous run of ``plan.order``)."""
    s, e = _span(plan, gid)
    return plan.order[s:e].tolist()


def _copies(plan: Plan, index: tuple[dict, dict], gid: int):
    """Producers copied into group ``gid``, iterated in the order of the set
    ``{p for p, g in plan.dups if g == gid}`` (candidate lists follow it, and so does
    the random pick among them)."""
    held = index[0].get(gid)
    if held is None or len(held) == 1:
        return held or ()
    if len(held) <= 4 and len({p & 7 for p in held}) == len(held):
        return set(held)  # no collisions in a set's first table: insertion order is moot
    return {p for p, g in plan.dups if g == gid}


def _outside_operands(space: FusionSpace, plan: Plan, index: tuple[dict, dict], gid: int,
                      s: int, e: int, table: tuple[tuple[int, ...], ...]):
    """Distinct nodes outside group ``gid`` (span ``s:e``) that it reads, among those listed
    by ``table`` (distinct operands, or fusible ones), in the order members and copies read
    them; copies count as inside."""
    order, group = plan.order, plan.group
    copies = _copies(plan, index, gid)
    if e - s == 1 and not copies:
        return table[order[s]]
    seen: set[int] = set()
    out: list[int] = []
    for m in (*order[s:e], *copies):
        for o in table[m]:
            if o not in seen and group[o] != gid and o not in copies:
                seen.add(o)
                out.append(o)
    return out


def group_operands(space: FusionSpace, plan: Plan, gid: int) -> list[int]:
    """Nodes outside group ``gid`` whose values the group reads (copies count as inside)."""
    s, e = _span(plan, gid)
    return list(_outside_operands(space, plan, _index(plan), gid, s, e, space._dops))


def _successors(space: FusionSpace, plan: Plan, index: tuple[dict, dict], gid: int,
                s: int, e: int) -> set[int]:
    """Groups that read a value of group ``gid`` (span ``s:e``): through its members'
    users (except groups holding their own copy of the member) and through copies that
    read a member."""
    order, group, users = plan.order, plan.group, space.users
    holders = index[1]
    out: set[int] = set()
    if not holders:
        for m in order[s:e]:
            for u in users[m]:
                gu = group[u]
                if gu != gid:
                    out.add(gu)
        return out
    for m in order[s:e]:
        own = holders.get(m, ())
        for u in users[m]:
            gu = group[u]
            if gu != gid and gu not in own:
                out.add(gu)
            for g in holders.get(u, ()):
                if g != gid and g not in own:
                    out.add(g)
    return out


def group_users(space: FusionSpace, plan: Plan, gid: int) -> set[int]:
    """Group ids that read a value of group ``gid``: through its members' users (except
    groups that hold their own copy of the member) and through copies of duplicated
    producers that read a member."""
    s, e = _span(plan, gid)
    return _successors(space, plan, _index(plan), gid, s, e)


def copy_readers(graph: DeviceGraph, plan: Plan) -> dict[int, set[int]]:
    """Node -> the groups that hold a copy of a producer reading the node (a copy reads its
    producer's operands from inside the group that holds it)."""
    readers: dict[int, set[int]] = {}
    for p, g in plan.dups:
        for o in graph.operands[p]:
            readers.setdefault(o, set()).add(g)
    return readers


def group_outputs(graph: DeviceGraph, plan: Plan | None, members: Sequence[int],
                  readers: dict[int, set[int]] | None = None) -> tuple[int, ...]:
    """Members of a fusion group whose values leave it: the outputs of its fusion.

    The one rule of "which members are read outside their group": a member is an output
    when it is the graph's root, when a node outside the group reads it and that node's
    group holds no copy of it, or when a copy held by another group reads it. Without a
    plan (``plan=None``) there are no copies and the group is ``members``.

    Args:
        graph: the per-device graph.
        plan: the plan the group belongs to, or None.
        members: the group's members.
        readers: :func:`copy_readers` of ``plan`` (computed when None).
    """
    users, root = graph.users, graph.root
    if plan is None:
        inside = set(members)
        return tuple(m for m in members
                     if m == root or any(u not in inside for u in users[m]))
    group, dups = plan.group, plan.dups
    if readers is None:
        readers = copy_readers(graph, plan)
    gid = group[members[0]]

    def leaves(m: int) -> bool:
        if m == root or any(h != gid and (m, h) not in dups for h in readers.get(m, ())):
            return True
        return any(group[u] != gid and (m, group[u]) not in dups for u in users[m])

    return tuple(m for m in members if leaves(m))


def dead_groups(space: FusionSpace, plan: Plan) -> set[int]:
    """Compute groups whose values nobody reads any more, because every user now holds its
    own copy (duplicate fusion). XLA deletes them, so :func:`~hlo_tools.rewrite.apply_plan`
    leaves them out and the cost model does not charge them."""
    graph, group = space.graph, plan.group
    if not plan.dups:
        return set()
    readers: dict[int, set[int]] = {}
    for node in range(space.n):
        for u in space.users[node]:
            if group[u] != group[node] and (node, group[u]) not in plan.dups:
                readers.setdefault(group[node], set()).add(group[u])
    for p, g in plan.dups:
        for o in space.operands[p]:
            if group[o] != g and (o, g) not in plan.dups:
                readers.setdefault(group[o], set()).add(g)
    root_group = group[graph.root]
    dead: set[int] = set()
    changed = True
    while changed:
        changed = False
        for gid in {group[p] for p, _ in plan.dups} | {group[o] for g in dead
                                                        for o in group_operands(space, plan, g)}:
            if gid in dead or gid == root_group or not space.fusible[gid]:
                continue
            if not (readers.get(gid, set()) - dead):
                dead.add(gid)
                changed = True
    return dead


# --------------------------------------------------------------------------- legality


def can_fuse(space: FusionSpace, plan: Plan, producer: int, consumer: int) -> Decision:
    """Whether the group of ``producer`` may be fused into the group of ``consumer``.

    Legal when both are fusible compute groups, the producer's group feeds the
    consumer's group, and merging them creates no cycle (no other path from the
    producer group to the consumer group).
    """
    gp, gc = plan.group[producer], plan.group[consumer]
    if gp == gc:
        return Decision(False, "already in the same group")
    for node, role in ((producer, "producer"), (consumer, "consumer")):
        if not space.fusible[node]:
            return _unfusible(space, node, role)
    index = _index(plan)
    sp, ep = _span(plan, gp)
    users = _successors(space, plan, index, gp, sp, ep)
    if gc not in users:
        return Decision(False, "producer group does not feed the consumer group")
    sc, ec = _span(plan, gc)
    if not _layout_safe(space, plan, index, gp, sp, ep, gc, sc, ec):
        return _LAYOUT_UNSAFE
    if not space.multi_output:
        if len(users) > 1 or plan.group[space.root] == gp:
            return Decision(False, "producer has users outside the consumer group: that "
                            "needs a multi-output fusion (disabled on this backend; "
                            "duplicate the producer instead)")
    elif _window_reach(space, plan, index, gp, users, gc, sc) is None:
        return Decision(False, "fusing would create a cycle (another path joins them)")
    if space._any_compare and _compare_reads_copy(space, plan, index, gp, sp, ep, gc, sc, ec):
        return _COMPARES_COPY
    return LEGAL


def _layout_safe(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ga: int, sa: int,
                 ea: int, gb: int, sb: int, eb: int, extra: int | None = None) -> bool:
    """Whether no node of a would-be fusion of groups ``ga`` (span ``sa:ea``) and ``gb``
    (members, copies and ``extra``) reads another one at an operand position XLA:CPU
    cannot fuse (:data:`FUSED_OPERAND_POSITIONS`)."""
    if not space._any_bad:
        return True
    bad, order, held = space._bad, plan.order, index[0]
    nodes = [*order[sa:ea], *held.get(ga, ()), *order[sb:eb]]
    if gb != ga:
        nodes += held.get(gb, ())
    if extra is not None:
        nodes.append(extra)
    if all(bad[c] is None for c in nodes):
        return True
    inside = set(nodes)
    return all(bad[c] is None or bad[c].isdisjoint(inside) for c in inside)


def _compare_reads_copy(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ga: int,
                        sa: int, ea: int, gb: int, sb: int, eb: int,
                        extra: int | None = None) -> bool:
    """Whether a compare in a would-be fusion of groups ``ga`` (span ``sa:ea``) and ``gb``
    (members, their copies and ``extra``, a new copy) reads a copy, directly or through
    values computed from one inside the fusion.

    A copy is a second version of its producer's value, computed in another kernel: on
    XLA:CPU a fused ``y - x * x`` is one FMA, the unfused original two roundings. Where a
    compare sets the two versions against each other (jax's gradient of ``max`` compares
    ``x`` with ``max(x, 0)``; LayerNorm's variance is such an ``x``), a last-bit difference
    becomes another branch and a different gradient (reformer, plan_check seed 63)."""
    held = index[0]
    copies = [*held.get(ga, ()), *(held.get(gb, ()) if gb != ga else ())]
    if extra is not None:
        copies.append(extra)
    if not copies:
        return False
    is_compare, dops = space._compare, space._dops
    nodes = [*plan.order[sa:ea], *(plan.order[sb:eb] if gb != ga else ()), *copies]
    if not any(is_compare[c] for c in nodes):
        return False
    inside = set(nodes)
    tainted = {c for c in copies if space._reduce[c] or not inside.isdisjoint(dops[c])}
    if not tainted:
        return False
    grew = True
    while grew:
        grew = False
        for c in nodes:
            if c not in tainted and any(o in tainted for o in dops[c]):
                tainted.add(c)
                grew = True
    return any(is_compare[c] and any(o in tainted for o in dops[c]) for c in nodes)


def _unfusible(space: FusionSpace, node: int, role: str) -> Decision:
    kind = space.graph.kinds[node]
    op = space.graph.opcodes[node]
    if kind == NodeKind.PARAMETER:
        return Decision(False, f"{role} is a parameter: parameters are never fused")
    if kind == NodeKind.COLLECTIVE:
        return Decision(False, f"{role} is a collective ({op}): never fused")
    if kind == NodeKind.CONTROL_FLOW:
        return Decision(False, f"{role} is control flow ({op}): never fused across or into")
    if kind == NodeKind.CUSTOM_CALL:
        return Decision(False, f"{role} is a custom-call: opaque, never fused")
    if kind == NodeKind.SIDE_EFFECT:
        return Decision(False, f"{role} has side effects ({op}): never fused")
    if kind == NodeKind.PLUMBING:
        return Decision(False, f"{role} is tuple plumbing ({op}): never fused")
    return Decision(False, f"{role} opcode {op} is not fusible on this backend")


def can_duplicate(space: FusionSpace, plan: Plan, producer: int, consumer: int) -> Decision:
    """Whether ``producer`` may be copied into the group of ``consumer``.

    The producer must be an unfused (singleton) fusible compute op or constant that
    the consumer group reads and that also has users outside that group; duplicating
    never creates a cycle (the copy reads only what the producer already reads).
    """
    gc = plan.group[consumer]
    if not space.fusible[producer]:
        return _unfusible(space, producer, "producer")
    if not space.fusible[consumer]:
        return _unfusible(space, consumer, "consumer")
    if plan.group[producer] == gc:
        return Decision(False, "producer is already in the consumer group")
    if not _alone(plan, producer):
        return Decision(False, "only unfused producers are duplicated")
    if (producer, gc) in plan.dups:
        return Decision(False, "the consumer group already holds a copy of the producer")
    index = _index(plan)
    sc, ec = _span(plan, gc)
    if producer not in _outside_operands(space, plan, index, gc, sc, ec, space._dops):
        return Decision(False, "the consumer group does not read the producer")
    return _duplicate_rest(space, plan, index, producer, gc, sc, ec)


def _duplicate_rest(space: FusionSpace, plan: Plan, index: tuple[dict, dict], producer: int,
                    gc: int, sc: int, ec: int) -> Decision:
    """The last checks of :func:`can_duplicate` (layout, other users, exposed values)."""
    if not space._any_bad:
        pass
    elif ec - sc == 1 and gc not in index[0]:  # _layout_safe of two single nodes
        bad = space._bad[plan.order[sc]]
        if bad is not None and producer in bad:
            return _LAYOUT_UNSAFE
    elif not _layout_safe(space, plan, index, gc, sc, ec, gc, sc, sc, producer):
        return _LAYOUT_UNSAFE
    group, holders = plan.group, index[1]
    own = holders.get(producer, ())
    for u in space.users[producer]:
        gu = group[u]
        if gu != gc and gu not in own:
            break
    else:
        return _NO_OTHER_USERS
    if not space.multi_output and _exposes_member(space, plan, index, producer, gc):
        return _EXPOSES_MEMBER
    if space._any_compare and _compare_reads_copy(space, plan, index, gc, sc, ec, gc, sc, sc,
                                                  producer):
        return _COMPARES_COPY
    return LEGAL


def _exposes_member(space: FusionSpace, plan: Plan, index: tuple[dict, dict], producer: int,
                    gc: int) -> bool:
    """Whether a copy of ``producer`` in group ``gc`` would read an operand that is not yet
    an output of its (multi-node) group."""
    group, holders = plan.group, index[1]
    for o in space._dops[producer]:
        if group[o] == gc or gc in holders.get(o, ()) or _alone(plan, o):
            continue
        if not _is_read_outside(space, plan, index, o):
            return True
    return False


def _is_read_outside(space: FusionSpace, plan: Plan, index: tuple[dict, dict],
                     node: int) -> bool:
    """Whether ``node``'s value leaves its group (a user elsewhere, a copy elsewhere that
    reads it, or the program root)."""
    if node == space.root:
        return True
    group, holders = plan.group, index[1]
    g = group[node]
    own = holders.get(node, ())
    for u in space.users[node]:
        gu = group[u]
        if gu != g and gu not in own:
            return True
        for h in holders.get(u, ()):
            if h != g and h not in own:
                return True
    return False


def can_combine(space: FusionSpace, plan: Plan, a: int, b: int) -> Decision:
    """Whether the buckets of all-reduces ``a`` and ``b`` may become one bucket.

    Both must be all-reduces with the same replica groups, reduction and element
    type; they must be neighbours (see :func:`allreduce_neighbours`); and neither
    bucket may depend on the other (that would be a cycle).
    """
    ga, gb = plan.group[a], plan.group[b]
    if ga == gb:
        return Decision(False, "already in the same bucket")
    tables = _ar(space)
    if a not in tables.members or b not in tables.members:
        return Decision(False, "only gradient all-reduces of more than one element are "
                        "combined")
    if tables.key[a] != tables.key[b]:
        return Decision(False, "all-reduces differ in replica groups, reduction or type")
    if _combine_plan(space, plan, _index(plan), ga, gb) is None:
        return Decision(False, "one bucket depends on the other (would create a cycle)")
    return LEGAL


def _combine_plan(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ga: int,
                  gb: int) -> Plan | None:
    """The plan with buckets ``ga`` and ``gb`` merged, or None if one depends on the other.

    The groups between them that the earlier bucket reaches are found from the static
    node-level descendants of its members when that is exact (see
    :func:`_descendant_groups`), else by a walk of the window."""
    first, second = (ga, gb) if plan.pos[ga] < plan.pos[gb] else (gb, ga)
    s1, e1 = _span(plan, first)
    s2, e2 = _span(plan, second)
    return _combine_spans(space, plan, index, first, s1, e1, second, s2, e2)


def _combine_spans(space: FusionSpace, plan: Plan, index: tuple[dict, dict], first: int,
                   s1: int, e1: int, second: int, s2: int, e2: int) -> Plan | None:
    """:func:`_combine_plan` given the buckets in schedule order and their spans."""
    single = _single_output(plan)
    reached = _descendant_groups(space, plan, first, s1, e1, s2, e2) if single else _WALK
    if reached is _WALK:
        succ = _successors(space, plan, index, first, s1, e1)
        reached = None if second in succ else _window_reach(space, plan, index, first, succ,
                                                            second, s2)
    if reached is None:
        return None
    return _merge_runs(space, plan, index, first, s1, e1, second, s2, e2, reached, single)


#: :func:`_descendant_groups` cannot answer: walk the window instead.
_WALK = object()


def _descendants(space: FusionSpace, node: int) -> tuple[tuple[int, ...], bool]:
    """Every node reachable from ``node`` in the graph, and whether an all-reduce is among
    them (cached on the space)."""
    found = space._descendants.get(node)
    if found is None:
        users, seen, stack = space.users, set(), [node]
        while stack:
            for u in users[stack.pop()]:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        opcodes = space.graph.opcodes
        found = space._descendants[node] = (
            tuple(sorted(seen)), any(opcodes[u] == "all-reduce" for u in seen))
    return found


def _descendant_groups(space: FusionSpace, plan: Plan, first: int, s1: int, e1: int, s2: int,
                       e2: int):
    """For a single-output plan (:func:`_single_output`), the groups scheduled between group
    ``first`` (span ``s1:e1``) and position ``s2`` that ``first`` reaches (their runs as
    :class:`_Runs`, or an array of group ids with repeats), or None if it reaches the group
    at ``s2:e2``.

    A path between groups enters a fusion group anywhere and leaves it by its one output,
    which every member reaches; so a group reaches another exactly when one of its members
    reaches one of the other's in the graph, copies notwithstanding (a copy reads what its
    producer reads). Only buckets have several outputs, so when a member of ``first``
    reaches an all-reduce this answers :data:`_WALK`."""
    order, pos, group = plan.order, plan.pos, plan.group
    nodes = _bucket_descendants(space, order[s1:e1])
    if nodes is None:
        return _WALK
    if len(nodes) <= _NUMPY_DESCENDANTS or pos.itemsize != 4 or group.itemsize != 4:
        # their positions, distinct and sorted (in C); those in the window form a slice
        at = sorted(set(map(pos.__getitem__, nodes)))
        i = bisect_left(at, e1)
        j = bisect_left(at, s2, i)
        if j < len(at) and at[j] < e2:
            return None
        return _runs_at(plan, at[i:j])
    if not isinstance(nodes, np.ndarray):
        nodes = np.array(nodes, np.int32)
        space._buckets[order[s1:e1].tobytes()] = nodes
    at = np.frombuffer(pos, _I32)[nodes]
    if ((at >= s2) & (at < e2)).any():
        return None
    return np.frombuffer(group, _I32)[nodes[(at >= e1) & (at < s2)]]


def _bucket_descendants(space: FusionSpace, members: array) -> tuple | np.ndarray | None:
    """The descendants of ``members`` (with repeats; an int32 array once numpy has looked
    them up), or None if one is an all-reduce. Cached on the space by members: a bucket is
    often merged again, from the same plan or others."""
    key = members.tobytes()
    found = space._buckets.get(key, False)
    if found is False:
        parts = [_descendants(space, m) for m in members]
        found = None if any(through for _, through in parts) else tuple(
            chain.from_iterable(nodes for nodes, _ in parts))
        if len(space._buckets) >= _BUCKET_CACHE:
            space._buckets.clear()
        space._buckets[key] = found
    return found


class _Runs(list):
    """Sorted, disjoint ``(start, end)`` position ranges, each a run of whole groups, and
    adjacent ranges joined: the groups a merge moves, as :func:`_merge_runs` takes them."""


def _runs_at(plan: Plan, at: list[int]) -> _Runs:
    """The runs of the groups at positions ``at`` (sorted, distinct), which lie strictly
    between two other groups' runs, as :class:`_Runs`."""
    runs = _Runs()
    # at[k] - k is the same along a range of consecutive positions and grows at each gap,
    # so the ranges are found by bisection (in C) rather than position by position
    steps = list(map(sub, at, range(len(at))))
    k = 0
    while k < len(at):
        m = bisect_right(steps, steps[k], k)
        _add_run(plan, runs, at[k], at[m - 1] + 1)
        k = m
    return runs


def _add_run(plan: Plan, runs: _Runs, s: int, e: int) -> None:
    """Appends to ``runs`` the positions ``s:e`` widened to whole groups (the first and last
    group may stick out), joined with the last run if they touch."""
    order, group = plan.order, plan.group
    g = group[order[s]]
    while group[order[s - 1]] == g:  # (a group between two others never starts the order)
        s -= 1
    g = group[order[e - 1]]
    while group[order[e]] == g:
        e += 1
    if runs and runs[-1][1] >= s:
        runs[-1] = (runs[-1][0], e)
    else:
        runs.append((s, e))


def _window_reach(space: FusionSpace, plan: Plan, index: tuple[dict, dict], src: int,
                  succ: set[int], dst: int, limit: int) -> dict[int, tuple[int, int]] | None:
    """The groups reachable from group ``src`` (whose successors are ``succ``) that are
    scheduled before position ``limit`` (the start of group ``dst``), with their spans;
    None if one of them reaches ``dst``. Only that window is visited: in a topological
    order a path from ``src`` to ``dst`` cannot leave it."""
    pos = plan.pos
    stack = [g for g in succ if g != dst and pos[g] < limit]
    seen = set(stack)
    seen.add(src)
    reached: dict[int, tuple[int, int]] = {}
    while stack:
        g = stack.pop()
        s, e = reached[g] = _span(plan, g)
        for h in _successors(space, plan, index, g, s, e):
            if h == dst:
                return None
            if h not in seen and pos[h] < limit:
                seen.add(h)
                stack.append(h)
    return reached


# --------------------------------------------------------------------------- rewrites


def _merge(space: FusionSpace, plan: Plan, first: int, second: int, single: bool) -> Plan:
    """Merges group ``first`` (scheduled earlier) with group ``second``.

    The window between them is re-ordered as [not reachable from ``first``] +
    [merged group] + [reachable from ``first``], which keeps a topological order.
    """
    index = _index(plan)
    s1, e1 = _span(plan, first)
    s2, e2 = _span(plan, second)
    succ = _successors(space, plan, index, first, s1, e1)
    succ.discard(second)
    reached = _window_reach(space, plan, index, first, succ, -1, s2)
    return _merge_runs(space, plan, index, first, s1, e1, second, s2, e2, reached, single)


def _merge_runs(space: FusionSpace, plan: Plan, index: tuple[dict, dict], first: int, s1: int,
                e1: int, second: int, s2: int, e2: int, reached, single: bool) -> Plan:
    """:func:`_merge` given the spans ``s1:e1`` and ``s2:e2`` of the two groups and the
    groups between them reachable from ``first``: a dict group -> span, a set of groups,
    or an array of group ids (possibly repeated); empty or None when there are none."""
    order, pos, group = plan.order, plan.pos, plan.group
    if order.itemsize != 4 or pos.itemsize != 4 or group.itemsize != 4:
        order, pos, group = array("i", order), array("i", pos), array("i", group)
    na = e1 - s1
    new_order = order[:] if e1 < s2 else order
    if e1 == s2:  # adjacent groups: the schedule stays as it is
        lo = hi = s1
    elif reached is None or not len(reached):  # [between] + first + second
        new_order[s1:s2 - na] = order[e1:s2]
        new_order[s2 - na:s2] = order[s1:e1]
        lo, hi = s1, s2
    elif reached.__class__ is _Runs:
        _move_runs(new_order, order, s1, e1, s2, e2, reached)
        lo, hi = s1, e2
    elif isinstance(reached, np.ndarray) or (len(reached) > _NUMPY_GROUPS
                                            and s2 - e1 > _PYTHON_PARTITION):
        ordv = np.frombuffer(order, _I32)
        between = ordv[e1:s2]
        mark = np.zeros(len(order), np.bool_)
        mark[reached if isinstance(reached, np.ndarray) else list(reached)] = True
        late = mark[np.frombuffer(group, _I32)[between]]
        np.frombuffer(new_order, _I32)[s1:e2] = np.concatenate(
            (between[~late], ordv[s1:e1], ordv[s2:e2], between[late]))
        lo, hi = s1, e2
    elif len(reached) > _NUMPY_GROUPS:  # a short window: node by node
        before, after = [], []
        for x in order[e1:s2]:
            (after if group[x] in reached else before).append(x)
        new_order[s1:e2] = array("i", before + order[s1:e1].tolist() + order[s2:e2].tolist()
                                 + after)
        lo, hi = s1, e2
    else:  # a few groups: move their runs
        spans = reached.values() if isinstance(reached, dict) else map(
            lambda g: _span(plan, g), reached)
        _move_runs(new_order, order, s1, e1, s2, e2, sorted(spans))
        lo, hi = s1, e2
    new_pos = pos[:] if hi > lo else pos
    if hi - lo <= _NUMPY_WINDOW:
        for k in range(lo, hi):
            new_pos[new_order[k]] = k
    else:
        np.frombuffer(new_pos, _I32)[np.frombuffer(new_order, _I32)[lo:hi]] = \
            space._arange[lo:hi]
    gid, other = (first, second) if first < second else (second, first)
    s, e = (s1, e1) if other == first else (s2, e2)
    new_group = group[:]
    if e - s <= _NUMPY_WINDOW:
        for k in range(s, e):
            new_group[order[k]] = gid
    else:
        np.frombuffer(new_group, _I32)[np.frombuffer(order, _I32)[s:e]] = gid
    return _finish_merge(plan, index, first, second, new_order, new_pos, new_group, lo, hi,
                         False, single)


def _finish_merge(plan: Plan, index: tuple[dict, dict], first: int, second: int,
                  new_order: array, new_pos: array, new_group: array, lo: int, hi: int,
                  ar_kept: bool, single: bool) -> Plan:
    """The plan merging ``first`` and ``second`` into new arrays (whose positions changed
    only in ``lo:hi``): its copies and all-reduce state follow the merge (``ar_kept``: the
    kernel found that the state stays as it is)."""
    gid, other = (first, second) if first < second else (second, first)
    dups, new_index, stable = _merged_dups(plan, index, first, second, gid, other)
    state = getattr(plan, "_ars", None)
    if state is not None and not ar_kept:
        state = _merged_ar_state(state, plan.pos, new_pos, lo, hi, first, second, gid, other)
    return _plan(new_order, new_pos, new_group, dups, new_index, single, state, stable)


def _move_runs(new_order: array, order: array, s1: int, e1: int, s2: int, e2: int,
               runs: list[tuple[int, int]]) -> None:
    """Writes ``new_order[s1:e2]``: the nodes between the runs ``s1:e1`` and ``s2:e2`` of
    ``order`` that are outside ``runs`` (sorted disjoint ranges), those two runs, then the
    nodes of ``runs``, each part in its order."""
    w, q = s1, e1
    for s, e in runs:  # the unreached nodes between, in order
        new_order[w:w + s - q] = order[q:s]
        w, q = w + s - q, e
    new_order[w:w + s2 - q] = order[q:s2]
    w += s2 - q
    new_order[w:w + e1 - s1] = order[s1:e1]
    w += e1 - s1
    new_order[w:w + e2 - s2] = order[s2:e2]
    w += e2 - s2
    for s, e in runs:  # then the reached ones, in order
        new_order[w:w + e - s] = order[s:e]
        w += e - s


def _merged_dups(plan: Plan, index: tuple[dict, dict], first: int, second: int, gid: int,
                 other: int) -> tuple[frozenset, tuple[dict, dict], bool]:
    """``dups``, the copy index and the stable flag after merging ``first`` and ``second``
    into ``gid``: copies held by ``other`` move to ``gid``, copies of the merged members
    are dropped.

    The frozenset is rebuilt exactly as the original implementation rebuilt it: renamed,
    then filtered, each a new set inserting the previous one's items in its iteration order.
    Its iteration order (which :func:`_copies` can depend on) and its table (which later
    unions start from) are thus unchanged. A set's table after such a rebuild depends only
    on the iteration order of the set rebuilt; so when two rebuilds give back a set that
    iterates like the one they started from, rebuilding that set twice gives back its own
    table: it is *stable*, and merges that change no copies then keep it as it is."""
    dups = plan.dups
    if not dups:
        return frozenset(), _NO_COPIES, False
    held, holders = index
    moved = held.get(other, ())
    kept = held.get(gid, ())
    if not moved and not kept:  # (so nothing is dropped)
        return _rebuilt_dups(plan, index)
    group = plan.group
    dropped = {p for p in moved + kept if group[p] == first or group[p] == second}
    if not moved and not dropped:
        return _rebuilt_dups(plan, index)
    if moved:
        dups = frozenset([(p, gid if g == other else g) for p, g in dups])
    else:
        dups = frozenset(iter(dups))
    if dropped:
        dups = frozenset([(p, g) for p, g in dups if not (g == gid and p in dropped)])
    else:
        dups = frozenset(iter(dups))
    held, holders = dict(held), dict(holders)
    held.pop(other, None)
    now = tuple(p for p in dict.fromkeys(kept + moved) if p not in dropped)
    if now:
        held[gid] = now
    else:
        held.pop(gid, None)
    for p in set(kept + moved):
        gs = tuple(g for g in holders[p] if g != other and g != gid)
        if p not in dropped:
            gs += (gid,)
        if gs:
            holders[p] = gs
        else:
            del holders[p]
    return dups, ((held, holders) if held else _NO_COPIES), False


def _rebuilt_dups(plan: Plan, index: tuple[dict, dict]) -> tuple[frozenset, tuple[dict, dict],
                                                                 bool]:
    """:func:`_merged_dups` of a merge that changes no copies: ``dups`` rebuilt twice (the
    same for every such merge of ``plan``, so kept on it) or, if stable, as it is."""
    if getattr(plan, "_stable", False):
        return plan.dups, index, True
    rebuilt = getattr(plan, "_rebuilt", None)
    if rebuilt is None:
        again = frozenset(iter(frozenset(iter(plan.dups))))
        rebuilt = again, list(again) == list(plan.dups)
        try:
            plan._rebuilt = rebuilt
        except AttributeError:  # not a Plan instance
            pass
    return rebuilt[0], index, rebuilt[1]


def _with_copy(space: FusionSpace, plan: Plan, index: tuple[dict, dict], producer: int,
               gid: int) -> Plan:
    """``plan`` with a copy of ``producer`` in group ``gid`` (its copy index is built when
    first used)."""
    return _plan(plan.order, plan.pos, plan.group, plan.dups | {(producer, gid)},
                 _AddedCopy(index, producer, gid), _single_output(plan) and not space.multi_output,
                 getattr(plan, "_ars", None))


def fuse(space: FusionSpace, plan: Plan, producer: int, consumer: int) -> Plan:
    """Non-duplicate fusion: the producer's group joins the consumer's group.

    The producer's other users then read the fused op's output (a multi-output fusion).
    Raises ``ValueError`` with the reason when the move is illegal.
    """
    decision = can_fuse(space, plan, producer, consumer)
    if not decision:
        raise ValueError(f"cannot fuse {producer} into {consumer}: {decision.reason}")
    return _merge(space, plan, plan.group[producer], plan.group[consumer],
                  _single_output(plan) and not space.multi_output)


def duplicate(space: FusionSpace, plan: Plan, producer: int, consumer: int) -> Plan:
    """Duplicate fusion: the consumer's group gets its own copy of ``producer``."""
    decision = can_duplicate(space, plan, producer, consumer)
    if not decision:
        raise ValueError(f"cannot duplicate {producer} into {consumer}: {decision.reason}")
    return _with_copy(space, plan, _index(plan), producer, plan.group[consumer])


def combine(space: FusionSpace, plan: Plan, a: int, b: int) -> Plan:
    """AllReduce combination: the buckets of ``a`` and ``b`` become one bucket."""
    decision = can_combine(space, plan, a, b)
    if not decision:
        raise ValueError(f"cannot combine {a} and {b}: {decision.reason}")
    return _combine_plan(space, plan, _index(plan), plan.group[a], plan.group[b])


# --------------------------------------------------------------------------- C kernel


def c_kernel_available() -> bool:
    """Whether the moves run in the C kernel (built on first call; see the module doc)."""
    return _plan_kernel.load() is not None


def _kernel(space: FusionSpace) -> tuple[Any, Any] | bool:
    """The C kernel (:mod:`hlo_tools._plan_kernel`) and ``space``'s tables for it, made on
    first use and kept as ``space._ks``; False when the pure-Python code runs."""
    kernel = _plan_kernel.load()
    if kernel is None:
        space._ks = False
    else:
        space._ks = kernel, kernel.new_space(
            space.n, space.root, space.multi_output, space.users, space._dops, space._fops,
            space._bad, space.compute_nodes, _outside_fops, _neighbours_of,
            [i for i, r in enumerate(space._reduce) if r],
            _compare_reads_copy if space._any_compare else None)
    return space._ks


def _kernel_ar(space: FusionSpace, tables: _ArTables, kernel) -> Any:
    """The kernel's copy of ``tables`` (kept as ``space._kar`` while they are current)."""
    kar = space._kar
    if kar is None or kar[0] is not tables:
        n = space.n
        rank, key, index = [-1] * n, [-1] * n, [-1] * n
        for b, k in tables.index.items():
            rank[b], key[b], index[b] = tables.rank[b], tables.key[b], k
        kar = space._kar = tables, kernel.new_ar_tables(
            n, tuple(tables.index), rank, key, index, tables.by_rank, tables.is_allreduce,
            tables.skip_buckets, tables.in_order)
    return kar[1]


def _kernel_ar_of(space: FusionSpace, state: _ArState | None, kernel) -> Any:
    """The kernel's copy of the all-reduce tables ``state`` (a plan's :class:`_ArState`, or
    None) was made with, if it has one or they are the space's current tables; else None."""
    if state is None:
        return None
    kar = space._kar
    if kar is not None and kar[0] is state.tables:
        return kar[1]
    tables = _ar(space)
    return _kernel_ar(space, tables, kernel) if state.tables is tables else None


def _outside_fops(space: FusionSpace, plan: Plan, index: tuple[dict, dict], gid: int, s: int,
                  e: int):
    """The kernel's call back for a group holding copies: its fusible outside operands."""
    return _outside_operands(space, plan, index, gid, s, e, space._fops)


def _neighbours_of(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ar: int):
    """The kernel's call back for a rank node that is fused or holds copies."""
    return _neighbours(space, plan, index, _ar(space), ar)


# --------------------------------------------------------------------------- moves


def _bits(rng: random.Random) -> Callable[[int], int] | None:
    """``rng.getrandbits`` when ``rng.choice`` draws as :class:`random.Random`'s does
    (``choice`` picks ``seq[_randbelow(len(seq))]``, and ``_randbelow`` draws
    ``n.bit_length()`` bits until they are below ``n``), else None."""
    cls = type(rng)
    if (cls.choice is not random.Random.choice
            or cls._randbelow is not random.Random._randbelow_with_getrandbits):
        return None
    return rng.getrandbits


def _chooser(rng: random.Random) -> Callable[[Sequence], Any]:
    """``rng.choice``, or when ``rng`` draws as :class:`random.Random` does, a function
    making exactly the same draws without its two method calls (see :func:`_bits`)."""
    bits = _bits(rng)
    if bits is None:
        return rng.choice

    def choice(seq):
        n = len(seq)
        if not n:
            raise IndexError("Cannot choose from an empty sequence")
        k = n.bit_length()
        r = bits(k)
        while r >= n:
            r = bits(k)
        return seq[r]
    return choice



def op_fusion_move(space: FusionSpace, plan: Plan, rng: random.Random,
                   tries: int = 8) -> Plan:
    """Fuses a random compute op's group with one of its producers' groups (or returns
    ``plan`` unchanged if ``tries`` random picks found no legal pair)."""
    if not space.compute_nodes:
        return plan
    if space.multi_output:
        return _multi_output_fusion_move(space, plan, rng, tries)
    index = _index(plan)
    ks = space._ks if space._ks is not None else _kernel(space)
    if ks:
        bits = _bits(rng)
        if bits is not None:
            state = getattr(plan, "_ars", None)
            found = ks[0].op_fusion(ks[1], _kernel_ar_of(space, state, ks[0]), state, space,
                                    plan, index, bits, tries)
            if found is None:
                return plan
            if found is not NotImplemented:
                return _finish_merge(plan, index, *found, _single_output(plan))
    held, holders = index
    order, pos, group = plan.order, plan.pos, plan.group
    nodes, fops, n = space.compute_nodes, space._fops, len(order)
    root_group = group[space.root]
    choice = _chooser(rng)
    for _ in range(tries):
        # a random edge, drawn as _random_edge draws it (inlined: this is the hot loop)
        consumer = choice(nodes)
        gc = group[consumer]
        sc = ec = pos[consumer]
        while sc and group[order[sc - 1]] == gc:
            sc -= 1
        ec += 1
        while ec < n and group[order[ec]] == gc:
            ec += 1
        if ec - sc == 1 and gc not in held:
            candidates = fops[consumer]
        else:
            candidates = _outside_operands(space, plan, index, gc, sc, ec, fops)
        if not candidates:
            continue
        producer = choice(candidates)
        gp = group[producer]
        # the checks of can_fuse that can fail here, cheapest first: the consumer's group
        # must be the producer's only successor, and its own readers are looked at first
        if gp == root_group or not _feeds_only_node(space, group, holders, producer, gp, gc):
            continue
        sp = ep = pos[producer]
        while sp and group[order[sp - 1]] == gp:
            sp -= 1
        ep += 1
        while ep < n and group[order[ep]] == gp:
            ep += 1
        if ep - sp > 1 and not _feeds_only(space, plan, holders, gp, sp, ep, gc):
            continue
        if space._any_bad:
            if ep - sp == 1 and ec - sc == 1 and gp not in held and gc not in held:
                bad = space._bad[consumer]  # _layout_safe of two single nodes
                if bad is not None and producer in bad:
                    continue
            elif not _layout_safe(space, plan, index, gp, sp, ep, gc, sc, ec):
                continue
        if held and space._any_compare and _compare_reads_copy(space, plan, index, gp, sp, ep,
                                                               gc, sc, ec):
            continue
        return _merge_runs(space, plan, index, gp, sp, ep, gc, sc, ec, None,
                           _single_output(plan))
    return plan


def _multi_output_fusion_move(space: FusionSpace, plan: Plan, rng: random.Random,
                              tries: int) -> Plan:
    """:func:`op_fusion_move` with multi-output fusion: a merge must create no cycle."""
    index = _index(plan)
    choice = _chooser(rng)
    group = plan.group
    for _ in range(tries):
        edge = _random_edge(space, plan, index, choice)
        if edge is None:
            continue
        producer, gc, sc, ec = edge
        gp = group[producer]
        sp, ep = _span(plan, gp)
        succ = _successors(space, plan, index, gp, sp, ep)
        if space._any_bad and not _layout_safe(space, plan, index, gp, sp, ep, gc, sc, ec):
            continue
        succ.discard(gc)
        reached = _window_reach(space, plan, index, gp, succ, gc, sc)
        if reached is not None and not (space._any_compare and _compare_reads_copy(
                space, plan, index, gp, sp, ep, gc, sc, ec)):
            return _merge_runs(space, plan, index, gp, sp, ep, gc, sc, ec, reached, False)
    return plan


def _feeds_only_node(space: FusionSpace, group: array, holders: dict[int, tuple[int, ...]],
                     node: int, gp: int, gc: int) -> bool:
    """:func:`_feeds_only` of the single member ``node`` of group ``gp``."""
    if not holders:
        for u in space.users[node]:
            gu = group[u]
            if gu != gp and gu != gc:
                return False
        return True
    own = holders.get(node, ())
    for u in space.users[node]:
        gu = group[u]
        if gu != gp and gu != gc and gu not in own:
            return False
        if u in holders:
            for g in holders[u]:
                if g != gp and g != gc and g not in own:
                    return False
    return True


def _feeds_only(space: FusionSpace, plan: Plan, holders: dict[int, tuple[int, ...]], gp: int,
                sp: int, ep: int, gc: int) -> bool:
    """Whether group ``gc`` is the only group reading a value of group ``gp`` (span
    ``sp:ep``): :func:`_successors` with an early exit."""
    order, group, users = plan.order, plan.group, space.users
    if not holders:
        for m in order[sp:ep]:
            for u in users[m]:
                gu = group[u]
                if gu != gp and gu != gc:
                    return False
        return True
    for m in order[sp:ep]:
        own = holders.get(m, ())
        for u in users[m]:
            gu = group[u]
            if gu != gp and gu != gc and gu not in own:
                return False
            for g in holders.get(u, ()):
                if g != gp and g != gc and g not in own:
                    return False
    return True


def duplicate_fusion_move(space: FusionSpace, plan: Plan, rng: random.Random,
                          tries: int = 8) -> Plan:
    """Fuses a random producer into a consumer group, keeping a copy for its other users."""
    if not space.compute_nodes:
        return plan
    index = _index(plan)
    ks = space._ks if space._ks is not None else _kernel(space)
    if ks:
        bits = _bits(rng)
        if bits is not None:
            found = ks[0].duplicate(ks[1], space, plan, index, bits, tries)
            if found is None:
                return plan
            if found is not NotImplemented:
                return _with_copy(space, plan, index, *found)
    choice = _chooser(rng)
    for _ in range(tries):
        edge = _random_edge(space, plan, index, choice)
        if edge is None:
            continue
        producer, gc, sc, ec = edge
        # fusible, outside the consumer group, read by it and not yet copied into it
        if _alone(plan, producer) and _duplicate_rest(space, plan, index, producer, gc, sc,
                                                      ec):
            return _with_copy(space, plan, index, producer, gc)
    return plan


def _random_edge(space: FusionSpace, plan: Plan, index: tuple[dict, dict],
                 choice: Callable[[Sequence], Any]) -> tuple[int, int, int, int] | None:
    """A random (producer, consumer) pair of fusible nodes in different groups, as
    (producer, consumer group, span of the consumer group)."""
    consumer = choice(space.compute_nodes)
    order, group = plan.order, plan.group
    gid = group[consumer]
    s = e = plan.pos[consumer]
    while s and group[order[s - 1]] == gid:
        s -= 1
    e += 1
    n = len(order)
    while e < n and group[order[e]] == gid:
        e += 1
    if e - s == 1 and gid not in index[0]:
        candidates = space._fops[consumer]
    else:
        candidates = _outside_operands(space, plan, index, gid, s, e, space._fops)
    if not candidates:
        return None
    return choice(candidates), gid, s, e


def allreduce_neighbours(space: FusionSpace, plan: Plan, ar: int) -> list[int]:
    """All-reduces whose bucket may neighbour ``ar``'s bucket.

    Following the paper, two gradient all-reduces are neighbours when the (fused) ops
    producing their gradients are the same group or producer/consumer of each other.
    We also count as neighbours the all-reduces adjacent to ``ar`` in order of
    gradient production (the order the channel sends them), because in JAX's backward
    pass sibling gradients (a weight's and its bias's, say) are often produced by ops
    that share an input rather than feed each other.
    """
    return _neighbours(space, plan, _index(plan), _ar(space), ar)


def _neighbours(space: FusionSpace, plan: Plan, index: tuple[dict, dict], tables: _ArTables,
                ar: int) -> list[int]:
    """:func:`allreduce_neighbours`, given the plan's copy index and the space's tables."""
    order, pos, group = plan.order, plan.pos, plan.group
    by_rank = tables.by_rank
    r = tables.rank[ar]
    mine = group[r]
    n = len(order)
    # mine, the groups it reads from and the groups reading it
    q = pos[r]
    held, holders = index
    if (mine not in held and (not q or group[order[q - 1]] != mine)
            and (q + 1 == n or group[order[q + 1]] != mine)):  # r alone, without copies
        if holders:
            near = {mine}
            own = holders.get(r, ())
            for u in space.users[r]:
                gu = group[u]
                if gu not in own:
                    near.add(gu)
                for g in holders.get(u, ()):
                    if g not in own:
                        near.add(g)
        else:
            near = {group[u] for u in space.users[r]}
            near.add(mine)
        for o in space._dops[r]:
            near.add(group[o])
    else:
        s, e = _span(plan, mine)
        near = _successors(space, plan, index, mine, s, e)
        near.add(mine)
        copies = held.get(mine, ())
        for m in (*order[s:e], *copies):
            for o in space._dops[m]:
                if o not in copies:
                    near.add(group[o])
    # all-reduces ranked by a node of a near group, in space.allreduces order
    state = _ar_state(plan, tables)
    ranked_in = state.ranked_in
    out: list[int] = []
    skip, is_ar = tables.skip_buckets, tables.is_allreduce
    for h in near:
        if skip and is_ar[h]:
            continue  # buckets hold no rank nodes
        found = ranked_in.get(h) or by_rank[h]
        if found:
            out += found
    if len(out) > 1:
        if tables.in_order:
            out.sort()
        else:
            out.sort(key=tables.index.__getitem__)
    out.remove(ar)
    # the all-reduces just before and after ar in order of production (a stable sort of
    # space.allreduces by the position of their producers)
    tie = by_rank[r]
    k = tie.index(ar)
    if k:
        out.append(tie[k - 1])
    else:
        i = state.where[r]
        if i:
            out.append(by_rank[state.ranked[i - 1]][-1])
    if k + 1 < len(tie):
        out.append(tie[k + 1])
    else:
        i = state.where[r]
        if i + 1 < len(state.ranked):
            out.append(by_rank[state.ranked[i + 1]][0])
    return out


class _ArState(NamedTuple):
    """Per-plan all-reduce facts for :func:`_neighbours`, kept up to date by merges (see
    :func:`_merged_ar_state`) and built on first use otherwise (:func:`_ar_state`)."""

    tables: _ArTables  # the tables these facts were built with
    ranked: list[int]  # the rank nodes in schedule order
    where: dict[int, int]  # rank node -> its index in ranked
    ranked_in: dict[int, tuple[int, ...]]  # group of 2+ members -> the all-reduces its
    # members rank (only groups with some); a single node's are tables.by_rank[node]
    buckets: int  # how many groups the combinable all-reduces form


def _ar_state(plan: Plan, tables: _ArTables) -> _ArState:
    """The plan's :class:`_ArState` for ``tables``."""
    state = getattr(plan, "_ars", None)
    if state is not None and state.tables is tables:
        return state
    group, by_rank = plan.group, tables.by_rank
    ranked = sorted(tables.rank_nodes, key=plan.pos.__getitem__)
    ranked_in: dict[int, tuple[int, ...]] = {}
    for m in tables.rank_nodes:
        if not _alone(plan, m):
            ranked_in[group[m]] = ranked_in.get(group[m], ()) + by_rank[m]
    state = _ArState(tables, ranked, {m: i for i, m in enumerate(ranked)}, ranked_in,
                     len({group[b] for b in tables.members}))
    try:
        plan._ars = state
    except AttributeError:  # not a Plan instance
        pass
    return state


def _merged_ar_state(state: _ArState, pos: array, new_pos: array, lo: int, hi: int,
                     first: int, second: int, gid: int, other: int) -> _ArState:
    """``state`` after a merge of groups ``first`` and ``second`` into ``gid`` that moved
    the nodes at positions ``lo:hi`` from ``pos`` to ``new_pos``."""
    tables, ranked, where, ranked_in, buckets = state
    changed = False
    if hi > lo:  # only rank nodes inside the window may move
        i = bisect_left(ranked, lo, key=pos.__getitem__)
        j = bisect_left(ranked, hi, lo=i, key=pos.__getitem__)
        if j - i > 1:
            inside = ranked[i:j]
            at = list(map(new_pos.__getitem__, inside))
            if at != sorted(at):  # (positions are distinct: sorting pairs sorts by position)
                ranked = ranked[:i] + [m for _, m in sorted(zip(at, inside))] + ranked[j:]
                where = dict(where)
                for k in range(i, j):
                    where[ranked[k]] = k
                changed = True
    by_rank = tables.by_rank
    a, b = ranked_in.get(first) or by_rank[first], ranked_in.get(second) or by_rank[second]
    if a or b:
        ranked_in = dict(ranked_in)
        ranked_in.pop(other, None)
        ranked_in[gid] = (a or ()) + (b or ())
        changed = True
    if first in tables.members and second in tables.members:  # two buckets
        buckets -= 1
        changed = True
    return _ArState(tables, ranked, where, ranked_in, buckets) if changed else state


def allreduce_move(space: FusionSpace, plan: Plan, rng: random.Random,
                   tries: int = 8) -> Plan:
    """Combines a random all-reduce's bucket with a random neighbouring bucket."""
    ars = space.allreduces
    if len(ars) < 2:
        return plan
    tables = _ar(space)
    ks = space._ks if space._ks is not None else _kernel(space)
    if ks:
        bits = _bits(rng)
        if bits is not None:
            return _allreduce_move_c(space, plan, tables, ks, rng, bits, tries)
    choice = _chooser(rng)
    if _ar_state(plan, tables).buckets == 1:
        for _ in range(tries):  # one bucket: no try finds a neighbour
            choice(ars)
        return plan
    return _allreduce_tries(space, plan, _index(plan), tables, choice, tries)


def _allreduce_tries(space: FusionSpace, plan: Plan, index: tuple[dict, dict],
                     tables: _ArTables, choice: Callable[[Sequence], Any], tries: int) -> Plan:
    """The tries of :func:`allreduce_move` (of a plan with two buckets or more)."""
    ars, group, key = space.allreduces, plan.group, tables.key
    for _ in range(tries):
        a = choice(ars)
        ga = group[a]
        neighbours = [b for b in _neighbours(space, plan, index, tables, a) if group[b] != ga]
        if not neighbours:
            continue
        b = choice(neighbours)
        if key[a] != key[b]:
            continue
        merged = _combine_plan(space, plan, index, ga, group[b])
        if merged is not None:
            return merged
    return plan


def _allreduce_move_c(space: FusionSpace, plan: Plan, tables: _ArTables, ks: tuple[Any, Any],
                      rng: random.Random, bits: Callable[[int], int], tries: int) -> Plan:
    """:func:`allreduce_move` with the C kernel making the tries (and the Python code the
    tries left when the kernel declines the plan, or is busy in another thread)."""
    state = _ar_state(plan, tables)
    kernel = ks[0]
    if state.buckets == 1:
        kernel.draws(bits, len(space.allreduces), tries)  # no try finds a neighbour
        return plan
    index = _index(plan)
    kar = _kernel_ar(space, tables, kernel)
    while tries > 0:
        found = kernel.allreduce_pick(ks[1], kar, space, plan, index, state, bits, tries)
        if found is None:
            return plan
        if found is NotImplemented:
            return _allreduce_tries(space, plan, index, tables, _chooser(rng), tries)
        tries, first, s1, e1, second, s2, e2 = found
        merged = _combine_c(space, plan, index, ks, first, s1, e1, second, s2, e2)
        if merged is not None:
            return merged
    return plan


def _combine_c(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ks: tuple[Any, Any],
               first: int, s1: int, e1: int, second: int, s2: int, e2: int) -> Plan | None:
    """:func:`_combine_spans` with the C kernel's merge when the descendants of ``first``
    decide (see :func:`_descendant_groups`)."""
    if _single_output(plan):
        nodes = _descendants_i32(space, plan.order[s1:e1])
        if nodes is not None:
            state = getattr(plan, "_ars", None)
            found = ks[0].merge(ks[1], _kernel_ar_of(space, state, ks[0]), state, plan, first,
                                s1, e1, second, s2, e2, nodes)
            if found is None:
                return None
            if found is not NotImplemented:
                return _finish_merge(plan, index, *found, True)
    return _combine_spans(space, plan, index, first, s1, e1, second, s2, e2)


def _descendants_i32(space: FusionSpace, members: array) -> array | None:
    """:func:`_bucket_descendants` as an array('i') for the kernel (cached likewise)."""
    key = members.tobytes()
    found = space._kbuckets.get(key, False)
    if found is False:
        parts = [_descendants(space, m) for m in members]
        found = None if any(through for _, through in parts) else array(
            "i", chain.from_iterable(nodes for nodes, _ in parts))
        if len(space._kbuckets) >= _BUCKET_CACHE:
            space._kbuckets.clear()
        space._kbuckets[key] = found
    return found


MOVES = (op_fusion_move, duplicate_fusion_move, allreduce_move)


def random_moves(space: FusionSpace, plan: Plan, rng: random.Random, moves: int,
                 weights: tuple[float, float, float] = (0.6, 0.15, 0.25)) -> Plan:
    """Applies ``moves`` random moves of all three kinds (op fusion, duplicate fusion,
    AllReduce combination, drawn with ``weights``)."""
    cum = _cumulative(weights) if moves > 0 and type(rng).choices is _CHOICES else None
    if cum is None:
        for _ in range(moves):  # (raises as rng.choices does on bad weights)
            plan = rng.choices(MOVES, weights)[0](space, plan, rng)
        return plan
    cum, total = cum
    draw, last = rng.random, len(MOVES) - 1
    for _ in range(moves):  # rng.choices(MOVES, weights)[0], the same draw
        plan = MOVES[bisect_right(cum, draw() * total, 0, last)](space, plan, rng)
    return plan


_CHOICES = random.Random.choices


def _cumulative(weights) -> tuple[list[float], float] | None:
    """The cumulative weights and their total as ``random.Random.choices`` computes them
    for ``MOVES``, or None if it would raise (cached for hashable weights: a search makes
    one move at a time)."""
    try:
        return _cumulative_cached(weights)
    except TypeError:  # unhashable
        pass
    try:
        return _cumulative_cached.__wrapped__(weights)
    except TypeError:  # not numbers: rng.choices raises
        return None


@lru_cache(maxsize=16)
def _cumulative_cached(weights) -> tuple[list[float], float] | None:
    cum = list(accumulate(weights))
    total = cum[-1] + 0.0 if cum else 0.0
    if len(cum) != len(MOVES) or not 0.0 < total < float("inf"):
        return None
    return cum, total


def random_plan(module, seed: int, moves: int = 50, *,
                weights: tuple[float, float, float] = (0.6, 0.15, 0.25)) -> Plan:
    """A plan of ``moves`` random legal moves of all three kinds on ``module``'s
    per-device program (seeded: the same arguments give the same plan)."""
    from hlo_tools.graph import device_graph

    graph = device_graph(module)
    space = FusionSpace(graph)
    return random_moves(space, initial_plan(graph), random.Random(seed), moves, weights)
