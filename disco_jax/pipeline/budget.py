"""The first call's time budget, and how the pipeline's phases share it.

Under ``ENABLE_SEARCH=1`` everything DisCo adds to a step's first call -- profiling in
context, the fit, the search, compiling and measuring the candidates, predicting -- comes
out of one budget of ``B`` seconds. The phases share it by one rule:

0. **XLA's default** is compiled first (it is always a candidate), and its compile time
   ``c`` prices the profile (:meth:`Budget.profile_level`): the full profile (two more
   compiles of the step) at :data:`PROFILE_FIXED_S` ``+`` :data:`PROFILE_COMPILES` ``x c``
   when that fits in :data:`PROFILE_SHARE` of ``B``; else the lean one (one compile: no one-bucket
   program) at :data:`PROFILE_FIXED_S` ``+``
   :data:`LEAN_COMPILES` ``x c`` when that and a plan's compile (:data:`PLAN_COMPILES`
   ``x c``) fit in what is left; else there is no time to choose by measurement, and the
   first call runs XLA's default.

   The lean profile runs first only when it fits in the profile's share with its calls
   priced too (XLA's default, timed by two calls; :meth:`Budget.lean_first`). Otherwise,
   and in a multi-process job with staged programs asked for whenever the full profile
   does not fit, the candidates of step 3 but the plans are built first (in a job the
   staged programs first: they overlap the all-reduces that cross processes; their picks
   by the analytic cost model), and the lean profile, the search and one plan follow only
   while they still fit (:meth:`Budget.lean_after`). So the profile takes about its share
   of the budget at most, whatever the step's compile and call cost.
1. **Profile and fit**: the profile's own share is :data:`PROFILE_SHARE` of ``B``
   (:meth:`Budget.profile_clock`). Its compiles, the trace of the no-fusion program and
   :data:`~disco_jax.pipeline.profile.MIN_ROUNDS` rounds of timings are the least it does;
   more rounds, the trace of the one-bucket program and the timings taken again when they
   contradict each other each only while the share covers them. With ``B`` under
   :data:`SHORT_S` it does the least (:attr:`Budget.short`). Ops the profile did not see
   are timed standalone only after a full profile and while half the budget is left
   (else the analytic model prices them).
2. **Search**: :data:`SEARCH_SHARE` of what is left, never more than the search's own
   limit.
3. **Candidates** are compiled in order of priority -- XLA's default (always), the
   search's best plan, hand bucketing from the smallest bucket size up, XLA's op fusion,
   the other plans, staged programs (in a multi-process job right after XLA's default)
   -- each only while what is left covers its compile
   (as long as the longest compile so far) and the final choice of the programs kept so
   far (:meth:`Budget.affords`).
4. **Final choice**: what is left, with every sample shortened to fit (at least one call
   per program and round; :meth:`Budget.sample_s`).
5. **Predictions** of the baselines (for the report) only while a quarter of the budget
   is left.

When the budget runs out the best so far wins, as in the search: the choice among the
programs compiled by then. ``B = None`` means no budget (every phase as configured).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["FULL", "LEAN", "LEAN_CALLS", "LEAN_COMPILES", "PLAN_COMPILES", "PROFILE_COMPILES",
           "PROFILE_FIXED_S", "PROFILE_SHARE", "SEARCH_SHARE", "SHORT_S", "Budget"]

#: The in-context profile's share of the budget: what it may take beyond the least it does.
PROFILE_SHARE = 1 / 3
#: The search's share of what is left of the budget after the profile and the fit.
SEARCH_SHARE = 0.2
#: Budgets under this many seconds profile with fewer rounds (3 instead of 5).
SHORT_S = 20.0
#: What the full in-context profile costs: :data:`PROFILE_FIXED_S` (the profiler's start
#: and stop, the timed calls) and this many compiles of XLA's default (it compiles two
#: programs of the step with nothing fused, which XLA:CPU compiles 2.5-3.5 times slower
#: than its default, and traces them). The zoo transformer at ``small`` in a 2-process
#: gloo job took 52.6 s where XLA's default compiled in 5.0 s, when it also compiled a
#: third program (no fusion 12.3 s, one bucket 17.7 s, the third 12.9 s): 39.7 s
#: without the third.
PROFILE_COMPILES = 7.5
#: What the lean profile costs beyond :data:`PROFILE_FIXED_S`, in compiles of XLA's
#: default: one compile with nothing fused, its trace and three timed rounds (the zoo
#: transformer at ``small`` in a 2-process gloo job: 14.5 s where XLA's default compiled
#: in 4.2 s, 3 s + 2.7 compiles).
LEAN_COMPILES = 3.0
#: Calls of the step the lean profile makes: its traced no-fusion iterations with their
#: warm-up and the timed rounds of two programs.
LEAN_CALLS = 15
#: What one exact plan costs to compile, in compiles of XLA's default (the lean profile
#: is worth its time only when a plan can be compiled after it).
PLAN_COMPILES = 3.0
#: :meth:`Budget.profile_level`'s answers.
FULL, LEAN = "full", "lean"
#: The profile's cost that does not grow with the compile time, seconds.
PROFILE_FIXED_S = 3.0


class Budget:
    """A first call's budget of ``total_s`` seconds, counted from construction.

    Args:
        total_s: the budget, seconds (None: unlimited).
        clock: seconds, monotonic (for tests).
    """

    def __init__(self, total_s: float | None,
                 clock: Callable[[], float] = time.perf_counter):
        if total_s is not None and not total_s > 0:
            raise ValueError(f"a time budget must be positive, got {total_s}")
        self.total_s = total_s
        self._clock = clock
        self._t0 = clock()
        self._compile_s = 0.0  # the longest compile so far
        self._iteration_s = 0.0  # one call of the step
        self._kept = 0  # programs in the final choice so far

    @property
    def limited(self) -> bool:
        return self.total_s is not None

    def elapsed_s(self) -> float:
        return self._clock() - self._t0

    def left_s(self) -> float:
        """Seconds left (infinite without a budget; never below 0)."""
        if self.total_s is None:
            return math.inf
        return max(0.0, self.total_s - self.elapsed_s())

    @property
    def short(self) -> bool:
        """A budget under :data:`SHORT_S`: the profile does the least it can
        (:func:`~disco_jax.pipeline.profile.profile_in_context`'s ``quick``)."""
        return self.total_s is not None and self.total_s < SHORT_S

    def profile_rounds(self, default: int, level: str = FULL) -> int:
        """Profiled rounds: ``default``, or 3 for a budget under :data:`SHORT_S` or a
        :data:`LEAN` profile."""
        return min(default, 3) if self.short or level == LEAN else default

    def times_ops(self, level: str = FULL) -> bool:
        """Whether the fit may time the ops its profile lacks standalone: after a
        :data:`FULL` profile, without a budget or with half of it left."""
        return level == FULL and (self.total_s is None
                                  or self.left_s() >= 0.5 * self.total_s)

    def search_s(self, limit_s: float | None) -> float | None:
        """The search's time: :data:`SEARCH_SHARE` of what is left, at most ``limit_s``
        (None: the search config's own limit), at least 0.1 s (start plans only)."""
        if self.total_s is None:
            return limit_s
        share = max(0.1, SEARCH_SHARE * self.left_s())
        return share if limit_s is None else min(limit_s, share)

    def note_compile(self, seconds: float) -> None:
        """A program took ``seconds`` to compile (the longest is the next one's guess)."""
        self._compile_s = max(self._compile_s, seconds)

    def compile_s(self) -> float:
        """The longest compile so far, seconds (the next one's guess)."""
        return self._compile_s

    def profile_s(self, level: str = FULL) -> float:
        """What the profile of ``level`` (:data:`FULL`, :data:`LEAN`) is expected to take:
        :data:`PROFILE_FIXED_S` and :data:`PROFILE_COMPILES` (:data:`LEAN_COMPILES`)
        compiles, each as long as the longest so far."""
        compiles = PROFILE_COMPILES if level == FULL else LEAN_COMPILES
        return PROFILE_FIXED_S + compiles * self._compile_s

    def profile_level(self) -> str | None:
        """Which profile the budget affords (the compile so far is XLA's default's,
        compiled first): :data:`FULL` without a budget or when :meth:`profile_s` fits in
        :data:`PROFILE_SHARE` of it; :data:`LEAN` when the lean profile and a plan's
        compile fit in what is left; None: neither (run XLA's default)."""
        if self.total_s is None or PROFILE_SHARE * self.total_s >= self.profile_s(FULL):
            return FULL
        if self.left_s() >= self.profile_s(LEAN) + PLAN_COMPILES * self._compile_s:
            return LEAN
        return None

    def lean_first(self) -> bool:
        """Whether the lean profile, its :data:`LEAN_CALLS` calls of the step included
        (:meth:`note_iteration` first), fits in :data:`PROFILE_SHARE` of the budget."""
        return self.total_s is None or (
            PROFILE_SHARE * self.total_s
            >= self.profile_s(LEAN) + LEAN_CALLS * self._iteration_s)

    def lean_after(self, rounds: int) -> bool:
        """Whether the lean profile and one plan still fit after programs built first:
        :meth:`profile_s` of :data:`LEAN`, :data:`LEAN_CALLS` calls of the step, a plan's
        compile (:data:`PLAN_COMPILES`) and a final choice of ``rounds`` among the
        programs kept so far and the plan."""
        return self.affords(rounds, compiles=LEAN_COMPILES + PLAN_COMPILES,
                            extra_calls=LEAN_CALLS, extra_s=PROFILE_FIXED_S)

    def profile_clock(self) -> Callable[[], float] | None:
        """Starts the profile's share: returns what is left of it, seconds, when called
        (None without a budget: the profile does all it is configured to do)."""
        if self.total_s is None:
            return None
        end = self.elapsed_s() + PROFILE_SHARE * self.total_s
        return lambda: max(0.0, end - self.elapsed_s())

    def note_iteration(self, seconds: float) -> None:
        """One call of the step takes about ``seconds`` (the profile's measure; the
        guess for every program of the final choice)."""
        self._iteration_s = seconds

    def keep(self) -> None:
        """One more program takes part in the final choice."""
        self._kept += 1

    def choice_s(self, programs: int, rounds: int, warmup: int = 2) -> float:
        """The least a final choice among ``programs`` can take: one call per program
        per round and warm-up."""
        return programs * (rounds + warmup) * self._iteration_s

    def affords(self, rounds: int, *, programs: int = 1, compiles: float = 1,
                extra_calls: int = 0, extra_s: float = 0.0) -> bool:
        """Whether ``programs`` more fit: their ``compiles`` (each as long as the longest
        so far), ``extra_calls`` calls of the step and ``extra_s`` seconds (a fit's own
        measuring) and a final choice of ``rounds`` among the programs kept so far and
        them."""
        if self.total_s is None:
            return True
        need = (compiles * self._compile_s + extra_calls * self._iteration_s + extra_s
                + self.choice_s(self._kept + programs, rounds))
        return self.left_s() >= need

    def sample_s(self, programs: int, rounds: int, default_s: float,
                 warmup: int = 2) -> float:
        """How long one sample of the final choice may last: ``default_s``, shortened so
        that ``rounds`` rounds of ``programs`` samples fit in what is left (after the
        warm-up); 0 means one call per sample."""
        if self.total_s is None:
            return default_s
        left = self.left_s() - programs * warmup * self._iteration_s
        return max(0.0, min(default_s, left / max(1, programs * rounds)))
