"""The compact backtracking search and the README's main command."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import hlo_tools
from disco_estimator.costs.cost_model import CostModel
from disco_estimator.costs.lower import simulate_plan
from disco_jax.pipeline.search import backtracking_search
from hlo_tools import plan as P

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "shard_map_mlp.pre.hlo"


@pytest.fixture(scope="module")
def problem():
    module = hlo_tools.parse(FIXTURE.read_text())
    graph = hlo_tools.device_graph(module)
    costs = CostModel("inproc4")  # analytic op times: deterministic, no timing
    return graph, P.FusionSpace(graph), costs


def _search(problem, seed):
    graph, space, costs = problem
    return backtracking_search(
        space, P.initial_plan(graph), lambda p: simulate_plan(graph, p, costs).iteration_s,
        patience=60, time_budget_s=600, seed=seed)


def test_search_is_deterministic_for_a_seed(problem):
    a, b = _search(problem, 3), _search(problem, 3)
    assert a.plan.key() == b.plan.key() and a.cost_s == b.cost_s
    assert a.evaluated == b.evaluated


def test_search_finds_a_plan_cheaper_than_no_fusion(problem):
    """On the MLP every elementwise chain and the gradient all-reduces can be fused, which
    saves kernel launches and all-reduce latencies: the search must find a strictly
    cheaper plan than the no-fusion one, with fusion groups in it, and report its cost
    and the start's as the simulator gives them."""
    graph, _, costs = problem
    start = P.initial_plan(graph)
    for seed in range(3):
        result = _search(problem, seed)
        assert result.initial_cost_s == simulate_plan(graph, start, costs).iteration_s
        assert result.cost_s == simulate_plan(graph, result.plan, costs).iteration_s
        assert result.cost_s < 0.99 * result.initial_cost_s, seed
        assert result.plan.key() != start.key()
        assert any(len(ms) > 1 for ms in result.plan.groups().values())


def test_readme_main_command_runs(tmp_path):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the command sets up its own devices
    env.pop("ENABLE_SEARCH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "disco_jax", "demo", "--time-budget", "2", "--repeats", "3",
         "--store", str(tmp_path / "store")],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "xla_default" in proc.stdout and "disco" in proc.stdout
    assert "bucketed" in proc.stdout  # hand bucketing, the baseline users run
    assert "meas" in proc.stdout and "pred" in proc.stdout
    assert "DisCo's choice" in proc.stdout
    # the product path: searched and stored, then run from the store
    assert "ENABLE_SEARCH=1: searched" in proc.stdout, proc.stdout[-2000:]
    assert "ENABLE_SEARCH=0: stored" in proc.stdout, proc.stdout[-2000:]
    fingerprints = re.findall(r"enactment ([0-9a-f]{12})", proc.stdout)
    assert len(fingerprints) == 2 and fingerprints[0] == fingerprints[1]
    assert list((tmp_path / "store").iterdir())


def test_demo_rejects_unknown_model(capsys):
    from disco_jax.cli import main

    assert main(["demo", "--model", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err.lower()
