"""Tests of the simulator-accuracy tools: measured Chrome traces, the benchmark's statistics
and crash bookkeeping, per-operand all-reduce latency, calibration
(disco_estimator.costs.constants_fit), hardware-file writing. The benchmark and its worker
are loaded from benchmarks/ by path."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hlo_tools
from disco_estimator.costs import constants_fit as CAL
from disco_estimator.costs.cost_model import BackendConstants
from disco_estimator.costs.simulator import SimGraph, simulate
from disco_estimator.costs.trace import to_chrome_trace
from disco_estimator.hardware import load_hardware, shipped_hardware_dir
from disco_estimator.ops import OpEvent, OpTimes, measured_chrome_trace, module_view
from disco_estimator.ops.keys import op_key
from hlo_tools import plan as P

_BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def _load(name: str):
    """A script of benchmarks/ as a module (registered, as dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


SA = _load("simulator_accuracy")
W = _load("accuracy_worker")
RK = _load("ranking")

SNIPPETS = pathlib.Path(__file__).parent / "fixtures" / "snippets"
GRADS = (SNIPPETS / "grads_two_allreduces.hlo").read_text()  # shared with test_costs

# XLA's plan of GRADS: one combined (tuple) all-reduce of both gradients.
COMBINED = """HloModule combined

sum {
  l = f32[] parameter(0)
  r = f32[] parameter(1)
  ROOT s = f32[] add(l, r)
}

ENTRY e {
  w1 = f32[256] parameter(0)
  w2 = f32[64] parameter(1)
  g1 = f32[256] negate(w1)
  g2 = f32[64] negate(w2)
  ar = (f32[256], f32[64]) all-reduce(g1, g2), replica_groups={{0,1}}, to_apply=sum
  r1 = f32[256] get-tuple-element(ar), index=0
  r2 = f32[64] get-tuple-element(ar), index=1
  u1 = f32[256] subtract(w1, r1)
  u2 = f32[64] subtract(w2, r2)
  ROOT t = (f32[256], f32[64]) tuple(u1, u2)
}
"""

TIMES = {"g1": 20e-6, "g2": 10e-6, "u1": 20e-6, "u2": 10e-6}


# --------------------------------------------------------------------------- traces


def _ev(name: str, start_us: float, dur_us: float, device: int = 0, run: str = "1") -> OpEvent:
    return OpEvent(name, "jit_step", device, run, 7, start_us * 1e-6, dur_us * 1e-6)


def test_measured_trace_has_the_simulated_layout() -> None:
    events = [_ev("fusion.1", 100, 10), _ev("all-reduce", 110, 30), _ev("add.2", 112, 8),
              _ev("mul.3", 115, 3), _ev("fusion.1", 500, 10, run="2")]
    trace = measured_chrome_trace(events, label="m")
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"]) for e in xs] == [
        ("fusion.1", 0, 0.0), ("all-reduce", 1, pytest.approx(10.0)),
        ("add.2", 0, pytest.approx(12.0)), ("mul.3", 2, pytest.approx(15.0))]
    other = trace["otherData"]
    assert other["iteration_us"] == pytest.approx(40.0)
    assert other["comm_us"] == pytest.approx(30.0)
    assert other["compute_us"] == pytest.approx(18.0)  # [0, 10) and [12, 20)
    assert other["overlap_us"] == pytest.approx(8.0)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
               if e["name"] == "thread_name"}
    assert threads == {0: "compute", 1: "communication", 2: "compute (concurrent)"}
    graph = SimGraph(("a", "b"), np.array([False, True]), np.array([1e-6, 2e-6]),
                     np.array([4, 4]), np.array([0, 0, 1], dtype=np.int32),
                     np.array([0], dtype=np.int32))
    sim = to_chrome_trace(simulate(graph, 1.0), graph)
    assert set(sim) == set(trace)
    assert {k for k in sim["otherData"]} - set(other) == {"peak_bytes", "overlap_param"}
    assert set(sim["traceEvents"][-1]) == set(xs[0])
    second = measured_chrome_trace(events, run_id="2", pid_offset=3)
    assert [e["pid"] for e in second["traceEvents"] if e["ph"] == "X"] == [3]
    with pytest.raises(ValueError):
        measured_chrome_trace(events, run_id="nope")


