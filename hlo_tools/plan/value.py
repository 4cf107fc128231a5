"""The plan value and the facts read off it alone.

A :class:`Plan` is four fields (schedule order, its inverse, group ids, duplicated
producers). Plans made by the package also carry private facts its moves keep up to date
(:func:`_plan`): the copy index (:func:`_index`), whether every fusion group has one output
(:func:`_single_output`) and the all-reduce state (:class:`~hlo_tools.plan.neighbours._ArState`).
A group is a contiguous run of ``order`` (:func:`_span`, :func:`members`), and
:func:`group_outputs` is the one rule of which members of a group are read outside it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from hlo_tools.graph import DeviceGraph

if TYPE_CHECKING:
    from hlo_tools.plan.neighbours import _ArState


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

    A plan is an immutable 4-tuple of these fields. Plans made by the package's functions
    also carry private derived facts that moves keep up to date instead of recomputing (an
    index of ``dups``, see :func:`_index`; the producers of the gradients in schedule order;
    flags);
    they are not part of its value: a plan made otherwise, copied or unpickled works the
    same, the facts being rebuilt on first use.
    """

    def __reduce__(self):
        return Plan, tuple(self)

    def to_json(self) -> dict[str, list]:
        """The plan as JSON lists: ``{"order": [N], "group": [N], "dups": [[p, g], ...]}``
        (``dups`` sorted); :meth:`from_json` reads it back."""
        return {"order": list(self.order), "group": list(self.group),
                "dups": sorted([int(p), int(g)] for p, g in self.dups)}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        """The plan of :meth:`to_json`'s dict.

        Raises:
            ValueError: ``order`` is not a permutation or ``group`` has another length.
        """
        order = array("i", (int(v) for v in data["order"]))
        group = array("i", (int(v) for v in data["group"]))
        if sorted(order) != list(range(len(order))) or len(group) != len(order):
            raise ValueError("plan JSON: order is not a permutation of the group's nodes")
        pos = array("i", bytes(4 * len(order)))
        for k, node in enumerate(order):
            pos[node] = k
        return cls(order, pos, group, frozenset((int(p), int(g)) for p, g in data["dups"]))

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
          index: tuple[dict, dict] | _AddedCopy, single: bool, ar_state: _ArState | None
          ) -> Plan:
    """A new plan with its private attributes: the copy index (see :func:`_index`), the
    single-output flag (:func:`_single_output`) and the all-reduce state
    (:func:`~hlo_tools.plan.neighbours._ar_state`)."""
    plan = _new_tuple(Plan, (order, pos, group, dups))
    plan._ix = index
    plan._single = single
    if ar_state is not None:
        plan._ars = ar_state
    return plan


def _single_output(plan: Plan) -> bool:
    """Whether every fusion group of ``plan`` was built by the package's moves under the
    single-output rules (``multi_output=False``): each group then has at most one member
    whose value leaves it, and every member reaches that one. Group-level reachability is
    then node-level reachability, which :func:`~hlo_tools.plan.reach._descendant_groups`
    uses. False for plans made in another way (or with multi-output fusions)."""
    return getattr(plan, "_single", False)


class _AddedCopy(NamedTuple):
    """The copy index of a plan made by :func:`~hlo_tools.plan.merge._with_copy`, not built
    yet: the index of the plan it was made from and the copy it added (many such plans are
    never moved from)."""

    index: tuple[dict, dict]
    producer: int
    gid: int

    def build(self) -> tuple[dict, dict]:
        held, holders = self.index
        held, holders = dict(held), dict(holders)
        held[self.gid] = tuple(sorted((*held.get(self.gid, ()), self.producer)))
        holders[self.producer] = tuple(sorted((*holders.get(self.producer, ()), self.gid)))
        return held, holders


def _index(plan: Plan) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """The plan's copy index: (group -> producers it holds copies of, producer -> groups
    holding a copy of it), each tuple in ascending order: a function of ``plan.dups``
    alone. (The order of a group's copies is the order in which the moves list the
    producers it reads, see :func:`~hlo_tools.plan.groups._outside_operands`.)"""
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
    for p, g in sorted(plan.dups):
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
