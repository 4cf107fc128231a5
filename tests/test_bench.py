"""The product path of ``disco bench``: plan JSON, the search's best few plans, in-context
calibration, measuring and the final choice, and ``disco bench`` end to end (one
process with 4 host devices, a real 2-process gloo job, and a predicted GPU table)."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

import hlo_tools
from disco_estimator.costs.cost_model import BackendConstants, CostModel
from disco_jax import zoo
from disco_jax.cli.bench import render_table
from disco_jax.pipeline.bench import PROGRAMS
from disco_jax.pipeline.choose import choice_tiers, choose, decide, measure
from disco_jax.pipeline.fit import (
    SAVING_SHARE_BOUNDS,
    calibrate_in_context,
    fit_overlap_to_latency,
    in_context_costs,
)
from disco_jax.pipeline.profile import profile_in_context
from disco_jax.pipeline.search import search
from hlo_tools import baselines as bl
from hlo_tools import plan as P


@pytest.fixture(scope="module")
def vgg():
    step, args = zoo.get("vgg")(4, "tiny")
    module = hlo_tools.parse(hlo_tools.extract(step, *args))
    return step, args, module, hlo_tools.device_graph(module)


def test_plan_json_round_trip(vgg):
    *_, graph = vgg
    plan = P.random_moves(P.FusionSpace(graph), P.initial_plan(graph), random.Random(3), 60)
    back = P.Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert back == plan and back.key() == plan.key()
    bad = plan.to_json()
    bad["order"] = bad["order"][:-1] + [bad["order"][0]]
    with pytest.raises(ValueError, match="permutation"):
        P.Plan.from_json(bad)


def test_search_returns_its_best_few_distinct_plans(vgg):
    *_, graph = vgg
    costs = CostModel("inproc4")
    out = search(graph, costs, seed=1, time_budget_s=60, patience=200, progress=False,
                 top_k=4)
    assert 1 <= len(out.top) <= 4
    assert out.top[0][0] == out.plan and out.top[0][1] == out.cost_s
    assert [c for _, c in out.top] == sorted(c for _, c in out.top)
    assert len({p.key() for p, _ in out.top}) == len(out.top)


def _sleeper(seconds):
    def run():
        time.sleep(seconds)
        return np.zeros(1)
    return run


def test_measure_interleaves_and_choose_keeps_the_fastest():
    runs = {"slow": _sleeper(0.004), "fast": _sleeper(0.001), "mid": _sleeper(0.002)}
    samples = measure(runs, (), rounds=3, min_sample_s=0.005)
    assert sorted(samples) == ["fast", "mid", "slow"]
    assert all(len(s) == 3 for s in samples.values())
    assert min(samples["slow"]) > max(samples["fast"])
    choice = choose(runs, (), rounds=3, min_sample_s=0.005)
    assert choice.name == "fast"
    assert choice.medians_s["fast"] == min(choice.medians_s.values())


def test_decide_keeps_the_incumbent_unless_a_challenger_wins_most_rounds():
    # 4 rounds; "lucky" has the lower median but beats XLA's default in 2 rounds only
    samples = {"xla_default": [1.00, 1.00, 1.00, 1.00],
               "lucky": [0.85, 0.85, 1.10, 1.20],
               "steady": [0.98, 0.97, 0.99, 1.05]}
    plain = decide(samples)
    assert plain.name == "lucky" and plain.incumbent is None and plain.wins == {}
    kept = decide(samples, [["xla_default"]])  # the rest form the last tier
    assert kept.wins == {"lucky": 2, "steady": 3}
    assert kept.against == {"lucky": "xla_default", "steady": "xla_default"}
    assert kept.name == kept.incumbent == "xla_default"  # 3 of 4 is below the default 0.8
    assert decide(samples, [["xla_default"]], win_share=0.75).name == "steady"
    samples["steady"][3] = 0.99  # now it wins every round
    assert decide(samples, [["xla_default"]]).name == "steady"
    # eligible by its wins, then chosen by the median only when it is lower
    assert decide({"xla_default": [1.0, 1.0, 1.0], "odd": [0.99, 0.99, 2.0]},
                  [["xla_default"]], win_share=0.5).name == "odd"
    assert decide({"xla_default": [1.0, 1.0, 1.0], "odd": [0.99, 1.5, 2.0]},
                  [["xla_default"]], win_share=0.3).name == "xla_default"
    # ties in the median go to the first name in sorted order
    assert decide({"b": [1.0], "a": [1.0]}).name == "a"
    with pytest.raises(ValueError, match="nothing"):
        decide({})
    with pytest.raises(ValueError, match="not measured"):
        decide(samples, [["bucketed"]])
    with pytest.raises(ValueError, match="empty"):
        decide(samples, [[]])
    with pytest.raises(ValueError, match="win_share"):
        decide(samples, [["xla_default"]], win_share=0)


def test_decide_makes_a_plan_beat_the_bucketing_that_beat_xla():
    # hand bucketing wins every round against XLA's default; the plan also beats XLA's
    # default every round and has the lowest median, but ties with the bucketing (2 of 4)
    samples = {"xla_default": [3.0, 3.0, 3.0, 3.0],
               "bucketed_1MiB": [1.00, 1.00, 1.00, 1.00],
               "bucketed_4MiB": [1.20, 1.20, 1.20, 1.20],
               "plan_0": [0.98, 0.97, 1.02, 1.03]}
    tiers = [["xla_default"], ["bucketed_1MiB", "bucketed_4MiB"], ["plan_0"]]
    choice = decide(samples, tiers)
    assert choice.name == "bucketed_1MiB" and choice.incumbent == "xla_default"
    assert choice.wins == {"bucketed_1MiB": 4, "bucketed_4MiB": 4, "plan_0": 2}
    assert choice.against["plan_0"] == "bucketed_1MiB"
    assert choice.against["bucketed_4MiB"] == "xla_default"
    # without the middle tier the plan faces XLA's default alone and is chosen
    assert decide(samples, [["xla_default"], ["plan_0"]]).name == "plan_0"
    # a plan that beats the bucketing in every round takes it
    samples["plan_0"] = [0.9, 0.9, 0.95, 0.99]
    assert decide(samples, tiers).name == "plan_0"


def test_choice_tiers_name_the_incumbent_and_the_bucketing_and_leave_the_rest_last():
    names = ["plan_0", "bucketed_4MiB", "xla_default", "staged_k2_r1", "bucketed_one",
             "op_fusion", "allreduce_fusion"]
    assert choice_tiers(names) == (["xla_default"], ["allreduce_fusion", "bucketed_4MiB",
                                                     "bucketed_one", "op_fusion"])
    assert [P.bucketed_name(t) for t in P.BUCKET_THRESHOLDS] == [
        "bucketed_1MiB", "bucketed_4MiB", "bucketed_16MiB", "bucketed_64MiB", "bucketed_one"]
    samples = {"xla_default": [3.0] * 4, "bucketed_1MiB": [1.0] * 4, "plan_0": [1.1] * 4,
               "staged_k2_r1": [0.5] * 4}
    assert decide(samples, choice_tiers(samples)) == decide(
        samples, [["xla_default"], ["bucketed_1MiB"], ["plan_0", "staged_k2_r1"]])


def test_pooled_in_context_medians_take_the_later_samples_in():
    from disco_jax.pipeline.profile import InContext, pooled

    first = InContext(None, 3.0, None, 2.0, None, 1.0, 4, 0.5, 0.1, runs={},
                      samples_s={"no_fusion": [3.0, 3.0, 3.0], "one_bucket": [2.0, 2.0, 2.0],
                                 "fused": [1.0, 1.0, 1.0], "tuple": [0.5], "flat": [0.1]})
    later = pooled(first, {"no_fusion": [1.0, 1.0, 1.0, 1.0], "fused": [2.0],
                           "tuple": [0.7, 0.9]})
    # medians of the pooled samples; programs without new samples keep theirs
    assert (later.wall_s, later.one_bucket_wall_s) == (1.0, 2.0)
    assert (later.fused_wall_s, later.tuple_wall_s, later.flat_wall_s) == (1.0, 0.7, 0.1)
    assert later.samples_s["no_fusion"] == [3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0]
    assert first.samples_s["no_fusion"] == [3.0, 3.0, 3.0]  # the input is left alone
    # what was not measured stays unmeasured
    none = first._replace(tuple_buffers=None, tuple_wall_s=None, flat_wall_s=None)
    assert pooled(none, {"tuple": [1.0]}).tuple_wall_s is None
    # keep=False: the later rounds' medians alone, where the program has later samples
    rounds = pooled(first, {"no_fusion": [1.0, 5.0, 4.0], "fused": [2.0]}, keep=False)
    assert (rounds.wall_s, rounds.fused_wall_s, rounds.one_bucket_wall_s) == (4.0, 2.0, 2.0)
    assert rounds.samples_s["no_fusion"] == [1.0, 5.0, 4.0]
    assert rounds.samples_s["one_bucket"] == [2.0, 2.0, 2.0]


def test_in_context_timings_with_one_bucket_not_faster_are_inconsistent():
    """One bucket runs the same kernels with fewer collectives: its median at or above
    the no-fusion program's is a slow phase, measured again by profile_in_context."""
    from disco_jax.pipeline.profile import inconsistent_walls

    assert inconsistent_walls({"no_fusion": [10.1, 10.0, 30.0], "one_bucket": [14.3] * 3,
                               "fused": [5.0] * 3})
    assert inconsistent_walls({"no_fusion": [10.0], "one_bucket": [10.0]})
    assert not inconsistent_walls({"no_fusion": [10.1, 10.0, 9.0],
                                   "one_bucket": [30.0, 9.5, 9.0]})