def test_iteration_stats_from_events() -> None:
    events = [_ev("k1", 0, 10), _ev("all-reduce.1", 10, 30), _ev("k2", 12, 8),
              _ev("k1", 100, 12, run="2")]
    stats = W.iteration_stats(events, frozenset())
    assert len(stats) == 2
    first = stats[0]
    assert first["span_s"] == pytest.approx(40e-6)
    assert first["compute_busy_s"] == pytest.approx(18e-6)
    assert first["compute_sum_s"] == pytest.approx(18e-6)
    assert first["comm_sum_s"] == pytest.approx(30e-6)
    assert (first["kernels"], first["comm_events"]) == (2, 1)
    assert stats[1]["span_s"] == pytest.approx(12e-6)
    assert W._union_s([(0, 2), (1, 3), (5, 6)]) == pytest.approx(4.0)


def test_thread_waits_counts_handoffs_concurrency_and_busy_time() -> None:
    kc = _load("kernel_classes")

    def raw(op, ts, dur, tid, run="1", module="m"):  # a trace event, microseconds
        return {"ph": "X", "ts": ts, "dur": dur, "tid": tid,
                "args": {"hlo_op": op, "hlo_module": module, "run_id": run}}

    # run 1: a on t1 [0, 10); b on t2 after a 5 us gap [15, 25) -- a handoff; c on t2
    # [20, 30) beside b (5 us at once); d on t2 after a gap [40, 45) -- same thread, no
    # handoff. Busy: 10 + 15 + 5 = 30 us.
    events = [raw("a", 0, 10, 1), raw("b", 15, 10, 2), raw("c", 20, 10, 2),
              raw("d", 40, 5, 2), raw("other", 0, 99, 3, module="n"),
              {"ph": "M", "name": "thread_name", "tid": 1}]
    got = kc.thread_waits(events, "m")
    assert got["handoffs"] == 1
    assert got["handoff_s"] == pytest.approx(5e-6)
    assert got["concurrent_s"] == pytest.approx(5e-6)
    assert got["busy_s"] == pytest.approx(30e-6)
    # a second iteration with no handoff: the medians fall halfway
    got = kc.thread_waits(events + [raw("a", 100, 10, 1, run="2"),
                                    raw("b", 110, 10, 1, run="2")], "m")
    assert got["handoffs"] == 0.5
    assert got["busy_s"] == pytest.approx(25e-6)


def test_traced_share_solves_the_linear_price_and_clamps() -> None:
    kc = _load("kernel_classes")
    from disco_jax.pipeline.fit import SAVING_SHARE_BOUNDS

    # priced 2.0 with no saving, 0.5 at share 1: a trace of 1.25 (x scale 1) is share 0.5
    assert kc.traced_share({"0.0": 2.0, "1.0": 0.5}, 1.25, 1.0) == pytest.approx(0.5)
    assert kc.traced_share({"0.0": 2.0, "1.0": 0.5}, 0.625, 2.0) == pytest.approx(0.5)
    assert kc.traced_share({"0.0": 2.0, "1.0": 0.5}, 100.0, 1.0) == SAVING_SHARE_BOUNDS[0]
    assert kc.traced_share({"0.0": 2.0, "1.0": 0.5}, -100.0, 1.0) == SAVING_SHARE_BOUNDS[1]
    assert kc.traced_share({"0.0": 0.5, "1.0": 0.5}, 0.1, 1.0) == 1.0


