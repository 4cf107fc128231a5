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
"""

from __future__ import annotations

import random
from array import array
from typing import NamedTuple

from hlo_tools.graph import DeviceGraph, NodeKind

__all__ = [
    "Decision",
    "FusionSpace",
    "Plan",
    "initial_plan",
    "members",
    "dead_groups",
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
]

#: Opcodes we never fuse on XLA:CPU although they are ordinary kernels.
#: * reshape, transpose, concatenate, bitcast, copy: a hand-written fusion reaches XLA
#:   before layout assignment, which leaves fused computations without layouts, and the
#:   emitter then aborts the process (``Check failed: input_shape.has_layout()``);
#:   ``benchmarks/probe_cpu_fusion.py`` finds these by compiling each pair in a subprocess.
#: * dot, convolution: XLA:CPU runs them as library calls; inside a loop fusion they
#:   become slow elemental loops, and as kOutput fusions they abort the process.
#: * the rest are emitted by dedicated emitters or library calls (sort, fft, scatter...).
UNFUSIBLE_OPCODES = frozenset({
    "reshape", "transpose", "concatenate", "bitcast", "copy", "dot", "convolution",
    "sort", "fft", "cholesky", "triangular-solve", "custom-call", "rng", "rng-bit-generator",
    "scatter", "select-and-scatter", "reduce-window", "gather", "while", "conditional",
    "call", "map", "topk", "batch-norm-training", "batch-norm-inference",
    "batch-norm-grad", "dynamic-update-slice", "iota", "pad", "reverse", "dynamic-slice",
})


#: Consumers that may read a value computed inside their fusion only at these operand
#: positions on XLA:CPU: ``select`` with an on-true/on-false value computed in the same
#: fusion aborts the emitter (the fused value has no layout; see UNFUSIBLE_OPCODES),
#: while a fused predicate is fine.
FUSED_OPERAND_POSITIONS = {"select": frozenset({0})}


class Decision(NamedTuple):
    """A legality answer that carries its reason (truthy when legal)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


LEGAL = Decision(True, "legal")


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
    """

    def __init__(self, graph: DeviceGraph, unfusible: frozenset[str] = UNFUSIBLE_OPCODES,
                 multi_output: bool = False,
                 fused_operand_positions: dict[str, frozenset[int]] | None = None):
        self.graph = graph
        self.multi_output = multi_output
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


class Plan(NamedTuple):
    """One candidate strategy: groups, duplicated producers and the schedule.

    Attributes:
        order: ``[N]`` node indices in a topological order of the group-contracted
            graph, every group contiguous.
        pos: ``[N]`` inverse of ``order`` (``order[pos[i]] == i``).
        group: ``[N]`` group id of each node: the smallest node index in its group.
        dups: ``(producer, group id)`` pairs: the group holds a copy of the producer.
    """

    order: array
    pos: array
    group: array
    dups: frozenset[tuple[int, int]] = frozenset()

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


def initial_plan(graph: DeviceGraph) -> Plan:
    """The plan that changes nothing: every node its own group, print order."""
    n = graph.num_nodes
    order = array("i", range(n))
    return Plan(order, array("i", order), array("i", order), frozenset())


def members(plan: Plan, gid: int) -> list[int]:
    """Members of group ``gid`` in schedule order (a contiguous run of ``plan.order``)."""
    order, group = plan.order, plan.group
    start = end = plan.pos[gid]
    while start > 0 and group[order[start - 1]] == gid:
        start -= 1
    while end + 1 < len(order) and group[order[end + 1]] == gid:
        end += 1
    return list(order[start:end + 1])


def _dup_nodes(plan: Plan, gid: int) -> set[int]:
    return {p for p, g in plan.dups if g == gid}


def group_operands(space: FusionSpace, plan: Plan, gid: int) -> list[int]:
    """Nodes outside group ``gid`` whose values the group reads (copies count as inside)."""
    group = plan.group
    copies = _dup_nodes(plan, gid)
    seen, out = set(), []
    for m in [*members(plan, gid), *copies]:
        for o in space.operands[m]:
            if group[o] != gid and o not in copies and o not in seen:
                seen.add(o)
                out.append(o)
    return out


def group_users(space: FusionSpace, plan: Plan, gid: int) -> set[int]:
    """Group ids that read a value of group ``gid``: through its members' users (except
    groups that hold their own copy of the member) and through copies of duplicated
    producers that read a member."""
    readers = _copy_readers(space, plan) if plan.dups else {}
    return _successor_groups(space, plan, gid, readers)


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
    users = group_users(space, plan, gp)
    if gc not in users:
        return Decision(False, "producer group does not feed the consumer group")
    if not _layout_safe(space, _fused_nodes(plan, gp, gc)):
        return Decision(False, "the consumer reads the producer at an operand position this "
                        "backend cannot fuse (e.g. a select's on-true/on-false value)")
    if not space.multi_output:
        if len(users) > 1 or _is_output(space, plan, gp):
            return Decision(False, "producer has users outside the consumer group: that "
                            "needs a multi-output fusion (disabled on this backend; "
                            "duplicate the producer instead)")
        return LEGAL
    if _reaches_through_window(space, plan, gp, gc):
        return Decision(False, "fusing would create a cycle (another path joins them)")
    return LEGAL


def _layout_safe(space: FusionSpace, nodes: set[int]) -> bool:
    """Whether no node of a would-be fusion (members and copies) reads another one at an
    operand position XLA:CPU cannot fuse (:data:`FUSED_OPERAND_POSITIONS`)."""
    opcodes, operands = space.graph.opcodes, space.operands
    for c in nodes:
        allowed = space.fused_operand_positions.get(opcodes[c])
        if allowed is not None and any(o in nodes and k not in allowed
                                       for k, o in enumerate(operands[c])):
            return False
    return True


def _fused_nodes(plan: Plan, *gids: int) -> set[int]:
    """Members and copies of the given groups."""
    nodes = {p for p, g in plan.dups if g in gids}
    for gid in gids:
        nodes.update(members(plan, gid))
    return nodes


def _is_output(space: FusionSpace, plan: Plan, gid: int) -> bool:
    """Whether the group holds the computation's root (its value leaves the program)."""
    return plan.group[space.graph.root] == gid


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
    if len(members(plan, plan.group[producer])) != 1:
        return Decision(False, "only unfused producers are duplicated")
    if (producer, gc) in plan.dups:
        return Decision(False, "the consumer group already holds a copy of the producer")
    if producer not in group_operands(space, plan, gc):
        return Decision(False, "the consumer group does not read the producer")
    if not _layout_safe(space, _fused_nodes(plan, gc) | {producer}):
        return Decision(False, "the consumer reads the producer at an operand position this "
                        "backend cannot fuse (e.g. a select's on-true/on-false value)")
    outside = [u for u in space.users[producer]
               if plan.group[u] != gc and (producer, plan.group[u]) not in plan.dups]
    if not outside:
        return Decision(False, "producer has no other users: use plain fusion")
    if not space.multi_output and _exposes_member(space, plan, producer, gc):
        return Decision(False, "the copy would read a value inside another fusion, giving "
                        "that fusion a second output (multi-output fusion is disabled)")
    return LEGAL


