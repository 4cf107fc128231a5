"""Backtracking search over plans (Algorithm 1 of the DisCo paper, section 4.5).

A priority queue holds candidate plans ordered by predicted iteration time. Each step
takes the cheapest, applies each of the three kinds of move a random number of times in
``[0, beta]`` (op fusion, duplicate fusion, AllReduce combination), and costs the result
with the simulator. A candidate better than the best so far becomes the best; one within
``alpha`` times the best goes back into the queue. The search stops when the queue is
empty, when the best has not improved for ``patience`` evaluated candidates, when the
time budget is spent, or when the caller's ``stop`` callable says so (``disco optimize``
sets it on SIGINT/SIGTERM): the best plan so far is the result in every case.

A memory budget (``memory_budget_bytes``) refuses every plan whose predicted peak memory
(the simulator's live-range estimate, :attr:`disco_estimator.costs.simulator.SimResult.peak_bytes`)
exceeds it: such a plan costs infinity, so it is never the best, never among the ``top``
plans and never queued; the refusals are counted (:attr:`SearchStats.over_budget`). Duplicate
fusion keeps a duplicated producer's operands live until the last copy runs, so a plan
that duplicates a cheap producer of a large tensor into late consumers raises the
predicted peak, and the budget refuses it rather than letting memory grow silently.

Two entry points share one loop:

* :func:`search`, the product form: a graph and a cost model in, a :class:`SearchOutcome`
  out. The queue starts from the no-fusion plan *and* every start plan (by default the
  baselines expressible as plans, :func:`baseline_plans`: flat gradient buckets of at most
  T bytes for T in :data:`BUCKET_THRESHOLDS`, when :func:`hlo_tools.plan.bucket_plan` is
  available), so the result is never predicted worse than any of them. Its parameters come
  from ``disco_jax/configs/search.toml`` (:func:`load_config`), overridable by arguments.
  It shows a ``rich`` progress line (best cost, candidates/s) when stderr is a terminal.
* :func:`backtracking_search`, the compact core: any cost callable, one start plan.

Both are seeded: for a seed and the same inputs they evaluate the same candidates in the
same order and return the same plan, as long as the time budget is not what stops them.
A candidate whose plan key (:meth:`hlo_tools.plan.Plan.key`) was seen before is skipped
without being costed or counted (its cost is that of the first plan with the key).
"""

from __future__ import annotations

import heapq
import importlib.resources
import math
import random
import sys
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from disco_estimator.costs.cost_model import CostModel
from disco_estimator.costs.lower import sim_graph
from disco_estimator.costs.simulator import full_overlap_bound, simulate
from disco_jax.pipeline.sync import SOLO, Sync
from disco_jax.units import format_bytes
from hlo_tools import plan as P
from hlo_tools.graph import DeviceGraph

__all__ = [
    "BUCKET_THRESHOLDS",
    "NO_FUSION",
    "MemoryBudgetError",
    "STOP_INTERRUPTED",
    "STOP_PATIENCE",
    "STOP_QUEUE_EMPTY",
    "STOP_TIME_BUDGET",
    "SearchConfig",
    "SearchOutcome",
    "SearchResult",
    "SearchStats",
    "backtracking_search",
    "baseline_plans",
    "load_config",
    "plans_for_choice",
    "search",
    "SearchedPlans",
]

#: Name of the no-fusion start plan (every node its own group), always in the queue.
NO_FUSION = "no_fusion"
#: Bucket thresholds of the ``bucketed`` start plans, bytes (None: one bucket): the
#: hand-bucketing sweep's (:data:`hlo_tools.plan.BUCKET_THRESHOLDS`).
BUCKET_THRESHOLDS = P.BUCKET_THRESHOLDS

#: Stop reason: ``patience`` candidates in a row did not improve the best.
STOP_PATIENCE = "patience"
#: Stop reason: the time budget was spent.
STOP_TIME_BUDGET = "time_budget"
#: Stop reason: the queue ran empty.
STOP_QUEUE_EMPTY = "queue_empty"
#: Stop reason: the caller's ``stop`` callable returned True (e.g. after Ctrl-C).
STOP_INTERRUPTED = "interrupted"