def test_the_profile_does_the_least_when_its_time_is_up(vgg):
    """With no time left the profile still compiles, traces the no-fusion program and
    takes MIN_ROUNDS rounds of timings, but neither more rounds nor the one-bucket
    trace; without a limit it does both."""
    from disco_jax.pipeline.profile import MIN_ROUNDS

    step, args, module, _ = vgg
    least = profile_in_context(step, args, module, iterations=2, rounds=5,
                               left_s=lambda: 0.0)
    # no-fusion, one bucket, XLA's default, and the tuple probe's two programs
    assert [len(s) for s in least.samples_s.values()] == [MIN_ROUNDS] * 5
    assert least.one_bucket_profile is None and least.profile.times_s
    full = profile_in_context(step, args, module, iterations=2, rounds=4, left_s=None)
    assert {len(s) for s in full.samples_s.values()} <= {4, 8, 12}
    assert full.one_bucket_profile is not None


def test_a_lean_profile_times_xla_default_as_the_fused_program(vgg):
    """Lean: one compile (no one-bucket program); XLA's default, compiled already, is
    the fused program; the fit matches the no-fusion program with the tuple probe's
    latency per buffer as D, and XLA's default unless the fused scale hit a bound."""
    from disco_jax.pipeline.candidates import baseline_program
    from disco_jax.pipeline.program import lower_program

    step, args, module, _ = vgg
    program = lower_program(step, args)
    default = baseline_program(program, bl.baseline_options("xla_default", program.platform))
    measured = profile_in_context(step, args, module, rounds=3, xla_default=default,
                                  lean=True)
    assert measured.lean and measured.one_bucket_wall_s is None
    assert set(measured.runs) == {"no_fusion", "fused", "tuple", "flat"}
    assert measured.runs["fused"] is default
    assert measured.fused_wall_s > 0 and measured.wall_s > 0
    costs, cal = in_context_costs(module, "inproc4", measured, progress=False)
    assert cal.wall_s[1] is None and cal.predicted_s[1] is None
    # nothing to tell D apart from the compute scale: the tuple probe's latency per buffer
    assert cal.d_s == cal.tuple_latency_s == costs.hardware.allreduce.d_s
    assert cal.d_tuple_extra_s == 0.0
    assert cal.predicted_s[0] == pytest.approx(cal.wall_s[0], rel=0.05), cal
    lo, hi = SAVING_SHARE_BOUNDS
    if lo < cal.saving_share < hi:
        assert cal.fused_predicted_s == pytest.approx(cal.fused_wall_s, rel=0.1), cal


