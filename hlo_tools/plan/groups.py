"""The edges between a plan's groups: what a group reads, who reads it, dead groups.

A group reads the operands of its members and of the copies it holds (a copy reads its
producer's operands from inside the group that holds it); a group is read by the users of
its members, except by groups that hold their own copy of the member, and by the copies
held elsewhere that read a member. The functions taking a copy index (``index``, see
:func:`~hlo_tools.plan.value._index`) and a span are the fast forms the moves use.
"""

from __future__ import annotations

from array import array

from hlo_tools.plan.space import FusionSpace
from hlo_tools.plan.value import Plan, _index, _span


def _outside_operands(space: FusionSpace, plan: Plan, index: tuple[dict, dict], gid: int,
                      s: int, e: int, table: tuple[tuple[int, ...], ...]):
    """Distinct nodes outside group ``gid`` (span ``s:e``) that it reads, among those listed
    by ``table`` (distinct operands, or fusible ones), in the order members (in schedule
    order), then copies (in ascending order) read them; copies count as inside."""
    order, group = plan.order, plan.group
    copies = index[0].get(gid, ())
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