class MemoryBudgetError(ValueError):
    """No start plan fits the memory budget (not even the no-fusion plan).

    Attributes:
        budget_bytes: the budget, bytes.
        smallest_peak_bytes: the smallest predicted peak memory of a start plan, bytes.
    """

    def __init__(self, budget_bytes: int, smallest_peak_bytes: int):
        super().__init__(
            f"no plan fits the memory budget: the smallest predicted peak memory of a "
            f"start plan is {format_bytes(smallest_peak_bytes)}, the budget "
            f"{format_bytes(budget_bytes)}")
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest_peak_bytes


_CONFIG_KEYS = {"alpha": float, "beta": int, "patience": int, "time_budget_s": float}


class SearchConfig(NamedTuple):
    """Parameters of a search.

    Attributes:
        alpha: children predicted at most ``alpha`` times the best are queued (>= 1).
        beta: each kind of move is applied ``randint(0, beta)`` times per child (>= 0).
        patience: stop after this many evaluated candidates without a new best (>= 1).
        time_budget_s: stop after this many seconds (> 0; ``math.inf``: no limit).
    """

    alpha: float
    beta: int
    patience: int
    time_budget_s: float

    def check(self) -> SearchConfig:
        """Returns ``self``; raises ValueError for a value out of range."""
        if not (self.alpha >= 1.0 and math.isfinite(self.alpha)):
            raise ValueError(f"alpha must be a finite number >= 1, got {self.alpha}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not self.time_budget_s > 0:
            raise ValueError(f"time_budget_s must be > 0, got {self.time_budget_s}")
        return self


def load_config(path: str | None = None) -> SearchConfig:
    """The search parameters of a TOML file's ``[search]`` table.

    Args:
        path: the file (default: the packaged ``disco_jax/configs/search.toml``, read with
            :mod:`importlib.resources`).

    Raises:
        ValueError: a key is missing, unknown or out of range.
    """
    if path is None:
        resource = importlib.resources.files("disco_jax") / "configs" / "search.toml"
        raw = tomllib.loads(resource.read_text(encoding="utf-8"))
        where = "disco_jax/configs/search.toml"
    else:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
        where = str(path)
    table = raw.get("search")
    if not isinstance(table, dict):
        raise ValueError(f"{where}: no [search] table")
    unknown = sorted(set(table) - set(_CONFIG_KEYS))
    missing = sorted(set(_CONFIG_KEYS) - set(table))
    if unknown or missing:
        raise ValueError(f"{where}: [search] unknown keys {unknown}, missing keys {missing}")
    try:
        return SearchConfig(**{k: kind(table[k]) for k, kind in _CONFIG_KEYS.items()}).check()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


class SearchStats(NamedTuple):
    """What a search did.

    Attributes:
        evaluated: candidates costed (start plans included), each once per plan key.
        pops: plans taken from the queue and expanded.
        duplicates: children skipped because a plan with their key was already seen.
        seconds: wall time of the whole search, start plans and final bound included.
        stop_reason: :data:`STOP_PATIENCE`, :data:`STOP_TIME_BUDGET`,
            :data:`STOP_QUEUE_EMPTY` or :data:`STOP_INTERRUPTED`.
        over_budget: evaluated candidates refused because their predicted peak memory
            exceeded the memory budget (start plans included).
    """

    evaluated: int
    pops: int
    duplicates: int
    seconds: float
    stop_reason: str
    over_budget: int = 0

    @property
    def candidates_per_s(self) -> float:
        """Evaluated candidates per second of wall time."""
        return self.evaluated / self.seconds if self.seconds > 0 else 0.0


class SearchOutcome(NamedTuple):
    """Result of :func:`search`.

    Attributes:
        plan: the best plan found.
        cost_s: its predicted iteration time, seconds.
        start_costs_s: predicted iteration time of each start plan by name, seconds
            (:data:`NO_FUSION` first, then the seeded start plans in the order given;
            ``math.inf``: refused, over the memory budget).
        best_start: name of the cheapest start plan.
        fo_bound_s: full-overlap bound of the best plan
            (:func:`disco_estimator.costs.simulator.full_overlap_bound` of its SimGraph), seconds.
        stats: the :class:`SearchStats`.
        config: the parameters the search ran with.
        seed: the seed it ran with.
        top: the ``top_k`` cheapest distinct plans evaluated (by plan key), as
            ``(plan, predicted seconds)``, cheapest first; ``top[0]`` is the best plan.
            They are the candidates a final choice by measurement runs.
        peak_bytes: predicted peak memory of the best plan, bytes (persistent buffers
            -- parameters, constants -- included).
        memory_budget_bytes: the budget the search ran with (None: none).
    """

    plan: P.Plan
    cost_s: float
    start_costs_s: dict[str, float]
    best_start: str
    fo_bound_s: float
    stats: SearchStats
    config: SearchConfig
    seed: int
    top: tuple[tuple[P.Plan, float], ...] = ()
    peak_bytes: int = 0
    memory_budget_bytes: int | None = None

    def start_costs_json(self) -> dict[str, float | None]:
        """``start_costs_s`` for JSON: a start refused by the memory budget is None."""
        return {name: (None if c == math.inf else c) for name, c in self.start_costs_s.items()}


class SearchResult(NamedTuple):
    """Outcome of :func:`backtracking_search`.

    Attributes:
        plan: the best plan found.
        cost_s: its predicted iteration time, seconds.
        initial_cost_s: predicted iteration time of the starting plan, seconds.
        evaluated: candidates costed (the start included).
        steps: queue pops.
        seconds: wall time spent.
    """

    plan: P.Plan
    cost_s: float
    initial_cost_s: float
    evaluated: int
    steps: int
    seconds: float


# --------------------------------------------------------------------------- start plans


def baseline_plans(space: P.FusionSpace) -> dict[str, P.Plan]:
    """The baselines expressible as plans, by name: no fusion, and -- when
    ``hlo_tools.plan.bucket_plan`` exists -- flat gradient buckets in order of production,
    each at most T bytes, for T in :data:`BUCKET_THRESHOLDS` (``bucketed_1MiB`` ...
    ``bucketed_one``)."""
    plans = {NO_FUSION: P.initial_plan(space.graph)}
    bucket_plan = getattr(P, "bucket_plan", None)
    if bucket_plan is not None:
        for threshold in BUCKET_THRESHOLDS:
            plans[P.bucketed_name(threshold)] = bucket_plan(space, threshold)
    return plans


# --------------------------------------------------------------------------- the loop


class _Progress:
    """A ``rich`` status line on stderr (best cost, candidates/s), or nothing."""

    def __init__(self, enabled: bool):
        self._live = None
        self._last = 0.0
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._bar = Progress(SpinnerColumn(), TextColumn("search: {task.description}"),
                             TimeElapsedColumn(), console=Console(stderr=True),
                             transient=True)
        self._task = self._bar.add_task("starting", total=None)
        self._bar.start()
        self._live = True

    def update(self, now: float, t0: float, evaluated: int, best: float, first: float,
               force: bool = False) -> None:
        if self._live is None or (not force and now - self._last < 0.2):
            return
        self._last = now
        rate = evaluated / max(now - t0, 1e-9)
        self._bar.update(self._task, description=(
            f"best {best * 1e3:.3f} ms ({first / best:.2f}x the best start), "
            f"{evaluated} candidates, {rate:.0f} candidates/s"))

    def close(self) -> None:
        if self._live is not None:
            self._bar.stop()
            self._live = None


class _Loop(NamedTuple):
    plan: P.Plan
    cost_s: float
    evaluated: int
    pops: int
    duplicates: int
    stop_reason: str
    top: tuple[tuple[P.Plan, float], ...]


class _Top:
    """The ``k`` cheapest plans offered (each key offered once), kept in a max-heap."""

    def __init__(self, k: int):
        self.k, self._heap, self._tie = k, [], 0

    def offer(self, plan: P.Plan, cost: float) -> None:
        if self.k <= 0 or cost == math.inf:  # refused (over the memory budget)
            return
        self._tie += 1
        item = (-cost, -self._tie, plan)
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, item)
        elif cost < -self._heap[0][0]:
            heapq.heapreplace(self._heap, item)

    def sorted(self) -> tuple[tuple[P.Plan, float], ...]:
        return tuple((plan, -neg) for neg, _, plan in sorted(self._heap, reverse=True))