def test_the_flat_probe_gives_the_seconds_per_byte():
    from disco_jax.pipeline.fit import C_BOUNDS, flat_rate

    assert flat_rate(1.1e-3, 1e-4, 10**6, 1e-9) == pytest.approx(1e-9)  # (1.1-0.1) ms / MB
    assert flat_rate(5e-5, 1e-4, 10**6, 1e-9) == C_BOUNDS[0] * 1e-9  # below the latency
    assert flat_rate(1.0, 0.0, 1, 1e-9) == C_BOUNDS[1] * 1e-9


def test_in_context_calibration_matches_both_programs(vgg):
    step, args, module, _ = vgg
    measured = profile_in_context(step, args, module, rounds=3)
    assert measured.wall_s > measured.one_bucket_wall_s > 0
    costs, cal = in_context_costs(module, "inproc4", measured, progress=False)
    assert cal is not None and cal.d_s >= 0 and cal.compute_scale > 0
    for want, got in zip(cal.wall_s, cal.predicted_s):
        assert abs(got - want) <= 0.1 * want, cal
    # XLA's default: measured (its fusions, its combined all-reduce), and matched unless
    # the scale hit a bound
    assert measured.fused is not None and measured.fused_wall_s > 0
    summary = bl.summary(measured.fused)
    assert summary["multi_op_fusions"] > 0 and summary["combined_all_reduces"] == 1, summary
    lo, hi = SAVING_SHARE_BOUNDS
    assert lo <= cal.saving_share <= hi
    assert costs.constants.saving_share == cal.saving_share
    if lo < cal.saving_share < hi:
        assert cal.fused_predicted_s == pytest.approx(cal.fused_wall_s, rel=0.1), cal
    # one process: the tuple probe ran on the 4 devices; each buffer of a combined
    # all-reduce pays its latency per buffer, C is the flat probe's
    assert measured.tuple_buffers == len(hlo_tools.device_graph(module).gradient_allreduces)
    assert measured.tuple_wall_s > 0 and measured.flat_wall_s > 0 and measured.flat_bytes > 0
    assert cal.tuple_latency_s is not None and cal.tuple_latency_s >= 0
    assert cal.d_s + cal.d_tuple_extra_s == pytest.approx(cal.tuple_latency_s)
    assert costs.hardware.allreduce.c_s_per_byte == cal.c_s_per_byte
    _check_overlap(costs, cal)
    again, _ = calibrate_in_context(costs, module, measured)
    assert again.constants.compute_scale == pytest.approx(costs.constants.compute_scale,
                                                          rel=0.05)
    # in a job the probes give the latency per buffer and C: 10 buffers took 0.9 ms more
    # than one flat buffer of 1 MB, which took 2 ms: 0.1 ms a buffer, (2 - 0.1) ms / MB
    probed = measured._replace(tuple_buffers=10, tuple_wall_s=2.9e-3, flat_wall_s=2e-3,
                               flat_bytes=10**6)
    fitted, cal = calibrate_in_context(costs, module, probed)
    assert cal.tuple_latency_s == pytest.approx(1e-4)
    assert cal.c_s_per_byte == pytest.approx(1.9e-9)
    assert fitted.hardware.allreduce.c_s_per_byte == pytest.approx(1.9e-9)
    assert cal.d_s + cal.d_tuple_extra_s == pytest.approx(1e-4)
    _check_overlap(fitted, cal)
    # an overlap the user set is kept through the fit
    given, _ = in_context_costs(module, "inproc4", measured, progress=False, overlap=0.5)
    assert given.overlap == 0.5
    kept, cal = calibrate_in_context(given, module, probed, fit_overlap=False)
    assert kept.overlap == 0.5 and cal.overlap is None


