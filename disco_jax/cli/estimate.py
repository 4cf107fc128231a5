"""``disco estimate IN.hlo``: the predicted time of every fusion of an HLO module.

For every ``fusion`` instruction of the module's per-device program (the shard_map body
of a pre-optimization module, else ENTRY) the fused computation's ops are the members
of one fusion group, and its time is predicted from their single-op times -- from the
cost model built as ``disco simulate`` builds it (``--hardware``, ``--profile``,
single ops timed on this machine and cached, ``--no-bench``) -- by the fallback rule
(:class:`disco_estimator.interface.FallbackFusedEstimator`) and, with ``--checkpoint``, by the
GNN (:class:`disco_estimator.gnn.estimator.GnnFusedEstimator`). With ``--measure`` each fusion
is also timed standalone the way the estimator's dataset is measured
(:func:`disco_estimator.gnn.dataset.measure_groups`: one ``fusion`` in a module of its own,
XLA's fusion passes off, random inputs, median of ``--repeats`` runs); a fusion that
cannot be built that way (e.g. multi-output) gets ``measured_s`` null and its reason.
A module as extracted from jax has no fusions yet; ``disco optimize`` writes one that
has, and ``lowered.compile().as_text()`` holds XLA's own.

``--json`` prints ``{"fusions": [{"name", "predicted_s", "fallback_s", "measured_s",
...}], ...}``: ``predicted_s`` is the GNN's prediction with ``--checkpoint``, else the
fallback rule's (``"predictor"`` says which); times in seconds.

This module holds the subcommand's parser (:func:`register`), the predictions
(:func:`fusion_groups`, :func:`estimate_fusions`) and the run (:func:`run`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from disco_jax.cli import UserError
from disco_jax.cli.options import (
    add_cost_model_arguments,
    check_arguments,
    cost_model,
    load_gnn,
    load_module,
)

__all__ = ["estimate_fusions", "fusion_groups", "register", "run"]

#: What ``disco estimate --help`` says (the module docstring is for developers).
HELP = """Predict the time of every fusion of an HLO module.

For each fusion of the module's per-device program, prints the fallback rule's predicted
time and, with --checkpoint, the GNN fused-op estimator's; --measure also times each
fusion standalone. A module as jax lowers it has no fusions yet: give it one that
disco optimize wrote, or XLA's compiled module."""

#: Examples, after the options in ``--help``.
EXAMPLES = """example:
  disco estimate step.opt.hlo --checkpoint pretrained --measure --json"""


