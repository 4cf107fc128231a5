"""``disco demo``: the whole pipeline on a bundled train step.

Build a zoo train step on 4 host devices and run the product's pipeline on it
(:func:`disco_jax.pipeline.optimize.optimize_step`: profile it in context and fit the
cost model to that run, search plans with the simulator, enact the best few, make the
final choice by measurement among them, hand bucketing -- the ``bucketed`` baseline:
XLA's fusion plus flat gradient buckets, the 1/4/16/64 MiB/one-bucket sweep -- and XLA's
default), then measure the paper's baselines, ``bucketed`` and DisCo's choice side by
side -- predicted and measured per-iteration time (one ``disco bench`` job,
:func:`disco_jax.pipeline.bench.bench_row`, run in this process). Then the product path a user
takes: the same step wrapped in :func:`disco_jax.jit` under ``ENABLE_SEARCH=1`` (search,
choose, store) and again under ``ENABLE_SEARCH=0`` (load the stored enactment and run
it), checked against ``jax.jit``.

This module holds the subcommand's parser (:func:`register`) and its run
(:func:`run_demo`).
"""

from __future__ import annotations

import argparse
import os

__all__ = ["register", "run_demo"]

#: What ``disco demo --help`` says (the module docstring is for developers).
HELP = """Optimize a bundled train step and show what DisCo gains.

Builds a zoo train step on 4 host CPU devices, profiles it, searches plans, makes the
final choice by measurement, then measures XLA's default, the paper's other baselines,
hand bucketing (flat gradient buckets of 1-64 MiB) and DisCo's choice side by side and
prints them, predicted and measured. Then it runs the step the way a user does:
disco_jax.jit under ENABLE_SEARCH=1 (search and store) and ENABLE_SEARCH=0 (run the
stored program), checked against jax.jit."""

#: Examples, after the options in ``--help``.
EXAMPLES = """example:
  disco demo --model transformer --size small --time-budget 10"""

DEVICES = 4


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``demo`` subcommand."""
    from disco_jax.cli.options import add_fused_estimator_argument

    parser = subparsers.add_parser(
        "demo", help="optimize a bundled zoo train step and compare with XLA's default",
        description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vgg", help="zoo model (default: vgg)")
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "medium", "large"),
                        help="zoo size: layer widths and per-device batch (default: tiny)")
    parser.add_argument("--hardware", default="inproc4",
                        help="hardware profile name or path (default: inproc4)")
    parser.add_argument("--time-budget", type=float, default=20.0,
                        help="seconds: the table's search, and the product path's first "
                             "call (what it may add to jax.jit's; default: 20)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the search and the round order (default: 0)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="interleaved measurement rounds (default: 10)")
    parser.add_argument("--store", default=None,
                        help="strategy store directory (default: $DISCO_STORE, else the "
                             "user cache directory)")
    add_fused_estimator_argument(parser)
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Runs ``disco demo``; returns the exit code."""
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
    import jax

    from disco_jax import zoo
    from disco_jax.cli import UserError
    from disco_jax.cli.bench import TABLE_LEGEND, render_table
    from disco_jax.cli.options import fused_choice
    from disco_jax.pipeline.bench import bench_row

    if len(jax.devices()) < DEVICES:
        raise UserError(f"needs {DEVICES} devices; set XLA_FLAGS="
                        f"--xla_force_host_platform_device_count={DEVICES}")
    if args.model not in zoo.names():
        raise UserError(f"unknown model {args.model!r}; valid: {', '.join(zoo.names())}")
    fused = fused_choice(args)
    spec = {"model": args.model, "setup": "inproc4", "hardware": args.hardware,
            "size": args.size, "seed": args.seed, "time_budget_s": args.time_budget,
            "top_k": 3, "rounds": args.repeats, "choice_rounds": 5, "min_sample_s": 0.05,
            "gnn": fused.checkpoint, "fused_estimator": fused.to_json()}
    row = bench_row(spec)
    print()
    print(render_table([row]))
    print(TABLE_LEGEND)
    choice = row["choice"]
    meas = row["measured_s"]
    who = (f" (the {choice['disco_is']} program: measured once, as that baseline)"
           if choice["disco_is"] else "")
    print(f"\nDisCo's choice: {choice['disco']}{who}, chosen by measurement in "
          f"{spec['choice_rounds']} rounds among {len(choice['medians_s'])} programs, then "
          f"measured with the baselines above in {args.repeats} fresh rounds: "
          f"{meas['disco'] * 1e3:.2f} ms against XLA's default {meas['xla_default'] * 1e3:.2f}"
          f" ms; its outputs differ from jax.jit's by at most {row['disco_max_abs_diff']:.1e}")
    _product_path(args, choice["disco"])
    return 0


def _product_path(args: argparse.Namespace, table_choice: str) -> None:
    """``disco_jax.jit`` on the step: ``ENABLE_SEARCH=1`` (search, store), then ``0``;
    a line says so when its own search and final choice picked another program than the
    table's run (``table_choice``)."""
    import jax
    import numpy as np

    from disco_estimator.costs.fused_choice import FUSED_ESTIMATOR_ENV
    from disco_jax import zoo
    from disco_jax.jit import FLAG_ENV, jit

    step, step_args = zoo.get(args.model)(DEVICES, args.size)
    want = jax.jit(step)(*step_args)
    print(f"\nThe product path: disco_jax.jit(step) with {FLAG_ENV}=1, then {FLAG_ENV}=0")
    saved = {k: os.environ.get(k) for k in (FLAG_ENV, FUSED_ESTIMATOR_ENV)}
    if args.fused_estimator:  # the search of disco_jax.jit reads it
        os.environ[FUSED_ESTIMATOR_ENV] = args.fused_estimator
    infos = []
    try:
        for flag in ("1", "0"):
            os.environ[FLAG_ENV] = flag
            wrapped = jit(step, time_budget_s=args.time_budget, store=args.store)
            got = wrapped(*step_args)
            info = wrapped.last_run_info
            diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                       for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            measured = f", measured {info.measured_s * 1e3:.2f} ms" if info.measured_s else ""
            print(f"  {FLAG_ENV}={flag}: {info.mode} {info.choice or ''}{measured}; "
                  f"enactment {(info.hlo_fingerprint or '')[:12]}; outputs within "
                  f"{diff:.1e} of jax.jit"
                  + (f"; fell back: {info.reason}" if info.reason else ""))
            infos.append(info)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if infos[0].store_path:
        print(f"  stored in {infos[0].store_path} (disco store list)")
    if infos[0].mode == "searched" and infos[0].choice != table_choice:
        print(f"  (disco_jax.jit searched and measured again and chose {infos[0].choice}, the "
              f"table's run {table_choice}: their measurements differ by the machine's noise, "
              "and the final choice keeps the simpler program unless another wins most rounds)")
