"""``disco optimize IN.hlo -o OUT.hlo``: search the best plan of a module, write it as HLO.

The input is pre-optimization HLO text from anywhere (``lowered.as_text(dialect="hlo")``,
an XLA dump). Its per-device program (the shard_map body, else ENTRY) is searched by
:func:`disco_jax.search.search` with the simulator as cost model -- built as
``disco simulate`` builds it (hardware file; single ops timed on this machine, cached;
``--profile`` first; in context by default when this process's devices can run the
module: profiled here and the AllReduce latency and compute scale fitted to it, see
``disco simulate --help``) -- from the no-fusion plan and the bucketed baselines. The best plan
is written back with :func:`hlo_tools.apply_plan`: compile it with
``hlo_tools.compile_hlo(step, args, text, exact=True)`` to run exactly that plan.

OUT is written atomically (a temporary file in its directory, then ``os.replace``): on
any error there is no partial file, and an existing OUT is left as it was.

This module holds the subcommand's parser (:func:`register`) and its run (:func:`run`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from disco_jax.cli import UserError
from disco_jax.cli.simulate import (
    add_cost_model_arguments,
    add_in_context_argument,
    check_arguments,
    cost_model_in_context,
    in_context_line,
    load_module,
)
from hlo_tools.dirs import write_atomic

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    """Adds the ``optimize`` subcommand."""
    p = subparsers.add_parser(
        "optimize", help="search the best plan of an HLO module and write it as HLO",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="IN.hlo", help="pre-optimization HLO text")
    p.add_argument("-o", "--output", required=True, metavar="OUT.hlo",
                   help="where to write the optimized HLO (atomically)")
    p.add_argument("--time-budget", type=float, metavar="S",
                   help="search time budget in seconds (default: configs/search.toml)")
    p.add_argument("--seed", type=int, default=0, help="search seed (default: 0)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_cost_model_arguments(p)
    add_in_context_argument(p)
    p.set_defaults(func=run)


def _check_output(spec: str) -> Path:
    out = Path(spec)
    if out.is_dir():
        raise UserError(f"-o {spec}: is a directory, expected a file name")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise UserError(f"-o {spec}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"-o {spec}: directory {parent} is not writable")
    return out


def run(args: argparse.Namespace) -> int:
    """Runs ``disco optimize``; returns the exit code."""
    import hlo_tools
    from disco_jax.search import search

    check_arguments(args)
    out = _check_output(args.output)
    if args.time_budget is not None and not args.time_budget > 0:
        raise UserError(f"--time-budget must be > 0, got {args.time_budget}")
    try:
        module = load_module(args.file)
    except UserError as err:  # one line: file:line:col and the reason, not the quote
        raise UserError(str(err).splitlines()[0]) from None
    try:
        graph = hlo_tools.device_graph(module)
    except ValueError as err:
        raise UserError(f"{args.file}: {err}") from None
    costs, in_context = cost_model_in_context(module, args)
    outcome = search(graph, costs, seed=args.seed, time_budget_s=args.time_budget)
    text = hlo_tools.to_text(hlo_tools.apply_plan(module, outcome.plan, graph))
    try:
        write_atomic(out, text, mkdir=False)
    except OSError as err:
        raise UserError(f"-o {args.output}: cannot write: {err.strerror or err}") from None
    report = _report(args, graph, outcome, costs)
    report["in_context"] = in_context
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_report(report)
    return 0


def _report(args: argparse.Namespace, graph: Any, outcome: Any, costs: Any) -> dict[str, Any]:
    groups = outcome.plan.groups()
    buckets = sum(1 for ms in groups.values() if graph.opcodes[ms[0]] == "all-reduce")
    stats = outcome.stats
    return {
        "file": str(args.file),
        "output": str(args.output),
        "computation": graph.computation.name,
        "nodes": graph.num_nodes,
        "predicted_s": outcome.cost_s,
        "start_predicted_s": outcome.start_costs_s,
        "best_start": outcome.best_start,
        "fo_bound_s": outcome.fo_bound_s,
        "plan": {"fusions": len(groups) - buckets, "buckets": buckets,
                 "duplicated_producers": len(outcome.plan.dups)},
        "search": {"seed": outcome.seed, "evaluated": stats.evaluated, "pops": stats.pops,
                   "duplicates": stats.duplicates, "seconds": stats.seconds,
                   "stop_reason": stats.stop_reason, "config": outcome.config._asdict()},
        "cost_model": costs.describe(),
    }


def _fmt_ms(t: float) -> str:
    return f"{t * 1e3:10.3f} ms" if math.isfinite(t) else str(t)


def _print_report(r: dict[str, Any]) -> None:
    out = sys.stdout
    print(f"{r['file']}: {r['computation']}, {r['nodes']} nodes -> {r['output']}", file=out)
    best = r["start_predicted_s"][r["best_start"]]
    for name, t in r["start_predicted_s"].items():
        print(f"  {'start ' + name:28s} {_fmt_ms(t)}", file=out)
    print(f"  {'optimized plan':28s} {_fmt_ms(r['predicted_s'])}  "
          f"({best / r['predicted_s']:.2f}x the best start, {r['best_start']})", file=out)
    print(f"  {'full-overlap bound':28s} {_fmt_ms(r['fo_bound_s'])}", file=out)
    p, s = r["plan"], r["search"]
    print(f"plan: {p['fusions']} fusions, {p['duplicated_producers']} duplicated producers, "
          f"{p['buckets']} AllReduce buckets", file=out)
    print(in_context_line(r["in_context"]), file=out)
    print(f"search: {s['evaluated']} candidates, {s['pops']} pops in {s['seconds']:.1f} s "
          f"(seed {s['seed']}, stopped by {s['stop_reason']})", file=out)