def _random_apply(space: P.FusionSpace, plan: P.Plan, move, rng: random.Random,
                  beta: int) -> P.Plan:
    """``RandomApply`` of Algorithm 1: ``move`` applied ``randint(0, beta)`` times."""
    for _ in range(rng.randint(0, beta)):
        plan = move(space, plan, rng)
    return plan


def _loop(space: P.FusionSpace, starts: Iterable[tuple[P.Plan, float]],
          cost: Callable[[P.Plan], float], config: SearchConfig, rng: random.Random,
          seen: dict, t0: float, show: _Progress, top_k: int = 1,
          stop_now: Callable[[], bool] | None = None,
          moves: tuple[Callable[..., P.Plan], ...] = P.MOVES) -> _Loop:
    """Algorithm 1 from costed start plans (``seen`` holds their keys already); asks
    ``stop_now`` (when given) before each pop."""
    queue: list[tuple[float, int, P.Plan]] = []
    best, best_cost = None, math.inf
    top = _Top(top_k)
    for tie, (plan, c) in enumerate(starts):
        queue.append((c, tie, plan))
        top.offer(plan, c)
        if c < best_cost:
            best, best_cost = plan, c
    heapq.heapify(queue)
    tie = len(queue)
    first = best_cost
    evaluated = len(seen)
    pops = duplicates = unchanged = 0
    alpha, beta, patience, deadline = (config.alpha, config.beta, config.patience,
                                       t0 + config.time_budget_s)
    stop = STOP_QUEUE_EMPTY
    while queue:
        now = time.perf_counter()
        if unchanged >= patience:
            stop = STOP_PATIENCE
            break
        if now >= deadline:
            stop = STOP_TIME_BUDGET
            break
        if stop_now is not None and stop_now():
            stop = STOP_INTERRUPTED
            break
        show.update(now, t0, evaluated, best_cost, first)
        _, _, plan = heapq.heappop(queue)
        pops += 1
        for move in moves:
            child = _random_apply(space, plan, move, rng, beta)
            key = child.key()
            if key in seen:
                duplicates += 1
                continue
            c = cost(child)
            seen[key] = c
            evaluated += 1
            top.offer(child, c)
            if c < best_cost:
                best, best_cost, unchanged = child, c, 0
            else:
                unchanged += 1
            if c <= alpha * best_cost:
                heapq.heappush(queue, (c, tie, child))
                tie += 1
    show.update(time.perf_counter(), t0, evaluated, best_cost, first, force=True)
    return _Loop(best, best_cost, evaluated, pops, duplicates, stop, top.sorted())