def register(subparsers: Any) -> None:
    """Adds the ``estimate`` subcommand."""
    p = subparsers.add_parser(
        "estimate", help="predict the time of every fusion of an HLO module",
        description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="IN.hlo", help="HLO text (pre- or post-optimization)")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="GNN estimator checkpoint (disco train-estimator --out); without "
                        "it only the fallback rule predicts")
    add_cost_model_arguments(p)
    p.add_argument("--measure", action="store_true",
                   help="also time every fusion standalone, as the estimator's dataset is")
    p.add_argument("--repeats", type=int, default=15, metavar="N",
                   help="timed runs per fusion with --measure (default: 15)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- predictions


def fusion_groups(module: Any, graph: Any) -> list[tuple[Any, Any, list[int]]]:
    """The ``fusion`` instructions of ``graph`` as fusion groups.

    Returns:
        ``(instruction, body graph, members)`` per fusion, in program order: the graph
        of its fused computation (:func:`hlo_tools.graph.device_graph`) and every node of
        it that is not a parameter.
    """
    from disco_estimator.gnn.dataset import fusion_groups as groups_of

    return groups_of(module, graph)


def estimate_fusions(module: Any, graph: Any, costs: Any, gnn: Any = None,
                     measure: bool = False, repeats: int = 15) -> list[dict[str, Any]]:
    """Predicted (and optionally measured) seconds of every fusion of ``graph``.

    Args:
        module: the module.
        graph: its per-device graph.
        costs: the :class:`~disco_estimator.costs.cost_model.CostModel` giving the member times.
        gnn: a :class:`~disco_estimator.gnn.estimator.GnnFusedEstimator`, or None.
        measure: also time each fusion standalone
            (:func:`disco_estimator.gnn.dataset.measure_groups`).
        repeats: timed runs per fusion when measuring.

    Returns:
        Per fusion ``{"name", "kind", "ops", "members_s" (sum of the member times),
        "fallback_s", "gnn_s" (None without ``gnn``), "predicted_s" (``gnn_s``, else
        ``fallback_s``), "measured_s" (None unless measured), "measure_error" (why it
        could not be measured, with ``measure``), "estimated" (a member time came from
        the analytic model)}``.
    """
    from disco_estimator.interface import FallbackFusedEstimator

    fallback = FallbackFusedEstimator(costs)
    groups = fusion_groups(module, graph)
    gnn_s: list[float | None] = [None] * len(groups)
    if gnn is not None and groups:
        from disco_estimator.gnn.features import subgraph_from_group

        subs = [subgraph_from_group(body, costs.node_costs(body), members)
                for _, body, members in groups]
        gnn_s = [float(t) for t in gnn.predict_subgraphs(subs)]
    measured: list[dict[str, Any]] = [{} for _ in groups]
    if measure and groups:
        from disco_estimator.gnn.dataset import measure_groups

        measured = measure_groups([(body, members, ()) for _, body, members in groups],
                                  repeats=repeats, warmup=min(3, repeats))
    rows = []
    for (instr, body, members), g, m in zip(groups, gnn_s, measured):
        gc = costs.graph_costs(body)
        fb = float(fallback.predict(body, members))
        row = {"name": instr.name, "kind": instr.attrs.get("kind", ""),
               "ops": len(members),
               "members_s": float(gc.time_s[members].sum()),
               "fallback_s": fb, "gnn_s": g, "predicted_s": fb if g is None else g,
               "measured_s": m.get("time_s"), "estimated": bool(gc.estimated[members].any())}
        if measure:
            row["measure_error"] = m.get("error")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- run


def _fmt_us(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e6:.2f} us" if math.isfinite(t) else str(t)


def _print_report(r: dict[str, Any]) -> None:
    out = sys.stdout
    rows = r["fusions"]
    gnn = f"GNN {r['checkpoint']}" if r["checkpoint"] else \
        "no --checkpoint (fallback rule only)"
    print(f"{r['file']}: {r['computation']}, {len(rows)} fusions; hardware "
          f"{r['cost_model']['hardware']}; {gnn}", file=out)
    if not rows:
        print("no fusion instructions (a module as extracted from jax has none yet)",
              file=out)
        return
    width = max(len("fusion"), *(len(x["name"]) for x in rows))
    measured = r["measured"]
    head = f"{'measured':>14s}" if measured else ""
    print(f"  {'fusion':{width}s} {'kind':8s} {'ops':>4s} {'members sum':>14s} "
          f"{'fallback':>14s} {'gnn':>14s}{head}", file=out)
    for x in rows:
        mark = " (estimated op times)" if x["estimated"] else ""
        if measured and x["measured_s"] is None:
            mark += f" (not measured: {x['measure_error']})"
        meas = f"{_fmt_us(x['measured_s']):>14s}" if measured else ""
        print(f"  {x['name']:{width}s} {x['kind']:8s} {x['ops']:>4d} "
              f"{_fmt_us(x['members_s']):>14s} {_fmt_us(x['fallback_s']):>14s} "
              f"{_fmt_us(x['gnn_s']):>14s}{meas}{mark}", file=out)
    t = r["total"]
    meas = f"{_fmt_us(t['measured_s']):>14s}" if measured else ""
    print(f"  {'total':{width}s} {'':8s} {t['ops']:>4d} {_fmt_us(t['members_s']):>14s} "
          f"{_fmt_us(t['fallback_s']):>14s} {_fmt_us(t['gnn_s']):>14s}{meas}", file=out)


def run(args: argparse.Namespace) -> int:
    """Runs ``disco estimate``; returns the exit code."""
    from hlo_tools.graph import device_graph

    check_arguments(args)
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {args.repeats}")
    try:
        module = load_module(args.file)
    except UserError as err:  # one line: file:line:col and the reason, not the quote
        raise UserError(str(err).splitlines()[0]) from None
    try:
        graph = device_graph(module)
    except ValueError as err:
        raise UserError(f"{args.file}: {err}") from None
    gnn = load_gnn(args.checkpoint, "--checkpoint") if args.checkpoint is not None else None
    costs = cost_model(module, args)
    if gnn is not None:
        gnn.bind(costs)
    rows = estimate_fusions(module, graph, costs, gnn, measure=args.measure,
                            repeats=args.repeats)
    timed = [x["measured_s"] for x in rows if x["measured_s"] is not None]
    total = {"ops": sum(x["ops"] for x in rows),
             "members_s": sum(x["members_s"] for x in rows),
             "fallback_s": sum(x["fallback_s"] for x in rows),
             "gnn_s": sum(x["gnn_s"] for x in rows) if gnn is not None else None,
             "predicted_s": sum(x["predicted_s"] for x in rows),
             "measured_s": sum(timed) if args.measure and len(timed) == len(rows) else None}
    report = {"file": str(args.file), "computation": graph.computation.name,
              "checkpoint": args.checkpoint,
              "predictor": "gnn" if gnn is not None else "fallback",
              "measured": bool(args.measure), "fusions": rows, "total": total,
              "cost_model": costs.describe()}
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_report(report)
    return 0