def _check_overlap(costs, cal):
    """The fitted overlap is the phi up to the hardware file's at which the fitted
    latency is the probe's (the bisection's own test is below): at 0, below the file's,
    the programs asked for more."""
    upper = BackendConstants.from_hardware(costs.hardware).overlap  # the file's
    assert 0.0 <= cal.overlap <= upper and costs.overlap == cal.overlap
    if cal.overlap == 0.0 < upper:
        assert cal.d_s >= cal.tuple_latency_s, cal


def test_fit_overlap_to_latency_finds_where_the_latency_crosses():
    # D(phi) = 1 + 2 phi ms: the probe's 2 ms is met at phi 0.5, within 1/128
    d_at = lambda phi: 1e-3 + 2e-3 * phi  # noqa: E731
    assert fit_overlap_to_latency(d_at, 2e-3, 1.0) == pytest.approx(0.5, abs=1 / 128)
    assert fit_overlap_to_latency(d_at, 0.5e-3, 1.0) == 0.0  # more than the probe at 0
    # less than the probe up to the file's phi: the file's, never more
    assert fit_overlap_to_latency(d_at, 5e-3, 1.0) == 1.0
    assert fit_overlap_to_latency(d_at, 2e-3, 0.25) == 0.25
    assert fit_overlap_to_latency(d_at, 2e-3, 0.0) == 0.0