def test_heldout_runs_mean_over_runs_and_largest_programs() -> None:
    ha = _load("heldout_accuracy")

    def row(setup, pred_bucketed, pred_plan):
        # measured 1.0 s each; XLA's default is fitted, so it is not scored
        return {"model": "gru", "setup": setup,
                "measured_s": {"bucketed": 1.0, "xla_default": 1.0},
                "predicted_s": {"bucketed": pred_bucketed, "xla_default": 2.0},
                "choice": {"disco": "plan_0", "medians_s": {"plan_0": 1.0, "plan_1": 1.0},
                           "predicted_s": {"plan_0": pred_plan, "plan_1": 1.0}}}

    runs = [{"rows": [row("gloo2", 1.3, 0.9)]}, {"rows": [row("gloo2", 1.5, 1.1)]}]
    got = ha.across_runs(runs, top=2)["gloo2"]
    # run 1: |0.3|, |-0.1|, 0 -> 0.1333; run 2: 0.5, 0.1, 0 -> 0.2
    assert got["run_means"] == pytest.approx([0.4 / 3, 0.2])
    assert got["mean_over_runs"] == pytest.approx((0.4 / 3 + 0.2) / 2)
    first, second = got["largest"]
    assert first["program"] == "gru bucketed"
    assert first["signed_errors"] == pytest.approx([0.3, 0.5])
    assert first["share"] == pytest.approx(0.8 / 1.0)
    assert second["program"] == "gru choice:plan"  # plan_0 and plan_1 as one
    assert second["signed_errors"] == pytest.approx([-0.1, 0.0, 0.1, 0.0])


def test_heldout_against_scores_both_codes_on_the_programs_both_measured() -> None:
    ha = _load("heldout_accuracy")

    def run(pred_bucketed, plans=None):
        # measured 1.0 s each; XLA's default is fitted, so it is not scored
        plans = plans or {}
        return {"rows": [{"model": "gru", "setup": "gloo2",
                          "measured_s": {"bucketed": 1.0, "xla_default": 1.0},
                          "predicted_s": {"bucketed": pred_bucketed, "xla_default": 2.0},
                          "choice": {"disco": "xla_default",
                                     "medians_s": {k: 1.0 for k in plans},
                                     "predicted_s": plans}}]}

    # this code also scores a plan (+40%) that the baseline never measured
    mine = [run(1.1, {"plan_0": 1.4}), run(0.8, {"plan_0": 1.4})]
    theirs = [run(1.3), run(1.1)]
    got = ha.against(mine, theirs)["gloo2"]
    assert got["run_means"] == pytest.approx([0.25, 0.3])
    assert got["baseline_mean_over_runs"] == pytest.approx(0.2)
    assert got["common_programs"] == ["gru bucketed"]
    assert got["common_run_means"] == pytest.approx([0.1, 0.2])
    assert got["baseline_common_run_means"] == pytest.approx([0.3, 0.1])
    assert got["paired_diffs"] == pytest.approx([-0.2, 0.1])
    assert got["common_mean_over_runs"] == pytest.approx(0.15)
    # a setup only one side measured is not compared
    assert ha.against(mine, [{"rows": []}]) == {}


