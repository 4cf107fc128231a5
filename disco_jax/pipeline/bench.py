"""``disco bench``'s jobs: every baseline and DisCo, measured side by side in a real setup.

One job = one train step in one setup, run in child processes (each setup needs its own
device configuration; ``gloo2-1gbit`` runs in a private network namespace made with
``unshare -n`` whose loopback ``tc`` limits to 1 Gbit/s, so the host's network is never
touched). Every process of a job:

1. builds the step on the job's devices and extracts its pre-optimization HLO;
2. profiles it in context (:func:`disco_jax.pipeline.profile.profile_in_context`);
3. process 0 builds the cost model from that profile and searches
   (:func:`disco_jax.pipeline.search.search`);
   the best few plans go to every process (as JSON through the job's coordinator);
4. compiles the baselines (:mod:`hlo_tools.baselines`: ``no_fusion``, ``op_fusion``,
   ``allreduce_fusion``, ``xla_default`` and every distinct program of the ``bucketed``
   sweep) and the plans (``exact=True`` with library dots);
5. **final choice**: the plans, the bucketed sweep and ``xla_default`` run interleaved for
   a few rounds; the fastest is DisCo's choice (a plan is never chosen when a baseline
   measured faster), the fastest bucketed program is the ``bucketed`` baseline. The
   in-context fit's programs run in the same rounds (they are not candidates);
6. **bench**: the six programs (four baselines, ``bucketed``, DisCo's choice) run
   interleaved in fresh rounds (so the choice's selection does not bias the figures);
7. process 0 fits the cost model again on the fit's programs with their samples of
   step 5 pooled in (:func:`disco_jax.pipeline.profile.pooled`), predicts every program with it
   (``predicted_s``; the search's model's predictions are kept as
   ``predicted_at_start_s``) and writes the row. With ``spec["compare_fused"]`` (GNN
   checkpoints) it fits and predicts the final choice's candidates once more with each
   GNN as the fused-op estimator (``choice.predicted_by_estimator_s``: the same
   measurements under each estimator).

``--predict-only`` jobs (:func:`predict_row`) do steps 1, 3 and 7 in one process for any
hardware file (e.g. ``gpu_cluster_example``): no profile (standalone op times of this
machine, scaled by the file's ``compute_scale``), nothing measured.

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
from typing import Any, NamedTuple

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


#: Names of the in-context fit's programs when they run again in the final choice's
#: rounds (``fit:no_fusion``, ...).
FIT_PREFIX = "fit:"


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


def bench_row(spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """Runs one job in this process (see the module docstring); the row on process 0,
    None elsewhere."""
    import jax

    from disco_jax.costs.lower import sim_graph, sim_graph_from_module, simulate_plan
    from disco_jax.costs.simulator import full_overlap_bound
    from disco_jax.pipeline.candidates import build_candidates, enactment_route
    from disco_jax.pipeline.choose import choice_tiers, decide, measure, summarize_samples
    from disco_jax.pipeline.fit import calibrate_in_context, in_context_costs, predict_module
    from disco_jax.pipeline.profile import pooled, profile_in_context
    from disco_jax.pipeline.program import lower_program
    from disco_jax.pipeline.search import plans_for_choice
    from disco_jax.pipeline.sync import job_sync
    from hlo_tools import baselines as bl
    from hlo_tools.jax_bridge import EXACT

    pid = jax.process_index()
    say = (lambda text: _log(spec, text)) if pid == 0 else (lambda text: None)
    sync = job_sync(f"bench_{spec['model']}")
    t_job = time.perf_counter()
    program = lower_program(*make_step(spec, jax.device_count()))
    step, args, module, graph = program.step, program.args, program.module, program.graph
    say(f"{graph.num_nodes} nodes, {len(graph.gradient_allreduces)} gradient all-reduces; "
        "profiling in context")
    measured = profile_in_context(step, args, module, sync=sync)

    row: dict[str, Any] = {"model": spec["model"], "setup": spec["setup"],
                           "size": spec["size"]}
    costs = None
    if pid == 0:
        gnn = None
        if spec.get("gnn"):
            from disco_estimator.gnn.estimator import GnnFusedEstimator

            gnn = GnnFusedEstimator.from_checkpoint(spec["gnn"])
        costs, cal = in_context_costs(module, spec["hardware"], measured, progress=False,
                                      calibrate=bool(spec.get("calibrate", True)), fused=gnn)
        row["fused_estimator"] = type(costs.fused).__name__
        if cal is not None:
            row["calibration"] = cal._asdict()
            say(f"in-context fit: all-reduce D {cal.d_s * 1e3:.3f} ms, compute scale "
                f"{cal.compute_scale:.2f}, fused-op scale {cal.fused_scale:.2f}, extra "
                f"latency per buffer of a combined all-reduce "
                f"{cal.d_tuple_extra_s * 1e3:.3f} ms, bucket copies "
                f"{_gb_per_s(cal.copy_s_per_byte)} (no fusion "
                f"/ one bucket measured {cal.wall_s[0] * 1e3:.2f} / "
                f"{cal.wall_s[1] * 1e3:.2f} ms, predicted {cal.predicted_s[0] * 1e3:.2f} / "
                f"{cal.predicted_s[1] * 1e3:.2f} ms)")
    route = enactment_route(None, program.platform)
    searched = plans_for_choice(graph, costs, sync=sync, seed=int(spec["seed"]),
                                time_budget_s=float(spec["time_budget_s"]),
                                top_k=int(spec["top_k"]), buckets_only=route.name != EXACT,
                                say=say)
    outcome = searched.outcome
    if outcome is not None:
        row["search_s"] = outcome.stats.seconds
        row["search"] = {"evaluated": outcome.stats.evaluated,
                         "stop_reason": outcome.stats.stop_reason,
                         "best_start": outcome.best_start,
                         "start_predicted_s": outcome.start_costs_s,
                         "top_predicted_s": [c for _, c in outcome.top]}

    say("compiling the baselines, the bucketed sweep and the plans")
    cands = build_candidates(program, searched.plans_json, route, baselines=bl.BASELINES,
                             staged=spec.get("staged", ()), costs=costs, sync=sync, say=say,
                             staged_top=int(spec.get("staged_top", 3)),
                             chunk_bytes=spec.get("chunk_bytes", "default"))
    runs, plans, staged_info = cands.runs, cands.plans, cands.staged_info
    bucketed = list(cands.bucketed)
    thresholds = {n: t for n, (t, _) in cands.bucketed.items()}
    bucket_counts = {n: k for n, (_, k) in cands.bucketed.items()}
    staged = [n for n in runs if n.startswith("staged")]
    swept = [n for n in runs if n.startswith("xla_combine_")]
    candidates = {n: runs[n] for n in (*bucketed, *swept, "op_fusion", "xla_default",
                                       *plans, *staged)}
    # the in-context fit's programs again, in the same rounds (not candidates)
    fit_runs = {f"{FIT_PREFIX}{n}": r for n, r in (measured.runs or {}).items()}
    say(f"final choice among {len(candidates)} programs (and the fit's {len(fit_runs)})")
    choice_samples = measure({**candidates, **fit_runs}, args,
                             rounds=int(spec["choice_rounds"]), sync=sync, tag="choice",
                             min_sample_s=float(spec["min_sample_s"]))
    choice = decide({n: choice_samples[n] for n in candidates}, choice_tiers(candidates))
    best_bucketed = min(bucketed, key=choice.medians_s.__getitem__)
    finals = {name: runs[name] for name in bl.BASELINES}
    finals["bucketed"] = runs[best_bucketed]
    # DisCo's choice may be a baseline's own program: then it is measured once, as that
    # baseline (two measurements of one program differ only by noise)
    same = next((n for n in ("bucketed", *bl.BASELINES)
                 if finals[n] is runs[choice.name]), None)
    if same is None:
        finals["disco"] = runs[choice.name]
    say(f"choice: {choice.name}; bucketed: {best_bucketed}; measuring "
        f"{spec['rounds']} interleaved rounds")
    samples = measure(finals, args, rounds=int(spec["rounds"]), sync=sync, tag="bench",
                      min_sample_s=float(spec["min_sample_s"]), progress=say)
    if same is not None:
        samples["disco"] = samples[same]
        finals["disco"] = finals[same]
    want = jax.jit(step)(*args)
    diff = _max_diff(finals["disco"](*args), want)
    if pid != 0:
        return None

    at_start = costs
    more: dict[str, Any] = {}
    if cal is not None and fit_runs:
        more = {n[len(FIT_PREFIX):]: s for n, s in choice_samples.items()
                if n.startswith(FIT_PREFIX)}
        costs, refit = calibrate_in_context(costs, module, pooled(measured, more))
        row["calibration_refit"] = refit._asdict()
        say(f"fit again with the choice rounds' samples: all-reduce D {refit.d_s * 1e3:.3f} "
            f"ms, compute scale {refit.compute_scale:.2f}, fused-op scale "
            f"{refit.fused_scale:.2f}")
    say("predicting every program")
    # XLA's programs as it runs them, parsed once for both models
    compiled = {n: bl.module_from_compiled(runs[n])
                for n in (*bl.BASELINES, *bucketed, *swept)}

    def predictions(cm: Any) -> tuple[dict[str, float], dict[str, float]]:
        """The six programs' and the final choice's candidates' predicted seconds."""
        predicted: dict[str, float] = {}
        for name in bl.BASELINES:
            predicted[name] = predict_module(compiled[name], cm)
        pred_bucketed = {n: predict_module(compiled[n], cm) for n in bucketed}
        pred_plans = {n: simulate_plan(graph, plan, cm).iteration_s
                      for n, plan in plans.items()}
        predicted["bucketed"] = pred_bucketed[best_bucketed]
        # staged programs: the search's model priced them (staged_candidates)
        pred_staged = {n: staged_info["predicted_s"].get(n) for n in staged}
        pred_swept = {n: predict_module(compiled[n], cm) for n in swept}
        pred_choice = {**pred_bucketed, **pred_swept, **pred_plans, **pred_staged,
                       "op_fusion": predicted["op_fusion"],
                       "xla_default": predicted["xla_default"]}
        predicted["disco"] = pred_choice[choice.name]
        # FO: the chosen program with every AllReduce hidden (its full-overlap bound),
        # under the model that priced it: a staged program's under the staged model
        if choice.name in staged and choice.name in staged_info.get("fo_bound_s", {}):
            predicted["fo"] = staged_info["fo_bound_s"][choice.name]
        elif choice.name in staged:
            predicted["fo"] = full_overlap_bound(sim_graph(graph, plans["plan_0"], cm))
        elif choice.name in plans:
            predicted["fo"] = full_overlap_bound(sim_graph(graph, plans[choice.name], cm))
        else:
            predicted["fo"] = full_overlap_bound(sim_graph_from_module(
                compiled[choice.name], cm))
        return predicted, pred_choice

    predicted, pred_choice = predictions(costs)
    start_predicted, start_choice = (predicted, pred_choice) if costs is at_start \
        else predictions(at_start)
    by_estimator = None
    if spec.get("compare_fused") and cal is not None:
        # the same measurements and candidates under other fused-op estimators
        from disco_estimator.gnn.estimator import GnnFusedEstimator

        by_estimator = {type(costs.fused).__name__: pred_choice}
        for path in spec["compare_fused"]:
            say(f"predicting every program again with the GNN of {path}")
            other, _ = in_context_costs(module, spec["hardware"], pooled(measured, more),
                                        progress=False,
                                        fused=GnnFusedEstimator.from_checkpoint(path))
            by_estimator[f"gnn:{Path(path).name}"] = predictions(other)[1]
    spread = {n: summarize_samples(samples[n]) for n in PROGRAMS}
    row.update({
        "measured_s": {n: spread[n]["median_s"] for n in PROGRAMS},
        "spread_s": spread,
        "predicted_s": predicted,
        "predicted_at_start_s": start_predicted,
        "choice": {"disco": choice.name, "bucketed": best_bucketed, "disco_is": same,
                   "bucketed_threshold_bytes": thresholds[best_bucketed],
                   "bucket_counts": bucket_counts,
                   "medians_s": choice.medians_s,
                   # rounds each challenger beat the choice before its tier in
                   "wins": choice.wins, "against": choice.against,
                   "predicted_s": pred_choice, "predicted_at_start_s": start_choice,
                   "predicted_by_estimator_s": by_estimator},
        "staged": {k: v for k, v in staged_info.items() if k != "predicted_s"},
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

    from disco_jax.costs.cost_model import CostModel
    from disco_jax.pipeline.fit import predict_module
    from disco_jax.pipeline.program import lower_program
    from disco_jax.pipeline.search import search
    from hlo_tools import baselines as bl

    program = lower_program(*make_step(spec, jax.device_count()))
    step, args, module, graph = program.step, program.args, program.module, program.graph
    measured = None
    if spec.get("op_times"):
        from disco_estimator.ops import OpProfile

        measured = OpProfile.load(spec["op_times"])
    costs = CostModel.for_module(module, spec["hardware"], profile=measured, progress=False)
    _log(spec, f"searching ({spec['time_budget_s']:.0f} s budget)")
    outcome = search(graph, costs, seed=int(spec["seed"]),
                     time_budget_s=float(spec["time_budget_s"]), progress=False)

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
