"""disco_jax.pipeline.search.search: Algorithm 1 in product form (config, start plans, stats)."""

from __future__ import annotations

import math
import pathlib
import random
import tomllib

import pytest

import hlo_tools
from disco_estimator.costs.cost_model import CostModel
from disco_estimator.costs.lower import sim_graph, simulate_plan
from disco_estimator.costs.simulator import full_overlap_bound
from disco_jax import search as search_fn
from disco_jax.pipeline.search import (
    NO_FUSION,
    STOP_PATIENCE,
    STOP_QUEUE_EMPTY,
    STOP_TIME_BUDGET,
    SearchConfig,
    baseline_plans,
    load_config,
)
from hlo_tools import plan as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "shard_map_mlp.pre.hlo"


@pytest.fixture(scope="module")
def problem():
    module = hlo_tools.parse(FIXTURE.read_text())
    graph = hlo_tools.device_graph(module)
    costs = CostModel("inproc4")  # analytic op times: deterministic, no timing
    return graph, P.FusionSpace(graph), costs


def _run(problem, **kw):
    graph, space, costs = problem
    kw.setdefault("time_budget_s", 600.0)
    kw.setdefault("patience", 60)
    return search_fn(graph, costs, space=space, progress=False, **kw)


def test_config_file_is_the_packaged_one():
    raw = tomllib.loads((ROOT / "disco_jax" / "configs" / "search.toml").read_text())
    config = load_config()
    assert config == SearchConfig(**raw["search"])
    assert (config.alpha, config.beta, config.patience) == (1.05, 10, 1000)
    assert config.time_budget_s <= 60.0


def test_config_file_values_are_used_and_checked(problem, tmp_path):
    path = tmp_path / "search.toml"
    path.write_text("[search]\nalpha = 1.2\nbeta = 0\npatience = 7\ntime_budget_s = 30\n")
    config = load_config(str(path))
    assert config == SearchConfig(1.2, 0, 7, 30.0)
    out = _run(problem, config=config, patience=None, time_budget_s=None, start_plans={})
    assert out.config == config
    # beta = 0: every child is its parent, so nothing new is ever costed
    assert out.stats.evaluated == 1 and out.stats.stop_reason == STOP_QUEUE_EMPTY
    path.write_text("[search]\nalpha = 0.5\nbeta = 1\npatience = 7\ntime_budget_s = 30\n")
    with pytest.raises(ValueError, match="alpha"):
        load_config(str(path))
    path.write_text("[search]\nalpha = 1.1\nbeta = 1\n")
    with pytest.raises(ValueError, match="missing"):
        load_config(str(path))


def test_search_is_deterministic_for_a_seed(problem):
    a, b = _run(problem, seed=3), _run(problem, seed=3)
    assert a.plan.key() == b.plan.key() and a.cost_s == b.cost_s
    assert a.stats._replace(seconds=0) == b.stats._replace(seconds=0)
    assert a.stats.stop_reason != STOP_TIME_BUDGET  # the budget is not what stopped it
    assert a.start_costs_s == b.start_costs_s
    c = _run(problem, seed=4)
    assert (c.stats.evaluated, c.plan.key()) != (a.stats.evaluated, a.plan.key())


def test_outcome_reports_what_the_simulator_gives(problem):
    graph, _, costs = problem
    out = _run(problem, seed=0)
    assert out.cost_s == simulate_plan(graph, out.plan, costs).iteration_s
    assert out.start_costs_s[NO_FUSION] == simulate_plan(
        graph, P.initial_plan(graph), costs).iteration_s
    assert out.cost_s < 0.99 * out.start_costs_s[NO_FUSION]
    assert out.fo_bound_s == full_overlap_bound(sim_graph(graph, out.plan, costs))
    assert out.fo_bound_s <= out.cost_s
    assert out.stats.evaluated > 1 and out.stats.pops >= 1 and out.stats.seconds > 0


def test_never_predicted_worse_than_a_seeded_start(problem):
    """A strong start plan (the best of another search) is queued and kept: with patience 1
    the search cannot rediscover it, so it must come from the seed."""
    graph, space, costs = problem
    strong = _run(problem, seed=11, patience=200)
    weak = P.random_moves(space, P.initial_plan(graph), random.Random(5), 30)
    starts = {"strong": strong.plan, "weak": weak}
    out = _run(problem, seed=0, patience=1, start_plans=starts)
    assert out.stats.stop_reason == STOP_PATIENCE
    assert set(out.start_costs_s) == {NO_FUSION, "strong", "weak"}
    assert out.start_costs_s["strong"] == strong.cost_s
    assert out.best_start == "strong"
    assert out.cost_s <= min(out.start_costs_s.values())
    unseeded = _run(problem, seed=0, patience=1, start_plans={})
    assert set(unseeded.start_costs_s) == {NO_FUSION}
    assert unseeded.cost_s > strong.cost_s  # so the seed is what made the difference


def test_default_start_plans_are_the_baselines(problem):
    graph, space, _ = problem
    plans = baseline_plans(space)
    assert plans[NO_FUSION].key() == P.initial_plan(graph).key()
    out = _run(problem, patience=1)
    assert set(out.start_costs_s) == set(plans)
    assert out.cost_s <= min(out.start_costs_s.values())


def test_overrides_take_effect(problem):
    out = _run(problem, patience=1)
    assert out.config.patience == 1 and out.stats.stop_reason == STOP_PATIENCE
    assert out.stats.evaluated <= 1 + 3 * out.stats.pops
    out = _run(problem, time_budget_s=1e-9)
    assert out.stats.stop_reason == STOP_TIME_BUDGET and out.stats.pops == 0
    out = _run(problem, beta=0, start_plans={})
    assert out.stats.stop_reason == STOP_QUEUE_EMPTY and out.stats.evaluated == 1
    # alpha: 1 queues only children as good as the best, a huge one queues every child
    narrow, wide = _run(problem, seed=2, alpha=1.0), _run(problem, seed=2, alpha=1e6)
    assert narrow.config.alpha == 1.0 and wide.config.alpha == 1e6
    assert narrow.stats != wide.stats
    with pytest.raises(ValueError, match="alpha"):
        _run(problem, alpha=0.9)
    with pytest.raises(ValueError, match="patience"):
        _run(problem, patience=0)
    assert math.isfinite(_run(problem, time_budget_s=math.inf).cost_s)


def test_a_wrong_no_fusion_start_is_refused(problem):
    graph, space, _ = problem
    other = P.random_moves(space, P.initial_plan(graph), random.Random(0), 20)
    with pytest.raises(ValueError, match="no-fusion"):
        _run(problem, start_plans={NO_FUSION: other})