def test_heldout_scores_each_code_on_what_its_own_fit_did_not_measure() -> None:
    ha = _load("heldout_accuracy")

    def run(calibration, pred_bucketed, pred_default):
        # measured 1.0 s each; hand bucketing with one bucket, DisCo chose it
        return {"rows": [{"model": "gru", "setup": "gloo2", "calibration": calibration,
                          "measured_s": {"bucketed": 1.0, "xla_default": 1.0, "disco": 1.0,
                                         "op_fusion": 1.0},
                          "predicted_s": {"bucketed": pred_bucketed,
                                          "xla_default": pred_default,
                                          "disco": pred_bucketed, "op_fusion": 1.2},
                          "choice": {"disco": "bucketed_1MiB", "bucketed": "bucketed_1MiB",
                                     "bucket_counts": {"bucketed_1MiB": 1},
                                     "medians_s": {"bucketed_1MiB": 1.0},
                                     "predicted_s": {"bucketed_1MiB": pred_bucketed}}}]}

    # the code before 0ffdcc7 fitted XLA's fusion of the one-bucket program: hand
    # bucketing with one bucket is its fitted program, XLA's default a held-out one
    old = run({"fused_scale": 0.5, "d_s": 1e-4}, 1.0, 1.5)
    assert ha.fit_program(old["rows"][0]) == "one_bucket"
    assert ha.signed_errors(old["rows"][0]) == pytest.approx(
        {"xla_default": 0.5, "op_fusion": 0.2})
    new = run({"saving_share": 0.7, "c_s_per_byte": 1e-10, "d_s": 1e-4}, 1.4, 1.0)
    assert ha.fit_program(new["rows"][0]) == "xla_default"
    assert ha.signed_errors(new["rows"][0]) == pytest.approx(
        {"bucketed": 0.4, "disco": 0.4, "choice:bucketed_1MiB": 0.4, "op_fusion": 0.2})
    # side by side, neither code is judged on a program either fit measured
    got = ha.against([new], [old])["gloo2"]
    assert got["common_programs"] == ["gru op_fusion"]
    assert got["paired_diffs"] == pytest.approx([0.0])
    assert got["run_means"] == pytest.approx([(0.4 * 3 + 0.2) / 4])
    assert got["baseline_mean_over_runs"] == pytest.approx(0.35)


# --------------------------------------------------------------------------- bookkeeping


def test_statistics_and_spearman() -> None:
    assert SA.merge_samples([[3.0, 1.0, 5.0], [2.0, 4.0, 6.0]]) == [2.0, 1.0, 5.0]
    s = SA.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (s["median_s"], s["p25_s"], s["p75_s"], s["n"]) == (3.0, 2.0, 4.0, 5)
    assert SA.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert SA.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert SA.spearman([1, 2], [1, 2]) is None and SA.spearman([1, 1, 1], [1, 2, 3]) is None


def test_separated_pairs_count_only_pairs_the_measurement_tells_apart() -> None:
    def t(p25: float, med: float, p75: float) -> dict[str, float]:
        return {"p25_s": p25, "median_s": med, "p75_s": p75}

    # a and b overlap (a tie within the noise); c is clear of both
    m = SA.Measured("m", "gloo2", {"a": t(1.0, 1.5, 2.0), "b": t(1.8, 1.9, 2.5),
                                   "c": t(3.0, 3.5, 4.0)}, None, None, {}, None, None, {})
    right = SA.separated_pairs({"a": 2.0, "b": 1.0, "c": 5.0}, m)   # a/b swapped: a tie
    assert right == {"separated_pairs": 2, "ordered_pairs": 2}
    wrong = SA.separated_pairs({"a": 2.0, "b": 6.0, "c": 5.0}, m)   # b after c: wrong
    assert wrong == {"separated_pairs": 2, "ordered_pairs": 1}


def test_ranking_tau_counts_every_pair_and_the_separated_ones() -> None:
    def t(p25: float, med: float, p75: float) -> dict[str, float]:
        return {"p25_s": p25, "median_s": med, "p75_s": p75}

    measured = {"no_fusion": 1.5, "op_fusion": 1.9, "xla_default": 3.5}
    row = {"model": "m", "setup": "gloo2", "size": "tiny", "measured_s": measured,
           "spread_s": {"no_fusion": t(1.0, 1.5, 2.0), "op_fusion": t(1.8, 1.9, 2.5),
                        "xla_default": t(3.0, 3.5, 4.0)}}
    # the overlapping pair predicted in the wrong order: tau-a counts it, the separated
    # tau does not
    r = RK.row_ranking({**row, "predicted_s": {"no_fusion": 2.0, "op_fusion": 1.0,
                                               "xla_default": 5.0}})
    assert r["tau"] == pytest.approx(1 / 3)
    assert (r["tau_separated"], r["separated_pairs"]) == (1.0, 2)
    assert r["error"]["op_fusion"] == pytest.approx(1.0 / 1.9 - 1.0)
    r = RK.row_ranking({**row, "predicted_s": {"no_fusion": 2.0, "op_fusion": 6.0,
                                               "xla_default": 3.6}})
    assert (r["tau"], r["tau_separated"]) == (pytest.approx(1 / 3), 0.0)
    s = RK.summarize([r])
    assert s["mean_tau_separated"] == 0.0 and s["within_10"] == pytest.approx(1 / 3)
    # DisCo's choice is XLA's default: one program, one place in the order (the tie of
    # the program with itself would count as a pair no prediction can order)
    same = {**row, "measured_s": {**measured, "disco": 3.5},
            "spread_s": {**row["spread_s"], "disco": t(3.0, 3.5, 4.0)},
            "predicted_s": {"no_fusion": 1.0, "op_fusion": 2.0, "xla_default": 4.0,
                            "disco": 4.0}, "choice": {"disco_is": "xla_default"}}
    r = RK.row_ranking(same)
    assert r["tau"] == 1.0 and r["separated_pairs"] == 2
    assert r["error"]["disco"] == r["error"]["xla_default"]
    r = RK.row_ranking({**same, "choice": {"disco_is": None}})
    assert r["tau"] == pytest.approx(5 / 6) and r["separated_pairs"] == 4


