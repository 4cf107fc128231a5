"""Backtracking search over plans (Algorithm 1 of the DisCo paper, section 4.5).

A priority queue holds candidate plans ordered by predicted iteration time. Each step
takes the cheapest, applies each of the three kinds of move a random number of times in
``[0, beta]`` (op fusion, duplicate fusion, AllReduce combination), and costs the result
with the simulator. A candidate better than the best so far becomes the best; one within
``alpha`` times the best goes back into the queue. The search stops when the queue is
empty, when the best has not improved for ``patience`` steps, or when the time budget is
spent.

This module holds the compact core of the search: :func:`backtracking_search` and its
:class:`SearchResult`. The cost of a plan is any callable; the ``disco demo`` command
passes :func:`disco_jax.lower.simulate_plan`'s iteration time.
"""

from __future__ import annotations

import heapq
import random
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from hlo_tools import plan as P

__all__ = ["SearchResult", "backtracking_search"]


class SearchResult(NamedTuple):
    """Outcome of a search.

    Attributes:
        plan: the best plan found.
        cost_s: its predicted iteration time, seconds.
        initial_cost_s: predicted iteration time of the starting plan, seconds.
        evaluated: candidates costed.
        steps: queue pops.
        seconds: wall time spent.
    """

    plan: P.Plan
    cost_s: float
    initial_cost_s: float
    evaluated: int
    steps: int
    seconds: float


def _random_apply(space: P.FusionSpace, plan: P.Plan, move, rng: random.Random,
                  beta: int) -> P.Plan:
    """``RandomApply`` of Algorithm 1: ``move`` applied ``randint(0, beta)`` times."""
    for _ in range(rng.randint(0, beta)):
        plan = move(space, plan, rng)
    return plan


def backtracking_search(space: P.FusionSpace, start: P.Plan, cost: Callable[[P.Plan], float],
                        *, alpha: float = 1.05, beta: int = 10, patience: int = 1000,
                        time_budget_s: float = 60.0, seed: int = 0,
                        progress: bool = False) -> SearchResult:
    """Searches for the plan with the lowest ``cost`` (Algorithm 1 of the paper).

    Args:
        space: the fusion space of the graph.
        start: the plan to start from (usually :func:`hlo_tools.plan.initial_plan`).
        cost: predicted iteration time of a plan, seconds (the simulator).
        alpha: children costing at most ``alpha`` times the best are queued.
        beta: each kind of move is applied ``randint(0, beta)`` times per child.
        patience: stop after this many evaluated children without a new best.
        time_budget_s: stop after this many seconds.
        seed: seeds the moves; with the same inputs the search is deterministic as long
            as the time budget is not what stops it.
        progress: print the best cost and candidates/s to stderr.
    """
    rng = random.Random(seed)
    t0 = time.perf_counter()
    best, best_cost = start, cost(start)
    initial = best_cost
    queue, tie = [(best_cost, 0, start)], 1
    seen = {start.key()}
    evaluated = steps = unchanged = 0
    while queue and unchanged < patience and time.perf_counter() - t0 < time_budget_s:
        _, _, plan = heapq.heappop(queue)
        steps += 1
        for move in P.MOVES:
            child = _random_apply(space, plan, move, rng, beta)
            key = child.key()
            if key in seen:
                continue
            seen.add(key)
            c = cost(child)
            evaluated += 1
            if c < best_cost:
                best, best_cost, unchanged = child, c, 0
            else:
                unchanged += 1
            if c <= alpha * best_cost:
                heapq.heappush(queue, (c, tie, child))
                tie += 1
        if progress and steps % 20 == 0:
            rate = evaluated / (time.perf_counter() - t0)
            print(f"\r  search: {evaluated} candidates, best {best_cost * 1e3:.3f} ms "
                  f"({initial / best_cost:.2f}x predicted), {rate:.0f} candidates/s ",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return SearchResult(best, best_cost, initial, evaluated, steps, time.perf_counter() - t0)
