"""Legality: whether a move may be made, and if not, why (a :class:`Decision`).

:func:`can_fuse`, :func:`can_duplicate` and :func:`can_combine` answer for any pair of
nodes. The moves (:mod:`hlo_tools.plan.moves`) ask the same checks, in the same order, on
the pairs they draw: :func:`_single_output_fusion`, :func:`_multi_output_fusion`,
:func:`_duplicate_rest` and, for buckets,
:func:`~hlo_tools.plan.reach._bucket_reach`; they record what each try decided as a
:class:`Try` when asked. The C kernel (:mod:`hlo_tools.plan.kernel`) ports these checks
for speed and mirrors them.
"""

from __future__ import annotations

from typing import NamedTuple

from hlo_tools.graph import NodeKind
from hlo_tools.plan.groups import (
    _feeds_only,
    _feeds_only_node,
    _is_read_outside,
    _outside_operands,
    _successors,
)
from hlo_tools.plan.reach import _bucket_reach, _window_reach
from hlo_tools.plan.space import FusionSpace, _ar
from hlo_tools.plan.value import Plan, _alone, _index, _single_output, _span


class Decision(NamedTuple):
    """A legality answer that carries its reason (truthy when legal)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


LEGAL = Decision(True, "legal")
# The refusals the moves meet (made once: the moves often refuse).
_SAME_GROUP = Decision(False, "already in the same group")
_NOT_FEEDING = Decision(False, "producer group does not feed the consumer group")
_NEEDS_MULTI_OUTPUT = Decision(False, "producer has users outside the consumer group: that "
                               "needs a multi-output fusion (disabled on this backend; "
                               "duplicate the producer instead)")
_CYCLE = Decision(False, "fusing would create a cycle (another path joins them)")
_LAYOUT_UNSAFE = Decision(False, "the consumer may not read the producer inside a fusion at "
                          "this operand position (hlo_tools.opcodes.FUSED_OPERAND_POSITIONS: "
                          "a select's on-true/on-false value has no layout on XLA:CPU; a "
                          "broadcast would recompute its operand per output element)")
_COMPARES_COPY = Decision(False, "a compare in the fusion would read a duplicated copy (or a "
                          "value computed from one): a copy recomputed inside a fusion may "
                          "differ from the original in the last bit (XLA:CPU contracts a "
                          "multiply and an add into one FMA there), and a compare of the two "
                          "versions can take the other branch")
_FUSED_PRODUCER = Decision(False, "only unfused producers are duplicated")
_NO_OTHER_USERS = Decision(False, "producer has no other users: use plain fusion")
_EXPOSES_MEMBER = Decision(False, "the copy would read a value inside another fusion, giving "
                           "that fusion a second output (multi-output fusion is disabled)")
_SAME_BUCKET = Decision(False, "already in the same bucket")
_KEYS_DIFFER = Decision(False, "all-reduces differ in replica groups, reduction or type")
_BUCKET_CYCLE = Decision(False, "one bucket depends on the other (would create a cycle)")
# What else a try of a move can meet (its draws found no pair to ask legality about).
_NO_PRODUCER = Decision(False, "the consumer group reads no fusible node outside it")
_NO_NEIGHBOUR = Decision(False, "no neighbouring bucket")
_NOTHING_TO_DRAW = Decision(False, "nothing to draw (no compute op, or fewer than two "
                            "combinable all-reduces)")


class Try(NamedTuple):
    """One try of a move and its decision, as the moves record them when asked (the
    ``trace`` argument of :func:`~hlo_tools.plan.moves.random_moves`).

    Attributes:
        move: ``"op_fusion"``, ``"duplicate"`` or ``"allreduce"``.
        drawn: the nodes drawn, in draw order: the consumer, then the producer (fusion
            moves), or an all-reduce, then its neighbour (AllReduce moves); fewer when the
            first has none to pair with, none when there was nothing to draw.
        decision: :data:`LEGAL` for the try that made the move, else why not.
    """

    move: str
    drawn: tuple[int, ...]
    decision: Decision


def can_fuse(space: FusionSpace, plan: Plan, producer: int, consumer: int) -> Decision:
    """Whether the group of ``producer`` may be fused into the group of ``consumer``.

    Legal when both are fusible compute groups, the producer's group feeds the
    consumer's group, no node of the fusion would read another at an operand position
    the backend cannot fuse, no compare in it would read a duplicated copy, and either the
    consumer's group is the only reader of the producer's (single-output fusion, the
    default) or, with multi-output fusion, merging them creates no cycle (no other path
    from the producer group to the consumer group).

    A refusal carries the first failing check, in this order: the same group, an unfusible
    node, no edge between the groups; then with single output another reader of the
    producer's group (or the program root in it), an operand position, a compare; with
    multi-output fusion an operand position, a cycle, a compare. The op fusion move asks
    the same checks in the same order (:func:`_single_output_fusion`,
    :func:`_multi_output_fusion`).
    """
    gp, gc = plan.group[producer], plan.group[consumer]
    if gp == gc:
        return _SAME_GROUP
    for node, role in ((producer, "producer"), (consumer, "consumer")):
        if not space.fusible[node]:
            return _unfusible(space, node, role)
    index = _index(plan)
    sp, ep = _span(plan, gp)
    users = _successors(space, plan, index, gp, sp, ep)
    if gc not in users:
        return _NOT_FEEDING
    sc, ec = _span(plan, gc)
    if space.multi_output:
        return _multi_output_fusion(space, plan, index, gp, sp, ep, users, gc, sc, ec)[0]
    return _single_output_fusion(space, plan, index, producer, gp, consumer, gc, sc, ec)


def _single_output_fusion(space: FusionSpace, plan: Plan, index: tuple[dict, dict],
                          producer: int, gp: int, consumer: int, gc: int, sc: int,
                          ec: int) -> Decision:
    """Whether group ``gp`` (of ``producer``) may join group ``gc`` (of ``consumer``, span
    ``sc:ec``), which reads ``producer``, into a single-output fusion: :func:`can_fuse`
    after its first checks, and the op fusion move's checks (cheapest first: the
    producer's own readers before the rest of its group's)."""
    group = plan.group
    held, holders = index
    if gp == group[space.root] or not _feeds_only_node(space, group, holders, producer, gp,
                                                       gc):
        return _NEEDS_MULTI_OUTPUT
    order, n = plan.order, len(plan.order)
    sp = ep = plan.pos[producer]  # the producer group's span (most groups are single nodes)
    while sp and group[order[sp - 1]] == gp:
        sp -= 1
    ep += 1
    while ep < n and group[order[ep]] == gp:
        ep += 1
    if ep - sp > 1 and not _feeds_only(space, plan, holders, gp, sp, ep, gc):
        return _NEEDS_MULTI_OUTPUT
    if space._any_bad:
        if ep - sp == 1 and ec - sc == 1 and gp not in held and gc not in held:
            bad = space._bad[consumer]  # _layout_safe of two single nodes
            if bad is not None and producer in bad:
                return _LAYOUT_UNSAFE
        elif not _layout_safe(space, plan, index, gp, sp, ep, gc, sc, ec):
            return _LAYOUT_UNSAFE
    if held and space._any_compare and _compare_reads_copy(space, plan, index, gp, sp, ep, gc,
                                                           sc, ec):
        return _COMPARES_COPY
    return LEGAL


def _multi_output_fusion(space: FusionSpace, plan: Plan, index: tuple[dict, dict], gp: int,
                         sp: int, ep: int, succ: set[int], gc: int, sc: int,
                         ec: int) -> tuple[Decision, dict[int, tuple[int, int]] | None]:
    """Whether group ``gp`` (span ``sp:ep``, read by the groups ``succ``) may join group
    ``gc`` (span ``sc:ec``), one of them, into a multi-output fusion: :func:`can_fuse`
    after its first checks, and the groups between them that ``gp`` reaches (which the
    merge moves after the fused group; None when refused)."""
    if space._any_bad and not _layout_safe(space, plan, index, gp, sp, ep, gc, sc, ec):
        return _LAYOUT_UNSAFE, None
    reached = _window_reach(space, plan, index, gp, succ, gc, sc)
    if reached is None:
        return _CYCLE, None
    if space._any_compare and _compare_reads_copy(space, plan, index, gp, sp, ep, gc, sc, ec):
        return _COMPARES_COPY, None
    return LEGAL, reached


def _layout_safe(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ga: int, sa: int,
                 ea: int, gb: int, sb: int, eb: int, extra: int | None = None) -> bool:
    """Whether no node of a would-be fusion of groups ``ga`` (span ``sa:ea``) and ``gb``
    (members, copies and ``extra``) reads another one at an operand position XLA:CPU
    cannot fuse (:data:`hlo_tools.opcodes.FUSED_OPERAND_POSITIONS`, and the shared
    operands of a fused reduce, see ``FusionSpace.shared_reduce_operands``)."""
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
    """The refusal for an unfusible ``node`` (the ``role`` it would play: producer or
    consumer), saying what kind of node it is."""
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
        return _FUSED_PRODUCER
    if (producer, gc) in plan.dups:
        return Decision(False, "the consumer group already holds a copy of the producer")
    index = _index(plan)
    sc, ec = _span(plan, gc)
    if producer not in _outside_operands(space, plan, index, gc, sc, ec, space._dops):
        return Decision(False, "the consumer group does not read the producer")
    return _duplicate_rest(space, plan, index, producer, gc, sc, ec)


def _duplicate_rest(space: FusionSpace, plan: Plan, index: tuple[dict, dict], producer: int,
                    gc: int, sc: int, ec: int) -> Decision:
    """The last checks of :func:`can_duplicate` (layout, other users, exposed values,
    compares), which the duplicate fusion move makes on an unfused producer the consumer
    group (span ``sc:ec``) reads."""
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


def can_combine(space: FusionSpace, plan: Plan, a: int, b: int) -> Decision:
    """Whether the buckets of all-reduces ``a`` and ``b`` may become one bucket.

    Both must be gradient all-reduces of more than one element with the same replica
    groups, reduction and element type, and neither bucket may depend on the other (that
    would be a cycle). (The AllReduce move picks only neighbouring buckets, see
    :func:`~hlo_tools.plan.neighbours.allreduce_neighbours`; legality does not ask it.)
    """
    ga, gb = plan.group[a], plan.group[b]
    if ga == gb:
        return _SAME_BUCKET
    tables = _ar(space)
    if a not in tables.members or b not in tables.members:
        return Decision(False, "only gradient all-reduces of more than one element are "
                        "combined")
    if tables.key[a] != tables.key[b]:
        return _KEYS_DIFFER
    first, second = (ga, gb) if plan.pos[ga] < plan.pos[gb] else (gb, ga)
    s1, e1 = _span(plan, first)
    s2, e2 = _span(plan, second)
    if _bucket_reach(space, plan, _index(plan), first, s1, e1, second, s2, e2,
                     _single_output(plan)) is None:
        return _BUCKET_CYCLE
    return LEGAL
