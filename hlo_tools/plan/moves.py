"""The random moves: op fusion, duplicate fusion and AllReduce combination.

Each move makes up to ``tries`` random picks (a compute op and one of the producers its
group reads; or an all-reduce and a neighbouring one), asks legality
(:mod:`hlo_tools.plan.legality`) about each, and applies the first legal one, or returns
the plan unchanged. The picks are drawn as ``rng.choice`` draws them
(:mod:`hlo_tools.plan.draws`), and the tries run in the C kernel when it is there
(:mod:`hlo_tools.plan.kernel`), else here. :func:`random_moves` draws the kind of each move
as ``rng.choices`` does.

Given a ``trace`` list, the moves append a :class:`~hlo_tools.plan.legality.Try` for each
try (what was drawn and the decision); without one they record nothing and pay nothing.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from hlo_tools.plan.draws import _CHOICES, _bits, _chooser, _cumulative
from hlo_tools.plan.groups import _outside_operands, _successors
from hlo_tools.plan.kernel import _allreduce_c, _draws, _duplicate_c, _kernel, _op_fusion_c
from hlo_tools.plan.legality import (
    _BUCKET_CYCLE,
    _FUSED_PRODUCER,
    _KEYS_DIFFER,
    _NO_NEIGHBOUR,
    _NO_PRODUCER,
    _NOTHING_TO_DRAW,
    LEGAL,
    Try,
    _duplicate_rest,
    _multi_output_fusion,
    _single_output_fusion,
)
from hlo_tools.plan.merge import _combine_plan, _merge_runs, _with_copy
from hlo_tools.plan.neighbours import _ar_state, _neighbours
from hlo_tools.plan.space import FusionSpace, _ar, _ArTables
from hlo_tools.plan.value import Plan, _alone, _index, _single_output, _span, initial_plan


def op_fusion_move(space: FusionSpace, plan: Plan, rng: random.Random, tries: int = 8,
                   trace: list[Try] | None = None) -> Plan:
    """Fuses a random compute op's group with one of its producers' groups (or returns
    ``plan`` unchanged if ``tries`` random picks found no legal pair).

    Args:
        space: the plan's fusion space.
        plan: the plan to move from.
        rng: draws the picks.
        tries: how many picks to try.
        trace: if given, a :class:`~hlo_tools.plan.legality.Try` is appended for each try.
    """
    if not space.compute_nodes:
        if trace is not None:
            trace.append(Try("op_fusion", (), _NOTHING_TO_DRAW))
        return plan
    if space.multi_output:
        return _multi_output_fusion_move(space, plan, rng, tries, trace)
    index = _index(plan)
    ks = space._ks if space._ks is not None else _kernel(space)
    if ks:
        bits = _bits(rng)
        if bits is not None:
            found = _op_fusion_c(space, plan, index, ks, bits, tries, trace)
            if found is not NotImplemented:
                return plan if found is None else found
    held = index[0]
    order, pos, group = plan.order, plan.pos, plan.group
    nodes, fops, n = space.compute_nodes, space._fops, len(order)
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
            if trace is not None:
                trace.append(Try("op_fusion", (consumer,), _NO_PRODUCER))
            continue
        producer = choice(candidates)
        gp = group[producer]
        decision = _single_output_fusion(space, plan, index, producer, gp, consumer, gc, sc, ec)
        if trace is not None:
            trace.append(Try("op_fusion", (consumer, producer), decision))
        if decision is LEGAL:
            sp, ep = _span(plan, gp)
            return _merge_runs(space, plan, index, gp, sp, ep, gc, sc, ec, None,
                               _single_output(plan))
    return plan


def _multi_output_fusion_move(space: FusionSpace, plan: Plan, rng: random.Random, tries: int,
                              trace: list[Try] | None) -> Plan:
    """:func:`op_fusion_move` with multi-output fusion: a merge must create no cycle."""
    index = _index(plan)
    choice = _chooser(rng)
    group = plan.group
    for _ in range(tries):
        consumer, producer, gc, sc, ec = _random_edge(space, plan, index, choice)
        if producer is None:
            if trace is not None:
                trace.append(Try("op_fusion", (consumer,), _NO_PRODUCER))
            continue
        gp = group[producer]
        sp, ep = _span(plan, gp)
        succ = _successors(space, plan, index, gp, sp, ep)
        decision, reached = _multi_output_fusion(space, plan, index, gp, sp, ep, succ, gc, sc,
                                                 ec)
        if trace is not None:
            trace.append(Try("op_fusion", (consumer, producer), decision))
        if decision is LEGAL:
            return _merge_runs(space, plan, index, gp, sp, ep, gc, sc, ec, reached, False)
    return plan


def duplicate_fusion_move(space: FusionSpace, plan: Plan, rng: random.Random, tries: int = 8,
                          trace: list[Try] | None = None) -> Plan:
    """Fuses a random producer into a consumer group, keeping a copy for its other users
    (arguments as for :func:`op_fusion_move`)."""
    if not space.compute_nodes:
        if trace is not None:
            trace.append(Try("duplicate", (), _NOTHING_TO_DRAW))
        return plan
    index = _index(plan)
    ks = space._ks if space._ks is not None else _kernel(space)
    if ks:
        bits = _bits(rng)
        if bits is not None:
            found = _duplicate_c(space, plan, index, ks, bits, tries, trace)
            if found is not NotImplemented:
                return plan if found is None else found
    choice = _chooser(rng)
    for _ in range(tries):
        consumer, producer, gc, sc, ec = _random_edge(space, plan, index, choice)
        if producer is None:
            decision = _NO_PRODUCER
        elif not _alone(plan, producer):
            decision = _FUSED_PRODUCER
        else:  # fusible, outside the consumer group, read by it and not yet copied into it
            decision = _duplicate_rest(space, plan, index, producer, gc, sc, ec)
        if trace is not None:
            trace.append(Try("duplicate", (consumer,) if producer is None
                             else (consumer, producer), decision))
        if decision is LEGAL:
            return _with_copy(space, plan, index, producer, gc)
    return plan


def _random_edge(space: FusionSpace, plan: Plan, index: tuple[dict, dict],
                 choice: Callable[[Sequence], Any]) -> tuple[int, int | None, int, int, int]:
    """A random consumer, one of the fusible nodes outside its group that the group reads
    (None if there is none), the consumer's group and its span."""
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
    return consumer, (choice(candidates) if candidates else None), gid, s, e


