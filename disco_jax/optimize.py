"""The whole product pipeline for one train step, returning what to run as an
:class:`~disco_jax.enactment.Enactment` (what ``disco_jax.jit`` runs under
``ENABLE_SEARCH=1`` and keeps in the strategy store).

The steps are those of ``disco bench``'s jobs (:func:`disco_jax.bench.bench_row`):

1. profile the step's pre-optimization module in context and fit the cost model to it
   (:func:`disco_jax.enact.profile_in_context`, :func:`disco_jax.enact.in_context_costs`);
2. search (:func:`disco_jax.search.search`; process 0 of a job, the ``top_k`` plans shared
   with every process through ``sync``);
3. compile the candidates: the plans (``exact=True``, dots on the kernel library), every
   distinct program of the bucketed sweep (:func:`hlo_tools.baselines.bucketed_candidates`),
   XLA's default, and optional staged programs (:func:`disco_jax.staged.staged_step`);
4. the final choice by measurement (:func:`disco_jax.enact.choose`), in tiers: XLA's
   default stays unless hand bucketing beats it in most paired rounds, and that choice
   stays unless a plan or staged program beats it so: a plan is chosen only when it beat
   the baseline chosen before it, round by round.

Typical use::

    step, args = zoo.get("vgg")(4, "tiny")
    opt = optimize_step(step, args, time_budget_s=2.0)
    out = opt.run(*args)                 # == jax.jit(step)(*args)
    opt.enactment.to_json()              # what the strategy store keeps
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

__all__ = [
    "DEFAULT_CHOICE_ROUNDS",
    "Optimized",
    "default_hardware",
    "enactment_route",
    "optimize_step",
    "plan_compile_options",
    "staged_candidates",
]

#: Interleaved rounds of the final choice by measurement.
DEFAULT_CHOICE_ROUNDS = 3


class Optimized(NamedTuple):
    """What :func:`optimize_step` chose.

    Attributes:
        enactment: the winner, as the store keeps it.
        run: the winner compiled: ``run(*args)`` returns what ``jax.jit(step)(*args)``
            returns (a staged run has ``.close()``).
        report: JSON-able: ``choice`` (the winner's name), ``predicted_s`` and
            ``measured_s`` (seconds per iteration of every candidate by name, median of
            the choice's rounds; a prediction is None where the simulator has none),
            ``search`` (settings and statistics), ``hardware`` (the file's name),
            ``calibration`` (the in-context fit, or None), ``seconds`` (wall time of the
            whole pipeline per phase).
    """

    enactment: Any
    run: Callable[..., Any]
    report: dict[str, Any]


def default_hardware(num_processes: int, platform: str = "cpu") -> str:
    """The shipped hardware file for a setup on a backend (the in-context fit adapts its
    all-reduce latency and compute scale): on CPU ``inproc4`` for one process, else
    ``gloo2``; on GPU ``gpu_nvlink8`` for one process (its devices on one server), else
    ``gpu_400g``.

    Raises:
        ValueError: a platform with no shipped hardware file (not CPU or GPU).
    """
    from hlo_tools.jax_bridge import platform_family

    family = platform_family(platform)
    if family == "cpu":
        return "inproc4" if num_processes <= 1 else "gloo2"
    if family == "gpu":
        return "gpu_nvlink8" if num_processes <= 1 else "gpu_400g"
    raise ValueError(f"no shipped hardware file for platform {platform!r}; pass hardware= "
                     "(a file from disco calibrate)")


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


def plan_compile_options(route: Any) -> dict[str, Any]:
    """How a plan of the search compiles on a route: exactly (XLA's fusion off, dots and
    convolutions on the kernel library) where hand-written fusions compile, else as the
    ``bucketed`` baseline (the plan's buckets written into the module, XLA's op fusion
    on and its combiner off). Keyword arguments of both
    :meth:`~disco_jax.enactment.Enactment.single` and :func:`hlo_tools.compile_hlo`."""
    from hlo_tools import baselines as bl
    from hlo_tools.jax_bridge import EXACT

    if route.name == EXACT:
        return {"exact": True, "library": True}
    return {"exact": False,
            "compiler_options": bl.baseline_options(bl.BUCKETED, route.platform)}


def _predict(module: Any, costs: Any) -> float:
    """Predicted seconds per iteration of a module as written (XLA's compiled plans)."""
    from disco_jax.enact import cover
    from disco_jax.lower import sim_graph_from_module
    from disco_jax.simulator import simulate

    cover(costs, module)
    return simulate(sim_graph_from_module(module, costs), costs.overlap).iteration_s


def _search_report(outcome: Any, seed: int, top_k: int, choice_rounds: int) -> dict[str, Any]:
    return {"settings": {**outcome.config._asdict(), "seed": seed, "top_k": top_k,
                         "choice_rounds": choice_rounds},
            "evaluated": outcome.stats.evaluated, "pops": outcome.stats.pops,
            "seconds": outcome.stats.seconds, "stop_reason": outcome.stats.stop_reason,
            "best_start": outcome.best_start, "start_predicted_s": outcome.start_costs_json(),
            "fo_bound_s": outcome.fo_bound_s,
            "peak_bytes": outcome.peak_bytes,
            "memory_budget_bytes": outcome.memory_budget_bytes,
            "over_budget": outcome.stats.over_budget}


def optimize_step(step: Callable[..., Any], args: Sequence[Any], *,
                  time_budget_s: float | None = None, hardware: str | None = None,
                  sync: Any = None, top_k: int = 3,
                  choice_rounds: int = DEFAULT_CHOICE_ROUNDS, staged: Sequence[Any] = (),
                  min_sample_s: float = 0.05, seed: int = 0, predict_baselines: bool = True,
                  bucket_thresholds: Sequence[int | None] | None = None,
                  profile_rounds: int = 5, memory_budget_bytes: int | None = None,
                  route: str | None = None,
                  progress: Callable[[str], None] | None = None) -> Optimized:
    """Profiles, searches, compiles the candidates and chooses by measurement.

    Args:
        step: the train step (plain or jitted), called with positional arguments only.
        args: its arguments, placed as they will be at run time. They are not donated:
            every candidate runs on them several times.
        time_budget_s: search budget, seconds (None: ``configs/search.toml``).
        hardware: hardware file name or path (None: :func:`default_hardware`).
        sync: the job's :class:`disco_jax.enact.Sync` (None: one process). Every process
            calls this function alike; process 0 searches and its plans are shared.
        top_k: plans of the search that take part in the final choice.
        choice_rounds: interleaved rounds of the final choice.
        staged: staged programs to add to the choice: bucket counts, ``"plan"`` for
            the buckets of the search's best plan, ``"auto"`` for the staged cost model's
            best bucketings (:func:`staged_candidates`).
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
            final choice runs among the baselines alone (``report["search"]["refused"]``
            says why).
        route: how plans reach the backend: ``"exact"`` (hand-written fusions compile:
            the joint search), ``"buckets"`` (AllReduce buckets alone, over XLA's own
            fusion) or None: the backend's probe (:func:`enactment_route`).
        progress: called with a line per phase (None: silent).

    Returns:
        The :class:`Optimized` winner.

    Raises:
        ValueError: the step has no gradient all-reduce to optimize (not a ``shard_map``
            data-parallel step), or a parameter out of range.
        hlo_tools.jax_bridge.HloCompileError: XLA rejected a candidate.
    """
    import jax

    import hlo_tools
    from disco_jax.enact import choice_tiers, choose, in_context_costs, profile_in_context
    from disco_jax.enactment import Enactment
    from disco_jax.search import MemoryBudgetError, search
    from disco_jax.staged import CHUNK_BYTES
    from disco_jax.units import format_bytes
    from hlo_tools import baselines as bl
    from hlo_tools.jax_bridge import (
        EXACT,
        compile_hlo,
        device_memory_bytes,
        fresh_function,
        lowered_text,
    )
    from hlo_tools.plan import Plan

    say = progress or (lambda text: None)
    if top_k < 1 or choice_rounds < 1:
        raise ValueError(f"top_k and choice_rounds must be >= 1, got {top_k}, {choice_rounds}")
    platform = jax.default_backend()
    plan_route = enactment_route(route, platform)
    buckets_only = plan_route.name != EXACT
    hardware = hardware or default_hardware(jax.process_count(), platform)
    pid = jax.process_index()
    seconds: dict[str, float] = {}
    t0 = t_phase = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t_phase
        now = time.perf_counter()
        seconds[name] = now - t_phase
        t_phase = now

    step = fresh_function(step)  # a jitted step is kept: its jax.jit arguments matter
    source_text = lowered_text((step if hasattr(step, "lower") else jax.jit(step)).lower(*args))
    module = hlo_tools.parse(source_text)
    graph = hlo_tools.device_graph(module)
    if not graph.gradient_allreduces:
        raise ValueError("the step has no gradient all-reduce (write the data-parallel step "
                         "with jax.shard_map and lax.pmean)")
    say(f"{graph.num_nodes} nodes, {len(graph.gradient_allreduces)} gradient all-reduces; "
        f"plans {'joint' if not buckets_only else 'of AllReduce buckets'} "
        f"({plan_route.reason}); hardware {hardware}; profiling in context")
    measured = profile_in_context(step, args, module, sync=sync, iterations=profile_rounds,
                                  rounds=profile_rounds)
    lap("profile")

    costs = calibration = outcome = refused = None
    plans_json = None
    if pid == 0:
        costs, calibration = in_context_costs(module, hardware, measured, progress=False)
        lap("fit")
        say(f"searching ({'config' if time_budget_s is None else f'{time_budget_s:g} s'} "
            "budget)")
        budget = memory_budget_bytes or device_memory_bytes()
        try:
            outcome = search(graph, costs, seed=seed, time_budget_s=time_budget_s,
                             progress=False, top_k=top_k, memory_budget_bytes=budget,
                             buckets_only=buckets_only)
        except MemoryBudgetError as err:
            refused = str(err)
            say(f"search: {refused}; choosing among the baselines")
            plans_json = []
        else:
            plans_json = [plan.to_json() for plan, _ in outcome.top]
            say(f"search: {outcome.stats.evaluated} candidates, predicted "
                f"{outcome.cost_s * 1e3:.2f} ms (best start {outcome.best_start}), peak "
                f"memory {format_bytes(outcome.peak_bytes)} of {format_bytes(budget)}")
        lap("search")
    if sync is not None:
        plans_json = sync.share("optimize_plans", plans_json)

    say("compiling the candidates")
    enactments: dict[str, Enactment] = {}
    runs: dict[str, Any] = {}
    thresholds = bl.BUCKET_THRESHOLDS if bucket_thresholds is None else tuple(bucket_thresholds)
    for cand in bl.bucketed_candidates(step, args, thresholds):
        label = bl.bucketed_name(cand.threshold_bytes)
        if any(e.text == cand.run.hlo_text for e in enactments.values()):
            continue  # the same buckets as a smaller threshold
        enactments[label] = Enactment.single(label, cand.run.hlo_text, exact=False,
                                             compiler_options=dict(cand.run.compiler_options))
        runs[label] = cand.run
    enactments["xla_default"] = Enactment.single("xla_default", source_text, exact=False)
    runs["xla_default"] = compile_hlo(step, args, source_text, exact=False)
    options = bl.baseline_options("op_fusion", jax.default_backend())
    enactments["op_fusion"] = Enactment.single("op_fusion", source_text, exact=False,
                                               compiler_options=options)
    runs["op_fusion"] = compile_hlo(step, args, source_text, exact=False,
                                    compiler_options=options)
    for label, options in bl.combine_threshold_candidates(
            platform, sum(int(graph.out_bytes[i]) for i in graph.gradient_allreduces)):
        enactments[label] = Enactment.single(label, source_text, exact=False,
                                             compiler_options=options)
        runs[label] = compile_hlo(step, args, source_text, exact=False,
                                  compiler_options=options)
    plans: dict[str, Plan] = {}
    how = plan_compile_options(plan_route)
    for i, pj in enumerate(plans_json):
        name = f"plan_{i}"
        plans[name] = Plan.from_json(pj)
        text = hlo_tools.to_text(hlo_tools.apply_plan(module, plans[name], graph))
        enactments[name] = Enactment.single(name, text, **how)
        runs[name] = compile_hlo(step, args, text, **how)
    staged_runs, staged_info = staged_candidates(
        step, args, module, graph, staged, plans=plans, costs=costs, sync=sync, say=say)
    for name, run in staged_runs.items():
        enactments[name] = Enactment.of_stages(name, run.plan, exact=False,
                                               chunk_bytes=CHUNK_BYTES)
        runs[name] = run
    lap("compile")

    say(f"final choice among {len(runs)} programs")
    choice = choose(runs, args, rounds=choice_rounds, sync=sync, tag="optimize_choice",
                    min_sample_s=min_sample_s, seed=seed,
                    tiers=choice_tiers(runs))
    lap("choice")
    for name, run in runs.items():
        if name != choice.name and hasattr(run, "close"):
            run.close()

    predicted: dict[str, float | None] = {name: None for name in runs}
    predicted.update({n: t for n, t in staged_info.get("predicted_s", {}).items()
                      if n in runs})
    if pid == 0:
        if outcome is not None:
            predicted.update(zip(plans, (c for _, c in outcome.top)))
        if predict_baselines:
            for name in runs:
                if name.startswith("bucketed") or name in ("xla_default", "op_fusion"):
                    predicted[name] = _predict(bl.module_from_compiled(runs[name]), costs)
        lap("predict")
    report = {
        "choice": choice.name,
        "predicted_s": predicted,
        "measured_s": dict(choice.medians_s),
        # rounds each challenger beat the choice before its tier in (see enact.decide)
        "wins": dict(choice.wins), "against": dict(choice.against),
        "search": (_search_report(outcome, seed, top_k, choice_rounds) if outcome
                   else {"refused": refused} if refused else None),
        "hardware": hardware,
        "route": plan_route.to_json(),
        "calibration": ({k: v for k, v in calibration._asdict().items()}
                        if calibration is not None else None),
        "seconds": {**seconds, "total": time.perf_counter() - t0},
    }
    won = (f", faster than {choice.against[choice.name]} in {choice.wins[choice.name]} of "
           f"{choice_rounds} rounds" if choice.name in choice.wins else "")
    say(f"choice: {choice.name} ({choice.medians_s[choice.name] * 1e3:.2f} ms measured{won})")
    return Optimized(enactments[choice.name], runs[choice.name], report)


def staged_candidates(step: Any, args: Sequence[Any], module: Any, graph: Any,
                      entries: Sequence[Any], *, plans: Mapping[str, Any] | None = None,
                      costs: Any = None, sync: Any = None,
                      say: Callable[[str], None] | None = None, top: int = 3,
                      chunk_bytes: int | None | str = "default"
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Staged enactments (:mod:`disco_jax.staged`, XLA's fusion inside each stage) to add
    to a final choice.

    Args:
        step, args: the train step and its arguments.
        module, graph: its pre-optimization module and per-device graph.
        entries: bucket counts, ``"plan"`` (the buckets of ``plans["plan_0"]``) and
            ``"auto"``: the staged cost model (:mod:`disco_jax.staged_cost`) fitted on one
            staged step measured here (after its self-test), then the ``top`` best
            predicted bucketings of :func:`~disco_jax.staged_cost.layouts`, and the best
            one predicted with the streams not sharing the CPU (overlap 1) when it is not
            among them: the fitted overlap also absorbs what is not overlap (the step's
            fixed tail), so the fully overlapped ranking is measured too.
        plans: the search's plans by name.
        costs: the cost model (process 0; None elsewhere).
        sync: the job's :class:`~disco_jax.enact.Sync` (None: one process); every process
            calls this alike.
        say: progress lines.
        top: predicted bucketings kept by ``"auto"``.
        chunk_bytes: each bucket is reduced in collectives of at most this many bytes
            (None: one per bucket; ``"default"``: :data:`~disco_jax.staged.CHUNK_BYTES`).

    Returns:
        ``(runs, info)``: the compiled staged steps by name, and (process 0) the
        self-test, the fit and the predicted seconds of every staged candidate.
    """
    import jax
    import numpy as np

    from disco_jax.enact import measure
    from disco_jax.staged import CHUNK_BYTES, staged_step
    from disco_jax.staged_cost import fit_staged_costs, layouts, predict_layouts
    from hlo_tools import plan as P
    from hlo_tools.plan.buckets import ready_order

    say = say or (lambda text: None)
    chunk = CHUNK_BYTES if chunk_bytes == "default" else chunk_bytes
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
            out[name] = staged_step(step, args, buckets=arg, chunk_bytes=chunk)
        except ValueError as err:
            say(f"{name}: not staged ({err})")
    if "auto" not in entries:
        return out, info
    space = P.FusionSpace(graph)
    # the order by process 0's cost model (the others have none), shared: every process
    # builds the same stages
    node_s = costs.graph_costs(graph).time_s if costs is not None else None
    order = [int(a) for a in ready_order(space, node_s)]
    if sync is not None:
        order = sync.share("staged_order", order)
    cands = layouts(graph, order)
    ref = "staged_k4_r1" if "staged_k4_r1" in cands else next(iter(cands))
    try:
        out[ref] = staged_step(step, args, buckets=cands[ref], chunk_bytes=chunk)
    except ValueError as err:
        say(f"staged: not staged ({err})")
        return out, info
    barrier = sync.barrier if sync is not None else None
    check = out[ref].self_test(*args, barrier=barrier)
    info["self_test"] = check._asdict()
    if not check.overlaps:  # the final choice measures them anyway
        say(f"staged self-test: {check.reason}")
    parts = out[ref].parts(*args, barrier=barrier)
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
        # what staging within one step could reach if the two streams did not share the
        # CPU: the first stage (the forward pass and more) hides nothing
        unshared = {n: p.unshared_s for n, p in both.items()}
        bound = min(unshared, key=unshared.__getitem__)
        if bound != ref and bound not in pick:
            pick.append(bound)
        info = {**info, "predicted_s": preds, "reference": ref, "reference_s": total,
                "fo_bound_s": {n: p.fo_bound_s for n, p in both.items()},
                "parts": parts._asdict(),
                # the computation alone, XLA-fused in stages: the step with every
                # all-reduce hidden (the measured full-overlap bound)
                "compute_s": float(sum(parts.stage_s)),
                "unshared_bound": {"layout": bound, "predicted_s": unshared[bound]},
                "fit": {k: float(v) for k, v in fit._asdict().items() if k != "node_s"}}
        say(f"staged fit on {ref} ({total * 1e3:.1f} ms): compute scale "
            f"{fit.compute_scale:.2f}, {fit.stage_s * 1e3:.2f} ms/stage, all-reduce "
            f"{fit.c_s_per_byte * 2**20 * 1e3:.2f} ms/MiB + {fit.d_s * 1e3:.2f} ms, overlap "
            f"{fit.overlap:.2f}; best predicted {best[0]} {preds[best[0]] * 1e3:.1f} ms "
            f"({bound} {unshared[bound] * 1e3:.1f} ms if the streams did not share the CPU)")
    if sync is not None:
        pick = sync.share("staged_pick", pick)
    for name in pick:
        out[name] = staged_step(step, args, buckets=cands[name], chunk_bytes=chunk)
    return out, info
