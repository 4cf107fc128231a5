"""One process of a 2-process gloo job running staged steps (tests/test_staged_gloo.py).

Modes:

* ``zoo``: every shard_map zoo model (tiny) as a staged step with 2 buckets, 5 steps fed
  back, beside ``jax.jit`` of the same step; writes the losses, the largest parameter
  and optimizer-state difference, and the all-reduces in launch order.
* ``fallback``: a staged enactment built through :func:`disco_jax.enactment.build` in a
  process pinned to one CPU without ``NPROC``, with ``DISCO_STAGED=0`` from the test:
  the build falls back to one program; 5 steps.
* ``budget``: ``optimize_step`` of vgg (tiny) with staged programs under a budget that
  cannot pay for the full profile: the staged programs and baselines are built first;
  the winner's 5 steps beside ``jax.jit``'s.
* ``fail``: process 1's second stage fails (an injected exception); both processes must
  raise :class:`disco_jax.enactment.staged.StagedStepError` within the bounded wait.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

from step_helpers import local, run_steps

STEPS = 5


def _run_steps(fn, args, steps=STEPS):
    return run_steps(fn, args, steps)


def _compare(got, want) -> dict:
    import jax
    import numpy as np

    rel = 0.0
    for g, w in zip(got, want):
        for a, b in zip(jax.tree.leaves(g[:2]), jax.tree.leaves(w[:2])):
            a, b = local(a), local(b)
            rel = max(rel, float(np.max(np.abs(a - b) / (1e-6 + 1e-5 * np.abs(b)))))
    return {"staged": [float(local(g[2])) for g in got],
            "jit": [float(local(w[2])) for w in want],
            "max_scaled_diff": rel}  # <= 1: within rtol 1e-5, atol 1e-6


def _zoo(args) -> dict:
    import jax

    from disco_jax import zoo
    from disco_jax.enactment.staged import staged_step

    out = {}
    for name in args.models.split(",") if args.models else zoo.MODELS:
        step, step_args = zoo.get(name)(2, "tiny")
        staged = staged_step(step, step_args, 2)
        try:
            got = _run_steps(staged, step_args)
            log = list(staged.comm_log)
        finally:
            staged.close()
        row = _compare(got, _run_steps(jax.jit(step), step_args))
        row["comm_log"] = log
        row["stages"] = len(staged.plan.stages)
        out[name] = row
    return out


def _fallback(args) -> dict:
    import jax

    from disco_jax import zoo
    from disco_jax.enactment import Enactment, build
    from disco_jax.enactment.staged import StagedStep, even_buckets, staged_plan
    from hlo_tools import device_graph, extract, parse

    step, step_args = zoo.get("transformer")(2, "tiny")
    module = parse(extract(step, *step_args))
    graph = device_graph(module)
    enactment = Enactment.of_stages("staged_2", staged_plan(module, even_buckets(graph, 2),
                                                           graph))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = build(enactment, step, step_args)
    got = _run_steps(run, step_args)
    row = _compare(got, _run_steps(jax.jit(step), step_args))
    row["is_staged"] = isinstance(run, StagedStep)
    row["warnings"] = [str(w.message) for w in caught]
    row["cpus"] = len(os.sched_getaffinity(0))
    return row


def _fail(args, sync) -> dict:
    from disco_jax import zoo
    from disco_jax.enactment.staged import StagedStepError, staged_step

    step, step_args = zoo.get("vgg")(2, "tiny")
    staged = staged_step(step, step_args, 2, comm_timeout_s=6.0)
    _run_steps(staged, step_args, 1)  # a healthy step first

    def broken(inputs):
        raise RuntimeError("injected failure of stage 1")

    if args.process_id == 1:
        staged.programs[1] = broken
    t0 = time.monotonic()
    try:
        _run_steps(staged, step_args, 1)
        error = ""
    except StagedStepError as err:
        error = str(err)
    row = {"error": error, "seconds": time.monotonic() - t0}
    sync.barrier("after_failure")  # through the coordinator, not gloo
    return row


def _budget(args, sync) -> dict:
    import jax

    from disco_jax import zoo
    from disco_jax.pipeline.optimize import optimize_step

    step, step_args = zoo.get("vgg")(2, "tiny")
    lines: list[str] = []
    opt = optimize_step(step, step_args, time_budget_s=float(args.budget), sync=sync,
                        staged=("auto",), progress=lines.append, keep_labels=False)
    try:
        row = _compare(_run_steps(opt.run, step_args), _run_steps(jax.jit(step), step_args))
    finally:
        if hasattr(opt.run, "close"):
            opt.run.close()
    rep = opt.report
    return {**row, "lines": lines, "choice": rep.choice, "measured": sorted(rep.measured_s),
            "search": rep.search, "seconds": rep.seconds, "calibration": rep.calibration}


def _wait_for_peer(peer_out: Path, timeout_s: float = 60.0) -> None:
    """Wait until process 1 has written its row, then a little longer for it to exit:
    process 1 aborts when the coordinator in process 0 goes away first."""
    deadline = time.monotonic() + timeout_s
    while not peer_out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=("zoo", "fallback", "fail", "budget"))
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--models", default="", help="zoo mode: comma-separated (default: all)")
    ap.add_argument("--budget", default="15", help="budget mode: seconds")
    args = ap.parse_args()
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[args.process_id % len(cpus)]})
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=2,
                               process_id=args.process_id, initialization_timeout=60)
    from disco_jax.pipeline.sync import job_sync

    if args.mode == "zoo":
        row = _zoo(args)
    elif args.mode == "fallback":
        row = _fallback(args)
    elif args.mode == "budget":
        row = _budget(args, job_sync("staged_budget"))
    else:
        row = _fail(args, job_sync("staged_fail"))
    Path(args.out).write_text(json.dumps(row))
    sys.stdout.flush()
    if args.mode == "fail":  # process 0's communication thread may still wait in gloo
        if args.process_id == 0:  # it hosts the coordinator: leave after process 1 has
            _wait_for_peer(Path(args.out).with_name("fail1.json"))
        os._exit(0)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
