"""Where the cost model's price of XLA's programs goes, per class of kernel, against the
trace: a job per zoo model and setup (2 gloo processes, or ``inproc4``'s one process of 4
devices), fitted as ``disco bench`` fits it.

Each job (every process alike) lowers the step, compiles XLA's programs (``--programs``:
XLA's default and ``op_fusion`` by default; ``no_fusion`` and ``allreduce_fusion`` too,
and ``bucketed``, hand bucketing in 1 MiB buckets with XLA's fusion on),
takes the product's in-context profile (:func:`~disco_jax.pipeline.profile.profile_in_context`)
and traces each program; then process 0 fits the cost model
(:func:`~disco_jax.pipeline.fit.in_context_costs`) and prices every instruction of XLA's
programs. Per class -- multi-op fusions, single-op fusions,
kernel-library fusions (dots, convolutions), plain dots, the all-reduces, the rest --
the table gives the priced and the traced seconds per iteration (process 0's trace; a
loop's kernels in their own classes, each with its share of the loop's price), and
per program the measured and predicted iteration and the opcodes priced furthest from
their trace (each opcode's and each all-reduce's priced and traced seconds in the JSON).
A class priced far from its trace
while the program's total is right shows where a fitted scale took another class's
error. Beside them, the time no class holds: ``host``, a call's wall time beyond the
trace's iteration (dispatch, the result's wait), and ``idle``, the gaps within the
iteration in which no instruction ran, of it the ``handoffs`` (an instruction that starts
on another pool thread than the one before it, after a gap: the wait for that thread to
wake), and ``concurrent``, the time in which two or more instructions ran at once. Each of
these is from the traced calls, whose wall time (``traced call``) is the profiler's; compare
them with one another, not with ``meas``, measured untraced at another time.

The jobs run as ``disco bench`` runs its own (``--no-pin`` to leave them unpinned): each
process of a gloo job pinned to a CPU of its own, XLA:CPU's thread pool at the staged
enactment's size. Unpinned, the two processes share the two CPUs as the scheduler
places them, and a held-out step measures up to twice its pinned time.

``--share-fits PROGRAMS`` fits the saving share again to each of these programs in turn
(at the job's measured median of it, in place of XLA's default in the profile) and
prints every program's error under each fit: which program pins the share best. The
name ``traced`` sets the share instead where XLA's default's fusions of several ops are
priced at their traced time (:func:`traced_share`). Per program, the fusions of several
ops are also priced with no saving granted and at the fused-op estimator's price (share
0 and 1).

``--models`` names zoo models or held-out steps of ``benchmarks/heldout_steps.py``
(``--size small``). ``--variant NAME=DIR`` runs the same jobs on the checkout in ``DIR``
too (its full profile: with this checkout's script, on that code), each job right after
this checkout's.

Run from the repository root (``gloo2-1gbit``: as root, in a private network namespace
with ``tc`` on its loopback, as ``disco bench`` runs it)::

    sudo python benchmarks/kernel_classes.py --models bert,transformer --size medium \\
        --setups gloo2-1gbit --variant before=../other-checkout
    python benchmarks/kernel_classes.py --models resnet --setups inproc4 \\
        --programs no_fusion,allreduce_fusion,op_fusion,xla_default

Prints a table and writes ``benchmarks/results/kernel_classes.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the checkout a job runs (``--variant``); this one by default
CODE = Path(os.environ.get("KERNEL_CLASSES_CODE", ROOT))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(CODE))

from benchmarks.provenance import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "kernel_classes.json"
#: XLA's programs priced per class by default (``--programs`` may name any of the
#: paper's four baselines, :data:`hlo_tools.baselines.BASELINES`).
PROGRAMS = ("xla_default", "op_fusion")
CLASSES = ("multi_op_fusion", "single_op_fusion", "library_fusion", "dot", "all_reduce",
           "other")
#: The bucket size of ``--programs bucketed`` (hand bucketing, XLA's fusion on): the
#: smallest of ``disco bench``'s sweep.
BUCKET_BYTES = 1 << 20
#: Opcodes listed per program under the table, the furthest priced from their trace.
TOP = 4
#: Ops that are not work inside a fused computation.
_PLUMBING = frozenset({"parameter", "constant", "bitcast", "tuple", "get-tuple-element"})


def job_spec(model: str, size: str) -> dict[str, str]:
    """The ``disco bench`` job spec of a zoo model, or of a held-out step of
    ``benchmarks/heldout_steps.py`` by its name (at its sizes: ``tiny``, ``small``)."""
    from benchmarks import heldout_steps

    if model in heldout_steps.STEPS:
        return heldout_steps.job_spec(model, size)
    return {"model": model, "size": size}


def kernel_class(instr: Any, module: Any) -> str:
    """The class of one instruction of a compiled module (see :data:`CLASSES`)."""
    from hlo_tools.compiled import is_library_fusion
    from hlo_tools.opcodes import is_collective

    if instr.opcode == "fusion":
        if is_library_fusion(instr):
            return "library_fusion"
        body = module.computation(instr.called_computations[0])
        work = sum(i.opcode not in _PLUMBING for i in body.instructions)
        return "multi_op_fusion" if work > 1 else "single_op_fusion"
    if instr.opcode == "dot":
        return "dot"
    if is_collective(instr.opcode):
        return "all_reduce"
    return "other"


def loop_parts(costs: Any, module: Any, instr: Any, priced_s: float) -> list[tuple[Any, float]]:
    """The instructions of a ``while`` loop's condition and body that take time, each with
    its share of the loop's priced seconds per iteration ``priced_s``: the cost model
    prices a loop as its trip count times the sum of their times, so each gets that
    proportion (its trips included). Empty for any other instruction."""
    import hlo_tools

    if instr.opcode != "while":
        return []
    times = []
    for name in instr.called_computations:
        graph = hlo_tools.device_graph(module, module.computation(name))
        gc = costs.graph_costs(graph)
        times += [(i, float(t)) for i, t in zip(graph.computation.instructions, gc.time_s)
                  if t > 0]
    total = sum(t for _, t in times)
    return [(i, priced_s * t / total) for i, t in times] if total > 0 else []


def traced_share(at_share: dict[str, float], traced_s: float, scale: float) -> float:
    """The saving share at which a program's fusions of several ops are priced at their
    traced time: their price falls linearly from ``at_share["0.0"]`` (no saving granted)
    to ``at_share["1.0"]`` (the estimator's price), compute-scaled both, against the
    traced seconds times the compute ``scale``; the floor that stops a kernel's price
    far above share 1 is left out. Clamped to the fit's bounds; 1 where fusion saves
    nothing."""
    from disco_jax.pipeline.fit import SAVING_SHARE_BOUNDS

    none, full = at_share["0.0"], at_share["1.0"]
    if none <= full:
        return 1.0
    lo, hi = SAVING_SHARE_BOUNDS
    return min(max((none - scale * traced_s) / (none - full), lo), hi)


def with_share(costs: Any, share: float) -> Any:
    """``costs`` with the saving share set to ``share``: the same op times, hardware and
    constants otherwise (the fallback rule bound to the new model; another fused-op
    estimator kept)."""
    import dataclasses

    from disco_estimator.costs.cost_model import CostModel
    from disco_estimator.interface import FallbackFusedEstimator

    return CostModel(costs.hardware, op_times=costs.op_times,
                     constants=dataclasses.replace(costs.constants, saving_share=share),
                     fused=None if isinstance(costs.fused, FallbackFusedEstimator)
                     else costs.fused)


def thread_waits(raw_events: list[dict[str, Any]], module: str) -> dict[str, float]:
    """Where one program's traced iterations wait between threads, from the trace's raw
    events (each instruction with the thread that ran it).

    A *handoff* is an instruction that starts on another thread than the one before it,
    after a gap in which nothing ran: the work moved to another of XLA:CPU's pool
    threads and waited for it to wake. ``concurrent``: time in which two or more
    instructions ran at once.

    Returns:
        Medians over the iterations: ``handoffs`` (count), ``handoff_s`` (their gaps,
        seconds), ``concurrent_s`` and ``busy_s`` (union of the instructions' intervals).
    """
    by_run: dict[str, list[tuple[float, float, Any]]] = collections.defaultdict(list)
    for e in raw_events:
        a = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in a and a.get("hlo_module") == module \
                and a.get("run_id") is not None:
            start = float(e["ts"]) * 1e-6
            by_run[str(a["run_id"])].append((start, start + float(e.get("dur", 0)) * 1e-6,
                                             e.get("tid")))
    rows = []
    for evs in by_run.values():
        evs.sort(key=lambda ev: ev[0])
        n, gap_s, busy, end, tid = 0, 0.0, 0.0, evs[0][0], evs[0][2]
        for start, stop, thread in evs:
            if start > end:
                if thread != tid:
                    n, gap_s = n + 1, gap_s + (start - end)
                busy += stop - start
            elif stop > end:
                busy += stop - end
            end, tid = max(end, stop), thread
        points = sorted([(a, 1) for a, _, _ in evs] + [(b, -1) for _, b, _ in evs])
        depth, last, both = 0, points[0][0], 0.0
        for t, step in points:
            both += (t - last) if depth >= 2 else 0.0
            depth, last = depth + step, t
        rows.append((n, gap_s, both, busy))
    return {key: statistics.median(r[k] for r in rows)
            for k, key in enumerate(("handoffs", "handoff_s", "concurrent_s", "busy_s"))}


def _worker(args: argparse.Namespace) -> None:
    """One process of the job; process 0 writes the record to ``args.out``."""
    from disco_jax.activator import PROCESS_ID_ENV, initialize_from_env

    if args.pin and PROCESS_ID_ENV in os.environ:  # as disco bench pins a gloo job's processes
        from disco_estimator.gloo import pin_to_own_cpu

        pin_to_own_cpu(int(os.environ[PROCESS_ID_ENV]))
    initialize_from_env()
    import inspect

    import jax

    import hlo_tools
    from benchmarks.accuracy_worker import iteration_stats
    from disco_estimator.costs.cost_model import cover
    from disco_estimator.costs.lower import predict_module, sim_graph
    from disco_estimator.costs.simulator import simulate
    from disco_estimator.gloo import DEFAULT_LOOP_POLICY, quiet_gloo_loops
    from disco_estimator.ops import trace
    from disco_jax.pipeline.bench import make_step
    from disco_jax.pipeline.choose import measure
    from disco_jax.pipeline.fit import in_context_costs
    from disco_jax.pipeline.profile import profile_in_context
    from disco_jax.pipeline.sync import job_sync
    from hlo_tools import baselines as bl
    from hlo_tools.plan import initial_plan

    jax.devices()
    quiet_gloo_loops(DEFAULT_LOOP_POLICY)  # as disco bench runs its jobs
    step, args_ = make_step(job_spec(args.model, args.size), jax.device_count())
    module = hlo_tools.parse(jax.jit(step).lower(*args_).as_text(dialect="hlo"))
    sync = job_sync("kernel_classes")
    runs = {name: (bl.compile_bucketed(step, args_, BUCKET_BYTES).run if name == "bucketed"
                   else bl.compile_baseline(step, args_, name))
            for name in args.programs.split(",")}
    default = runs.get("xla_default") or bl.compile_baseline(step, args_, "xla_default")
    # the full profile: with XLA's default as its fused program where the code has one
    full = ({"xla_default": default}
            if "lean" in inspect.signature(profile_in_context).parameters else {})
    measured = profile_in_context(step, args_, module, sync=sync, **full)
    profiles, idle, waits = {}, {}, {}
    for name, run in runs.items():
        with tempfile.TemporaryDirectory(prefix="disco_classes_trace_") as tmp:
            profiles[name] = trace.profile_program(run, *args_, iterations=5, warmup=2,
                                                   trace_dir=tmp)
            raw = trace.read_trace_events(trace.find_trace_file(tmp))
        events = trace.op_events(raw, profiles[name].module)
        idle[name] = statistics.median(it["span_s"] - it["busy_s"]
                                       for it in iteration_stats(events, frozenset()))
        waits[name] = thread_waits(raw, profiles[name].module)
    walls = measure(runs, args_, rounds=5, min_sample_s=0.3, sync=sync, tag="classes")
    if jax.process_index() != 0:
        return
    costs, cal = in_context_costs(module, args.setup, measured, progress=False)
    compiled = {name: bl.module_from_compiled(run) for name, run in runs.items()}
    share_fits = {}
    for fused in filter(None, args.share_fits.split(",")):
        if fused == "traced":
            continue
        # the share fitted to another of the job's programs, at this job's median of it
        refit = measured._replace(fused=compiled[fused],
                                  fused_wall_s=statistics.median(walls[fused]))
        other, other_cal = in_context_costs(module, args.setup, refit, progress=False)
        share_fits[fused] = {"saving_share": other_cal.saving_share, "predicted_s": {
            name: predict_module(mod, other) for name, mod in compiled.items()}}
    at_shares = {str(share): with_share(costs, share) for share in (0.0, 1.0)}
    programs = {}
    for name, mod in compiled.items():
        cover(costs, mod)
        graph = hlo_tools.device_graph(mod)
        sim = sim_graph(graph, initial_plan(graph), costs)
        by_name = {i.name: i for i in graph.computation.instructions}
        traced = profiles[name].times_s
        classes = collections.defaultdict(lambda: {"n": 0, "priced_s": 0.0, "traced_s": 0.0})
        opcodes = collections.defaultdict(lambda: {"n": 0, "priced_s": 0.0, "traced_s": 0.0})
        all_reduces = []
        for k, node in enumerate(sim.names):
            instr, priced = by_name[node], float(sim.duration_s[k])
            inside = loop_parts(costs, mod, instr, priced)
            # a loop's kernels in their own classes; the loop keeps what is left
            rows = [(instr, priced - sum(p for _, p in inside))] + inside
            for inner, seconds in rows:
                kind = kernel_class(inner, mod)
                for entry in (classes[kind], opcodes[f"{kind}:{inner.opcode}"]):
                    entry["n"] += 1
                    entry["priced_s"] += seconds
                    entry["traced_s"] += traced.get(inner.name, 0.0)
                if kind == "all_reduce":
                    all_reduces.append([inner.shape.byte_size(), seconds,
                                        traced.get(inner.name, 0.0)])
        # XLA's fusions of several ops at no saving granted and at the estimator's price
        at_share = {}
        for share, alt in at_shares.items():
            alt_sim = sim_graph(graph, initial_plan(graph), alt)
            at_share[share] = sum(
                float(alt_sim.duration_s[k]) for k, node in enumerate(alt_sim.names)
                if kernel_class(by_name[node], mod) == "multi_op_fusion")
        programs[name] = {"measured_s": statistics.median(walls[name]),
                          "multi_op_fusion_at_share_s": at_share,
                          "predicted_s": simulate(sim, costs.overlap).iteration_s,
                          "traced_sum_s": sum(traced.values()),
                          "host_s": statistics.median(profiles[name].wall_times_s)
                          - statistics.median(profiles[name].trace_iteration_s),
                          "idle_s": idle[name],
                          "traced_wall_s": statistics.median(profiles[name].wall_times_s),
                          **waits[name], "classes": dict(classes),
                          "opcodes": dict(opcodes), "all_reduces": all_reduces}
    if "traced" in args.share_fits.split(","):
        xd = programs["xla_default"]
        share = traced_share(xd["multi_op_fusion_at_share_s"],
                             xd["classes"].get("multi_op_fusion", {}).get("traced_s", 0.0),
                             costs.constants.compute_scale)
        alt = with_share(costs, share)
        share_fits["traced"] = {"saving_share": share, "predicted_s": {
            name: predict_module(mod, alt) for name, mod in compiled.items()}}
    record = {"model": args.model, "size": args.size, "setup": args.setup,
              "calibration": cal._asdict(), "programs": programs, "share_fits": share_fits}
    Path(args.out).write_text(json.dumps(record))


def _job(model: str, size: str, setup: str, timeout_s: float, code: Path,
         programs: str, pin: bool = True, share_fits: str = "") -> dict[str, Any]:
    """Runs one job of the checkout ``code`` (in a private network namespace with the
    setup's link when it has one; one process of the setup's devices where the setup has
    one process) and returns process 0's record. With ``pin``, as ``disco bench`` runs
    its jobs: each process of a gloo job on a CPU of its own, XLA:CPU's pool at
    :data:`~disco_jax.enactment.staged.POOL_THREADS` threads."""
    from disco_estimator.gloo import child_env
    from disco_jax.enactment.staged import POOL_THREADS
    from disco_jax.pipeline.bench import SETUPS

    link = SETUPS[setup]
    with tempfile.TemporaryDirectory(prefix="disco_classes_") as tmp:
        out = Path(tmp) / "p0.json"
        worker = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", model,
                  "--size", size, "--setup", setup, "--programs", programs,
                  "--out", str(out), "--share-fits", share_fits] + ([] if pin else ["--no-pin"])
        launch = [sys.executable, "-m", "disco_jax", "launch", "-n", str(link.processes),
                  "--timeout", str(int(timeout_s)), "--", *worker]
        cmd = launch if link.processes > 1 else worker
        if link.rate:
            tc = (f"ip link set lo up && tc qdisc replace dev lo root tbf rate {link.rate} "
                  f"burst {link.burst} latency 100ms && ")
            cmd = ["unshare", "-n", "bash", "-c", tc + shlex.join(launch)]
        env = {**child_env(link.devices, {"NPROC": str(POOL_THREADS)} if pin else None),
               "KERNEL_CLASSES_CODE": str(code),
               "PYTHONPATH": os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])}
        subprocess.run(cmd, check=True, cwd=code, timeout=timeout_s + 60, env=env,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def render(records: list[dict[str, Any]]) -> str:
    """The table: per job and program, the iteration and each class, priced / traced ms."""
    ms = lambda s: f"{s * 1e3:8.1f}"  # noqa: E731
    lines = [f"{'model':12s} {'setup':12s} {'program':12s} {'meas':>8s} {'pred':>8s}  "
             + "  ".join(f"{c:>19s}" for c in CLASSES),
             f"{'':51s}  " + "  ".join(f"{'priced / traced':>19s}" for _ in CLASSES)]
    for r in records:
        tag = r["model"] + (f" ({r['variant']})" if r.get("variant") else "")
        for name, p in r["programs"].items():
            cells = [f"{ms(p['classes'][c]['priced_s'])} /{ms(p['classes'][c]['traced_s'])}"
                     if c in p["classes"] else f"{'-':>19s}" for c in CLASSES]
            lines.append(f"{tag:12s} {r['setup']:12s} {name:12s} "
                         f"{ms(p['measured_s'])} {ms(p['predicted_s'])}  " + "  ".join(cells))
            worst = sorted(p.get("opcodes", {}).items(),
                           key=lambda kv: -abs(kv[1]["priced_s"] - kv[1]["traced_s"]))[:TOP]
            waits = (f"host {p['host_s'] * 1e3:.2f}, idle {p['idle_s'] * 1e3:.2f} ms; "
                     if "idle_s" in p else "")
            if "handoffs" in p:
                waits += (f"traced call {p['traced_wall_s'] * 1e3:.2f} ms, "
                          f"{p['handoffs']:.0f} handoffs {p['handoff_s'] * 1e3:.2f} ms, "
                          f"concurrent {p['concurrent_s'] * 1e3:.2f} ms; ")
            if worst:
                lines.append(f"{'':12s} {waits}most off: " + ", ".join(
                    f"{op} x{v['n']} {v['priced_s'] * 1e3:.1f} / {v['traced_s'] * 1e3:.1f}"
                    for op, v in worst))
        for fused, fit in r.get("share_fits", {}).items():
            lines.append(f"{'':12s} share fitted to {fused}: {fit['saving_share']:.2f}; "
                         "error " + ", ".join(
                             f"{n} {fit['predicted_s'][n] / p['measured_s'] - 1:+.0%}"
                             for n, p in r["programs"].items()))
        for name, p in r["programs"].items():
            if p.get("multi_op_fusion_at_share_s", {}).get("1.0"):
                at = p["multi_op_fusion_at_share_s"]
                lines.append(f"{'':12s} {name}: fusions of several ops priced "
                             f"{at['0.0'] * 1e3:.2f} ms granted no saving, "
                             f"{at['1.0'] * 1e3:.2f} ms at the estimator's price")
        cal = r["calibration"]
        lines.append(f"{'':12s} fit: compute scale {cal['compute_scale']:.2f}, saving share "
                     f"{cal['saving_share']:.2f}, D {cal['d_s'] * 1e3:.3f} ms, C "
                     f"{cal['c_s_per_byte'] * 2**20 * 1e3:.2f} ms/MiB")
    lines.append("ms per iteration; priced: the fitted cost model's seconds of the class's "
                 "instructions; traced: process 0's trace; host: its calls' wall time beyond "
                 "the trace's iteration; idle: within the iteration, no instruction running; "
                 "traced call: its wall time; handoffs: instructions that started on "
                 "another thread after a gap, and the gaps; concurrent: two or more "
                 "instructions running")
    return "\n".join(lines)


def main() -> None:
    from hlo_tools.baselines import BASELINES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bert,transformer",
                        help="zoo models, or held-out steps of benchmarks/heldout_steps.py")
    parser.add_argument("--size", default="medium")
    parser.add_argument("--setups", default="gloo2-1gbit")
    parser.add_argument("--programs", default=",".join(PROGRAMS),
                        help=f"XLA's programs to price, of {', '.join(BASELINES)}, "
                             "and bucketed (1 MiB buckets)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                        help="also run each job on the checkout in DIR")
    parser.add_argument("--share-fits", default="", metavar="PROGRAMS",
                        help="also fit the saving share to each of these of --programs "
                             "(in place of XLA's default; traced: to XLA's default's traced "
                             "fusions) and predict every program")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the processes unpinned (disco bench --no-pin)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.programs.split(",")) - set(BASELINES) - {"bucketed"}
    if unknown:
        parser.error(f"--programs: unknown {', '.join(sorted(unknown))} "
                     f"(of {', '.join(BASELINES)}, bucketed)")
    fits = set(filter(None, args.share_fits.split(",")))
    unknown = fits - set(args.programs.split(",")) - {"traced"}
    if unknown:
        parser.error(f"--share-fits: {', '.join(sorted(unknown))} not in --programs")
    if "traced" in fits and "xla_default" not in args.programs.split(","):
        parser.error("--share-fits traced: needs xla_default in --programs")
    if args.worker:
        _worker(args)
        return
    variants = [("", ROOT)] + [(name, Path(path).resolve()) for name, _, path in
                               (v.partition("=") for v in args.variant)]
    records = []
    for setup in args.setups.split(","):
        for model in args.models.split(","):
            for name, code in variants:
                print(f"{model} {args.size} {setup} {name} ...", flush=True)
                records.append({**_job(model, args.size, setup, args.timeout, code,
                                       args.programs, args.pin, args.share_fits),
                                "variant": name})
    print(render(records))
    write_result(args.out, {"size": args.size, "records": records})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
