"""The search's memory budget: plans predicted to need more memory than the budget (the
simulator's live-range peak) are refused, duplicate fusion's longer live ranges included."""

from __future__ import annotations

import json
import pathlib

import jax
import pytest

import hlo_tools
from disco_estimator.costs.cost_model import CostModel
from disco_estimator.costs.lower import simulate_plan
from disco_jax.cli import main
from disco_jax.pipeline.search import MemoryBudgetError, baseline_plans, search
from disco_jax.units import env_bytes, format_bytes, parse_bytes
from hlo_tools import plan as P
from hlo_tools.jax_bridge import device_memory_bytes

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "shard_map_mlp.pre.hlo"
MIB = 1 << 20

# `sl` reads the 2 MiB `big` and has two users, `early` and `late`. Without duplication
# `big` dies once `sl` ran, before `mid1` and `mid2` (2 MiB each) exist. A copy of `sl` in
# `late`'s fusion reads `big` there, so `big` lives until `late`: 2 MiB more at the peak.
DUP_HLO = """\
HloModule dup_memory

ENTRY main {
  p0 = f32[512,1024]{1,0} parameter(0)
  big = f32[512,1024]{1,0} exponential(p0)
  sl = f32[1,1024]{1,0} slice(big), slice={[0:1], [0:1024]}
  early = f32[1,1024]{1,0} negate(sl)
  mid1 = f32[512,1024]{1,0} sine(p0)
  mid2 = f32[512,1024]{1,0} cosine(mid1)
  mid3 = f32[1,1024]{1,0} slice(mid2), slice={[0:1], [0:1024]}
  late = f32[1,1024]{1,0} add(sl, mid3)
  ROOT out = (f32[1,1024]{1,0}, f32[1,1024]{1,0}) tuple(early, late)
}
"""


def _node(graph, name: str) -> int:
    return graph.index[name]


@pytest.fixture(scope="module")
def dup_problem():
    module = hlo_tools.parse(DUP_HLO)
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    costs = CostModel("inproc4")  # analytic op times: deterministic
    plain = P.initial_plan(graph)
    decision = P.can_duplicate(space, plain, _node(graph, "sl"), _node(graph, "late"))
    assert decision.ok, decision.reason
    dup = P.duplicate(space, plain, _node(graph, "sl"), _node(graph, "late"))
    return module, graph, space, costs, plain, dup


def test_duplicate_fusion_raises_the_predicted_peak(dup_problem):
    module, graph, _, costs, plain, dup = dup_problem
    base = simulate_plan(graph, plain, costs).peak_bytes
    copied = simulate_plan(graph, dup, costs).peak_bytes
    assert copied - base == 2 * MIB, hlo_tools.to_text(module)


def test_the_budget_refuses_the_duplicate_plan(dup_problem):
    _, graph, space, costs, plain, dup = dup_problem
    budget = simulate_plan(graph, plain, costs).peak_bytes
    free = search(graph, costs, space=space, start_plans={"dup": dup}, time_budget_s=5,
                  patience=20, progress=False)
    assert free.start_costs_s["dup"] < float("inf") and free.stats.over_budget == 0
    held = search(graph, costs, space=space, start_plans={"dup": dup}, time_budget_s=5,
                  patience=20, progress=False, memory_budget_bytes=budget)
    assert held.start_costs_s["dup"] == float("inf")
    assert held.start_costs_json()["dup"] is None
    assert held.stats.over_budget >= 1
    assert held.peak_bytes <= budget and held.memory_budget_bytes == budget
    for plan, cost in held.top:
        assert cost < float("inf")
        assert simulate_plan(graph, plan, costs).peak_bytes <= budget


def test_no_plan_fits_a_tiny_budget(dup_problem):
    _, graph, space, costs, plain, _ = dup_problem
    with pytest.raises(MemoryBudgetError, match="no plan fits the memory budget") as err:
        search(graph, costs, space=space, time_budget_s=5, progress=False,
               memory_budget_bytes=1024)
    assert err.value.smallest_peak_bytes <= simulate_plan(graph, plain, costs).peak_bytes
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        search(graph, costs, space=space, progress=False, memory_budget_bytes=0)


