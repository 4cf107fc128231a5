"""Merges: the arrays of a merged plan, its copies and its all-reduce state.

Merging group ``first`` with a later group ``second`` re-orders only the window between
them, as [not reached from ``first``] + [merged group] + [reached from ``first``], which
keeps a topological order in which every group is contiguous (adjacent groups keep the
arrays); positions are renumbered with numpy when the window is long. The copies held by
the merged groups follow the merge (:func:`_merged_dups`), and so does the plan's
all-reduce state (:func:`~hlo_tools.plan.neighbours._merged_ar_state`). :func:`fuse`,
:func:`duplicate` and :func:`combine` are the checked public forms.
"""

from __future__ import annotations

from array import array

import numpy as np

from hlo_tools.plan.groups import _successors
from hlo_tools.plan.legality import can_combine, can_duplicate, can_fuse
from hlo_tools.plan.neighbours import _merged_ar_state
from hlo_tools.plan.reach import _I32, _bucket_reach, _Runs, _window_reach
from hlo_tools.plan.space import FusionSpace
from hlo_tools.plan.value import (
    _NO_COPIES,
    Plan,
    _AddedCopy,
    _index,
    _plan,
    _single_output,
    _span,
)

#: Windows longer than this are renumbered with numpy.
_NUMPY_WINDOW = 24
#: With more reached groups than this, a merge partitions its window node by node, with
#: numpy when the window is longer than _PYTHON_PARTITION.
_NUMPY_GROUPS = 12
_PYTHON_PARTITION = 160


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
    dups, new_index = _merged_dups(plan, index, first, second, gid, other)
    state = getattr(plan, "_ars", None)
    if state is not None and not ar_kept:
        state = _merged_ar_state(state, plan.pos, new_pos, lo, hi, first, second, gid, other)
    return _plan(new_order, new_pos, new_group, dups, new_index, single, state)


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
                 other: int) -> tuple[frozenset, tuple[dict, dict]]:
    """``dups`` and the copy index after merging ``first`` and ``second`` into ``gid``:
    copies held by ``other`` move to ``gid``, copies of the merged members are dropped
    (both unchanged, as objects, when the merge changes no copies)."""
    held, holders = index
    moved = held.get(other, ())
    kept = held.get(gid, ())
    if not moved and not kept:  # (so nothing is dropped)
        return plan.dups, index
    group = plan.group
    dropped = {p for p in moved + kept if group[p] == first or group[p] == second}
    if not moved and not dropped:
        return plan.dups, index
    dups = frozenset((p, gid if g == other else g) for p, g in plan.dups
                     if not ((g == gid or g == other) and p in dropped))
    held, holders = dict(held), dict(holders)
    held.pop(other, None)
    now = tuple(sorted({*kept, *moved}.difference(dropped)))
    if now:
        held[gid] = now
    else:
        held.pop(gid, None)
    for p in {*kept, *moved}:
        gs = [g for g in holders[p] if g != other and g != gid]
        if p not in dropped:
            gs.append(gid)
        if gs:
            holders[p] = tuple(sorted(gs))
        else:
            del holders[p]
    return dups, ((held, holders) if held else _NO_COPIES)


def _with_copy(space: FusionSpace, plan: Plan, index: tuple[dict, dict], producer: int,
               gid: int) -> Plan:
    """``plan`` with a copy of ``producer`` in group ``gid`` (its copy index is built when
    first used)."""
    return _plan(plan.order, plan.pos, plan.group, plan.dups | {(producer, gid)},
                 _AddedCopy(index, producer, gid), _single_output(plan) and not space.multi_output,
                 getattr(plan, "_ars", None))


def _combine_plan(space: FusionSpace, plan: Plan, index: tuple[dict, dict], ga: int,
                  gb: int) -> Plan | None:
    """The plan with buckets ``ga`` and ``gb`` merged, or None if one depends on the other."""
    first, second = (ga, gb) if plan.pos[ga] < plan.pos[gb] else (gb, ga)
    s1, e1 = _span(plan, first)
    s2, e2 = _span(plan, second)
    return _combine_spans(space, plan, index, first, s1, e1, second, s2, e2)


def _combine_spans(space: FusionSpace, plan: Plan, index: tuple[dict, dict], first: int,
                   s1: int, e1: int, second: int, s2: int, e2: int) -> Plan | None:
    """:func:`_combine_plan` given the buckets in schedule order and their spans."""
    single = _single_output(plan)
    reached = _bucket_reach(space, plan, index, first, s1, e1, second, s2, e2, single)
    if reached is None:
        return None
    return _merge_runs(space, plan, index, first, s1, e1, second, s2, e2, reached, single)


def fuse(space: FusionSpace, plan: Plan, producer: int, consumer: int) -> Plan:
    """Non-duplicate fusion: the producer's group joins the consumer's group.

    By default the consumer's group must be the only reader of the producer's; with
    multi-output fusion (``FusionSpace.multi_output``) the producer's other users then
    read an output of the fused op. Raises ``ValueError`` with the reason (see
    :func:`~hlo_tools.plan.legality.can_fuse`) when the move is illegal.
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