def test_the_tau_the_measurement_allows() -> None:
    """Programs far apart in every round: any resample keeps their order (1.0); two of
    them swapping places from round to round: the bootstrap finds the order unsure."""
    far = [[1.0, 1.1, 0.9], [2.0, 2.1, 1.9], [3.0, 3.1, 2.9]]
    medians = [1.0, 2.0, 3.0]
    assert RK.allowed_tau(medians, far, []) == 1.0
    swapping = [[1.0, 2.2, 0.9], [2.0, 1.0, 2.1], [3.0, 3.1, 2.9]]
    assert 1 / 3 <= RK.allowed_tau(medians, swapping, []) < 0.95
    # without the rounds: normal noise of the interquartile range's width
    assert RK.allowed_tau(medians, None, [(0.99, 1.01), (1.99, 2.01), (2.99, 3.01)]) == 1.0
    assert RK.allowed_tau(medians, None, [(0.0, 4.0)] * 3) < 0.8
    row = {"model": "m", "setup": "gloo2", "size": "tiny",
           "measured_s": {"no_fusion": 1.0, "op_fusion": 2.0},
           "samples_s": {"no_fusion": [1.0, 0.9, 1.1], "op_fusion": [2.0, 2.1, 1.9]},
           "predicted_s": {"no_fusion": 2.0, "op_fusion": 1.0},
           "predicted_at_start_s": {"no_fusion": 1.0, "op_fusion": 2.0}}
    bench, start = RK.row_ranking(row), RK.row_ranking(row, "start")
    assert (bench["tau"], start["tau"], bench["tau_allowed"]) == (-1.0, 1.0, 1.0)
    assert bench["bootstrap"] and RK.row_ranking(row, "choice_fit") is None
    s = RK.summarize([bench])
    assert s["mean_tau_allowed"] == 1.0 and s["within_10_beyond_fit"] == 0.0


def test_ranking_counts_a_model_measured_again_once() -> None:
    def r(model: str, tau: float) -> dict:
        return {"model": model, "setup": "inproc4", "size": "large", "tau": tau}

    got = RK.latest_rows({"a.json": [r("resnet", 0.2), r("vgg", 1.0)],
                          "b.json": [r("bert", 0.6)], "c.json": [r("resnet", 0.8)]})
    assert got == {"a.json": [r("vgg", 1.0)], "b.json": [r("bert", 0.6)],
                   "c.json": [r("resnet", 0.8)]}