def _exposes_member(space: FusionSpace, plan: Plan, producer: int, gc: int) -> bool:
    """Whether a copy of ``producer`` in group ``gc`` would read an operand that is not yet
    an output of its (multi-node) group."""
    for o in space.operands[producer]:
        h = plan.group[o]
        if h == gc or (o, gc) in plan.dups or len(members(plan, h)) == 1:
            continue
        if not _is_read_outside(space, plan, o):
            return True
    return False


def _is_read_outside(space: FusionSpace, plan: Plan, node: int) -> bool:
    """Whether ``node``'s value leaves its group (a user elsewhere, a copy elsewhere that
    reads it, or the program root)."""
    g = plan.group[node]
    if node == space.graph.root:
        return True
    if any(plan.group[u] != g and (node, plan.group[u]) not in plan.dups
           for u in space.users[node]):
        return True
    return any(hg != g and (node, hg) not in plan.dups and node in space.operands[p]
               for p, hg in plan.dups)


def can_combine(space: FusionSpace, plan: Plan, a: int, b: int) -> Decision:
    """Whether the buckets of all-reduces ``a`` and ``b`` may become one bucket.

    Both must be all-reduces with the same replica groups, reduction and element
    type; they must be neighbours (see :func:`allreduce_neighbours`); and neither
    bucket may depend on the other (that would be a cycle).
    """
    ga, gb = plan.group[a], plan.group[b]
    if ga == gb:
        return Decision(False, "already in the same bucket")
    if a not in space.allreduces or b not in space.allreduces:
        return Decision(False, "only gradient all-reduces of more than one element are "
                        "combined")
    if space.ar_key[a] != space.ar_key[b]:
        return Decision(False, "all-reduces differ in replica groups, reduction or type")
    first, second = (ga, gb) if plan.pos[ga] < plan.pos[gb] else (gb, ga)
    if _reaches_through_window(space, plan, first, second, direct_counts=True):
        return Decision(False, "one bucket depends on the other (would create a cycle)")
    return LEGAL


def _successor_groups(space: FusionSpace, plan: Plan, gid: int,
                      copy_readers: dict[int, list[int]]) -> set[int]:
    """Groups that read a value of group ``gid``, including through duplicated copies."""
    group, dups = plan.group, plan.dups
    out = set()
    for m in members(plan, gid):
        for u in space.users[m]:
            gu = group[u]
            if gu != gid and (m, gu) not in dups:
                out.add(gu)
        out.update(g for g in copy_readers.get(m, ()) if g != gid)
    return out


