"""The first call's progress on stderr: silent while short, then phase, elapsed, budget
left and the best so far (:mod:`disco_jax.progress`)."""

from __future__ import annotations

import io
import time

from disco_jax.progress import FirstCallProgress


def test_a_short_first_call_prints_nothing():
    out = io.StringIO()
    with FirstCallProgress(10.0, stream=out, quiet_s=5.0) as progress:
        progress("profiling in context")
        progress("choice: xla_default (3.00 ms measured)")
    assert out.getvalue() == ""


def test_what_the_budget_left_out_is_said_at_once():
    out = io.StringIO()
    with FirstCallProgress(5.0, stream=out, quiet_s=5.0) as progress:
        progress("compiling XLA's default")
        progress("time budget: the 5 s budget leaves less than profiling this step takes")
    assert out.getvalue().splitlines() == [
        "DisCo first call 0 s | 5 s of the budget left | time budget: the 5 s budget "
        "leaves less than profiling this step takes"]
    quiet = io.StringIO()
    with FirstCallProgress(5.0, stream=quiet, quiet_s=5.0, enabled=False) as progress:
        progress("time budget: plan_0 and what would follow left out")
    assert quiet.getvalue() == ""


def test_a_long_first_call_says_phase_budget_and_best():
    out = io.StringIO()
    with FirstCallProgress(10.0, stream=out, quiet_s=0.2) as progress:
        progress("profiling in context")
        time.sleep(0.5)  # the quiet time passes: the current phase is shown
        progress("search: 40 candidates, predicted 2.00 ms")
        progress("compiling the candidates")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("DisCo first call 0 s | 10 s of the budget left | "
                               "profiling in context")
    assert "compiling the candidates | best so far: search: 40 candidates" in lines[-2]
    assert lines[-1].startswith("DisCo first call done in 0.")


def test_over_the_budget_and_disabled():
    out = io.StringIO()
    with FirstCallProgress(0.0, stream=out, quiet_s=0.1) as progress:
        time.sleep(0.3)
        progress("final choice among 3 programs")
    assert "over the budget | final choice among 3 programs" in out.getvalue()
    quiet = io.StringIO()
    with FirstCallProgress(0.0, stream=quiet, quiet_s=0.0, enabled=False) as progress:
        time.sleep(0.1)
        progress("anything")
    assert quiet.getvalue() == ""