def _disco(*argv, timeout=900):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "disco_jax", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _check_rows(path, setup):
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 1 and "error" not in rows[0], rows
    row = rows[0]
    assert (row["model"], row["setup"]) == ("vgg", setup)
    assert set(row["measured_s"]) == set(PROGRAMS)
    assert set(row["predicted_s"]) == set(PROGRAMS) | {"fo"}
    assert all(t > 0 for t in row["measured_s"].values())
    assert row["search_s"] > 0
    assert row["disco_max_abs_diff"] < 1e-4
    # the final choice (tiered): XLA's default, or a challenger that beat the choice
    # before it in most choice rounds with a lower median
    choice = row["choice"]
    medians, name = choice["medians_s"], choice["disco"]
    # every program a user could set by hand is a candidate, and XLA's combiner alone
    assert {"xla_default", "op_fusion", "allreduce_fusion"} <= set(medians) and any(
        n.startswith("bucketed_") for n in medians), sorted(medians)
    if name != "xla_default":
        rival = choice["against"][name]
        assert medians[name] < medians[rival], choice
        assert choice["wins"][name] >= 2, choice  # 2 of 2 choice rounds (--choice-rounds 2)
    # the fit's programs ran in the choice rounds but were never candidates; the model
    # was fitted again with their samples, and the search's model's predictions are kept
    assert not any(n.startswith("fit:") for n in medians), sorted(medians)
    refit, first = row["calibration_refit"], row["calibration"]
    assert len(refit["wall_s"]) == 2 and all(t > 0 for t in refit["wall_s"])
    assert (refit["fused_wall_s"] is None) == (first["fused_wall_s"] is None)
    assert set(row["predicted_at_start_s"]) == set(row["predicted_s"])
    assert set(choice["predicted_at_start_s"]) == set(choice["predicted_s"])
    # the fit's programs ran in the bench's rounds too: the six programs are predicted by
    # the model fitted to those rounds, every round's sample kept
    rounds = row["calibration_bench"]
    assert all(t > 0 for t in rounds["wall_s"]) and rounds["wall_s"] != refit["wall_s"]
    assert set(row["predicted_choice_fit_s"]) == set(row["predicted_s"])
    assert set(row["samples_s"]) == set(PROGRAMS)
    assert all(len(s) == 2 for s in row["samples_s"].values())  # --rounds 2
    assert row["measured_s"]["no_fusion"] == statistics.median(row["samples_s"]["no_fusion"])
    return row