def _copy_readers(space: FusionSpace, plan: Plan) -> dict[int, list[int]]:
    """Node -> groups holding a copy of one of its users: they read the node too, unless
    they hold a copy of the node as well (then the copies read each other)."""
    readers: dict[int, list[int]] = {}
    for p, g in plan.dups:
        for o in space.operands[p]:
            if (o, g) not in plan.dups:
                readers.setdefault(o, []).append(g)
    return readers


def _reaches_through_window(space: FusionSpace, plan: Plan, src: int, dst: int,
                            direct_counts: bool = False) -> bool:
    """Whether group ``dst`` is reachable from group ``src`` other than by a direct edge
    (or by any path, with ``direct_counts``). Only groups scheduled before ``dst`` are
    visited: in a topological order a path from ``src`` cannot leave that window."""
    pos = plan.pos
    limit = pos[members(plan, dst)[0]]
    readers = _copy_readers(space, plan) if plan.dups else {}
    first = _successor_groups(space, plan, src, readers)
    if direct_counts and dst in first:
        return True
    stack = [g for g in first if g != dst and pos[g] < limit]
    seen = set(stack) | {src}
    while stack:
        for g in _successor_groups(space, plan, stack.pop(), readers):
            if g == dst:
                return True
            if g not in seen and pos[g] < limit:
                seen.add(g)
                stack.append(g)
    return False


# --------------------------------------------------------------------------- rewrites


def _merge(space: FusionSpace, plan: Plan, first: int, second: int) -> Plan:
    """Merges group ``first`` (scheduled earlier) with group ``second``.

    The window between them is re-ordered as [not reachable from ``first``] +
    [merged group] + [reachable from ``first``], which keeps a topological order.
    """
    order, pos, group = plan.order, plan.pos, plan.group
    a_members, b_members = members(plan, first), members(plan, second)
    lo, hi = pos[a_members[0]], pos[b_members[-1]]
    window = order[lo:hi + 1]
    reached = _reachable_in_window(space, plan, first, hi)
    in_a, in_b = set(a_members), set(b_members)
    before = [n for n in window if n not in in_a and n not in in_b and group[n] not in reached]
    after = [n for n in window if n not in in_a and n not in in_b and group[n] in reached]
    new_order, new_pos, new_group = array("i", order), array("i", pos), array("i", group)
    new_window = before + a_members + b_members + after
    new_order[lo:hi + 1] = array("i", new_window)
    for k, n in enumerate(new_window, lo):
        new_pos[n] = k
    gid = min(first, second)
    for n in a_members + b_members:
        new_group[n] = gid
    dups = plan.dups
    if first != gid or second != gid:
        old = {first, second} - {gid}
        dups = frozenset((p, gid if g in old else g) for p, g in dups)
    merged = set(a_members) | set(b_members)
    dups = frozenset((p, g) for p, g in dups if not (g == gid and p in merged))
    return Plan(new_order, new_pos, new_group, dups)


def _reachable_in_window(space: FusionSpace, plan: Plan, src: int, hi: int) -> set[int]:
    """Groups reachable from group ``src`` that are scheduled at or before ``hi``."""
    pos = plan.pos
    readers = _copy_readers(space, plan) if plan.dups else {}
    seen, stack = set(), [src]
    while stack:
        for g in _successor_groups(space, plan, stack.pop(), readers):
            if g not in seen and pos[g] <= hi:
                seen.add(g)
                stack.append(g)
    return seen


def fuse(space: FusionSpace, plan: Plan, producer: int, consumer: int) -> Plan:
    """Non-duplicate fusion: the producer's group joins the consumer's group.

    The producer's other users then read the fused op's output (a multi-output fusion).
    Raises ``ValueError`` with the reason when the move is illegal.
    """
    decision = can_fuse(space, plan, producer, consumer)
    if not decision:
        raise ValueError(f"cannot fuse {producer} into {consumer}: {decision.reason}")
    return _merge(space, plan, plan.group[producer], plan.group[consumer])


def duplicate(space: FusionSpace, plan: Plan, producer: int, consumer: int) -> Plan:
    """Duplicate fusion: the consumer's group gets its own copy of ``producer``."""
    decision = can_duplicate(space, plan, producer, consumer)
    if not decision:
        raise ValueError(f"cannot duplicate {producer} into {consumer}: {decision.reason}")
    return plan._replace(dups=plan.dups | {(producer, plan.group[consumer])})