# --------------------------------------------------------------------------- entry points


def search(graph: DeviceGraph, costs: CostModel, *, seed: int = 0,
           time_budget_s: float | None = None, alpha: float | None = None,
           beta: int | None = None, patience: int | None = None,
           start_plans: Mapping[str, P.Plan] | None = None, progress: bool | None = None,
           space: P.FusionSpace | None = None, config: SearchConfig | None = None,
           top_k: int = 3, stop: Callable[[], bool] | None = None,
           memory_budget_bytes: int | None = None, buckets_only: bool = False
           ) -> SearchOutcome:
    """Searches the plan of ``graph`` with the lowest predicted iteration time.

    The cost of a plan is :func:`disco_estimator.costs.simulator.simulate` of its
    :func:`disco_estimator.costs.lower.sim_graph` with the cost model's overlap.

    Args:
        graph: the per-device graph (:func:`hlo_tools.device_graph`).
        costs: the cost model.
        seed: seeds the moves.
        time_budget_s: overrides the config's time budget, seconds (``math.inf``: none).
        alpha: overrides the config's alpha.
        beta: overrides the config's beta.
        patience: overrides the config's patience.
        start_plans: plans queued at the start besides no fusion, by name (default:
            :func:`baseline_plans`; an empty mapping: no fusion alone).
        progress: show a progress line on stderr; None: when stderr is a terminal. Never
            shown when stderr is not a terminal.
        space: the graph's :class:`~hlo_tools.plan.FusionSpace` (built when None).
        config: the parameters before overrides (default: :func:`load_config`).
        top_k: how many of the cheapest distinct plans to return in ``top``.
        stop: asked before each pop of the queue and between start plans (after the
            no-fusion plan); when it returns True the search ends as the time budget
            ends it, with the best plan so far and :data:`STOP_INTERRUPTED`. A signal
            handler that sets a flag it reads stops a search cleanly.
        memory_budget_bytes: refuse plans whose predicted peak memory exceeds this many
            bytes (None: no budget; see the module doc).
        buckets_only: search AllReduce combination alone (op fusion and duplicate
            fusion left to XLA): the search space of a backend that compiles no
            hand-written fusion (:data:`hlo_tools.jax_bridge.BUCKETS`).

    Returns:
        The :class:`SearchOutcome`: the best plan is never predicted worse than any start
        that fits the budget, and never predicted over the budget.

    Raises:
        MemoryBudgetError: no start plan fits the memory budget.
        ValueError: a parameter out of range, or a start plan named :data:`NO_FUSION`
            that is not the no-fusion plan.
    """
    t0 = time.perf_counter()
    base = config or load_config()
    overrides = {k: v for k, v in (("alpha", alpha), ("beta", beta), ("patience", patience),
                                   ("time_budget_s", time_budget_s)) if v is not None}
    config = base._replace(**overrides).check()
    space = space if space is not None else P.FusionSpace(graph)
    starts = {NO_FUSION: P.initial_plan(graph)}
    given = baseline_plans(space) if start_plans is None else dict(start_plans)
    if NO_FUSION in given and given[NO_FUSION].key() != starts[NO_FUSION].key():
        raise ValueError(f"start plan {NO_FUSION!r} is not the no-fusion plan")
    starts.update(given)
    if memory_budget_bytes is not None and not memory_budget_bytes > 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    overlap = costs.overlap
    budget = math.inf if memory_budget_bytes is None else memory_budget_bytes
    over_budget, smallest_refused = 0, math.inf

    def cost(plan: P.Plan) -> float:
        nonlocal over_budget, smallest_refused
        result = simulate(sim_graph(graph, plan, costs), overlap, check=False)
        if result.peak_bytes > budget:
            over_budget += 1
            smallest_refused = min(smallest_refused, result.peak_bytes)
            return math.inf
        return result.iteration_s

    seen: dict[Any, float] = {}
    start_costs: dict[str, float] = {}
    queued: list[tuple[P.Plan, float]] = []
    for name, plan in starts.items():
        if start_costs and stop is not None and stop():
            break  # (the start plans not costed are left out of start_costs)
        key = plan.key()
        if key not in seen:  # e.g. one bucket and 64 MiB buckets on a small model
            seen[key] = cost(plan)
            if seen[key] < math.inf:
                queued.append((plan, seen[key]))
        start_costs[name] = seen[key]
    if not queued:
        raise MemoryBudgetError(int(budget), int(smallest_refused))
    best_start = min(start_costs, key=start_costs.__getitem__)
    show = _Progress(progress is not False and sys.stderr.isatty())
    try:
        loop = _loop(space, queued, cost, config, random.Random(seed), seen, t0, show,
                     top_k, stop, (P.allreduce_move,) if buckets_only else P.MOVES)
    finally:
        show.close()
    best_graph = sim_graph(graph, loop.plan, costs)
    fo = full_overlap_bound(best_graph)
    peak = simulate(best_graph, overlap, check=False).peak_bytes
    stats = SearchStats(loop.evaluated, loop.pops, loop.duplicates,
                        time.perf_counter() - t0, loop.stop_reason, over_budget)
    return SearchOutcome(loop.plan, loop.cost_s, start_costs, best_start, fo, stats, config,
                         seed, loop.top, int(peak), memory_budget_bytes)


