"""AllReduce neighbours and the per-plan all-reduce facts they are read from.

Two gradient all-reduces are neighbours when the groups producing their gradients are the
same or read one another, or when they are adjacent in order of gradient production
(:func:`allreduce_neighbours`). A plan keeps its rank nodes in schedule order and the
all-reduces each fused group ranks (:class:`_ArState`); merges keep that state up to date
(:func:`_merged_ar_state`) instead of recomputing it.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from typing import NamedTuple

from hlo_tools.plan.groups import _successors
from hlo_tools.plan.space import FusionSpace, _ar, _ArTables
from hlo_tools.plan.value import Plan, _alone, _index, _span


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
