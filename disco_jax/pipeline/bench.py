"""``disco bench``'s jobs: every baseline and DisCo, measured side by side in a real setup.

One job = one train step in one setup, run in child processes (each setup needs its own
device configuration; ``gloo2-1gbit`` runs in a private network namespace made with
``unshare -n`` whose loopback ``tc`` limits to 1 Gbit/s, so the host's network is never
touched). Every process of a job builds the step on the job's devices, then steps 1-5 are
:func:`disco_jax.pipeline.optimize.optimize_step` -- the product's pipeline, what
``disco_jax.jit`` runs -- with two additions (``extra_baselines``, ``remeasure_fit``):

1. it lowers the step and profiles it in context
   (:func:`disco_jax.pipeline.profile.profile_in_context`);
2. process 0 fits the cost model to that profile;
3. process 0 searches (:func:`disco_jax.pipeline.search.plans_for_choice`); the best few
   plans go to every process (as JSON through the job's coordinator);
4. it compiles the candidates (the plans as the backend's route allows, XLA's default,
   ``op_fusion``, ``allreduce_fusion``, every distinct program of the ``bucketed``
   sweep, staged programs) and the paper's other baseline (:mod:`hlo_tools.baselines`:
   ``no_fusion``), which is not a candidate;
5. **final choice**: the candidates run interleaved for a few rounds and the choice
   climbs tiers (:func:`disco_jax.pipeline.choose.decide`: XLA's default, then hand
   bucketing, then DisCo's programs, each replacing the choice only when it wins most
   rounds); the fastest bucketed program is the ``bucketed`` baseline. The in-context
   fit's programs run in the same rounds (they are not candidates).

This module adds:

6. **bench**: the six programs (four baselines, ``bucketed``, DisCo's choice) run
   interleaved in fresh rounds (so the choice's selection does not bias the figures),
   the in-context fit's programs in the same rounds;
7. process 0 fits the cost model again to the fit's programs' samples of those rounds
   alone (``calibration_bench``) and predicts the six programs with it
   (``predicted_s``): a prediction and its measurement then share the minutes they were
   taken in, where on this shared VM one program moved by up to a fifth between the
   profile and the bench's rounds of the same job. Kept beside it: the six programs under
   the fit that ``optimize_step`` took again with step 5's samples pooled in
   (:class:`~disco_jax.pipeline.optimize.Refit`, ``calibration_refit``;
   ``predicted_choice_fit_s``; the final choice's candidates, ``choice.predicted_s``,
   are priced by it, as they were measured in step 5) and under the search's own model
   (``predicted_at_start_s``). Staged programs keep the staged fit's prices, its step
   cost fitted again to the reference bucketing's median in step 5's rounds beside the
   other candidates (``staged.choice_shift_s``; not in ``predicted_at_start_s``). The
   row keeps every round's sample (``samples_s``). With
   ``spec["compare_fused"]`` (GNN checkpoints) it predicts the final choice's
   candidates once more with that fit under each GNN as the fused-op estimator
   (``choice.predicted_by_estimator_s``: the same measurements under each estimator).

``--predict-only`` jobs (:func:`predict_row`) run in one process for any hardware file
(e.g. ``gpu_cluster_example``): the search of
:func:`disco_jax.pipeline.optimize.predict_step` (no profile: standalone op times of this
machine, scaled by the file's ``compute_scale``, or ``spec["op_times"]``), then every
program predicted; nothing measured.

Run by :func:`run_job`; the worker side is ``python -m disco_jax.pipeline.bench {launch,run} ...``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from disco_jax.pipeline.optimize import OptimizeDetails

__all__ = [
    "PROGRAMS",
    "SETUPS",
    "Setup",
    "make_step",
    "predict_row",
    "run_job",
]

#: The programs of a row, in table order.
PROGRAMS = ("no_fusion", "op_fusion", "allreduce_fusion", "xla_default", "bucketed", "disco")


class Setup(NamedTuple):
    """A measured setup.

    Attributes:
        name: its name (= the hardware file it is priced with).
        processes: processes of the job.
        devices: CPU devices per process.
        rate: ``tc`` rate of the private loopback ("" = the host's loopback, no limit).
        burst: ``tc tbf`` burst of that link: 128 KiB, about 1 ms at 1 Gbit/s. A larger
            bucket fills while the link idles and then passes its bytes at memory speed:
            with 1 MB (DESIGN.md's first setting) a single program whose 1 MiB
            all-reduces sit between computations got part of its communication free
            (transformer-medium, 1 MiB buckets: 475 ms per step with 1 MB, 528 ms with
            128 KiB; communication alone 457 ms either way), which a real link never
            gives.
    """

    name: str
    processes: int
    devices: int
    rate: str = ""
    burst: str = "128kb"


SETUPS: dict[str, Setup] = {
    "inproc4": Setup("inproc4", 1, 4),
    "gloo2": Setup("gloo2", 2, 1),
    "gloo2-1gbit": Setup("gloo2-1gbit", 2, 1, "1gbit"),
}


def _log(spec: Mapping[str, Any], text: str) -> None:
    print(f"[{spec['model']} {spec['setup']}] {text}", file=sys.stderr, flush=True)


def make_step(spec: Mapping[str, Any], num_devices: int) -> tuple[Callable, tuple]:
    """The train step of a job spec: a zoo model, or ``spec["step"] = "module:function"``
    (a ``make(num_devices, size)`` like the zoo's; e.g. held-out steps of a benchmark)."""
    if spec.get("step"):
        mod, _, fn = spec["step"].partition(":")
        return getattr(importlib.import_module(mod), fn)(num_devices, spec["size"])
    from disco_jax import zoo

    return zoo.get(spec["model"])(num_devices, spec["size"])


# --------------------------------------------------------------------------- one process


def _max_diff(got: Any, want: Any) -> float:
    import jax
    import numpy as np

    def local(x: Any) -> Any:
        return np.asarray(x.addressable_data(0)) if hasattr(x, "addressable_data") else \
            np.asarray(x)

    return max(float(np.max(np.abs(local(a).astype(np.float64) - local(b))))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


class _Bench(NamedTuple):
    """What the bench's own rounds measured after the final choice (:func:`_bench_rounds`).

    Attributes:
        finals: the six programs by name (:data:`PROGRAMS`).
        samples: their samples.
        best_bucketed: the hand-bucketing program of the choice's rounds with the lowest
            median (the ``bucketed`` column).
        same: the baseline whose program DisCo's choice is (None: a program of its own).
        fit_samples: the in-context fit's programs' samples of the same rounds, named
            ``fit:<name>`` (:data:`~disco_jax.pipeline.optimize.FIT_PREFIX`).
    """

    finals: dict[str, Any]
    samples: dict[str, list[float]]
    best_bucketed: str
    same: str | None
    fit_samples: dict[str, list[float]]


def _bench_rounds(spec: Mapping[str, Any], details: OptimizeDetails, sync: Any,
                  say: Callable[[str], None]) -> _Bench:
    """Step 6: the paper's four baselines, the best hand bucketing and DisCo's choice in
    fresh interleaved rounds, so that the choice's selection does not bias the figures.
    DisCo's choice may be a baseline's own program: then it is measured once, as that
    baseline (two measurements of one program differ only by noise). The in-context
    fit's programs run in the same rounds, so that step 7 can fit the model to the
    minutes the six programs were measured in."""
    from disco_jax.pipeline.choose import measure
    from disco_jax.pipeline.optimize import FIT_PREFIX
    from hlo_tools import baselines as bl

    runs, choice = details.candidates.runs, details.choice
    best_bucketed = min(details.candidates.bucketed, key=choice.medians_s.__getitem__)
    finals = {name: runs[name] for name in bl.BASELINES}
    finals["bucketed"] = runs[best_bucketed]
    same = next((n for n in ("bucketed", *bl.BASELINES)
                 if finals[n] is runs[choice.name]), None)
    if same is None:
        finals["disco"] = runs[choice.name]
    say(f"choice: {choice.name}; bucketed: {best_bucketed}; measuring "
        f"{spec['rounds']} interleaved rounds")
    fits = {f"{FIT_PREFIX}{n}": r for n, r in (details.profile.runs or {}).items()}
    samples = measure({**finals, **fits}, details.program.args, rounds=int(spec["rounds"]),
                      sync=sync, tag="bench", min_sample_s=float(spec["min_sample_s"]),
                      progress=say)
    fit_samples = {n: samples.pop(n) for n in fits}
    if same is not None:
        samples["disco"] = samples[same]
        finals["disco"] = finals[same]
    return _Bench(finals, samples, best_bucketed, same, fit_samples)


def _staged_shift(details: OptimizeDetails) -> float | None:
    """Seconds the staged fit's predictions move by when its step cost is fitted again to
    the reference bucketing's median in the choice rounds
    (:func:`~disco_estimator.costs.staged_cost.restep`), as the cost model is fitted again
    to those rounds; None where no staged reference ran there."""
    from disco_estimator.costs.staged_cost import restep

    info = details.candidates.staged_info
    ref = info.get("reference")
    again = details.choice.medians_s.get(ref) if ref else None
    if again is None or ref not in info.get("predicted_s", {}):
        return None
    return restep(info["predicted_s"][ref], info["fit"]["step_s"], again)


def _predictor(details: OptimizeDetails, best_bucketed: str, shift: float
               ) -> Callable[..., tuple[dict, dict]]:
    """Step 7's predictions: a function of a cost model giving the six programs' (and
    ``fo``) and the final choice's candidates' predicted seconds, XLA's programs parsed
    once for every model; ``remeasured`` (default) moves the staged programs' by
    ``shift`` seconds, their step cost fitted again to the choice rounds
    (:func:`_staged_shift`)."""
    from disco_estimator.costs.lower import (
        predict_module,
        sim_graph,
        sim_graph_from_module,
        simulate_plan,
    )
    from disco_estimator.costs.simulator import full_overlap_bound
    from disco_jax.pipeline.candidates import CANDIDATE_BASELINES
    from hlo_tools import baselines as bl

    cands, graph, name = details.candidates, details.program.graph, details.choice.name
    runs, plans, staged_info = cands.runs, cands.plans, cands.staged_info
    bucketed = list(cands.bucketed)
    staged = [n for n in runs if n.startswith("staged")]
    swept = [n for n in runs if n.startswith("xla_combine_")]
    # XLA's programs as it runs them
    compiled = {n: bl.module_from_compiled(runs[n])
                for n in (*bl.BASELINES, *bucketed, *swept)}

    def predictions(cm: Any, remeasured: bool = True
                    ) -> tuple[dict[str, float], dict[str, float]]:
        """The six programs' and the final choice's candidates' predicted seconds."""
        move = shift if remeasured else 0.0
        predicted: dict[str, float] = {}
        for baseline in bl.BASELINES:
            predicted[baseline] = predict_module(compiled[baseline], cm)
        pred_bucketed = {n: predict_module(compiled[n], cm) for n in bucketed}
        pred_plans = {n: simulate_plan(graph, plan, cm).iteration_s
                      for n, plan in plans.items()}
        predicted["bucketed"] = pred_bucketed[best_bucketed]
        # staged programs: the staged fit priced them (staged_candidates)
        fitted = staged_info.get("predicted_s", {})
        pred_staged = {n: fitted[n] + move if n in fitted else None for n in staged}
        pred_swept = {n: predict_module(compiled[n], cm) for n in swept}
        pred_choice = {**pred_bucketed, **pred_swept, **pred_plans, **pred_staged,
                       **{n: predicted[n] for n in CANDIDATE_BASELINES}}
        predicted["disco"] = pred_choice[name]
        # FO: the chosen program with every AllReduce hidden (its full-overlap bound),
        # under the model that priced it: a staged program's under the staged model
        if name in staged and name in staged_info.get("fo_bound_s", {}):
            predicted["fo"] = staged_info["fo_bound_s"][name] + move
        elif name in staged:
            predicted["fo"] = full_overlap_bound(sim_graph(graph, plans["plan_0"], cm))
        elif name in plans:
            predicted["fo"] = full_overlap_bound(sim_graph(graph, plans[name], cm))
        else:
            predicted["fo"] = full_overlap_bound(sim_graph_from_module(compiled[name], cm))
        return predicted, pred_choice

    return predictions


def _fitted_programs(cal: Any) -> str:
    """The fit's programs, measured and predicted, for a progress line (one of them after
    a lean profile)."""
    ms = lambda t: f"{t * 1e3:.2f}"  # noqa: E731
    if cal.wall_s[1] is None:
        return (f"no fusion measured {ms(cal.wall_s[0])} ms, predicted "
                f"{ms(cal.predicted_s[0])} ms; lean profile")
    return (f"no fusion / one bucket measured {ms(cal.wall_s[0])} / {ms(cal.wall_s[1])} ms, "
            f"predicted {ms(cal.predicted_s[0])} / {ms(cal.predicted_s[1])} ms")


def _phi(overlap: float | None) -> str:
    """The fit's overlap phi for a progress line ("as given" where it was not fitted)."""
    return "as given" if overlap is None else f"{overlap:.2f}"


def _fused_choice(spec: Mapping[str, Any]) -> Any:
    """The job's fused-op estimator: the GNN of ``spec["gnn"]`` (a checkpoint), else the
    fallback rule (``disco bench`` resolved the user's choice to a checkpoint or none)."""
    from disco_estimator.costs.fused_choice import choose_fused_estimator

    if spec.get("gnn"):
        return choose_fused_estimator("gnn", checkpoint=spec["gnn"], origin="the job")
    return choose_fused_estimator("fallback", origin="the job")


def bench_row(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """Runs one job in this process (see the module docstring): steps 1-5 are
    :func:`~disco_jax.pipeline.optimize.optimize_step`, the product's pipeline, with the
    paper's other baselines compiled beside its candidates and the fit's programs in its
    choice rounds; steps 6 and 7 are this module's. The row on process 0, None
    elsewhere."""
    import jax

    from disco_jax.pipeline.candidates import CANDIDATE_BASELINES
    from disco_jax.pipeline.choose import summarize_samples
    from disco_jax.pipeline.optimize import optimize_step, refit
    from disco_jax.pipeline.sync import job_sync
    from hlo_tools import baselines as bl

    pid = jax.process_index()
    say = (lambda text: _log(spec, text)) if pid == 0 else (lambda text: None)
    sync = job_sync(f"bench_{spec['model']}")
    t_job = time.perf_counter()
    step, args = make_step(spec, jax.device_count())
    opt = optimize_step(
        step, args, hardware=spec["hardware"], sync=sync, top_k=int(spec["top_k"]),
        choice_rounds=int(spec["choice_rounds"]), staged=spec.get("staged", ()),
        min_sample_s=float(spec["min_sample_s"]), seed=int(spec["seed"]),
        predict_baselines=False, search_s=float(spec["time_budget_s"]),
        fused_estimator=_fused_choice(spec), progress=say,
        extra_baselines=[b for b in bl.BASELINES if b not in CANDIDATE_BASELINES],
        remeasure_fit=True, staged_top=int(spec.get("staged_top", 3)),
        chunk_bytes=spec.get("chunk_bytes", "default"), keep_labels=False,
        keep_details=True, profile=spec.get("profile"))
    details = opt.details
    program, choice, cands, cal = (details.program, details.choice, details.candidates,
                                   details.calibration)
    if cal is not None:
        say(f"in-context fit: all-reduce D {cal.d_s * 1e3:.3f} ms, compute scale "
            f"{cal.compute_scale:.2f}, saving share {cal.saving_share:.2f}, extra "
            f"latency per buffer of a combined all-reduce "
            f"{cal.d_tuple_extra_s * 1e3:.3f} ms, overlap {_phi(cal.overlap)}, bucket copies "
            f"{_gb_per_s(cal.copy_s_per_byte)} ({_fitted_programs(cal)})")
    bench = _bench_rounds(spec, details, sync, say)
    want = jax.jit(program.step)(*program.args)
    diff = _max_diff(bench.finals["disco"](*program.args), want)
    if pid != 0:
        return None

    row: dict[str, Any] = {"model": spec["model"], "setup": spec["setup"],
                           "size": spec["size"],
                           "fused_estimator": type(details.costs.fused).__name__}
    if cal is not None:
        row["calibration"] = cal._asdict()
    outcome = details.searched.outcome
    if outcome is not None:
        row["search_s"] = outcome.stats.seconds
        row["search"] = {"evaluated": outcome.stats.evaluated,
                         "stop_reason": outcome.stats.stop_reason,
                         "best_start": outcome.best_start,
                         "start_predicted_s": outcome.start_costs_s,
                         "top_predicted_s": [c for _, c in outcome.top]}
    at_start = details.costs
    chosen = details.refit  # fitted again with the choice rounds' samples
    choice_costs = chosen.costs if chosen is not None else at_start
    bench_costs = choice_costs
    if chosen is not None and chosen.calibration is not None:
        row["calibration_refit"] = chosen.calibration._asdict()
        rounds = refit(program, details.profile, at_start, cal, chosen.hardware,
                       bench.fit_samples, say, keep=False, where="the bench rounds")
        if rounds.calibration is not None:
            row["calibration_bench"] = rounds.calibration._asdict()
            bench_costs = rounds.costs
    say("predicting every program")
    shift = _staged_shift(details)
    predictions = _predictor(details, bench.best_bucketed, shift or 0.0)
    priced: dict[tuple[int, bool], tuple[dict, dict]] = {}

    def under(cm: Any, remeasured: bool = True) -> tuple[dict, dict]:
        key = (id(cm), remeasured)
        if key not in priced:
            priced[key] = predictions(cm, remeasured)
        return priced[key]

    predicted = under(bench_costs)[0]
    choice_predicted, pred_choice = under(choice_costs)
    start_predicted, start_choice = under(at_start, remeasured=False)
    by_estimator = None
    if spec.get("compare_fused") and chosen is not None and cal is not None:
        # the same measurements and candidates under other fused-op estimators
        from disco_estimator.gnn.estimator import GnnFusedEstimator

        by_estimator = {type(choice_costs.fused).__name__: pred_choice}
        for path in spec["compare_fused"]:
            say(f"predicting every program again with the GNN of {path}")
            other = chosen.with_fused(program.module,
                                     GnnFusedEstimator.from_checkpoint(path))
            by_estimator[f"gnn:{Path(path).name}"] = predictions(other)[1]
    spread = {n: summarize_samples(bench.samples[n]) for n in PROGRAMS}
    row.update({
        "measured_s": {n: spread[n]["median_s"] for n in PROGRAMS},
        "spread_s": spread,
        "samples_s": {n: bench.samples[n] for n in PROGRAMS},
        "predicted_s": predicted,
        "predicted_choice_fit_s": choice_predicted,
        "predicted_at_start_s": start_predicted,
        "choice": {"disco": choice.name, "bucketed": bench.best_bucketed,
                   "disco_is": bench.same,
                   "bucketed_threshold_bytes": cands.bucketed[bench.best_bucketed][0],
                   "bucket_counts": {n: k for n, (_, k) in cands.bucketed.items()},
                   "medians_s": choice.medians_s,
                   # rounds each challenger beat the choice before its tier in
                   "wins": choice.wins, "against": choice.against,
                   "predicted_s": pred_choice, "predicted_at_start_s": start_choice,
                   "predicted_by_estimator_s": by_estimator},
        "staged": {**{k: v for k, v in cands.staged_info.items() if k != "predicted_s"},
                   "choice_shift_s": shift},
        "disco_max_abs_diff": diff,
        "job_s": time.perf_counter() - t_job,
        "facts": {"jax_version": jax.__version__, "num_devices": jax.device_count(),
                  "num_processes": jax.process_count(), "host_cpus": os.cpu_count() or 0},
    })
    return row


def predict_row(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A ``--predict-only`` row in this process: the hardware file's devices must be this
    process's devices (host devices will do: nothing is run but the op timings)."""
    import jax

    from disco_estimator.costs.lower import predict_module
    from disco_jax.pipeline.optimize import predict_step
    from hlo_tools import baselines as bl

    measured = None
    if spec.get("op_times"):
        from disco_estimator.ops import OpProfile

        measured = OpProfile.load(spec["op_times"])
    _log(spec, f"searching ({spec['time_budget_s']:.0f} s budget)")
    program, costs, outcome = predict_step(
        *make_step(spec, jax.device_count()), spec["hardware"], op_profile=measured,
        seed=int(spec["seed"]), search_s=float(spec["time_budget_s"]))
    step, args, module, graph = program.step, program.args, program.module, program.graph

    gpu = costs.hardware.hardware.get("backend") == "gpu"
    threshold = bl.GPU_DEFAULT_THRESHOLD_BYTES if gpu else None
    starts = outcome.start_costs_s
    bucketed = {n: c for n, c in starts.items() if n.startswith("bucketed")}
    predicted = {
        "no_fusion": starts["no_fusion"],
        "op_fusion": predict_module(bl.module_from_compiled(bl.compile_baseline(step, args,
                                                                          "op_fusion")),
                              costs),
        "allreduce_fusion": predict_module(bl.apply_buckets(module, bl.combiner_buckets(
            module, threshold or bl.CPU_COMBINE_THRESHOLD_BYTES)), costs),
        # XLA's default = XLA's fusion + its combiner; XLA:GPU combines up to 30 MiB
        "xla_default": predict_module(bl.module_from_compiled(
            bl.compile_bucketed(step, args, threshold).run if gpu else
            bl.compile_baseline(step, args, "xla_default")), costs),
        "bucketed": min(bucketed.values()),
        "disco": outcome.cost_s,
        "fo": outcome.fo_bound_s,
    }
    swept = {}
    if gpu:  # XLA's combiner at the thresholds a user sweeps (2x steps)
        grad_bytes = sum(int(graph.out_bytes[i]) for i in graph.gradient_allreduces)
        for t in bl.combine_thresholds("gpu", grad_bytes):
            swept[bl.combine_threshold_name(t)] = predict_module(bl.module_from_compiled(
                bl.compile_bucketed(step, args, t).run), costs)
        if swept:
            predicted["xla_combine_best"] = min(swept.values())
    op_source = (f"op times: measured on {measured.device_kind} ({measured.backend})"
                 if measured is not None else
                 "op times: standalone on this machine's CPU x compute_scale")
    return {"model": spec["model"], "setup": spec["setup"], "size": spec["size"],
            "predicted_s": predicted, "search_s": outcome.stats.seconds,
            "search": {"evaluated": outcome.stats.evaluated,
                       "best_start": outcome.best_start,
                       "bucketed_predicted_s": bucketed,
                       "xla_combine_predicted_s": swept},
            "stand_ins": (op_source + "; op_fusion / xla_default: XLA:CPU's fusion decisions"
                          + ("; xla_default combines up to 30 MiB (XLA:GPU's default), "
                             "xla_combine_best: the best of the swept thresholds"
                             if gpu else ""))}


# --------------------------------------------------------------------------- parent side


def run_job(spec: Mapping[str, Any], timeout_s: float = 1800.0) -> dict[str, Any]:
    """Runs one job (``spec["setup"]`` in :data:`SETUPS`, or ``spec["predict_only"]``) in
    child processes; returns process 0's row.

    Raises:
        RuntimeError: the job failed (its processes' stderr went to this one's).
        TimeoutError: it ran past ``timeout_s``.
    """
    from disco_estimator.gloo import child_env, run_bounded
    from disco_jax.enactment.staged import POOL_THREADS

    with tempfile.TemporaryDirectory(prefix="disco_bench_") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(dict(spec)))
        out = Path(tmp) / "p0.json"
        me = [sys.executable, "-m", "disco_jax.pipeline.bench"]
        if spec.get("predict_only"):
            cmd = [*me, "run", "--spec", str(spec_path), "--out", str(out)]
            env = child_env(int(spec["num_devices"]))
        else:
            setup = SETUPS[spec["setup"]]
            # a process pinned to one CPU gets one thread in XLA:CPU's pool unless NPROC
            # says otherwise; staged enactments need two (jax/jaxlib 0.10.2)
            threads = spec.get("pool_threads") or POOL_THREADS
            env = child_env(setup.devices,
                            {"NPROC": str(threads)} if spec.get("pin_cpus") else None)
            if setup.processes == 1:
                cmd = [*me, "run", "--spec", str(spec_path), "--out", str(out)]
            else:
                cmd = [*me, "launch", "--spec", str(spec_path), "--out-dir", tmp,
                       "--timeout", str(timeout_s),
                       "--parent-netns", os.readlink("/proc/self/ns/net")]
                if setup.rate:
                    cmd = ["unshare", "-n", *cmd]
        run_bounded(cmd, env, timeout_s + 60)
        return json.loads(out.read_text())


# --------------------------------------------------------------------------- worker side


def _gb_per_s(s_per_byte: float | None) -> str:
    """A per-byte cost as a rate for the log ("not measured" for None)."""
    return "not measured" if s_per_byte is None else f"{1e-9 / s_per_byte:.1f} GB/s"


def _write(path: str, row: Any) -> None:
    from hlo_tools.dirs import write_atomic

    write_atomic(path, json.dumps(row, indent=1))


def _run(args: argparse.Namespace) -> None:
    spec = json.loads(Path(args.spec).read_text())
    if spec.get("predict_only"):
        _write(args.out, predict_row(spec))
        return
    if spec.get("pin_cpus") and args.coordinator:
        from disco_estimator.gloo import pin_to_own_cpu

        pin_to_own_cpu(args.process_id)
    import jax

    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=120)
    from disco_estimator.gloo import DEFAULT_LOOP_POLICY, quiet_gloo_loops

    policy = spec.get("gloo_loop", DEFAULT_LOOP_POLICY)
    quieted = None
    if args.coordinator and policy != "asis":
        jax.devices()  # starts the backend and gloo's event loop
        quieted = len(quiet_gloo_loops(policy))
        if not quieted:
            raise SystemExit(f"--gloo-loop {policy}: no gloo event loop found in this process")
    row = bench_row(spec)
    if row is not None:
        row["gloo_loop"] = policy if args.coordinator else None
        row["gloo_loops_quieted"] = quieted
        _write(args.out, row)
    if args.coordinator:
        jax.distributed.shutdown()


def _launch(args: argparse.Namespace) -> None:
    """Starts a multi-process job's processes (after limiting the private loopback)."""
    from disco_estimator.gloo import run_local_job, set_loopback_rate

    spec = json.loads(Path(args.spec).read_text())
    setup = SETUPS[spec["setup"]]
    if setup.rate:
        qdisc = set_loopback_rate(setup.rate, args.parent_netns, setup.burst)
        print(f"[{spec['model']} {setup.name}] lo: {qdisc}", file=sys.stderr, flush=True)
    rcs = run_local_job(
        lambda i, coordinator: [sys.executable, "-m", "disco_jax.pipeline.bench", "run",
                                "--spec", args.spec,
                                "--out", str(Path(args.out_dir) / "p0.json"),
                                "--coordinator", coordinator,
                                "--num-processes", str(setup.processes),
                                "--process-id", str(i)],
        setup.processes, timeout_s=args.timeout, grace_s=20.0)
    if any(rcs):
        raise SystemExit(f"bench workers exited with {rcs}")


def main(argv: list[str] | None = None) -> None:
    """``python -m disco_jax.pipeline.bench {launch,run}``: the worker side of :func:`run_job`."""
    ap = argparse.ArgumentParser(prog="python -m disco_jax.pipeline.bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch")
    la.add_argument("--spec", required=True)
    la.add_argument("--out-dir", required=True)
    la.add_argument("--timeout", type=float, default=1800.0)
    la.add_argument("--parent-netns", default="")
    ru = sub.add_parser("run")
    ru.add_argument("--spec", required=True)
    ru.add_argument("--out", required=True)
    ru.add_argument("--coordinator", default="")
    ru.add_argument("--num-processes", type=int, default=1)
    ru.add_argument("--process-id", type=int, default=0)
    args = ap.parse_args(argv)
    (_launch if args.cmd == "launch" else _run)(args)


if __name__ == "__main__":
    main()