def backtracking_search(space: P.FusionSpace, start: P.Plan, cost: Callable[[P.Plan], float],
                        *, alpha: float = 1.05, beta: int = 10, patience: int = 1000,
                        time_budget_s: float = 60.0, seed: int = 0,
                        progress: bool = False) -> SearchResult:
    """Searches for the plan with the lowest ``cost`` from one start plan (the compact core
    of :func:`search`, with any cost callable).

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
        progress: show the best cost and candidates/s on stderr (when it is a terminal).
    """
    t0 = time.perf_counter()
    config = SearchConfig(alpha, beta, patience, time_budget_s).check()
    initial = cost(start)
    seen = {start.key(): initial}
    show = _Progress(progress and sys.stderr.isatty())
    try:
        loop = _loop(space, [(start, initial)], cost, config, random.Random(seed), seen, t0,
                     show)
    finally:
        show.close()
    return SearchResult(loop.plan, loop.cost_s, initial, loop.evaluated, loop.pops,
                        time.perf_counter() - t0)


# --------------------------------------------------------------------- the pipeline's step


class SearchedPlans(NamedTuple):
    """The search's plans for a final choice (:func:`plans_for_choice`).

    Attributes:
        plans_json: the best plans, best first (:meth:`hlo_tools.plan.Plan.to_json`), the
            same on every process of a job (empty when no plan fit the memory budget).
        outcome: the search's :class:`SearchOutcome` (process 0; None elsewhere, or when
            refused).
        refused: why no plan fit the memory budget (None: they did).
    """

    plans_json: list[Any]
    outcome: SearchOutcome | None
    refused: str | None

    def report(self, seed: int, top_k: int, choice_rounds: int) -> dict[str, Any] | None:
        """The search's settings and statistics as JSON (None: not searched here)."""
        out = self.outcome
        if out is None:
            return {"refused": self.refused} if self.refused else None
        return {"settings": {**out.config._asdict(), "seed": seed, "top_k": top_k,
                             "choice_rounds": choice_rounds},
                "evaluated": out.stats.evaluated, "pops": out.stats.pops,
                "seconds": out.stats.seconds, "stop_reason": out.stats.stop_reason,
                "best_start": out.best_start, "start_predicted_s": out.start_costs_json(),
                "fo_bound_s": out.fo_bound_s,
                "peak_bytes": out.peak_bytes,
                "memory_budget_bytes": out.memory_budget_bytes,
                "over_budget": out.stats.over_budget}


