"""``disco demo``: the whole pipeline on a bundled train step.

Extract the step's HLO, time its single ops on this machine, search plans with the
simulator as cost model, enact the best plan exactly, and print XLA's default and hand
bucketing (the ``bucketed`` baseline: XLA's fusion plus flat gradient buckets, one row per
distinct set of buckets of the 1/4/16/64 MiB/one-bucket sweep) against the optimized
program — predicted and measured per-iteration time.

This module holds the subcommand's parser (:func:`register`) and its run
(:func:`run_demo`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

__all__ = ["register", "run_demo"]

DEVICES = 4


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo", help="optimize a bundled zoo train step and compare with XLA's default",
        description=__doc__)
    parser.add_argument("--model", default="vgg", help="zoo model (default: vgg)")
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--hardware", default="inproc4",
                        help="hardware profile name or path (default: inproc4)")
    parser.add_argument("--time-budget", type=float, default=20.0,
                        help="search time budget in seconds (default: 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=30,
                        help="measured iterations per program (default: 30)")
    parser.set_defaults(func=run_demo)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    """Runs ``disco demo``; returns the exit code."""
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
    import jax

    import hlo_tools
    from disco_jax import zoo
    from disco_jax.cli import UserError
    from disco_jax.cost_model import CostModel
    from disco_jax.lower import sim_graph_from_module
    from disco_jax.search import search
    from disco_jax.simulator import simulate
    from hlo_tools import baselines

    if len(jax.devices()) < DEVICES:
        raise UserError(f"needs {DEVICES} devices; set XLA_FLAGS="
                        f"--xla_force_host_platform_device_count={DEVICES}")
    try:
        make = zoo.get(args.model)
    except ValueError as err:
        raise UserError(str(err)) from None
    _say(f"[1/5] building {args.model}-{args.size} on {DEVICES} devices and extracting HLO")
    step, fargs = make(DEVICES, args.size)
    module = hlo_tools.parse(hlo_tools.extract(step, *fargs))
    graph = hlo_tools.device_graph(module)
    _say(f"      {graph.num_nodes} nodes, {len(graph.gradient_allreduces)} gradient AllReduces")

    _say("[2/5] timing single ops on this machine (cached after the first run)")
    costs = CostModel.for_module(module, args.hardware, progress=True)
    default = baselines.compile_baseline(step, fargs, "xla_default")
    default_module = baselines.module_from_compiled(default)
    predicted_default = simulate(sim_graph_from_module(default_module, costs),
                                 costs.overlap).iteration_s
    bucketed = {}  # hand bucketing, one program per distinct set of buckets
    for cand in baselines.bucketed_candidates(step, fargs):
        label = "one bucket" if cand.threshold_bytes is None else \
            f"{cand.threshold_bytes >> 20} MiB"
        bucketed.setdefault(cand.buckets, (f"bucketed {label}", cand.run))

    _say(f"[3/5] searching plans ({args.time_budget:.0f} s budget)")
    result = search(graph, costs, time_budget_s=args.time_budget, seed=args.seed)
    groups = result.plan.groups()
    fusions = sum(1 for ms in groups.values() if graph.opcodes[ms[0]] != "all-reduce")
    buckets = sum(1 for ms in groups.values() if graph.opcodes[ms[0]] == "all-reduce")
    _say(f"      {result.stats.evaluated} candidates in {result.stats.seconds:.1f} s "
         f"(stopped by {result.stats.stop_reason}): {fusions} fusions, "
         f"{len(result.plan.dups)} duplicated producers, {buckets} AllReduce buckets")

    _say("[4/5] enacting the plan exactly")
    text = hlo_tools.to_text(hlo_tools.apply_plan(module, result.plan, graph))
    disco = hlo_tools.compile_hlo(step, fargs, text, exact=True)
    unfused = hlo_tools.compile_hlo(step, fargs, hlo_tools.to_text(module), exact=True)

    _say(f"[5/5] measuring ({args.repeats} interleaved iterations each)")
    programs = {"no fusion": unfused, "XLA default": default,
                **dict(bucketed.values()), "DisCo plan": disco}
    measured = _measure(programs, fargs, args.repeats)
    predicted = {"no fusion": result.start_costs_s["no_fusion"],
                 "XLA default": predicted_default, "DisCo plan": result.cost_s}
    for name, run in bucketed.values():
        module_b = baselines.module_from_compiled(run)
        predicted[name] = simulate(sim_graph_from_module(module_b, costs),
                                   costs.overlap).iteration_s
    _print_table(predicted, measured)
    _check_outputs(programs, step, fargs)
    return 0


def _measure(programs: dict, fargs: tuple, repeats: int) -> dict[str, list[float]]:
    import jax

    for run in programs.values():  # warm-up
        jax.block_until_ready(run(*fargs))
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(repeats):
        for name, run in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run(*fargs))
            times[name].append(time.perf_counter() - t0)
    return times


def _print_table(predicted: dict[str, float], measured: dict[str, list[float]]) -> None:
    base = statistics.median(measured["XLA default"])
    print(f"\n{'program':22} {'predicted ms':>13} {'measured ms':>12} {'p25-p75 ms':>15} "
          f"{'vs XLA default':>15}")
    for name, samples in measured.items():
        q = statistics.quantiles(samples, n=4)
        med = statistics.median(samples)
        print(f"{name:22} {predicted[name] * 1e3:>13.3f} {med * 1e3:>12.3f} "
              f"{q[0] * 1e3:>7.3f}-{q[2] * 1e3:<7.3f} {base / med:>14.2f}x")


def _check_outputs(programs: dict, step, fargs: tuple) -> None:
    import jax
    import numpy as np

    want = jax.tree.leaves(jax.jit(step)(*fargs))
    for name, run in programs.items():
        got = jax.tree.leaves(run(*fargs))
        worst = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(got, want))
        print(f"{name:22} max |output - jax.jit output| = {worst:.2e}")
