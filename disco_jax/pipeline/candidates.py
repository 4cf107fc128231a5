"""The programs of a final choice: XLA's baselines, hand bucketing (and, where XLA has
one, its combine threshold swept), the search's plans compiled as the backend's route
allows, and staged enactments -- each as the :class:`~disco_jax.enactment.Enactment` the
store keeps and as its compiled program."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from disco_jax.pipeline.program import Program
from disco_jax.pipeline.sync import SOLO, Sync

__all__ = [
    "CANDIDATE_BASELINES",
    "STAGED_COMPILES",
    "STAGED_MEASURE_S",
    "Candidates",
    "baseline_program",
    "build_candidates",
    "enactment_route",
    "job_route",
    "plan_compile_options",
    "staged_candidates",
    "staged_compiles",
]

#: XLA's programs that join the final choice beside the plans and hand bucketing: its
#: default, its fusion with no combining, and its combiner with nothing fused (where
#: fused kernels run slower beside the job's other devices than their parts, the last
#: is the fastest program; docs/findings.md, "A share of the saving").
CANDIDATE_BASELINES: tuple[str, ...] = ("xla_default", "op_fusion", "allreduce_fusion")


class Candidates(NamedTuple):
    """The programs of a final choice, by name.

    Attributes:
        enactments: each as the store keeps it.
        runs: each compiled: ``run(*program.args)`` (a staged run has ``.close()``).
        plans: the search's plans (``plan_0``, ...).
        bucketed: per hand-bucketing program (``bucketed_1MiB``, ...), its threshold in
            bytes (None: one bucket) and its number of buckets.
        staged_info: the staged candidates' self-test, fit and predictions
            (:func:`staged_candidates`).
    """

    enactments: dict[str, Any]
    runs: dict[str, Callable[..., Any]]
    plans: dict[str, Any]
    bucketed: dict[str, tuple[int | None, int]]
    staged_info: dict[str, Any]

    def merged(self, more: Candidates) -> Candidates:
        """These candidates and ``more`` (built after them), as one final choice."""
        return Candidates(*(({**mine, **theirs}) for mine, theirs in zip(self, more)))

    def close_except(self, keep: str) -> None:
        """Closes every staged run but ``keep`` (their communication threads)."""
        for name, run in self.runs.items():
            if name != keep and hasattr(run, "close"):
                run.close()


def enactment_route(route: str | None, platform: str) -> Any:
    """The :class:`hlo_tools.jax_bridge.Route` plans take on ``platform``: ``route``
    when given (``"exact"`` or ``"buckets"``), else the backend's probe
    (:func:`hlo_tools.jax_bridge.probe_route`).

    Raises:
        ValueError: an unknown route name.
    """
    from hlo_tools.jax_bridge import ROUTES, Route, probe_route

    if route is None:
        return probe_route(platform)
    if route not in ROUTES:
        raise ValueError(f"route must be one of {', '.join(ROUTES)} or None, got {route!r}")
    return Route(route, platform, "asked for")


def job_route(route: Any, sync: Sync) -> Any:
    """The route every process of a job takes: ``route`` where every process's probe
    found the same, else :data:`~hlo_tools.jax_bridge.BUCKETS` with the reason of the
    first process whose probe did not find hand-written fusions compile. A plan is one
    program of the job: compiled as written in one process and with XLA's fusion on in
    another, XLA's fusion passes rewrite the hand-written fusions there (its verifier
    then rejected them, or the processes ran different programs)."""
    from hlo_tools.jax_bridge import BUCKETS, EXACT, Route

    answers = sync.gather("plan_route", [route.name, route.reason])
    if all(name == route.name for name, _ in answers):
        return route
    pid, (_, reason) = next((i, a) for i, a in enumerate(answers) if a[0] != EXACT)
    return Route(BUCKETS, route.platform, f"process {pid}: {reason}")


def plan_compile_options(route: Any) -> dict[str, Any]:
    """How a plan of the search compiles on a route: exactly (XLA's fusion off, dots and
    convolutions on the kernel library) where hand-written fusions compile, else as the
    ``bucketed`` baseline (the plan's buckets written into the module, XLA's op fusion
    on and its combiner off). Keyword arguments of
    :meth:`~disco_jax.enactment.Enactment.single` (``exact``, ``library``,
    ``compiler_options``: the fields of :class:`hlo_tools.CompileOptions`)."""
    from hlo_tools import baselines as bl
    from hlo_tools.jax_bridge import EXACT

    if route.name == EXACT:
        return {"exact": True, "library": True}
    return {"exact": False,
            "compiler_options": bl.baseline_options(bl.BUCKETED, route.platform)}


def baseline_program(program: Program, options: Mapping[str, Any]) -> Any:
    """``program`` compiled by XLA with a baseline's ``options``
    (:func:`hlo_tools.baselines.baseline_options`); with none, jax's own compile of the
    step (XLA's default as ``jax.jit`` runs it, not a recompile of the text)."""
    from hlo_tools.jax_bridge import CompileOptions, InPlaceOf, compile_module

    return compile_module(program.text if options else None,
                          InPlaceOf(program.step, program.args),
                          CompileOptions(exact=False, extra=dict(options)))


def build_candidates(program: Program, plans_json: Sequence[Any], route: Any, *,
                     baselines: Sequence[str] = CANDIDATE_BASELINES,
                     bucket_thresholds: Sequence[int | None] | None = None,
                     staged: Sequence[Any] = (), costs: Any = None, sync: Sync = SOLO,
                     say: Callable[[str], None] | None = None, staged_top: int = 3,
                     chunk_bytes: int | None | str = "default", budget: Any = None,
                     choice_rounds: int = 3,
                     compiled_already: Mapping[str, Any] | None = None) -> Candidates:
    """Compiles the candidates of a final choice for ``program``.

    Args:
        program: the train step, lowered and parsed.
        plans_json: the search's plans (:meth:`hlo_tools.plan.Plan.to_json`), named
            ``plan_0``, ``plan_1``, ... in order; compiled as ``route`` compiles plans
            (:func:`plan_compile_options`).
        route: the backend's :class:`hlo_tools.jax_bridge.Route`.
        baselines: XLA's programs to include (:data:`hlo_tools.baselines.BASELINES`
            names), compiled from the program's text with the baseline's options.
        bucket_thresholds: the hand-bucketing sweep (None:
            :data:`hlo_tools.baselines.BUCKET_THRESHOLDS`); thresholds that give the same
            buckets give one program, named after the smallest.
        staged, costs, sync, say, staged_top, chunk_bytes: the staged candidates
            (:func:`staged_candidates`).
        budget: the first call's :class:`~disco_jax.pipeline.budget.Budget` (None: no
            limit). XLA's default is compiled first and always; the others in order of
            priority -- the search's best plan, hand bucketing from the smallest bucket
            size up, XLA's other baselines, the other plans, the staged programs (in a
            multi-process job: first, with as many of the staged cost model's picks as
            the budget affords) -- each only while the budget affords it
            (:meth:`~disco_jax.pipeline.budget.Budget.affords`; in a job process 0
            decides for all).
        choice_rounds: the final choice's rounds (what the budget keeps time for).
        compiled_already: baselines compiled before, by name (not compiled again).

    Returns:
        The :class:`Candidates`. On backends whose combiner takes a threshold (XLA:GPU),
        with ``xla_default`` among ``baselines``, XLA's default at the swept thresholds
        too (``xla_combine_*``).
    """
    import jax

    from disco_jax.enactment import Enactment
    from disco_jax.enactment.staged import CHUNK_BYTES
    from disco_jax.pipeline.budget import PLAN_COMPILES, Budget
    from hlo_tools import apply_plan, to_text
    from hlo_tools import baselines as bl
    from hlo_tools.jax_bridge import (
        CompileOptions,
        HloCompileError,
        InPlaceOf,
        compile_module,
        platform_family,
    )
    from hlo_tools.plan import Plan

    step, args, text, platform = program.step, program.args, program.text, program.platform
    backend = platform_family(platform) or "cpu"  # how plans are written (GPU: legal there)
    enactments: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    bucketed: dict[str, tuple[int | None, int]] = {}
    thresholds = bl.BUCKET_THRESHOLDS if bucket_thresholds is None else tuple(bucket_thresholds)
    how = plan_compile_options(route)
    # an exact plan (nothing fused by XLA, each kernel emitted) compiles slower than XLA's
    # default; a plan of buckets as fast
    plan_compiles = PLAN_COMPILES if how["exact"] else 1.0
    plans: dict[str, Plan] = {f"plan_{i}": Plan.from_json(pj) for i, pj in enumerate(plans_json)}

    say = say or (lambda text: None)
    budget = budget or Budget(None)
    stopped: list[str] = []  # what the budget left out first
    asked = [0]  # how often it was asked: every process asks in the same order

    def affords(what: str, *, last: bool = True, **need: Any) -> bool:
        """Whether the budget affords ``what`` (process 0's answer, in a job, under a key
        of its own: the sweep asks once per bucket size); once it does not, nothing more
        is compiled -- unless ``what`` is not the ``last`` it tries (the staged programs
        cost several compiles; one program of hand bucketing may still fit)."""
        if stopped:
            return False
        if not budget.limited:
            return True
        ok = budget.affords(choice_rounds, **need)
        asked[0] += 1
        ok = sync.share(f"budget_{asked[0]}_{what}", ok)
        if not ok and last:
            stopped.append(what)
            say(f"time budget: {what} and what would follow left out")
        elif not ok:
            say(f"time budget: {what} left out")
        return ok

    def compiled(name: str, make: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        runs[name] = make()
        budget.note_compile(time.perf_counter() - t0)
        budget.keep()

    def baseline(name: str, options: dict[str, Any]) -> None:
        enactments[name] = Enactment.single(name, text, exact=False, compiler_options=options)
        if name in (compiled_already or {}):
            runs[name] = compiled_already[name]
            budget.keep()
            return
        compiled(name, lambda: baseline_program(program, options))

    def plan(name: str) -> None:
        """Compiles a plan; one XLA rejects (in any process of a job) is left out of the
        choice, with its text kept in the temp directory and a line that says why."""
        plan_text = to_text(apply_plan(program.module, plans[name], program.graph, backend=backend))
        options = CompileOptions(exact=how["exact"], library=how.get("library", False),
                                 extra=how.get("compiler_options"))
        error = None
        try:
            compiled(name, lambda: compile_module(plan_text, InPlaceOf(step, args), options))
        except HloCompileError as err:
            where = f"_p{jax.process_index()}" if jax.process_count() > 1 else ""
            kept = Path(tempfile.gettempdir()) / f"disco_rejected_{name}{where}_{os.getpid()}.hlo"
            kept.write_text(plan_text)
            error = f"{str(err).splitlines()[0][:200]}; text in {kept}"
        errors = sync.gather(f"compiled_{name}", error)
        if any(errors):
            runs.pop(name, None)
            say(f"{name}: XLA rejected it, left out ({next(e for e in errors if e)})")
            return
        enactments[name] = Enactment.single(name, plan_text, **how)

    staged_runs: dict[str, Any] = {}
    staged_info: dict[str, Any] = {}

    def staged_need(top: int) -> dict[str, Any]:
        """What the staged programs with ``top`` picks cost: each compiles in about
        :func:`staged_compiles` compiles of XLA's default; the picks need the
        reference measured first (:data:`STAGED_MEASURE_S`)."""
        return {"programs": top + 1,
                "compiles": staged_compiles(sync.processes) * (top + 1),
                "extra_calls": 10, "extra_s": STAGED_MEASURE_S if top else 0.0}

    def staged_programs() -> None:
        """The staged programs, with as many of the staged cost model's picks as the
        budget affords (at most ``staged_top``; none: the reference alone)."""
        top = staged_top
        if budget.limited:
            top = next((k for k in range(staged_top, 0, -1)
                        if budget.affords(choice_rounds, **staged_need(k))), 0)
            top = sync.share(f"budget_staged_top_{asked[0]}", top)
        if affords("staged programs", last=not staged_first, **staged_need(top)):
            got, info = staged_candidates(
                program, staged, plans=plans, costs=costs, sync=sync, say=say, top=top,
                chunk_bytes=chunk_bytes,
                afford=(lambda build_s: budget.affords(choice_rounds, compiles=0,
                                                       extra_s=build_s))
                if budget.limited else None)
            staged_runs.update(got)
            staged_info.update(info)
            for _ in got:
                budget.keep()

    # in a job with a budget the staged programs come first: where the all-reduces cross
    # processes they are what overlaps communication with computation
    staged_first = bool(staged) and budget.limited and sync.processes > 1
    others = [(b, bl.baseline_options(b, platform)) for b in baselines if b != "xla_default"]
    if "xla_default" in baselines:  # and its combiner's thresholds swept, later
        others += bl.combine_threshold_candidates(platform, program.gradient_bytes)
        baseline("xla_default", bl.baseline_options("xla_default", platform))
    if staged_first:
        staged_programs()
    names = list(plans)
    if names and affords(names[0], compiles=plan_compiles):
        plan(names[0])

    def bucketing_affords() -> bool:
        """Whether one more program of hand bucketing fits; it joins the final choice at
        once, so that the next one is priced with it."""
        ok = affords("hand bucketing")
        if ok:
            budget.keep()
        return ok

    t0 = time.perf_counter()
    sweep = bl.bucketed_candidates(step, args, thresholds, module=program.module,
                                   afford=bucketing_affords)
    seen: set = set()
    for cand in sweep:
        if cand.buckets in seen:
            continue  # the same buckets as a smaller threshold
        seen.add(cand.buckets)
        label = bl.bucketed_name(cand.threshold_bytes)
        enactments[label] = Enactment.single(label, cand.run.hlo_text, exact=False,
                                             compiler_options=dict(cand.run.compiler_options))
        runs[label] = cand.run
        bucketed[label] = (cand.threshold_bytes, len(cand.buckets))
    if seen:
        budget.note_compile((time.perf_counter() - t0) / len(seen))
    for name, options in others:
        if affords(name):
            baseline(name, options)
    for name in names[1:]:
        if affords(name, compiles=plan_compiles):
            plan(name)
    plans = {name: p for name, p in plans.items() if name in runs}
    if staged and not staged_first:
        staged_programs()
    chunk = CHUNK_BYTES if chunk_bytes == "default" else chunk_bytes
    for name, run in staged_runs.items():
        enactments[name] = Enactment.of_stages(name, run.plan, exact=False, chunk_bytes=chunk)
        runs[name] = run
    return Candidates(enactments, runs, plans, bucketed, staged_info)


#: What a staged program costs to compile in one process, in compiles of XLA's default
#: (its stages and communication programs compile apart: 10.4 s where XLA's default took
#: 5 s, transformer at ``small``, each process of a 2-process job compiling both).
STAGED_COMPILES = 2.0
#: Seconds the staged reference is measured for before the cost model picks (10 samples
#: of at least 0.3 s).
STAGED_MEASURE_S = 3.0


def staged_compiles(processes: int) -> float:
    """What a staged program costs to compile in a job of ``processes``, in compiles of
    XLA's default: its programs are spread over the processes
    (:func:`hlo_tools.jax_bridge.spread`), so :data:`STAGED_COMPILES` divided among them,
    and never below one compile (the largest stage, and loading the executables the
    others compiled). Transformer at ``medium`` in a pinned 2-process job: the staged
    reference built in 11.2 s, XLA's default compiled in 11 s."""
    return max(1.0, STAGED_COMPILES / max(1, processes))


def staged_candidates(program: Program, entries: Sequence[Any], *,
                      plans: Mapping[str, Any] | None = None,
                      costs: Any = None, sync: Sync = SOLO,
                      say: Callable[[str], None] | None = None, top: int = 3,
                      chunk_bytes: int | None | str = "default",
                      afford: Callable[[float], bool] | None = None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Staged enactments (:mod:`disco_jax.enactment.staged`, XLA's fusion inside each
    stage) to add to a final choice.

    Args:
        program: the train step, lowered and parsed.
        entries: bucket counts, ``"plan"`` (the buckets of ``plans["plan_0"]``) and
            ``"auto"``: the staged cost model (:mod:`disco_estimator.costs.staged_cost`) fitted
            on one staged step measured here (after its self-test), then the ``top`` best
            predicted bucketings of :func:`~disco_estimator.costs.staged_cost.layouts`.
        plans: the search's plans by name.
        costs: the cost model (process 0; None elsewhere).
        sync: the job's :class:`~disco_jax.pipeline.sync.Sync` (default: one process); every
            process calls this alike.
        say: progress lines.
        top: predicted bucketings kept by ``"auto"`` (0: the reference alone, neither
            measured nor fitted).
        chunk_bytes: each bucket is reduced in collectives of at most this many bytes
            (None: one per bucket; ``"default"``:
            :data:`~disco_jax.enactment.staged.CHUNK_BYTES`).
        afford: asked before each pick of ``"auto"`` is built, with the seconds the
            reference took to build (process 0's answer counts);
            False: it and the rest are left out (None: every pick).

    Returns:
        ``(runs, info)``: the compiled staged steps by name, and (process 0) the
        self-test, the fit and the predicted seconds of every staged candidate.
    """
    import jax
    import numpy as np

    from disco_estimator.costs.staged_cost import fit_staged_costs, layouts, predict_layouts
    from disco_jax.enactment.staged import CHUNK_BYTES, staged_step
    from disco_jax.pipeline.choose import measure
    from hlo_tools import plan as P
    from hlo_tools.plan.buckets import ready_order

    say = say or (lambda text: None)
    step, args, module, graph = program.step, program.args, program.module, program.graph
    chunk = CHUNK_BYTES if chunk_bytes == "default" else chunk_bytes
    # the staged programs run collectives: every process must still be here (a process
    # that left the pipeline falls back to jax.jit, whose collectives would meet ours)
    sync.barrier("staged_candidates")
    out: dict[str, Any] = {}
    info: dict[str, Any] = {"predicted_s": {}}
    for count in entries:
        if count == "auto":
            continue
        if count == "plan":
            if not plans or "plan_0" not in plans:
                continue
            buckets = P.bucket_members(P.FusionSpace(graph), plans["plan_0"])
            if len(buckets) < 2:
                continue
            name, arg = "staged_plan", buckets
        else:
            name, arg = f"staged_{count}", int(count)
        try:
            out[name] = staged_step(step, args, buckets=arg, chunk_bytes=chunk, module=module)
        except ValueError as err:
            say(f"{name}: not staged ({err})")
    if "auto" not in entries:
        return out, info
    space = P.FusionSpace(graph)
    # the order by process 0's cost model (the others have none), shared: every process
    # builds the same stages
    node_s = costs.graph_costs(graph).time_s if costs is not None else None
    order = [int(a) for a in ready_order(space, node_s)]
    order = sync.share("staged_order", order)
    cands = layouts(graph, order)
    ref = "staged_k4_r1" if "staged_k4_r1" in cands else next(iter(cands))
    t_build = time.perf_counter()
    try:
        out[ref] = staged_step(step, args, buckets=cands[ref], chunk_bytes=chunk,
                               module=module)
        build_s = time.perf_counter() - t_build
        say(f"staged reference {ref} built in {build_s:.1f} s")
    except ValueError as err:
        say(f"staged: not staged ({err})")
        return out, info
    check = out[ref].self_test(*args, barrier=sync.barrier)
    info["self_test"] = check._asdict()
    if not check.overlaps:  # the final choice measures them anyway
        say(f"staged self-test: {check.reason}")
    if top < 1:
        return out, info
    parts = out[ref].parts(*args, barrier=sync.barrier)
    # the whole step, interleaved with nothing: enough rounds that one slow phase of
    # the machine does not become the fitted overlap
    total = float(np.median(measure({ref: out[ref]}, args, rounds=7, warmup=3, sync=sync,
                                    tag="staged_ref", min_sample_s=0.3)[ref]))
    pick = None
    if jax.process_index() == 0:
        fit = fit_staged_costs(module, graph, cands[ref], node_s,
                               parts.stage_s, parts.comm_s, total)
        both = predict_layouts(module, graph, cands, fit)
        preds = {n: p.fitted_s for n, p in both.items()}
        best = sorted(preds, key=preds.__getitem__)[:top]
        pick = [n for n in best if n != ref]
        info = {**info, "predicted_s": preds, "reference": ref, "reference_s": total,
                "fo_bound_s": {n: p.fo_bound_s for n, p in both.items()},
                "parts": parts._asdict(),
                # the computation alone, XLA-fused in stages: the step with every
                # all-reduce hidden (the measured full-overlap bound)
                "compute_s": float(sum(parts.stage_s)),
                "fit": {k: float(v) for k, v in fit._asdict().items() if k != "node_s"}}
        say(f"staged fit on {ref} ({total * 1e3:.1f} ms): compute scale "
            f"{fit.compute_scale:.2f} (update {fit.post_scale:.2f}), "
            f"{fit.stage_s * 1e3:.2f} ms/stage, all-reduce "
            f"{fit.c_s_per_byte * 2**20 * 1e3:.2f} ms/MiB + {fit.d_s * 1e3:.2f} ms, "
            f"{fit.step_s * 1e3:.1f} ms/step; best predicted {best[0]} "
            f"{preds[best[0]] * 1e3:.1f} ms")
    pick = sync.share("staged_pick", pick)
    for name in pick:
        if afford is not None and not sync.share(f"staged_afford_{name}", afford(build_s)):
            say(f"time budget: staged {name} and the picks after it left out")
            break
        out[name] = staged_step(step, args, buckets=cands[name], chunk_bytes=chunk,
                                 module=module)
    return out, info
