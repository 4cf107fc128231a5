"""The first call's budget: the sharing rule on a hand-driven clock, and a real
candidate build that stops where the budget ends."""

from __future__ import annotations

import math

import pytest

from disco_jax.pipeline.budget import (
    FULL,
    LEAN,
    LEAN_COMPILES,
    PLAN_COMPILES,
    PROFILE_COMPILES,
    PROFILE_FIXED_S,
    PROFILE_SHARE,
    SEARCH_SHARE,
    SHORT_S,
    Budget,
)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_budget_limits_nothing():
    b = Budget(None, clock=Clock())
    assert not b.limited and b.left_s() == math.inf
    assert b.search_s(55.0) == 55.0 and b.search_s(None) is None
    assert b.affords(3, programs=100, compiles=100)
    assert b.sample_s(10, 3, 0.3) == 0.3
    assert b.profile_rounds(5) == 5


def test_the_profile_gets_its_share_of_the_budget():
    clock = Clock()
    assert Budget(None, clock=clock).profile_clock() is None  # no limit
    b = Budget(60.0, clock=clock)
    clock.now += 5.0  # XLA's default compiled
    left = b.profile_clock()
    assert left() == pytest.approx(60.0 * PROFILE_SHARE)
    clock.now += 15.0
    assert left() == pytest.approx(60.0 * PROFILE_SHARE - 15.0)
    clock.now += 100.0
    assert left() == 0.0


def test_search_gets_its_share_of_what_is_left():
    clock = Clock()
    b = Budget(30.0, clock=clock)
    clock.now += 10.0  # profile and fit
    assert b.left_s() == pytest.approx(20.0)
    assert b.search_s(None) == pytest.approx(SEARCH_SHARE * 20.0)
    assert b.search_s(1.0) == 1.0  # never above the search's own limit
    clock.now += 25.0
    assert b.left_s() == 0.0 and b.search_s(None) == 0.1  # start plans only


def test_standalone_op_timing_only_with_half_the_budget_left():
    clock = Clock()
    b = Budget(10.0, clock=clock)
    clock.now += 5.0
    assert b.times_ops()
    clock.now += 0.1
    assert not b.times_ops()
    assert Budget(None).times_ops()


def test_short_budgets_profile_fewer_rounds():
    assert Budget(SHORT_S - 1).profile_rounds(5) == 3 and Budget(SHORT_S - 1).short
    assert Budget(SHORT_S).profile_rounds(5) == 5 and not Budget(SHORT_S).short
    assert Budget(None).profile_rounds(5, LEAN) == 3 and not Budget(None).times_ops(LEAN)
    assert not Budget(None).short


def test_a_program_is_afforded_with_its_compile_and_its_share_of_the_choice():
    clock = Clock()
    b = Budget(10.0, clock=clock)
    b.note_iteration(0.1)
    b.note_compile(2.0)
    b.keep()  # XLA's default
    # one more: 2 s compile + 2 programs x (3 rounds + 2 warm-up) x 0.1 s = 3 s
    clock.now += 6.9
    assert b.affords(3)
    clock.now += 0.2
    assert not b.affords(3)
    b.note_compile(1.0)  # the longest compile is the guess
    assert not b.affords(3)
    # a staged program with one pick: 2 x 2 compiles + 10 calls + 3 s measured + the choice
    # of the 2 programs (2 x 5 x 0.1 s): 4 + 1 + 3 + 1 = 9 s
    b = Budget(10.0, clock=clock)
    b.note_iteration(0.1)
    b.note_compile(1.0)
    assert b.compile_s() == 1.0
    clock.now += 0.95
    assert b.affords(3, programs=2, compiles=4, extra_calls=10, extra_s=3.0)
    clock.now += 0.1
    assert not b.affords(3, programs=2, compiles=4, extra_calls=10, extra_s=3.0)


def test_a_staged_program_costs_its_compiles_spread_over_the_job():
    from disco_jax.pipeline.candidates import STAGED_COMPILES, staged_compiles

    # one process compiles every stage and all-reduce program itself
    assert staged_compiles(1) == STAGED_COMPILES == 2.0
    # two share them (each compiles half and loads the other half)
    assert staged_compiles(2) == 1.0
    # more processes than that never make it cheaper than one compile of XLA's default
    assert staged_compiles(8) == 1.0


def test_samples_shrink_to_fit_the_rounds():
    clock = Clock()
    b = Budget(10.0, clock=clock)
    b.note_iteration(0.01)
    clock.now += 4.0
    # 6 s left, 4 programs x 2 warm-up calls x 0.01 s = 0.08 s, 3 rounds of 4 samples
    assert b.sample_s(4, 3, 1.0) == pytest.approx((6.0 - 0.08) / 12)
    assert b.sample_s(4, 3, 0.1) == 0.1
    clock.now += 10.0
    assert b.sample_s(4, 3, 0.1) == 0.0  # one call per sample