def test_ranking_restep_prices_an_older_staged_choice_as_the_bench_now_does() -> None:
    # the staged fit: reference 1.0 s measured as priced (step cost 0.1 s over a 0.9 s
    # simulation); the choice rounds measured it at 1.2 s: every staged price +0.2 s
    row = {"model": "m", "setup": "gloo2", "size": "tiny",
           "staged": {"reference": "staged_k4_r1", "fit": {"step_s": 0.1}},
           "choice": {"disco": "staged_k2_r1", "medians_s": {"staged_k4_r1": 1.2},
                      "predicted_at_start_s": {"staged_k4_r1": 1.0, "staged_k2_r1": 0.8}},
           "predicted_s": {"no_fusion": 2.0, "disco": 0.8}}
    got = RK.restepped(row)
    assert got["predicted_s"] == {"no_fusion": 2.0, "disco": pytest.approx(1.0)}
    # a row the bench already priced so, or a choice that is not staged: as it is
    for done in ({**row, "staged": {**row["staged"], "choice_shift_s": 0.2}},
                 {**row, "choice": {**row["choice"], "disco": "xla_default"}}):
        assert RK.restepped(done) is done


def test_unfinished_compiles(tmp_path: Path) -> None:
    (tmp_path / "p0.log").write_text("start a\ndone a\nstart b\n")
    (tmp_path / "p1.log").write_text("start c\ndone c\nstart b\ndone b\nstart d\n")
    assert SA._unfinished(tmp_path) == ["b", "d"]


def test_variant_specs_are_unique_and_cycle_moves() -> None:
    specs = SA.variant_specs(7)
    names = [v["name"] for v in specs]
    assert names[:2] == ["xla_default", "no_fusion"] and len(set(names)) == 9
    assert [v["moves"] for v in specs[2:]] == [SA.MOVES[s % len(SA.MOVES)] for s in range(7)]
    assert SA.plan_spec(3) == specs[5]


def test_plan_json_round_trip() -> None:
    graph = hlo_tools.device_graph(hlo_tools.parse(GRADS))
    space = P.FusionSpace(graph)
    r1, r2 = graph.index["r1"], graph.index["r2"]
    plan = P.combine(space, P.initial_plan(graph), r1, r2)
    back = SA._plan_from_json(W.plan_json(plan))
    assert back.key() == plan.key() and list(back.order) == list(plan.order)
    assert [back.order[p] for p in back.pos] == list(range(graph.num_nodes))


# --------------------------------------------------------------------------- predicting


def _op_times(*texts: str) -> OpTimes:
    times = OpTimes()
    for text in texts:
        module = hlo_tools.parse(text)
        view = module_view(module)
        for _, instr in module.instructions():
            if instr.name in TIMES:
                times.add(op_key(view, instr).encode(), TIMES[instr.name], "test")
    return times


def _measured(meas: dict[str, float] | None = None) -> SA.Measured:
    module = hlo_tools.parse(GRADS)
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    bucket = P.combine(space, P.initial_plan(graph), graph.index["r1"], graph.index["r2"])
    plans = {"no_fusion": P.initial_plan(graph), "bucket": bucket}
    meas = meas or {"no_fusion": 1.0, "bucket": 1.0, "xla_default": 1.0}
    times = {n: {"median_s": t, "p25_s": t, "p75_s": t, "n": 1} for n, t in meas.items()}
    return SA.Measured("grads", "gloo2", times, module, graph, plans,
                       hlo_tools.parse(COMBINED), None, {})


def test_per_operand_latency_of_combined_all_reduce() -> None:
    m = _measured()
    hw = load_hardware("gloo2")
    c = CAL.Constants(0.0, 1e-6, 1e-10, 1.0, 1e-9, 1e-3)
    as_is = SA.Predictor(m, hw, _op_times(GRADS, COMBINED)).predict(c)
    fixed = SA.Predictor(m, hw, _op_times(GRADS, COMBINED), tuple_latency=True).predict(c)
    compute = sum(TIMES.values())
    assert as_is["no_fusion"] == pytest.approx(compute + 2e-3 + 1280e-9)
    assert as_is["xla_default"] == pytest.approx(compute + 1e-3 + 1280e-9)
    assert fixed["xla_default"] == pytest.approx(compute + 2e-3 + 1280e-9)
    assert fixed["no_fusion"] == as_is["no_fusion"]
    # the bucket: copies in and out around one all-reduce of the flat buffer
    assert fixed["bucket"] == as_is["bucket"] > compute + 1e-3 + 1280e-9