@pytest.mark.slow  # the demo's test (tests/test_search_demo.py) runs the same job in-process
def test_disco_bench_in_one_process(tmp_path):
    out = tmp_path / "bench.json"
    proc = _disco("bench", "--models", "vgg", "--setups", "inproc4", "--size", "tiny",
                  "--time-budget", "2", "--rounds", "2", "--choice-rounds", "2",
                  "--min-sample-s", "0.01", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_rows(out, "inproc4")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "vgg" in proc.stdout and "DisCo/best" in proc.stdout


@pytest.mark.slow
def test_disco_bench_in_a_two_process_gloo_job(tmp_path):
    out = tmp_path / "bench.json"
    proc = _disco("bench", "--models", "vgg", "--setups", "gloo2", "--size", "tiny",
                  "--time-budget", "2", "--rounds", "2", "--choice-rounds", "2",
                  "--min-sample-s", "0.01", "--staged", "auto", "--out", str(out), "--plot",
                  str(tmp_path / "plot.png"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = _check_rows(out, "gloo2")
    assert row["facts"]["num_processes"] == 2
    # gloo's event loop at SCHED_BATCH by default (process 0's row: its one loop)
    assert (row["gloo_loop"], row["gloo_loops_quieted"]) == ("batch", 1)
    # staged candidates in both processes: the reference and the layouts process 0 picked
    staged, choice = row["staged"], row["choice"]
    assert staged["reference"] in choice["medians_s"], choice
    preds = {n: t for n, t in choice["predicted_s"].items() if n.startswith("staged")}
    best = min(preds, key=preds.__getitem__)
    assert best in choice["medians_s"], choice
    # their step cost fitted again to the reference's median in the choice rounds: every
    # staged prediction moved by the same seconds from the search's
    shift = staged["choice_shift_s"]
    assert shift is not None
    for name, t in preds.items():
        assert t == pytest.approx(choice["predicted_at_start_s"][name] + shift), name
    # two processes: the tuple probe was measured; each buffer of a combined all-reduce
    # pays its per-buffer latency, D plus the extra
    cal = row["calibration"]
    assert cal["tuple_latency_s"] >= 0
    assert cal["d_s"] + cal["d_tuple_extra_s"] == pytest.approx(cal["tuple_latency_s"])


@pytest.mark.slow
def test_disco_bench_gloo_loop_idle_runs_the_gloo_loops_idle(tmp_path):
    out = tmp_path / "bench.json"
    proc = _disco("bench", "--models", "vgg", "--setups", "gloo2", "--size", "tiny",
                  "--time-budget", "2", "--rounds", "2", "--choice-rounds", "2",
                  "--min-sample-s", "0.01", "--gloo-loop", "idle", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = _check_rows(out, "gloo2")
    assert (row["gloo_loop"], row["gloo_loops_quieted"]) == ("idle", 1)
    assert json.loads(out.read_text())["meta"]["gloo_loop"] == "idle"


def test_disco_bench_predicts_a_gpu_cluster(tmp_path):
    """The predicted table of a GPU hardware file, its ops priced at times measured
    elsewhere (``--op-times``: here a profile of this CPU stands in for a GPU's)."""
    from disco_estimator.ops import profile_ops
    from hlo_tools.jax_bridge import (
        CompileOptions,
        InPlaceOf,
        compile_module,
        extract,
        fresh_function,
    )

    step, args = zoo.get("vgg")(4, "tiny")
    step = fresh_function(step)
    run = compile_module(extract(step, *args), InPlaceOf(step, args),
                         CompileOptions(exact=True, library=True))
    (tmp_path / "times").mkdir()
    (tmp_path / "times" / "gpu_op_times_vgg_tiny.json").write_text(
        json.dumps(profile_ops(run, *args, iterations=2, warmup=1).to_json()))
    out = tmp_path / "gpu.json"
    proc = _disco("bench", "--predict-only", "--hardware", "gpu_nvlink8", "--op-times",
                  str(tmp_path / "times"), "--models", "vgg", "--size", "tiny",
                  "--time-budget", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert "measured_s" not in row and row["setup"] == "gpu_nvlink8"
    assert row["stand_ins"].startswith("op times: measured on cpu")
    pred = row["predicted_s"]
    assert set(pred) == set(PROGRAMS) | {"fo"}  # vgg's gradients fit under every threshold
    assert pred["fo"] <= pred["disco"] <= min(pred["no_fusion"], pred["bucketed"]) + 1e-12
    assert not (tmp_path / "gpu.png").exists()
    missing = _disco("bench", "--predict-only", "--hardware", "gpu_nvlink8", "--op-times",
                     str(tmp_path), "--models", "vgg", "--size", "tiny", "--out", str(out))
    assert missing.returncode != 0 and "no gpu_op_times_vgg_tiny.json" in missing.stderr


@pytest.mark.parametrize("argv, message", [
    (["bench", "--models", "nope"], "unknown model"),
    (["bench", "--setups", "mars"], "unknown setup"),
    (["bench", "--predict-only"], "--hardware"),
    (["bench", "--pool-threads", "0"], "--pool-threads"),
    (["bench", "--chunk-bytes", "-1"], "--chunk-bytes"),
    (["bench", "--gloo-loop", "idle", "--staged", "auto"], "--gloo-loop idle and --staged"),
])
def test_disco_bench_rejects_bad_arguments(argv, message, capsys, tmp_path):
    from disco_jax.cli import main

    assert main([*argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_render_table_shows_speedups():
    row = {"model": "m", "setup": "s", "size": "tiny", "search_s": 1.0,
           "measured_s": {k: 2.0 for k in PROGRAMS} | {"disco": 1.0},
           "predicted_s": {k: 2.0 for k in PROGRAMS} | {"disco": 1.5, "fo": 1.0}}
    text = render_table([row, {"model": "x", "setup": "s", "size": "tiny",
                               "error": "boom"}])
    assert "2.00x" in text and "100%" in text and "failed: boom" in text


def test_the_share_is_the_measured_gain_over_the_bounds_and_never_negative():
    """DisCo measured 1.25x over the best baseline where the bound predicts 1.5x: half
    the gain, although the model predicts DisCo's program slower than the best baseline
    (the old share, a difference of predictions, printed -100% here); no gain gives 0%."""
    pred = {k: 2.0 for k in PROGRAMS} | {"disco": 2.5, "fo": 2.0 / 1.5}
    row = {"model": "m", "setup": "s", "size": "medium", "search_s": 1.0,
           "measured_s": {k: 2.0 for k in PROGRAMS} | {"disco": 1.6}, "predicted_s": pred}
    text = render_table([row])
    assert "1.25x" in text and "1.50x" in text and "50%" in text and "-" not in text.split(
        "\n")[3]
    row["measured_s"]["disco"] = 2.1
    assert " 0%" in render_table([row])
    # a measured gain past the predicted bound (2.5x against 1.5x) is all of it, not 300%
    row["measured_s"]["disco"] = 0.8
    assert "100%" in render_table([row]) and "300%" not in render_table([row])


@pytest.mark.parametrize("start", [5.0, -3.0])
def test_the_saving_share_fit_prices_xla_default_from_either_bound(vgg, start):
    """The saving share is fitted so that the cost model itself, not the affine
    stand-in the fit solves on, prices XLA's fused program at its measurement: from a
    share at which the stand-in's kernels sit on the floor (5) or far from it (-3)."""
    import dataclasses

    from disco_estimator.costs.lower import simulated_s

    step, args, module, _ = vgg
    measured = profile_in_context(step, args, module, rounds=3)
    costs, _ = in_context_costs(module, "inproc4", measured, progress=False)

    def at_share(model: CostModel, share: float) -> CostModel:
        consts = dataclasses.replace(model.constants, saving_share=share)
        return CostModel(model.hardware, op_times=model.op_times, constants=consts)

    # a time the fit can reach: XLA's program with no saving granted (share 0)
    want = simulated_s(measured.fused, at_share(costs, 0.0))
    assert want != pytest.approx(simulated_s(measured.fused, at_share(costs, start)),
                                 rel=0.05)
    fitted, got = calibrate_in_context(at_share(costs, start), module,
                                       measured._replace(fused_wall_s=want))
    assert got.saving_share == pytest.approx(0.0, abs=0.05), got
    assert simulated_s(measured.fused, fitted) == pytest.approx(want, rel=0.01), got
    assert got.fused_predicted_s == pytest.approx(simulated_s(measured.fused, fitted))