def plans_for_choice(graph: DeviceGraph, costs: CostModel | None, *, sync: Sync = SOLO,
                     seed: int = 0, time_budget_s: float | None = None, top_k: int = 3,
                     memory_budget_bytes: int | None = None, buckets_only: bool = False,
                     say: Callable[[str], None] | None = None) -> SearchedPlans:
    """The ``top_k`` best plans of :func:`search`, for a final choice by measurement.

    Process 0 of a job (the one with a cost model, ``costs``) searches within the memory
    budget (None: the device's memory); the plans reach every process through ``sync``
    (default: one process). When not even a start plan fits the budget there are no plans,
    and the final choice runs among the baselines.
    """
    from hlo_tools.jax_bridge import device_memory_bytes

    say = say or (lambda text: None)
    plans_json = outcome = refused = None
    if costs is not None:
        say(f"searching ({'config' if time_budget_s is None else f'{time_budget_s:.2g} s'} "
            "budget)")
        budget = memory_budget_bytes or device_memory_bytes()
        try:
            outcome = search(graph, costs, seed=seed, time_budget_s=time_budget_s,
                             progress=False, top_k=top_k, memory_budget_bytes=budget,
                             buckets_only=buckets_only)
        except MemoryBudgetError as err:
            refused = str(err)
            say(f"search: {refused}; choosing among the baselines")
            plans_json = []
        else:
            plans_json = [plan.to_json() for plan, _ in outcome.top]
            say(f"search: {outcome.stats.evaluated} candidates, predicted "
                f"{outcome.cost_s * 1e3:.2f} ms (best start {outcome.best_start}), peak "
                f"memory {format_bytes(outcome.peak_bytes)} of {format_bytes(budget)}")
    plans_json = sync.share("optimize_plans", plans_json)
    return SearchedPlans(plans_json, outcome, refused)
