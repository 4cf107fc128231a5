"""``disco simulate FILE.hlo``: simulate one iteration of an HLO module as written.

The per-device program of the module (the shard_map body of a pre-optimization module,
else ENTRY) is costed by :func:`disco_estimator.costs.lower.sim_graph_from_module` and run through
the simulator: every instruction is a kernel, ``fusion`` instructions are *predicted*
from their members (never timed as fusions), all-reduces use the hardware file's
``T = C * bytes + D``. Single ops are timed on this machine by
:mod:`disco_estimator.ops.standalone` (cached on disk; ``--no-bench`` uses only ``--profile`` and
the analytic model).

In context (``--in-context``; the default when this process's devices can run the
module and the hardware file describes this kind of setup): the module is first
compiled here from its text, with nothing fused and with one gradient bucket, run on
inputs made from its parameters and profiled
(:func:`disco_jax.pipeline.profile.profile_module_in_context`); its op times come right after
``--profile``'s, and the hardware file's AllReduce latency ``D`` and compute scale are
fitted to the two measured iterations (:func:`disco_jax.pipeline.fit.calibrate_in_context`).
XLA's compiled module is compiled again from its ops instead
(:func:`disco_jax.pipeline.profile.profile_compiled_in_context`), each instruction priced
at its traced time and the compute scale fitted to the measured iteration
(:func:`disco_jax.pipeline.fit.compiled_in_context_costs`). When it cannot (too few
devices, XLA rejects the module, another kind of setup), a one-line note on stderr says
why and the costs are built as without it; ``--no-in-context`` skips it.

This module holds the subcommand's parser (:func:`register`) and its run and report
(:func:`run`); the options it shares with the other commands that cost a module, the
reading of its input and the cost model they choose are :mod:`disco_jax.cli.options`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from disco_jax.cli import UserError
from disco_jax.cli.options import (
    add_cost_model_arguments,
    add_fused_estimator_argument,
    add_gnn_argument,
    add_in_context_argument,
    check_arguments,
    cost_model_in_context,
    fused_choice,
    fused_line,
    in_context_line,
    load_module,
)
from disco_jax.units import format_bytes, format_seconds

__all__ = ["register", "run"]

#: What ``disco simulate --help`` says (the module docstring is for developers).
HELP = """Predict one training iteration of an HLO module, as written.

Reads HLO text (jax's lowered.as_text(dialect="hlo"), or XLA's compiled module) and
prices its per-device program with the cost model: single ops timed on this machine
(cached), fusions predicted from their members, all-reduces from the hardware file's
T = C * bytes + D. When this machine can run the module, it is first profiled here and
the model is fitted to that run (a note says when it cannot): a pre-optimization module
compiled with nothing fused and with one gradient bucket; a compiled module compiled again
by XLA from its ops, each instruction then priced at its traced time. Prints the
iteration time, its computation and communication, overlap and peak memory."""

#: Examples, after the options in ``--help``.
EXAMPLES = """examples:
  disco simulate step.hlo --hardware gloo2
  disco simulate step.hlo --json --trace timeline.json   # open in ui.perfetto.dev"""

def register(subparsers: Any) -> None:
    """Adds the ``simulate`` subcommand."""
    p = subparsers.add_parser(
        "simulate", help="simulate one training iteration of an HLO module as written",
        description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE.hlo", help="HLO text (pre- or post-optimization)")
    add_cost_model_arguments(p)
    add_gnn_argument(p)
    add_fused_estimator_argument(p)
    add_in_context_argument(p)
    p.add_argument("--overlap", type=float, metavar="PHI",
                   help="override the hardware's compute/communication overlap phi in [0, 1]")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs ``disco simulate``; returns the exit code."""
    from disco_estimator.costs.lower import sim_graph_from_module
    from disco_estimator.costs.simulator import full_overlap_bound, simulate
    from hlo_tools.graph import device_graph

    check_arguments(args)
    fused_choice(args)  # a bad checkpoint or setting fails before any profiling
    module = load_module(args.file)
    try:
        graph = device_graph(module)
    except ValueError as err:
        raise UserError(f"{args.file}: {err}") from None
    costs, in_context = cost_model_in_context(module, args)
    sim = sim_graph_from_module(module, costs)
    result = simulate(sim, costs.overlap)
    summary = costs.graph_costs(graph).summary()
    report = {
        "iteration_s": result.iteration_s,
        "compute_s": result.compute_s,
        "compute_work_s": float(sim.duration_s[~sim.is_comm].sum()),
        "comm_s": result.comm_s,
        "overlap_s": result.overlap_s,
        "peak_bytes": result.peak_bytes,
        "fo_bound_s": full_overlap_bound(sim),
        "file": str(args.file),
        "computation": graph.computation.name,
        "nodes": len(sim.names),
        "comm_nodes": int(sim.is_comm.sum()),
        "time_sources": summary["sources"],
        "estimated_nodes": summary["estimated_nodes"],
        "cost_model": costs.describe(),
        "fused_estimator": fused_choice(args).to_json(),
        "in_context": in_context,
    }
    if args.trace is not None:
        from disco_estimator.costs.trace import write_trace

        write_trace(args.trace, result, sim, label=f"{Path(args.file).name} (simulated)")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_report(report, args)
    return 0


def _print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    cm = r["cost_model"]
    out = sys.stdout
    print(f"{r['file']}: {r['computation']}, {r['nodes']} nodes ({r['comm_nodes']} "
          f"communication)", file=out)
    print(f"hardware {cm['hardware']}: overlap phi = {cm['overlap']:g}, compute scale "
          f"{cm['compute_scale']:g}, AllReduce T = {cm['allreduce']['c_s_per_byte']:.3g} "
          f"s/B * bytes + {cm['allreduce']['d_s']:.3g} s", file=out)
    print(fused_line(fused_choice(args)), file=out)
    print(in_context_line(r["in_context"]), file=out)
    rows = [("iteration", format_seconds(r["iteration_s"])),
            ("compute (stream occupied)", format_seconds(r["compute_s"])),
            ("compute work (kernels)", format_seconds(r["compute_work_s"])),
            ("communication (channel busy)", format_seconds(r["comm_s"])),
            ("overlap (both busy)", format_seconds(r["overlap_s"])),
            ("full-overlap bound", format_seconds(r["fo_bound_s"])),
            ("peak memory", format_bytes(r["peak_bytes"]))]
    for label, value in rows:
        print(f"  {label:30s} {value:>12s}", file=out)
    sources = ", ".join(f"{k} {v}" for k, v in r["time_sources"].items())
    print(f"node times: {sources}; {r['estimated_nodes']} estimated", file=out)
    if args.trace:
        print(f"trace written to {args.trace}", file=out)