def test_the_profile_is_chosen_at_its_price_in_compiles():
    """Full when 3 s + 7.5 compiles fit in a third of the budget; lean when 3 s + 3
    compiles and a plan's 3 fit in what is left; else none."""
    assert (PROFILE_FIXED_S, PROFILE_COMPILES, LEAN_COMPILES, PLAN_COMPILES) == \
        (3.0, 7.5, 3.0, 3.0)
    clock = Clock()
    b = Budget(31.5, clock=clock)
    b.note_compile(1.0)
    clock.now += 1.0  # XLA's default compiled: 30.5 s left
    assert b.profile_s(FULL) == 10.5 and b.profile_s(LEAN) == 6.0
    assert b.profile_level() == FULL  # 10.5 s <= 31.5 / 3
    b = Budget(31.0, clock=clock)
    b.note_compile(1.0)
    assert b.profile_level() == LEAN  # 10.5 s > 31 / 3; 6 s + 3 s <= 31 s left
    clock.now += 21.5  # 9.5 s left
    assert b.profile_level() == LEAN
    clock.now += 1.0
    assert b.profile_level() is None  # 8.5 s left < 9 s
    assert Budget(None).profile_level() == FULL


def test_the_lean_profile_runs_first_only_within_its_share_with_its_calls():
    """3 s + 3 compiles + 15 calls of the step within a third of the budget: the lean
    profile first; else the baselines come first. Transformer at ``large`` in one
    process: 3 + 3 x 6 s + 15 x 1.6 s = 45 s > 120 / 3 (its lean profile took 75 s)."""
    clock = Clock()
    b = Budget(120.0, clock=clock)
    b.note_compile(6.0)
    b.note_iteration(1.6)
    assert b.profile_level() == LEAN and not b.lean_first()
    b.note_iteration(1.0)  # 3 + 18 + 15 = 36 s <= 40 s
    assert b.lean_first()
    assert Budget(None).lean_first()


def test_the_lean_profile_after_programs_built_first_is_priced_with_them():
    """After the staged programs and baselines: 3 s, 3 + 3 compiles, 15 calls of the step
    and a final choice among the programs kept so far and the plan."""
    from disco_jax.pipeline.budget import LEAN_CALLS

    assert LEAN_CALLS == 15
    clock = Clock()
    b = Budget(60.0, clock=clock)
    b.note_compile(2.0)
    b.note_iteration(0.1)
    for _ in range(3):
        b.keep()
    # 3 + 6 x 2 + 15 x 0.1 + 4 programs x (3 + 2) x 0.1 = 18.5 s
    clock.now += 60.0 - 18.5
    assert b.lean_after(3)
    clock.now += 0.01
    assert not b.lean_after(3)


def test_a_budget_below_the_profile_runs_xla_default_and_says_why():
    """A real first call with a budget the profile cannot fit in: XLA's default, compiled
    once, chosen without a search; it computes what jax.jit computes."""
    import jax
    import numpy as np

    from disco_jax import zoo
    from disco_jax.pipeline.optimize import optimize_step

    step, args = zoo.get("vgg")(jax.device_count(), "tiny")
    lines: list[str] = []
    opt = optimize_step(step, args, time_budget_s=1e-3, progress=lines.append)
    assert opt.report.choice == "xla_default" and opt.enactment.name == "xla_default"
    assert "leaves less than profiling this step" in opt.report.search["skipped"]
    assert opt.report.measured_s == {} and opt.report.calibration is None
    assert set(opt.report.seconds) == {"lower", "compile", "total"}
    assert any(line.startswith("time budget:") for line in lines), lines
    got, want = opt.run(*args), jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_lean_profile_past_its_share_comes_after_the_baselines(monkeypatch):
    """One process, a budget whose third the lean profile would overrun (forced here:
    ``Budget.lean_first`` says no): XLA's default, op fusion and hand bucketing are
    built first, the lean profile and the search only if they still fit; the choice
    computes what jax.jit computes."""
    import jax
    import numpy as np

    from disco_jax import zoo
    from disco_jax.pipeline.optimize import optimize_step

    monkeypatch.setattr(Budget, "lean_first", lambda self: False)
    monkeypatch.setattr(Budget, "profile_level", lambda self: LEAN)
    step, args = zoo.get("vgg")(jax.device_count(), "tiny")
    lines: list[str] = []
    opt = optimize_step(step, args, time_budget_s=20.0, progress=lines.append,
                        bucket_thresholds=(1 << 20,), choice_rounds=1, top_k=1)
    assert any("time budget: baselines first" in line for line in lines), lines
    assert {"xla_default", "op_fusion", "allreduce_fusion",
            "bucketed_1MiB"} <= set(opt.report.measured_s)
    profiled = [i for i, line in enumerate(lines) if line.startswith("profiling")]
    built = next(i for i, line in enumerate(lines) if "baselines first" in line)
    assert all(i > built for i in profiled)
    if not profiled:
        assert "after the baselines" in opt.report.search["skipped"]
    got, want = opt.run(*args), jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        Budget(0.0)