def test_search_results_respect_the_budget_on_a_real_step():
    """The budget is the smallest peak of the start plans (on this step they all need the
    same: the peak is in the forward pass): nothing returned is above it, and one byte
    less leaves no start plan, a clear error."""
    module = hlo_tools.parse(FIXTURE.read_text())
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    costs = CostModel("inproc4")
    budget = min(simulate_plan(graph, plan, costs).peak_bytes
                 for plan in baseline_plans(space).values())
    held = search(graph, costs, space=space, time_budget_s=5, patience=200, progress=False,
                  memory_budget_bytes=budget)
    assert held.peak_bytes <= budget
    for plan, _ in held.top:
        assert simulate_plan(graph, plan, costs).peak_bytes <= budget
    with pytest.raises(MemoryBudgetError, match=format_bytes(budget - 1)):
        search(graph, costs, space=space, time_budget_s=5, progress=False,
               memory_budget_bytes=budget - 1)


@pytest.mark.parametrize("text, value", [("1048576", 1 << 20), ("512MiB", 512 << 20),
                                         ("8GiB", 8 << 30), ("1.5g", 3 << 29),
                                         ("64 kb", 64 << 10), ("2M", 2 << 20)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-5MiB", "0", "0.5", "12 parsecs", "1e400"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("n, text", [(17, "17 B"), (3 << 10, "3.00 KiB"),
                                     (3 << 19, "1.50 MiB"), (8 << 30, "8.00 GiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_env_bytes_names_the_variable(monkeypatch):
    monkeypatch.setenv("DISCO_MEMORY_BUDGET", "much")
    with pytest.raises(ValueError, match="^DISCO_MEMORY_BUDGET="):
        env_bytes("DISCO_MEMORY_BUDGET")
    monkeypatch.setenv("DISCO_MEMORY_BUDGET", "3MiB")
    assert env_bytes("DISCO_MEMORY_BUDGET") == 3 << 20


def test_device_memory_is_a_share_of_the_machine():
    per_device = device_memory_bytes()
    assert 0 < per_device * len(jax.local_devices()) <= 1 << 50


def test_cli_reports_memory_and_refuses_a_tiny_budget(tmp_path, capsys):
    out = tmp_path / "mlp.opt.hlo"
    code = main(["optimize", str(FIXTURE), "-o", str(out), "--time-budget", "2", "--json",
                 "--memory-budget", "1GiB"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    memory = json.loads(captured.out)["memory"]
    assert memory["budget_bytes"] == 1 << 30
    assert 0 < memory["peak_bytes"] <= 1 << 30 and memory["no_fusion_peak_bytes"] > 0
    for written in tmp_path.iterdir():  # OUT and OUT.plan.json
        written.unlink()
    code = main(["optimize", str(FIXTURE), "-o", str(out), "--memory-budget", "1KiB"])
    captured = capsys.readouterr()
    assert code != 0 and "no plan fits the memory budget" in captured.err
    assert "Traceback" not in captured.err
    assert not out.exists() and not list(tmp_path.iterdir())
    code = main(["optimize", str(FIXTURE), "-o", str(out), "--memory-budget", "lots"])
    captured = capsys.readouterr()
    assert code != 0 and "--memory-budget" in captured.err and "Traceback" not in captured.err


def test_jit_under_a_tiny_budget_chooses_among_the_baselines(tmp_path, monkeypatch):
    """``DISCO_MEMORY_BUDGET`` below what any plan needs: the search refuses every plan,
    ``disco_jax.jit`` measures the baselines alone, stores the winner (a baseline) with
    the reason in its record, and computes what ``jax.jit`` computes; a malformed value
    is an error naming the variable."""
    import numpy as np

    import disco_jax
    from disco_jax import store as st
    from disco_jax import zoo

    step, args = zoo.get("vgg")(4, "tiny")
    quick = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
             "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    monkeypatch.setenv("DISCO_MEMORY_BUDGET", "1KiB")
    wrapped = disco_jax.jit(step, store=tmp_path, search_options=quick)
    got = wrapped(*args)
    info = wrapped.last_run_info
    assert info.mode == "searched" and not info.choice.startswith("plan_"), info
    record = st.load_entry(info.source_fingerprint, st.Setup.current(), root=tmp_path).entry
    assert "no plan fits the memory budget" in record.record.search["refused"]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(step)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("DISCO_MEMORY_BUDGET", "lots")
    with pytest.raises(ValueError, match="^DISCO_MEMORY_BUDGET="):
        disco_jax.jit(step, store=tmp_path / "other", search_options=quick)(*args)
