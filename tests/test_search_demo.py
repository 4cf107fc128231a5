"""The compact backtracking search and the README's main command."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import hlo_tools
from disco_jax import costs as C
from disco_jax.search import backtracking_search
from hlo_tools import plan as P

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "shard_map_mlp.pre.hlo"


@pytest.fixture(scope="module")
def problem():
    module = hlo_tools.parse(FIXTURE.read_text())
    graph = hlo_tools.device_graph(module)
    costs = C.CostModel("inproc4")  # analytic op times: deterministic, no timing
    return graph, P.FusionSpace(graph), costs


def _search(problem, seed):
    graph, space, costs = problem
    return backtracking_search(
        space, P.initial_plan(graph), lambda p: C.simulate_plan(graph, p, costs).iteration_s,
        patience=60, time_budget_s=600, seed=seed)


def test_search_is_deterministic_for_a_seed(problem):
    a, b = _search(problem, 3), _search(problem, 3)
    assert a.plan.key() == b.plan.key() and a.cost_s == b.cost_s
    assert a.evaluated == b.evaluated


def test_search_never_returns_a_plan_worse_than_its_start(problem):
    for seed in range(3):
        result = _search(problem, seed)
        assert result.cost_s <= result.initial_cost_s
        assert result.evaluated > 0


def test_readme_main_command_runs():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the command sets up its own devices
    proc = subprocess.run(
        [sys.executable, "-m", "disco_jax", "demo", "--time-budget", "2", "--repeats", "3"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "XLA default" in proc.stdout and "DisCo plan" in proc.stdout
    assert "predicted ms" in proc.stdout


def test_demo_rejects_unknown_model(capsys):
    from disco_jax.cli import main

    assert main(["demo", "--model", "nope"]) == 2
    assert "unknown" in capsys.readouterr().err.lower()
