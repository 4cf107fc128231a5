"""How well the staged cost model prices every bucketing of a staged step.

Runs a zoo step as ``disco bench`` runs it (two gloo processes, each pinned to a CPU,
over a private loopback limited to 1 Gbit/s: run as root), builds the staged step of
every bucketing that :func:`disco_estimator.costs.staged_cost.layouts` proposes, times
each one's programs alone (``StagedStep.parts``) and the whole steps interleaved, and
prices every bucketing from the reference ``staged_k4_r1`` alone, as the product does,
two ways:

* ``step cost``: :func:`~disco_estimator.costs.staged_cost.fit_staged_costs` (the
  streams fully overlapped, the rest of the reference's total one cost per step);
* ``fitted overlap``: the same scales with no cost per step and the overlap phi at
  which the simulated reference takes its measured total (bisection), the rule before.

Prints per model the mean and worst error over the bucketings, Kendall tau between the
predicted and measured order, and which bucketing each rule would pick; writes every
bucketing's parts, totals and predictions to ``benchmarks/results/staged_layouts.json``.

    sudo python benchmarks/staged_layouts.py --models rnnlm,transformer --size medium
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "staged_layouts.json"
REFERENCE = "staged_k4_r1"


def worker(a: argparse.Namespace) -> None:
    """One process of the job: every bucketing built, timed, and (process 0) priced."""
    from disco_estimator.gloo import DEFAULT_LOOP_POLICY, pin_to_own_cpu, quiet_gloo_loops

    pin_to_own_cpu(a.process_id)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(a.coordinator, num_processes=2, process_id=a.process_id,
                               initialization_timeout=120)
    jax.devices()
    quiet_gloo_loops(DEFAULT_LOOP_POLICY)
    import numpy as np

    from disco_estimator.costs.staged_cost import fit_staged_costs, layouts, predict_layouts
    from disco_jax import zoo
    from disco_jax.enactment.staged import staged_step
    from disco_jax.pipeline.choose import measure
    from disco_jax.pipeline.fit import in_context_costs
    from disco_jax.pipeline.profile import profile_in_context
    from disco_jax.pipeline.program import lower_program
    from disco_jax.pipeline.sync import job_sync
    from hlo_tools import plan as P
    from hlo_tools.plan.buckets import ready_order

    sync = job_sync(f"staged_layouts_{a.model}")
    me = jax.process_index() == 0
    t0 = time.perf_counter()

    def say(text: str) -> None:
        if me:
            print(f"  [{a.model} {time.perf_counter() - t0:5.0f} s] {text}", flush=True)

    step, args = zoo.get(a.model)(2, a.size)
    program = lower_program(step, args)
    measured = profile_in_context(step, args, program.module, sync=sync, iterations=3,
                                  rounds=3)
    node_s = None
    if me:
        costs, _ = in_context_costs(program.module, "gloo2", measured, progress=False)
        node_s = costs.graph_costs(program.graph).time_s
    order = ready_order(P.FusionSpace(program.graph), node_s) if me else None
    order = sync.share("order", None if order is None else [int(x) for x in order])
    cands = layouts(program.graph, order)
    say(f"profiled; {len(cands)} bucketings")
    runs, rows = {}, {}
    for name, buckets in cands.items():
        runs[name] = staged_step(step, args, buckets=buckets, module=program.module)
        parts = runs[name].parts(*args, barrier=sync.barrier)
        rows[name] = {"stage_s": list(parts.stage_s), "comm_s": list(parts.comm_s)}
        say(f"{name}: stages {sum(parts.stage_s) * 1e3:.0f} ms, "
            f"all-reduces {sum(parts.comm_s) * 1e3:.0f} ms")
    samples = measure(runs, args, rounds=a.rounds, warmup=2, tag="staged_layouts",
                      min_sample_s=0.3, sync=sync)
    if me:
        ref = rows[REFERENCE]
        for name, got in samples.items():
            rows[name]["samples_s"] = [float(x) for x in got]
            rows[name]["total_s"] = float(np.median(got))
        fit = fit_staged_costs(program.module, program.graph, cands[REFERENCE], node_s,
                               ref["stage_s"], ref["comm_s"], rows[REFERENCE]["total_s"])
        rules = {"step cost": fit, "fitted overlap": _fitted_overlap(
            program, cands[REFERENCE], fit, rows[REFERENCE]["total_s"])}
        for rule, costs in rules.items():
            for name, pred in predict_layouts(program.module, program.graph, cands,
                                              costs).items():
                rows[name].setdefault("predicted_s", {})[rule] = pred.fitted_s
        Path(a.out).write_text(json.dumps({
            "model": a.model, "size": a.size, "reference": REFERENCE, "layouts": rows,
            "fits": {rule: {k: float(v) for k, v in c._asdict().items() if k != "node_s"}
                     for rule, c in rules.items()}}, indent=1))
    jax.distributed.shutdown()


def _fitted_overlap(program, buckets, fit, total_s):
    """``fit`` with no cost per step and the overlap at which the simulated reference
    takes ``total_s`` (bisection; the bounds where even they miss it)."""
    from disco_estimator.costs.simulator import simulate
    from disco_estimator.costs.staged_cost import staged_graph
    from hlo_tools.stages import assign_stages

    costs = fit._replace(step_s=0.0)
    sim = staged_graph(program.graph, assign_stages(program.module, buckets, program.graph),
                       costs)
    lo, hi = 0.0, 1.0
    if simulate(sim, 1.0).iteration_s >= total_s:
        return costs._replace(overlap=1.0)
    if simulate(sim, 0.0).iteration_s <= total_s:
        return costs._replace(overlap=0.0)
    for _ in range(30):  # iteration time falls as phi grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulate(sim, mid).iteration_s > total_s else (lo, mid)
    return costs._replace(overlap=(lo + hi) / 2)


def _tau(x: list[float], y: list[float]) -> float:
    pairs = [(i, j) for i in range(len(x)) for j in range(i + 1, len(x))]
    sign = [((x[i] > x[j]) - (x[i] < x[j])) * ((y[i] > y[j]) - (y[i] < y[j]))
            for i, j in pairs]
    return sum(sign) / max(1, len(pairs))


def summary(result: dict) -> dict:
    """Per rule: mean and worst relative error, Kendall tau, its pick and the pick's
    measured seconds against the fastest bucketing's."""
    rows = result["layouts"]
    names = sorted(rows)
    measured = [rows[n]["total_s"] for n in names]
    out = {}
    for rule in result["fits"]:
        pred = [rows[n]["predicted_s"][rule] for n in names]
        err = [p / m - 1 for p, m in zip(pred, measured)]
        pick = names[min(range(len(names)), key=pred.__getitem__)]
        out[rule] = {"mean_abs_error": sum(map(abs, err)) / len(err),
                     "worst_error": max(err, key=abs), "tau": _tau(pred, measured),
                     "pick": pick, "pick_over_fastest": rows[pick]["total_s"] / min(measured)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="(internal) one process of the job")
    for flag in ("--model", "--size", "--coordinator", "--out"):
        w.add_argument(flag, required=True)
    w.add_argument("--process-id", type=int, required=True)
    w.add_argument("--rounds", type=int, default=7)
    n = sub.add_parser("netns", help="(internal) limit this namespace's loopback, then run")
    n.add_argument("--parent-netns", required=True)
    n.add_argument("command", nargs=argparse.REMAINDER)
    ap.add_argument("--models", default="rnnlm,transformer", help="zoo models")
    ap.add_argument("--size", default="medium", help="zoo size (default medium)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    if a.cmd == "worker":
        worker(a)
        return
    from disco_estimator.gloo import child_env, set_loopback_rate
    from disco_jax.enactment.staged import POOL_THREADS
    from disco_jax.pipeline.bench import SETUPS

    link = SETUPS["gloo2-1gbit"]
    if a.cmd == "netns":
        set_loopback_rate(link.rate, a.parent_netns, link.burst)
        command = a.command[1:] if a.command[:1] == ["--"] else a.command
        raise SystemExit(subprocess.run(command).returncode)
    from benchmarks.provenance import write_result

    me = [sys.executable, str(Path(__file__).resolve())]
    results = []
    with tempfile.TemporaryDirectory(prefix="disco_staged_layouts_") as tmp:
        for model in a.models.split(","):
            out = Path(tmp) / f"{model}.json"
            job = [*me, "job", model, a.size, str(a.rounds), str(out)]
            cmd = ["unshare", "-n", *me, "netns", "--parent-netns",
                   os.readlink("/proc/self/ns/net"), "--", *job]
            env = child_env(1, {"NPROC": str(POOL_THREADS)})
            if subprocess.run(cmd, env=env).returncode or not out.exists():
                print(f"  {model}: the job failed", flush=True)
                continue
            result = json.loads(out.read_text())
            result["summary"] = summary(result)
            results.append(result)
            write_result(a.out, {"setup": "gloo2-1gbit", "results": results})
    print(f"\n{'model':12s} {'rule':15s} {'mean |err|':>10s} {'worst':>7s} {'tau':>5s}  pick "
          "(measured / fastest)")
    for r in results:
        for rule, s in r["summary"].items():
            print(f"{r['model']:12s} {rule:15s} {s['mean_abs_error']:10.1%} "
                  f"{s['worst_error']:+7.1%} {s['tau']:5.2f}  {s['pick']} "
                  f"({s['pick_over_fastest']:.3f})")
    print(f"rows: {a.out}")


def _job(model: str, size: str, rounds: str, out: str) -> None:
    """The two processes of one model's job (inside the limited namespace)."""
    from disco_estimator.gloo import run_local_job

    me = [sys.executable, str(Path(__file__).resolve())]
    rcs = run_local_job(lambda i, coordinator: [
        *me, "worker", "--model", model, "--size", size, "--coordinator", coordinator,
        "--process-id", str(i), "--rounds", rounds, "--out", out], 2, timeout_s=1800)
    raise SystemExit(max(map(abs, rcs)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["job"]:
        _job(*sys.argv[2:6])
    else:
        main()