def test_candidates_stop_where_the_budget_ends():
    """A real build on a tiny step: with the budget spent, XLA's default alone is compiled
    (and runs); without one, every candidate."""
    import jax

    from disco_jax import zoo
    from disco_jax.pipeline.candidates import build_candidates, enactment_route
    from disco_jax.pipeline.program import lower_program

    program = lower_program(*zoo.get("vgg")(jax.device_count(), "tiny"))
    route = enactment_route(None, program.platform)
    lines: list[str] = []
    spent = Budget(1e-3)
    cands = build_candidates(program, [], route, bucket_thresholds=(None, 1 << 20),
                             budget=spent, say=lines.append)
    assert list(cands.runs) == ["xla_default"], list(cands.runs)
    assert any("time budget" in line for line in lines), lines
    jax.block_until_ready(cands.runs["xla_default"](*program.args))
    full = build_candidates(program, [], route, bucket_thresholds=(None, 1 << 20))
    assert {"xla_default", "op_fusion"} <= set(full.runs) and full.bucketed


def test_each_program_of_hand_bucketing_is_priced_with_those_before_it():
    """Calls of 10 s, 3 rounds: XLA's default and one bucketing take 100 s of final
    choice, a second bucketing 150 s; 130 s affords the first alone."""
    import jax

    from disco_jax import zoo
    from disco_jax.pipeline.candidates import build_candidates, enactment_route
    from disco_jax.pipeline.program import lower_program

    program = lower_program(*zoo.get("vgg")(jax.device_count(), "tiny"))
    budget = Budget(130.0, clock=Clock())
    budget.note_iteration(10.0)
    lines: list[str] = []
    cands = build_candidates(program, [], enactment_route(None, program.platform),
                             bucket_thresholds=(1 << 12, None), budget=budget,
                             say=lines.append, choice_rounds=3)
    assert len(cands.bucketed) == 1, cands.bucketed
    assert "op_fusion" not in cands.runs
    assert any("hand bucketing and what would follow left out" in line for line in lines)


class _Process0:
    """Process 0 of a job, alone: its shares and gathers go through a key-value store
    that refuses a key set twice, as jax.distributed's coordination service does."""

    processes = 2

    def __init__(self):
        self.keys: list[str] = []

    def _set(self, key: str) -> None:
        assert key not in self.keys, f"key {key} already exists"
        self.keys.append(key)

    def barrier(self, tag: str) -> None:
        pass

    def share(self, key, value):
        self._set(key)
        return value

    def gather(self, key, value):
        self._set(key)
        return [value]


def test_each_budget_question_of_a_job_has_its_own_key():
    """The hand-bucketing sweep asks the budget once per bucket size; in a job every
    answer is shared under a key of its own (a repeated key ended a 2-process search
    with ALREADY_EXISTS on process 0 while process 1 waited)."""
    import jax

    from disco_jax import zoo
    from disco_jax.pipeline.candidates import build_candidates, enactment_route
    from disco_jax.pipeline.program import lower_program

    program = lower_program(*zoo.get("vgg")(jax.device_count(), "tiny"))
    job = _Process0()
    cands = build_candidates(program, [], enactment_route(None, program.platform),
                             bucket_thresholds=(1 << 10, 1 << 14, None), budget=Budget(600.0),
                             sync=job)
    asked = [k for k in job.keys if k.startswith("budget_") and "hand bucketing" in k]
    assert len(asked) >= 2 and len(set(asked)) == len(asked), job.keys
    assert "xla_default" in cands.runs and cands.bucketed


def test_a_lean_first_call_computes_what_jax_jit_computes():
    """``profile="lean"``: XLA's default compiled first and timed as the fused program,
    one compile of the step with nothing fused (beside the tuple probe's two small
    programs), a fit with the one-bucket half empty; the choice runs and gives jax.jit's
    values."""
    import jax
    import numpy as np

    from disco_jax import zoo
    from disco_jax.pipeline.optimize import optimize_step

    step, args = zoo.get("vgg")(jax.device_count(), "tiny")
    lines: list[str] = []
    opt = optimize_step(step, args, profile="lean", progress=lines.append,
                        keep_labels=False, keep_details=True)
    assert any("lean" in line for line in lines), lines
    measured = opt.details.profile
    assert measured.lean and set(measured.runs) == {"no_fusion", "fused", "tuple", "flat"}
    assert measured.runs["fused"] is opt.details.candidates.runs["xla_default"]
    cal = opt.report.calibration
    assert cal["wall_s"][1] is None and cal["predicted_s"][0] > 0
    got, want = opt.run(*args), jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="profile must be"):
        optimize_step(step, args, profile="half")