def combine(space: FusionSpace, plan: Plan, a: int, b: int) -> Plan:
    """AllReduce combination: the buckets of ``a`` and ``b`` become one bucket."""
    decision = can_combine(space, plan, a, b)
    if not decision:
        raise ValueError(f"cannot combine {a} and {b}: {decision.reason}")
    ga, gb = plan.group[a], plan.group[b]
    first, second = (ga, gb) if plan.pos[ga] < plan.pos[gb] else (gb, ga)
    return _merge(space, plan, first, second)


# --------------------------------------------------------------------------- moves


def op_fusion_move(space: FusionSpace, plan: Plan, rng: random.Random,
                   tries: int = 8) -> Plan:
    """Fuses a random compute op's group with one of its producers' groups (or returns
    ``plan`` unchanged if ``tries`` random picks found no legal pair)."""
    for _ in range(tries):
        pair = _random_edge(space, plan, rng)
        if pair and can_fuse(space, plan, *pair):
            return _merge(space, plan, plan.group[pair[0]], plan.group[pair[1]])
    return plan


def duplicate_fusion_move(space: FusionSpace, plan: Plan, rng: random.Random,
                          tries: int = 8) -> Plan:
    """Fuses a random producer into a consumer group, keeping a copy for its other users."""
    for _ in range(tries):
        pair = _random_edge(space, plan, rng)
        if pair and can_duplicate(space, plan, *pair):
            return plan._replace(dups=plan.dups | {(pair[0], plan.group[pair[1]])})
    return plan


def _random_edge(space: FusionSpace, plan: Plan, rng: random.Random) -> tuple[int, int] | None:
    """A random (producer, consumer) pair of fusible nodes in different groups."""
    if not space.compute_nodes:
        return None
    consumer = rng.choice(space.compute_nodes)
    gid = plan.group[consumer]
    candidates = [o for o in group_operands(space, plan, gid) if space.fusible[o]]
    if not candidates:
        return None
    return rng.choice(candidates), consumer


def allreduce_neighbours(space: FusionSpace, plan: Plan, ar: int) -> list[int]:
    """All-reduces whose bucket may neighbour ``ar``'s bucket.

    Following the paper, two gradient all-reduces are neighbours when the (fused) ops
    producing their gradients are the same group or producer/consumer of each other.
    We also count as neighbours the all-reduces adjacent to ``ar`` in order of
    gradient production (the order the channel sends them), because in JAX's backward
    pass sibling gradients (a weight's and its bias's, say) are often produced by ops
    that share an input rather than feed each other.
    """
    group = plan.group
    mine = group[space.grad_producer.get(ar, ar)]
    near = {mine} | group_users(space, plan, mine)
    near |= {group[o] for o in group_operands(space, plan, mine)}
    out = [b for b in space.allreduces
           if b != ar and group[space.grad_producer.get(b, b)] in near]
    ranked = sorted(space.allreduces, key=lambda b: plan.pos[space.grad_producer.get(b, b)])
    k = ranked.index(ar)
    out += [ranked[j] for j in (k - 1, k + 1) if 0 <= j < len(ranked)]
    return out


def allreduce_move(space: FusionSpace, plan: Plan, rng: random.Random,
                   tries: int = 8) -> Plan:
    """Combines a random all-reduce's bucket with a random neighbouring bucket."""
    if len(space.allreduces) < 2:
        return plan
    for _ in range(tries):
        a = rng.choice(space.allreduces)
        neighbours = [b for b in allreduce_neighbours(space, plan, a)
                      if plan.group[b] != plan.group[a]]
        if not neighbours:
            continue
        b = rng.choice(neighbours)
        if can_combine(space, plan, a, b):
            ga, gb = plan.group[a], plan.group[b]
            first, second = (ga, gb) if plan.pos[ga] < plan.pos[gb] else (gb, ga)
            return _merge(space, plan, first, second)
    return plan


MOVES = (op_fusion_move, duplicate_fusion_move, allreduce_move)


def random_moves(space: FusionSpace, plan: Plan, rng: random.Random, moves: int,
                 weights: tuple[float, float, float] = (0.6, 0.15, 0.25)) -> Plan:
    """Applies ``moves`` random moves of all three kinds (op fusion, duplicate fusion,
    AllReduce combination, drawn with ``weights``)."""
    for _ in range(moves):
        move = rng.choices(MOVES, weights)[0]
        plan = move(space, plan, rng)
    return plan


def random_plan(module, seed: int, moves: int = 50, *,
                weights: tuple[float, float, float] = (0.6, 0.15, 0.25)) -> Plan:
    """A plan of ``moves`` random legal moves of all three kinds on ``module``'s
    per-device program (seeded: the same arguments give the same plan)."""
    from hlo_tools.graph import device_graph

    graph = device_graph(module)
    space = FusionSpace(graph)
    return random_moves(space, initial_plan(graph), random.Random(seed), moves, weights)