def test_fit_recovers_the_constants_that_made_the_times() -> None:
    truth = CAL.Constants(0.0, 1e-6, 1e-10, 1.3, 2e-9, 3e-3)
    ms = []
    for scale in (1.0, 2.0):  # two "models": the same program with slower ops
        times = OpTimes()
        for key, t in _op_times(GRADS, COMBINED).times.items():
            times.add(key, t * scale, "test")
        probe = SA.Predictor(_measured(), load_hardware("gloo2"), times, True)
        m = _measured(probe.predict(truth))
        ms.append(SA.Predictor(m, load_hardware("gloo2"), times, True))
    base = CAL.Constants.from_hardware(load_hardware("gloo2"))
    fitted, obj = CAL.fit_constants([p.case() for p in ms], base)
    assert obj < 0.01 and obj == CAL.objective([p.case() for p in ms], fitted)
    assert fitted.d_s == pytest.approx(3e-3, rel=0.05)


def _synthetic_case(truth: CAL.Constants, shape: list[tuple[float, float, float]],
                    noise: list[float]) -> CAL.FitCase:
    """Variants of (compute s, channel bytes, latencies): compute and communication
    overlap by phi; measured = truth's prediction times (1 + noise)."""
    def predict(c: CAL.Constants) -> dict[str, float]:
        out = {}
        for k, (w, b, n) in enumerate(shape):
            comp, comm = c.compute_scale * w, c.c_s_per_byte * b + c.d_s * n
            out[f"v{k}"] = comp + comm - c.overlap * min(comp, comm)
        return out

    def comm_terms(c: CAL.Constants) -> dict[str, tuple[float, float]]:
        return {f"v{k}": (b, n) for k, (_, b, n) in enumerate(shape)}

    measured = {n: t * (1 + e) for (n, t), e in zip(predict(truth).items(), noise)}
    return CAL.FitCase(measured, predict, comm_terms)


def test_fit_constants_on_synthetic_data() -> None:
    """The library fit alone (no simulator): overlap and D of made-up programs are found
    again, the fitted objective is the reported one, and it beats the starting point."""
    truth = CAL.Constants(0.3, 1e-6, 1e-10, 1.0, 1e-9, 2e-3)
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(3):
        shape = [(float(rng.uniform(2e-3, 20e-3)), float(rng.uniform(1e5, 1e7)),
                  float(rng.integers(1, 12))) for _ in range(8)]
        cases.append(_synthetic_case(truth, shape, [0.0] * 8))
    base = dataclasses.replace(truth, overlap=0.9, d_s=1e-4)
    fit = CAL.fit_constants(cases, base, ("overlap", "d_s"), maxfev=200)
    assert isinstance(fit, CAL.FitResult)
    assert fit.objective == CAL.objective(cases, fit.constants) < 0.002
    assert fit.objective < CAL.objective(cases, base)
    assert fit.constants.d_s == pytest.approx(2e-3, rel=0.02)
    assert fit.constants.overlap == pytest.approx(0.3, abs=0.02)
    assert fit.constants.kernel_launch_s in CAL.LAUNCH_GRID
    assert (fit.constants.compute_scale, fit.constants.c_s_per_byte) == (1.0, 1e-9)  # fixed
    again = CAL.fit_constants(cases, base, ("overlap", "d_s"), maxfev=200)
    assert again == fit  # deterministic
    with pytest.raises(ValueError):
        CAL.fit_constants(cases, base, ("mem_s_per_byte",))