def allreduce_move(space: FusionSpace, plan: Plan, rng: random.Random, tries: int = 8,
                   trace: list[Try] | None = None) -> Plan:
    """Combines a random all-reduce's bucket with a random neighbouring bucket (arguments
    as for :func:`op_fusion_move`)."""
    ars = space.allreduces
    if len(ars) < 2:
        if trace is not None:
            trace.append(Try("allreduce", (), _NOTHING_TO_DRAW))
        return plan
    tables = _ar(space)
    state = _ar_state(plan, tables)
    ks = space._ks if space._ks is not None else _kernel(space)
    bits = _bits(rng) if ks else None
    if state.buckets == 1:  # one bucket: no try finds a neighbour
        if bits is not None and trace is None:
            _draws(ks, bits, len(ars), tries)
        else:
            choice = _chooser(rng)
            for _ in range(tries):
                a = choice(ars)
                if trace is not None:
                    trace.append(Try("allreduce", (a,), _NO_NEIGHBOUR))
        return plan
    index = _index(plan)
    if bits is not None:
        found = _allreduce_c(space, plan, index, tables, state, ks, bits, tries, trace)
        if found.__class__ is not int:
            return plan if found is None else found
        tries = found  # the kernel declined the plan: the Python code makes the tries left
    return _allreduce_tries(space, plan, index, tables, _chooser(rng), tries, trace)


def _allreduce_tries(space: FusionSpace, plan: Plan, index: tuple[dict, dict],
                     tables: _ArTables, choice: Callable[[Sequence], Any], tries: int,
                     trace: list[Try] | None) -> Plan:
    """The tries of :func:`allreduce_move` (of a plan with two buckets or more)."""
    ars, group, key = space.allreduces, plan.group, tables.key
    for _ in range(tries):
        a = choice(ars)
        ga = group[a]
        neighbours = [b for b in _neighbours(space, plan, index, tables, a) if group[b] != ga]
        if not neighbours:
            if trace is not None:
                trace.append(Try("allreduce", (a,), _NO_NEIGHBOUR))
            continue
        b = choice(neighbours)
        # the checks of can_combine left: keys, then cycles
        merged = None if key[a] != key[b] else _combine_plan(space, plan, index, ga, group[b])
        if trace is not None:
            trace.append(Try("allreduce", (a, b), _KEYS_DIFFER if key[a] != key[b]
                             else _BUCKET_CYCLE if merged is None else LEGAL))
        if merged is not None:
            return merged
    return plan


MOVES = (op_fusion_move, duplicate_fusion_move, allreduce_move)


def random_moves(space: FusionSpace, plan: Plan, rng: random.Random, moves: int,
                 weights: tuple[float, float, float] = (0.6, 0.15, 0.25), *,
                 trace: list[Try] | None = None) -> Plan:
    """Applies ``moves`` random moves of all three kinds (op fusion, duplicate fusion,
    AllReduce combination, drawn with ``weights``).

    Args:
        space: the plan's fusion space.
        plan: the plan to start from.
        rng: draws the kinds of the moves and their picks.
        moves: how many moves to make (each may leave the plan as it is).
        weights: the weights of the three kinds, in the order of :data:`MOVES`.
        trace: if given, every try of every move is appended to it as a
            :class:`~hlo_tools.plan.legality.Try` (the draws and plans stay the same).
    """
    kinds = MOVES if trace is None else tuple(partial(m, trace=trace) for m in MOVES)
    cum = (_cumulative(weights, len(MOVES)) if moves > 0 and type(rng).choices is _CHOICES
           else None)
    if cum is None:
        for _ in range(moves):  # (raises as rng.choices does on bad weights)
            plan = rng.choices(kinds, weights)[0](space, plan, rng)
        return plan
    cum, total = cum
    draw, last = rng.random, len(MOVES) - 1
    for _ in range(moves):  # rng.choices(MOVES, weights)[0], the same draw
        plan = kinds[bisect_right(cum, draw() * total, 0, last)](space, plan, rng)
    return plan


def random_plan(module, seed: int, moves: int = 50, *,
                weights: tuple[float, float, float] = (0.6, 0.15, 0.25)) -> Plan:
    """A plan of ``moves`` random legal moves of all three kinds on ``module``'s
    per-device program (seeded: the same arguments give the same plan)."""
    from hlo_tools.graph import device_graph

    graph = device_graph(module)
    space = FusionSpace(graph)
    return random_moves(space, initial_plan(graph), random.Random(seed), moves, weights)
