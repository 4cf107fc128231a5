"""The whole product pipeline for one train step, returning what to run as an
:class:`~disco_jax.enactment.Enactment` (what ``disco_jax.jit`` runs under
``ENABLE_SEARCH=1`` and keeps in the strategy store). It composes the pipeline's steps on
one :class:`~disco_jax.pipeline.program.Program`, lowered and parsed once:

1. :func:`~disco_jax.pipeline.profile.profile_in_context` and
   :func:`~disco_jax.pipeline.fit.in_context_costs`: the cost model where the step runs;
2. :func:`~disco_jax.pipeline.search.plans_for_choice`: the search's best plans (process
   0 of a job searches; the plans go to every process through ``sync``);
3. :func:`~disco_jax.pipeline.candidates.build_candidates`: the plans compiled as the
   backend's route allows, hand bucketing, XLA's default and op fusion, staged programs;
4. :func:`~disco_jax.pipeline.choose.measure` and :func:`~disco_jax.pipeline.choose.decide`:
   the final choice by measurement, in tiers (XLA's default stays unless hand bucketing
   beats it in most paired rounds, and that choice stays unless a plan or staged program
   beats it so).

It is the one composition of these steps: ``disco bench`` and ``disco demo``
(:func:`disco_jax.pipeline.bench.bench_row`) call it with ``keep_details=True`` and
measure and predict its programs further from :attr:`Optimized.details`.
:func:`predict_step` is the part of it that needs no machine to run on (lower, price with
a hardware file, search), for ``disco bench --predict-only``.

Typical use::

    step, args = zoo.get("vgg")(4, "tiny")
    opt = optimize_step(step, args, time_budget_s=2.0)
    out = opt.run(*args)                 # == jax.jit(step)(*args)
    opt.enactment.to_json()              # what the strategy store keeps
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from disco_jax.pipeline.sync import SOLO, Sync

if TYPE_CHECKING:
    from disco_estimator.costs.fused_choice import FusedChoice
    from disco_jax.pipeline.candidates import Candidates
    from disco_jax.pipeline.choose import Choice
    from disco_jax.pipeline.profile import InContext
    from disco_jax.pipeline.program import Program
    from disco_jax.pipeline.search import SearchedPlans, SearchOutcome

__all__ = [
    "DEFAULT_CHOICE_ROUNDS",
    "FIT_PREFIX",
    "OptimizeDetails",
    "OptimizeReport",
    "Optimized",
    "Predicted",
    "Refit",
    "optimize_step",
    "predict_step",
    "refit",
]

#: Interleaved rounds of the final choice by measurement.
DEFAULT_CHOICE_ROUNDS = 3

#: Names of the in-context fit's programs when they run again in the final choice's
#: rounds (``fit:no_fusion``, ...; ``remeasure_fit`` of :func:`optimize_step`).
FIT_PREFIX = "fit:"


class OptimizeReport(NamedTuple):
    """How :func:`optimize_step` chose (every field JSON-able; :meth:`to_json`).

    Attributes:
        choice: the winner's name (``plan_0``, ``bucketed_1MiB``, ``xla_default``, ...).
        predicted_s: predicted seconds per iteration of every candidate by name (None
            where the model has none).
        measured_s: measured seconds per iteration of every candidate by name (medians
            of the choice's rounds).
        wins: per challenger, the rounds it beat the program it challenged in.
        against: per challenger, the program it challenged.
        search: the search's settings and statistics (``{"refused": why}`` when no plan
            fit the memory budget; None on processes other than 0).
        hardware: the hardware file's name.
        route: how plans reached the backend (:class:`hlo_tools.jax_bridge.Route`).
        calibration: the in-context fit (None on processes other than 0).
        seconds: wall seconds of each phase and ``total``.
        fused_estimator: the fused-op estimator of the cost model
            (:meth:`~disco_estimator.costs.fused_choice.FusedChoice.to_json`: name, checkpoint,
            its sha256).
    """

    choice: str
    predicted_s: dict[str, float | None]
    measured_s: dict[str, float]
    wins: dict[str, int]
    against: dict[str, str]
    search: dict[str, Any] | None
    hardware: str
    route: dict[str, str]
    calibration: dict[str, Any] | None
    seconds: dict[str, float]
    fused_estimator: dict[str, str | None]

    def to_json(self) -> dict[str, Any]:
        return self._asdict()


class OptimizeDetails(NamedTuple):
    """What :func:`optimize_step` built on the way to its choice (``keep_details=True``),
    for a caller that measures and predicts its programs further (``disco bench``). It
    holds every compiled program, so it is kept only when asked for.

    Attributes:
        program: the step, lowered and parsed once.
        profile: the in-context profile (its ``runs``: the fit's programs).
        costs: the cost model the search priced plans with (process 0; None elsewhere).
        calibration: its in-context fit (process 0; None elsewhere).
        searched: the search's plans and outcome.
        candidates: every program compiled: the final choice's candidates and the
            ``extra_baselines`` (staged runs other than the choice are closed).
        choice: the final choice among the candidates (their samples in ``samples_s``).
        samples_s: the samples of every program of the choice's rounds: the candidates'
            and, with ``remeasure_fit``, the fit's programs' (named ``fit:<name>``,
            :data:`FIT_PREFIX`).
        refit: with ``remeasure_fit``, the cost model fitted again on those samples
            pooled in (process 0; None elsewhere).
    """

    program: Program
    profile: InContext
    costs: Any
    calibration: Any
    searched: SearchedPlans
    candidates: Candidates
    choice: Choice
    samples_s: dict[str, list[float]]
    refit: Refit | None = None


class Refit(NamedTuple):
    """The cost model fitted again after the final choice (``remeasure_fit``): the fit's
    programs' samples of the choice's rounds pooled into the profile, so that
    predictions rest on more samples than the search's did.

    Attributes:
        costs: fitted again (the search's own when there was nothing to fit again).
        profile: the in-context profile with those samples pooled in
            (:func:`disco_jax.pipeline.profile.pooled`).
        calibration: the new fit (None: not fitted again).
        hardware: the hardware file the fit started from.
    """

    costs: Any
    profile: InContext
    calibration: Any
    hardware: str

    def with_fused(self, module: Any, fused: Any) -> Any:
        """The same fit with another fused-op estimator ``fused``: its cost model."""
        from disco_jax.pipeline.fit import in_context_costs

        return in_context_costs(module, self.hardware, self.profile, progress=False,
                                fused=fused)[0]


class Optimized(NamedTuple):
    """What :func:`optimize_step` chose.

    Attributes:
        enactment: the winner, as the store keeps it.
        run: the winner compiled: ``run(*args)`` returns what ``jax.jit(step)(*args)``
            returns (a staged run has ``.close()``).
        report: how it was chosen (:class:`OptimizeReport`).
        details: how it got there (:class:`OptimizeDetails`; None unless
            ``keep_details``, or when the budget left no time to choose).
    """

    enactment: Any
    run: Callable[..., Any]
    report: OptimizeReport
    details: OptimizeDetails | None = None


def _predictions(cands: Any, runs: Mapping[str, Any], searched: Any, costs: Any,
                 baselines: bool) -> dict[str, float | None]:
    """Every candidate's (``runs``') predicted seconds: the search's for its plans, the
    staged cost model's for staged programs, and (``baselines``) the simulation of XLA's
    compiled program for hand bucketing and XLA's candidate baselines."""
    from disco_estimator.costs.lower import predict_module
    from disco_jax.pipeline.candidates import CANDIDATE_BASELINES
    from hlo_tools import baselines as bl

    predicted: dict[str, float | None] = {name: None for name in runs}
    predicted.update({n: t for n, t in cands.staged_info.get("predicted_s", {}).items()
                      if n in runs})
    if searched.outcome is not None:
        predicted.update(zip(cands.plans, (c for _, c in searched.outcome.top)))
    if baselines:
        for name, run in runs.items():
            if name.startswith("bucketed") or name in CANDIDATE_BASELINES:
                predicted[name] = predict_module(bl.module_from_compiled(run), costs)
    return predicted


def _keep_labels(program: Any, cands: Any, costs: Any, wall_s: float, budget: Any,
                 sync: Any, say: Callable[[str], None]) -> None:
    """Traces the final choice's exact plans and XLA's default once more and adds their
    fused ops to the local dataset (:func:`~disco_jax.pipeline.labels.keep_labels`), when
    labels are wanted (:func:`~disco_jax.pipeline.labels.labels_wanted`) and the time
    budget has room for it (process 0 decides for the job)."""
    from disco_jax.pipeline.labels import keep_labels, keep_labels_s, labels_wanted

    runs = {n: r for n, r in cands.runs.items()
            if n == "xla_default" or (n.startswith("plan_") and not hasattr(r, "close"))}
    wanted = bool(runs) and labels_wanted() and (
        not budget.limited or budget.left_s() >= keep_labels_s(len(runs), wall_s))
    wanted = sync.share("keep_labels", wanted)
    if wanted:
        new = keep_labels(runs, program.args, costs, program.module.name)
        if costs is not None:
            say(f"kept {new} new fused-op label{'s' if new != 1 else ''} in the local "
                "dataset")


def _xla_default_only(program: Any, route: Any, hardware: str,
                      compiled_already: Mapping[str, Any], why: str,
                      seconds: dict[str, float], t0: float, fused: FusedChoice
                      ) -> Optimized:
    """XLA's default alone, compiled already, when the budget leaves no time to choose
    (the report's ``search`` says why)."""
    from disco_jax.pipeline.candidates import build_candidates

    cands = build_candidates(program, (), route, baselines=("xla_default",),
                             bucket_thresholds=(), compiled_already=compiled_already)
    report = OptimizeReport(
        choice="xla_default", predicted_s={"xla_default": None}, measured_s={}, wins={},
        against={}, search={"skipped": why}, hardware=hardware, route=route.to_json(),
        calibration=None, seconds={**seconds, "total": time.perf_counter() - t0},
        fused_estimator=fused.to_json())
    return Optimized(cands.enactments["xla_default"], cands.runs["xla_default"], report)


def _time_default(program: Any, compiled_already: Mapping[str, Any], budget: Any,
                  sync: Sync) -> None:
    """Times XLA's default (the faster of two calls): what a call of the step costs, for
    the budget's prices."""
    from disco_jax.pipeline.choose import measure

    calls = measure({"xla_default": compiled_already["xla_default"]}, program.args,
                    rounds=2, warmup=1, min_sample_s=0.0, sync=sync, tag="budget_call")
    budget.note_iteration(min(calls["xla_default"]))


def _candidates_first(program: Any, route: Any, hardware: str, baselines: Sequence[str],
                      staged: Sequence[Any], compiled_already: Mapping[str, Any],
                      cand_args: Mapping[str, Any]) -> Candidates:
    """The candidates but the search's plans, built before the profile: what a budget
    buys first when the lean profile does not fit in its share, and in a job whenever
    the full profile does not (staged programs overlap the all-reduces that cross
    processes). Process 0 orders the staged programs' stages and picks their bucketings
    with the analytic cost model of ``hardware`` (no op is timed)."""
    import jax

    from disco_estimator.costs.cost_model import CostModel
    from disco_jax.pipeline.candidates import build_candidates

    analytic = (CostModel.for_module(program.module, hardware, bench=False, progress=False)
                if jax.process_index() == 0 else None)
    return build_candidates(program, (), route, baselines=baselines, staged=staged,
                            costs=analytic, compiled_already=compiled_already, **cand_args)


def _profile_and_search(program: Any, level: str, budget: Any, sync: Sync,
                        say: Callable[[str], None], lap: Callable[[str], None],
                        seconds: Mapping[str, float], hardware: str, fused: FusedChoice,
                        route: Any, compiled_already: Mapping[str, Any], *,
                        profile_rounds: int, seed: int, top_k: int,
                        search_s: float | None, memory_budget_bytes: int | None
                        ) -> tuple[Any, Any, Any, SearchedPlans]:
    """The in-context profile of ``level``, the fit (process 0) and the search's plans
    for the final choice: ``(profile, costs, calibration, searched)``."""
    import jax

    from disco_jax.pipeline.budget import LEAN
    from disco_jax.pipeline.fit import in_context_costs
    from disco_jax.pipeline.profile import profile_in_context
    from disco_jax.pipeline.search import plans_for_choice
    from hlo_tools.jax_bridge import EXACT

    say("profiling in context" + (" (lean: XLA's default as the fused program)"
                                  if level == LEAN else ""))
    rounds = budget.profile_rounds(profile_rounds, level)
    measured = profile_in_context(program.step, program.args, program.module, sync=sync,
                                  iterations=rounds, rounds=rounds, quick=budget.short,
                                  left_s=budget.profile_clock(),
                                  xla_default=compiled_already["xla_default"],
                                  lean=level == LEAN)
    budget.note_iteration(measured.wall_s)
    lap("profile")
    if budget.limited:
        say(f"profiled in {seconds['profile']:.1f} s ({seconds['profile'] / budget.total_s:.0%}"
            f" of the {budget.total_s:g} s budget); fitting the cost model")
    costs = calibration = None
    if jax.process_index() == 0:
        costs, calibration = in_context_costs(program.module, hardware, measured,
                                              progress=False, bench=budget.times_ops(level),
                                              fused=fused.estimator)
        lap("fit")
    search_s = budget.search_s(search_s)
    search_s = sync.share("budget_search_s", search_s)  # process 0's clock decides
    searched = plans_for_choice(program.graph, costs, sync=sync, seed=seed,
                                time_budget_s=search_s, top_k=top_k,
                                memory_budget_bytes=memory_budget_bytes,
                                buckets_only=route.name != EXACT, say=say)
    if costs is not None:
        lap("search")
    return measured, costs, calibration, searched


def optimize_step(step: Callable[..., Any], args: Sequence[Any], *,
                  time_budget_s: float | None = None, hardware: str | None = None,
                  sync: Sync = SOLO, top_k: int = 3,
                  choice_rounds: int = DEFAULT_CHOICE_ROUNDS, staged: Sequence[Any] = (),
                  min_sample_s: float = 0.05, seed: int = 0, predict_baselines: bool = True,
                  bucket_thresholds: Sequence[int | None] | None = None,
                  profile_rounds: int = 5, memory_budget_bytes: int | None = None,
                  route: str | None = None, search_s: float | None = None,
                  fused_estimator: FusedChoice | None = None,
                  progress: Callable[[str], None] | None = None,
                  extra_baselines: Sequence[str] = (), remeasure_fit: bool = False,
                  staged_top: int = 3, chunk_bytes: int | None | str = "default",
                  keep_labels: bool = True, keep_details: bool = False,
                  profile: str | None = None) -> Optimized:
    """Profiles, searches, compiles the candidates and chooses by measurement.

    Args:
        step: the train step (plain or jitted), called with positional arguments only.
        args: its arguments, placed as they will be at run time. They are not donated:
            every candidate runs on them several times.
        time_budget_s: the budget of everything this function does, seconds, shared by
            its phases by the rule of :mod:`disco_jax.pipeline.budget` (None: no limit;
            the search stops at ``configs/search.toml``'s limit).
        hardware: hardware file name or path (None:
            :func:`~disco_jax.pipeline.fit.default_hardware`).
        sync: the job's :class:`~disco_jax.pipeline.sync.Sync` (default: one process). Every
            process calls this function alike; process 0 searches and its plans are
            shared.
        top_k: plans of the search that take part in the final choice.
        choice_rounds: interleaved rounds of the final choice.
        staged: staged programs to add to the choice: bucket counts, ``"plan"`` for
            the buckets of the search's best plan, ``"auto"`` for the staged cost model's
            best bucketings (:func:`~disco_jax.pipeline.candidates.staged_candidates`).
        min_sample_s: each measured sample lasts about this long, seconds.
        seed: seeds the search and the round order.
        predict_baselines: also predict XLA's default and the bucketed programs (times
            their compiled ops standalone, cached); else their predictions are None.
        bucket_thresholds: the bucket sizes T of the bucketed sweep, bytes (None in it:
            one bucket; default: :data:`hlo_tools.baselines.BUCKET_THRESHOLDS`).
        profile_rounds: profiled iterations and untraced samples of the in-context
            profile (fewer: faster, noisier fit).
        memory_budget_bytes: the search refuses plans predicted to need more memory per
            device, bytes (None: the device's memory,
            :func:`hlo_tools.jax_bridge.device_memory_bytes`). When no plan fits, the
            final choice runs among the baselines alone (``report.search["refused"]``
            says why).
        route: how plans reach the backend: ``"exact"`` (hand-written fusions compile:
            the joint search), ``"buckets"`` (AllReduce buckets alone, over XLA's own
            fusion) or None: the backend's probe
            (:func:`~disco_jax.pipeline.candidates.enactment_route`).
        search_s: the search's own limit, seconds, within its share of the budget (None:
            ``configs/search.toml``'s).
        fused_estimator: the cost model's fused-op estimator (None:
            :func:`~disco_estimator.costs.fused_choice.choose_fused_estimator` for the step's
            platform: ``$DISCO_FUSED_ESTIMATOR``, else the default).
        progress: called with a line per phase (None: silent).
        extra_baselines: more of XLA's baselines to compile
            (:data:`hlo_tools.baselines.BASELINES` names, e.g. ``no_fusion``), never
            candidates nor measured here: ``disco bench`` measures them after the choice
            (in :attr:`OptimizeDetails.candidates`).
        remeasure_fit: the in-context fit's programs run again in the final choice's
            rounds (named ``fit:<name>``, never candidates; :attr:`OptimizeDetails.samples_s`)
            and, with ``keep_details``, the cost model is fitted again with their samples
            pooled in (:attr:`OptimizeDetails.refit`).
        staged_top, chunk_bytes: the staged programs' settings
            (:func:`~disco_jax.pipeline.candidates.staged_candidates`).
        keep_labels: add the fused ops of the exact plans and XLA's default to the local
            dataset after the choice, when :func:`~disco_jax.pipeline.labels.labels_wanted`
            (False: never; ``disco bench`` leaves the dataset alone).
        keep_details: return :attr:`Optimized.details` (it holds every compiled program
            until dropped).
        profile: the in-context profile, ``"full"`` or ``"lean"``
            (:func:`~disco_jax.pipeline.budget.Budget.profile_level`; None: as the budget
            affords, full without one).

    Returns:
        The :class:`Optimized` winner.

    Raises:
        ValueError: the step has no gradient all-reduce to optimize (not a ``shard_map``
            data-parallel step), a parameter out of range, or a bad
            ``$DISCO_FUSED_ESTIMATOR``.
        hlo_tools.jax_bridge.HloCompileError: XLA rejected a candidate.
    """
    import jax

    from disco_estimator.costs.fused_choice import choose_fused_estimator
    from disco_jax.pipeline.budget import FULL, LEAN, PLAN_COMPILES, Budget
    from disco_jax.pipeline.candidates import (
        CANDIDATE_BASELINES,
        baseline_program,
        build_candidates,
        enactment_route,
        job_route,
    )
    from disco_jax.pipeline.choose import choice_tiers, decide, measure
    from disco_jax.pipeline.fit import default_hardware
    from disco_jax.pipeline.program import lower_program
    from disco_jax.pipeline.search import SearchedPlans
    from hlo_tools import baselines as bl
    from hlo_tools.jax_bridge import EXACT

    say = progress or (lambda text: None)
    if top_k < 1 or choice_rounds < 1:
        raise ValueError(f"top_k and choice_rounds must be >= 1, got {top_k}, {choice_rounds}")
    if set(extra_baselines) & set(CANDIDATE_BASELINES):
        raise ValueError(f"{', '.join(CANDIDATE_BASELINES)} are candidates, not "
                         "extra_baselines")
    if profile not in (None, FULL, LEAN):
        raise ValueError(f"profile must be {FULL!r} or {LEAN!r}, got {profile!r}")
    # in a job, process 0 compiles each program and the others load it: compiles of
    # processes that share the cores contend (docs/findings.md, "A minute in a job")
    with sync.compiles_shared() as shared:
        seconds: dict[str, float] = {}
        budget = Budget(time_budget_s)
        t0 = t_phase = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t_phase
            now = time.perf_counter()
            seconds[name] = seconds.get(name, 0.0) + now - t_phase
            t_phase = now

        program = lower_program(step, args)
        fused = (fused_estimator if fused_estimator is not None
                 else choose_fused_estimator(platform=program.platform))
        lap("lower")
        plan_route = job_route(enactment_route(route, program.platform), sync)
        hardware = hardware or default_hardware(jax.process_count(), program.platform)
        graph = program.graph
        start = "compiling XLA's default" if budget.limited else "profiling in context"
        say(f"{graph.num_nodes} nodes, {len(graph.gradient_allreduces)} gradient all-reduces; "
            f"plans {'joint' if plan_route.name == EXACT else 'of AllReduce buckets'} "
            f"({plan_route.reason}); hardware {hardware}; {start}")
        compiled_already: dict[str, Any] = {}
        level = profile or FULL
        first: Candidates | None = None  # the programs built before the profile
        skipped = None  # why nothing was profiled nor searched
        cand_args = {"bucket_thresholds": bucket_thresholds, "sync": sync, "say": say,
                     "staged_top": staged_top, "chunk_bytes": chunk_bytes, "budget": budget,
                     "choice_rounds": choice_rounds}
        baselines = (*CANDIDATE_BASELINES, *extra_baselines)
        if budget.limited or level == LEAN:  # XLA's default first: its compile prices the profile
            t_default = time.perf_counter()
            compiled_already["xla_default"] = baseline_program(
                program, bl.baseline_options("xla_default", program.platform))
            budget.note_compile(time.perf_counter() - t_default)
            lap("compile")
            if profile is None:
                level = sync.share("budget_profile", budget.profile_level())
            job_staged = bool(staged) and sync.processes > 1
            if profile is None and (level == LEAN or level is None and job_staged):
                _time_default(program, compiled_already, budget, sync)
                built = "staged programs and baselines" if job_staged else "baselines"
                if job_staged or not sync.share("budget_lean_first", budget.lean_first()):
                    say(f"time budget: {built} first, then the profile and the search if they "
                        "still fit")
                    first = _candidates_first(program, plan_route, hardware, baselines, staged,
                                              compiled_already, cand_args)
                    lap("compile")
                    level = sync.share("budget_profile_after",
                                       LEAN if budget.lean_after(choice_rounds) else None)
                    if level is None:
                        skipped = (f"the {budget.total_s:g} s budget left no time to profile "
                                   f"the step and compile a plan after the {built}")
            elif level is None:
                why = (f"the {budget.total_s:g} s budget leaves less than profiling this step "
                       f"and compiling a plan take (about "
                       f"{budget.profile_s(LEAN) + PLAN_COMPILES * seconds['compile']:.0f} s, "
                       f"from its {seconds['compile']:.1f} s compile): running XLA's default")
                say(f"time budget: {why}")
                return _xla_default_only(program, plan_route, hardware, compiled_already, why,
                                         seconds, t0, fused)
        measured = costs = calibration = None
        searched = SearchedPlans([], None, None)
        if level is not None and "xla_default" not in compiled_already:
            # a candidate in any case, and the profile's fused program
            compiled_already["xla_default"] = baseline_program(
                program, bl.baseline_options("xla_default", program.platform))
            lap("compile")
        if level is not None:
            measured, costs, calibration, searched = _profile_and_search(
                program, level, budget, sync, say, lap, seconds, hardware, fused, plan_route,
                compiled_already, profile_rounds=profile_rounds, seed=seed, top_k=top_k,
                search_s=search_s, memory_budget_bytes=memory_budget_bytes)
        else:
            say(f"time budget: {skipped}")

        if first is None:
            say("compiling the candidates")
            cands = build_candidates(program, searched.plans_json, plan_route,
                                     baselines=baselines, staged=staged, costs=costs,
                                     compiled_already=compiled_already, **cand_args)
        elif searched.plans_json:
            say("compiling the search's plans")
            cands = first.merged(build_candidates(
                program, searched.plans_json, plan_route, baselines=(),
                **{**cand_args, "bucket_thresholds": ()}))
        else:
            cands = first
        lap("compile")

        runs = {n: r for n, r in cands.runs.items() if n not in extra_baselines}
        beside = {f"{FIT_PREFIX}{n}": r for n, r in (measured.runs or {}).items()} \
            if remeasure_fit and measured is not None else {}
        sample_s = budget.sample_s(len(runs) + len(beside), choice_rounds, min_sample_s)
        sample_s = sync.share("budget_sample_s", sample_s)
        n = len(runs)
        say(f"final choice among {n} program{'s' if n != 1 else ''}"
            + (f" (and the fit's {len(beside)})" if beside else ""))
        samples = measure({**runs, **beside}, program.args, rounds=choice_rounds, sync=sync,
                          tag="optimize_choice", min_sample_s=sample_s, seed=seed)
        choice = decide({name: samples[name] for name in runs}, choice_tiers(runs))
        lap("choice")
        if keep_labels and measured is not None:
            _keep_labels(program, cands, costs, measured.wall_s, budget, sync, say)
            lap("labels")
        cands.close_except(choice.name)

        # the baselines' predictions (standalone op times) only from time left over
        spare = not budget.limited or budget.left_s() >= 0.25 * budget.total_s
        predicted = _predictions(cands, runs, searched, costs,
                                 predict_baselines and spare and costs is not None)
        lap("predict")
        report = OptimizeReport(
            choice=choice.name, predicted_s=dict(predicted), measured_s=dict(choice.medians_s),
            wins=dict(choice.wins), against=dict(choice.against),
            search=({"skipped": skipped} if skipped
                    else searched.report(seed, top_k, choice_rounds)), hardware=hardware,
            route=plan_route.to_json(),
            calibration=calibration._asdict() if calibration is not None else None,
            seconds={**seconds, "total": time.perf_counter() - t0},
            fused_estimator=fused.to_json())
        won = (f", faster than {choice.against[choice.name]} in {choice.wins[choice.name]} of "
               f"{choice_rounds} rounds" if choice.name in choice.wins else "")
        if shared is not None:
            say(f"compiles in the job: {shared.compiled} here and shared, {shared.loaded} "
                f"loaded from another process, {shared.local} here alone")
        say(f"choice: {choice.name} ({choice.medians_s[choice.name] * 1e3:.2f} ms measured{won})")
        details = None
        if keep_details:
            again = refit(program, measured, costs, calibration, hardware, samples, say) \
                if beside and costs is not None else None
            details = OptimizeDetails(program, measured, costs, calibration, searched, cands,
                                      choice, samples, again)
        return Optimized(cands.enactments[choice.name], cands.runs[choice.name], report, details)


def refit(program: Program, measured: InContext, costs: Any, calibration: Any,
          hardware: str, samples: Mapping[str, Sequence[float]],
          say: Callable[[str], None], *, keep: bool = True, where: str = "the choice rounds"
          ) -> Refit:
    """The cost model fitted again with the fit's programs' samples taken later in the job
    (``fit:<name>`` in ``samples``, :data:`FIT_PREFIX`) pooled into the profile
    (``keep=False``: in place of the profile's, :func:`~disco_jax.pipeline.profile.pooled`).
    ``where``: the rounds the samples come from, for the progress line."""
    from disco_jax.pipeline.fit import calibrate_in_context
    from disco_jax.pipeline.profile import pooled

    more = {n[len(FIT_PREFIX):]: s for n, s in samples.items() if n.startswith(FIT_PREFIX)}
    profile = pooled(measured, more, keep=keep)
    if calibration is None or not more:
        return Refit(costs, profile, None, hardware)
    costs, fitted = calibrate_in_context(costs, program.module, profile,
                                         fit_overlap=calibration.overlap is not None)
    say(f"fit again with {where}' samples: all-reduce D {fitted.d_s * 1e3:.3f} "
        f"ms, compute scale {fitted.compute_scale:.2f}, saving share "
        f"{fitted.saving_share:.2f}")
    return Refit(costs, profile, fitted, hardware)


class Predicted(NamedTuple):
    """What :func:`predict_step` found.

    Attributes:
        program: the step, lowered and parsed once.
        costs: the hardware file's cost model of it.
        outcome: the search's :class:`~disco_jax.pipeline.search.SearchOutcome` under it.
    """

    program: Program
    costs: Any
    outcome: SearchOutcome


def predict_step(step: Callable[..., Any], args: Sequence[Any], hardware: str, *,
                 op_profile: Any = None, seed: int = 0, search_s: float | None = None
                 ) -> Predicted:
    """The pipeline's prediction alone, for hardware the step does not run on here:
    lowers it, prices it with ``hardware``'s cost model and searches. Nothing is
    profiled in context, compiled or measured, so no final choice is made.

    Args:
        step: the train step (plain or jitted), called with positional arguments only.
        args: its arguments; their devices must be the hardware file's (host devices
            will do).
        hardware: hardware file name or path.
        op_profile: op times measured elsewhere
            (:class:`disco_estimator.ops.OpProfile`; None: each op timed standalone on
            this machine and scaled by the file's ``compute_scale``).
        seed: seeds the search.
        search_s: the search's limit, seconds (None: ``configs/search.toml``'s).

    Raises:
        ValueError: the step has no gradient all-reduce to optimize.
    """
    from disco_estimator.costs.cost_model import CostModel
    from disco_jax.pipeline.program import lower_program
    from disco_jax.pipeline.search import search

    program = lower_program(step, args)
    costs = CostModel.for_module(program.module, hardware, profile=op_profile,
                                 progress=False)
    outcome = search(program.graph, costs, seed=seed, time_budget_s=search_s,
                     progress=False)
    return Predicted(program, costs, outcome)