def test_linear_start_solves_an_exact_linear_system() -> None:
    """Without overlap the measured times are linear in (compute scale, C, D): the
    non-negative least-squares start recovers them."""
    truth = CAL.Constants(0.0, 1e-6, 1e-10, 1.3, 2e-9, 3e-3)
    shape = [(5e-3, 1e6, 2.0), (10e-3, 4e6, 1.0), (2e-3, 2e5, 8.0), (8e-3, 3e6, 4.0)]
    case = _synthetic_case(truth, shape, [0.0] * 4)
    k, c, d = CAL.linear_start([case], dataclasses.replace(truth, compute_scale=1.0))
    assert (k, c, d) == pytest.approx((1.3, 2e-9, 3e-3), rel=1e-6)


def test_write_config_round_trip(tmp_path: Path) -> None:
    shutil.copy(shipped_hardware_dir() / "gloo2.toml", tmp_path / "gloo2.toml")
    before = load_hardware(tmp_path / "gloo2.toml")
    c = CAL.Constants(0.25, 2e-6, 1e-10, 1.0, 3e-9, 3.5e-3)
    for _ in range(2):  # writing twice leaves one table and the first microbenchmark values
        path = SA.write_config("gloo2", c, "as_is", ("overlap", "d_s"), directory=tmp_path)
    text = path.read_text()
    assert text.count("[costs]\n") == 1 and text.count("microbenchmark_d_s = ") == 1
    hw = load_hardware(path)
    assert (hw.allreduce.c_s_per_byte, hw.allreduce.d_s) == (3e-9, 3.5e-3)
    micro = before.raw["allreduce"].get("microbenchmark_d_s", before.allreduce.d_s)
    assert hw.raw["allreduce"]["microbenchmark_d_s"] == micro
    assert hw.raw["allreduce"]["points"] == before.raw["allreduce"]["points"]
    consts = BackendConstants.from_hardware(hw)
    assert (consts.overlap, consts.kernel_launch_s, consts.compute_scale) == (0.25, 2e-6, 1.0)
    assert dataclasses.replace(CAL.Constants.from_hardware(hw), mem_s_per_byte=1e-10) == c
    json.dumps(c.to_json())
    fresh = SA.write_config("gloo2", c, "as_is", ("overlap", "d_s"), tmp_path / "new")
    assert fresh.read_text() == text  # from the shipped file when DIR has none


def test_write_config_flag_takes_an_optional_directory(tmp_path: Path) -> None:
    assert SA._parse_args(["--reuse"]).write_config is None
    assert SA._parse_args(["--reuse", "--write-config"]).write_config == shipped_hardware_dir()
    assert SA._parse_args(["--write-config", str(tmp_path)]).write_config == tmp_path


def test_pin_to_own_cpu_pins_this_process_and_its_threads() -> None:
    import os
    import subprocess

    code = ("import os, threading\n"
            "from disco_estimator.gloo import pin_to_own_cpu\n"
            "cpu = pin_to_own_cpu(3)\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))\n"
            "t.start(); t.join()\n"
            "print(cpu, sorted(os.sched_getaffinity(0)), sorted(seen[0]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split(maxsplit=1)
    cpus = sorted(os.sched_getaffinity(0))
    want = cpus[3 % len(cpus)]
    assert int(out[0]) == want
    assert out[1].strip() == f"[{want}] [{want}]"


@pytest.mark.parametrize("cpus, said", [("0,0", "two different CPUs"),
                                        ("0", "two different CPUs"),
                                        ("a,b", "two CPU numbers")])
def test_cpu_contention_rejects_bad_cpus_without_traceback(cpus, said, tmp_path):
    """``cpu_contention.py --cpus`` names what it wants; nothing is measured or written."""
    out = tmp_path / "c.json"
    done = subprocess.run([sys.executable, str(_BENCHMARKS / "cpu_contention.py"), "--cpus",
                           cpus, "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert said in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_cpu_contention_worker_times_both_kernels():
    """One worker pinned to a CPU it may use prints positive per-call times of both."""
    cpu = min(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, str(_BENCHMARKS / "cpu_contention.py"), "--worker",
                           str(cpu), "--seconds", "0.05"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    times = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(times) == {"matmul_ms", "stream_ms"} and min(times.values()) > 0
