"""Reachability in a plan's schedule window: cycle checks and the groups a merge moves.

In a topological order a path between two groups can only pass through the groups
scheduled between them (the *window*), so both the cycle check of a merge and the groups
that must move after the merged group are found there: by a walk of the window
(:func:`_window_reach`), or, for buckets of a single-output plan, from the graph's static
node-level descendants (:func:`_descendant_groups`, cached per bucket on the space).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from itertools import chain
from operator import sub

import numpy as np

from hlo_tools.plan.groups import _successors
from hlo_tools.plan.space import FusionSpace
from hlo_tools.plan.value import Plan, _span

# Where the work moves from Python loops to numpy (the results are the same).
_I32 = np.dtype(np.int32)
#: Above this many descendants to look up, :func:`_descendant_groups` uses numpy.
_NUMPY_DESCENDANTS = 256
#: How many buckets' descendants a space keeps (it forgets them all when full).
_BUCKET_CACHE = 512
#: :func:`_descendant_groups` cannot answer: walk the window instead.
_WALK = object()


def _bucket_reach(space: FusionSpace, plan: Plan, index: tuple[dict, dict], first: int,
                  s1: int, e1: int, second: int, s2: int, e2: int, single: bool):
    """The groups scheduled between buckets ``first`` (span ``s1:e1``) and ``second`` (span
    ``s2:e2``, later) that ``first`` reaches, in one of the forms
    :func:`~hlo_tools.plan.merge._merge_runs` takes; None if ``first`` reaches ``second``
    (merging them would be a cycle).

    They are found from the static node-level descendants of ``first``'s members when that
    is exact (``single``: the plan is single-output, see :func:`_descendant_groups`), else
    by a walk of the window."""
    reached = _descendant_groups(space, plan, first, s1, e1, s2, e2) if single else _WALK
    if reached is _WALK:
        succ = _successors(space, plan, index, first, s1, e1)
        reached = None if second in succ else _window_reach(space, plan, index, first, succ,
                                                            second, s2)
    return reached


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
    """For a single-output plan (:func:`~hlo_tools.plan.value._single_output`), the groups
    scheduled between group ``first`` (span ``s1:e1``) and position ``s2`` that ``first``
    reaches (their runs as :class:`_Runs`, or an array of group ids with repeats), or None
    if it reaches the group at ``s2:e2``.

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
    adjacent ranges joined: the groups a merge moves, as
    :func:`~hlo_tools.plan.merge._merge_runs` takes them."""


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
