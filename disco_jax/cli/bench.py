"""``disco bench``: every baseline and DisCo, measured side by side, per model and setup.

For each zoo model and each setup (``inproc4``: 4 host devices in one process;
``gloo2``: 2 gloo processes over 127.0.0.1; ``gloo2-1gbit``: the same over a private
loopback limited to 1 Gbit/s with ``tc``, needs root) one job
(:mod:`disco_jax.pipeline.bench`) profiles the step in context, searches, makes the final choice
by measurement and measures the four baselines of the paper, hand bucketing (the best of
the 1/4/16/64 MiB/one-bucket sweep) and DisCo's choice in interleaved rounds. Prints a
table like the paper's Table 1 and writes the rows to ``--out`` (JSON, rewritten
atomically after every row; ``--resume`` skips the rows it already holds) and a plot to
``--plot``.

``--predict-only --hardware NAME`` prints the predicted table for any hardware file
(e.g. ``gpu_cluster_example``) without running anything but the op timings; with
``--op-times DIR`` the ops are priced at times measured elsewhere (the
``gpu_op_times_<model>_<size>.json`` profiles ``benchmarks/gpu_check.py --profiles DIR``
writes on a GPU) instead of this machine's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TABLE_LEGEND", "register", "render_table", "run_bench", "write_plot"]

#: What ``disco bench --help`` says (the module docstring is for developers).
HELP = """Measure every baseline and DisCo side by side, per zoo model and setup.

For each model and setup (inproc4: 4 host devices in one process; gloo2: 2 gloo
processes on 127.0.0.1; gloo2-1gbit: the same over a loopback limited to 1 Gbit/s,
which needs root) one job profiles the step, searches, makes the final choice by
measurement, then measures the paper's four baselines, hand bucketing and DisCo's choice
in fresh interleaved rounds and predicts each. Prints the table and writes the rows to
--out (JSON, after every job; --resume skips rows it holds) and a plot. --predict-only
predicts the table for any hardware file, measuring nothing but op times (--op-times:
times measured on another machine, e.g. a GPU)."""

#: Examples, after the options in ``--help``.
EXAMPLES = """examples:
  disco bench --models vgg,bert --setups gloo2 --size small
  sudo disco bench --setups gloo2-1gbit --size large --staged auto
  disco bench --predict-only --hardware gpu_nvlink8 --size medium"""

DEFAULT_MODELS = ("vgg", "resnet", "transformer", "rnnlm", "bert", "reformer")
BASELINE_KEYS = ("no_fusion", "op_fusion", "allreduce_fusion", "xla_default", "bucketed")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``bench`` subcommand."""
    from disco_estimator.gloo import DEFAULT_LOOP_POLICY, LOOP_CHOICES
    from disco_jax.cli.options import add_fused_estimator_argument
    from disco_jax.pipeline.bench import SETUPS

    parser = subparsers.add_parser(
        "bench", help="measure every baseline and DisCo side by side (Table 1)",
        description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated zoo models (default: %(default)s)")
    parser.add_argument("--setups", default=",".join(SETUPS),
                        help="comma-separated setups (default: %(default)s)")
    parser.add_argument("--size", default="medium", choices=("tiny", "small", "medium", "large"),
                        help="zoo size (default: medium)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="search budget per job, seconds (default: configs/search.toml)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the search and the round order (default: 0)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="interleaved rounds of the final measurement (default: 10)")
    parser.add_argument("--choice-rounds", type=int, default=5,
                        help="interleaved rounds of the final choice (default: 5)")
    parser.add_argument("--top-k", type=int, default=3,
                        help="plans of the search in the final choice (default: 3)")
    parser.add_argument("--min-sample-s", type=float, default=0.2,
                        help="seconds of calls per sample (default: 0.2)")
    parser.add_argument("--staged", default="",
                        help="staged enactments to add to the final choice, comma-separated: "
                             "'auto' (the staged cost model's best bucketings), 'plan' (the "
                             "search's buckets), bucket counts; e.g. auto or plan,2,4")
    parser.add_argument("--chunk-bytes", type=int, default=None,
                        help="staged enactments reduce each bucket in collectives of at most "
                             "this many bytes; 0: one per bucket (default: "
                             "disco_jax.enactment.staged.CHUNK_BYTES)")
    parser.add_argument("--pool-threads", type=int, default=None,
                        help="NPROC of each pinned gloo process: XLA:CPU's pool threads "
                             "(default: disco_jax.enactment.staged.POOL_THREADS)")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin gloo processes to a CPU each")
    parser.add_argument("--gloo-loop", choices=LOOP_CHOICES, default=DEFAULT_LOOP_POLICY,
                        help="scheduling of gloo's TCP event loop in each gloo process "
                             "(disco_estimator.gloo.quiet_gloo_loops): batch never preempts the "
                             "pinned CPU's compute, idle runs only when the CPU is free (not "
                             "with --staged, whose all-reduces it starves), asis leaves it "
                             "as jaxlib starts it (default: %(default)s)")
    parser.add_argument("--out", default="bench.json", help="rows as JSON (default: %(default)s)")
    parser.add_argument("--plot", default=None, help="PNG plot (default: OUT with .png)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows OUT already holds and skip their jobs")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="bound on one job, seconds (default: 1800)")
    parser.add_argument("--predict-only", action="store_true",
                        help="predict only, for --hardware (nothing is measured)")
    parser.add_argument("--op-times", metavar="DIR",
                        help="with --predict-only: op times measured elsewhere, one "
                             "gpu_op_times_<model>_<size>.json per model (written by "
                             "benchmarks/gpu_check.py --profiles DIR)")
    parser.add_argument("--hardware", default=None,
                        help="hardware file (name or path) of --predict-only")
    add_fused_estimator_argument(parser)
    parser.set_defaults(func=run_bench)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _op_times(directory: str | None, model: str, size: str) -> str | None:
    """The op-times profile of a model in ``--op-times DIR`` (None without the option).

    Raises:
        UserError: the directory has no profile of the model.
    """
    if directory is None:
        return None
    from disco_jax.cli import UserError

    path = Path(directory) / f"gpu_op_times_{model}_{size}.json"
    if not path.is_file():
        raise UserError(f"--op-times {directory}: no {path.name} (benchmarks/gpu_check.py "
                        "--profiles DIR writes one per model and size)")
    return str(path.resolve())


def run_bench(args: argparse.Namespace) -> int:
    """Runs ``disco bench``; returns the exit code."""
    from disco_estimator.hardware import load_hardware
    from disco_jax import zoo
    from disco_jax.cli import UserError
    from disco_jax.cli.options import fused_choice
    from disco_jax.pipeline.bench import SETUPS, run_job
    from disco_jax.pipeline.search import load_config
    from hlo_tools.dirs import write_atomic

    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in zoo.names():
            raise UserError(f"unknown model {m!r}; valid: {', '.join(zoo.names())}")
    budget = args.time_budget if args.time_budget is not None else \
        load_config().time_budget_s
    if args.predict_only:
        if not args.hardware:
            raise UserError("--predict-only needs --hardware NAME|PATH")
        try:
            hw = load_hardware(args.hardware)
        except (OSError, ValueError) as err:
            raise UserError(str(err)) from None
        setups = [hw.name]
    else:
        setups = [s for s in args.setups.split(",") if s]
        for s in setups:
            if s not in SETUPS:
                raise UserError(f"unknown setup {s!r}; valid: {', '.join(SETUPS)}")
    if args.gloo_loop == "idle" and args.staged:
        raise UserError("--gloo-loop idle and --staged do not go together: a staged "
                        "enactment's all-reduces need gloo's event loop while compute runs")
    if args.pool_threads is not None and args.pool_threads < 1:
        raise UserError(f"--pool-threads must be >= 1, got {args.pool_threads}")
    if args.chunk_bytes is not None and args.chunk_bytes < 0:
        raise UserError(f"--chunk-bytes must be >= 0, got {args.chunk_bytes}")
    # the setups run on CPU; --predict-only prices ops of the hardware file's backend
    fused = fused_choice(args, str(hw.hardware.get("backend", "cpu")) if args.predict_only
                         else "cpu")
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    if args.resume and out.exists():
        try:
            rows = json.loads(out.read_text())["rows"]
        except (ValueError, KeyError) as err:
            raise UserError(f"{out}: not a disco bench file ({err})") from None
    done = {(r["model"], r["setup"], r["size"]) for r in rows}
    t0 = time.perf_counter()
    for setup in setups:
        for model in models:
            if (model, setup, args.size) in done:
                continue
            spec = {"model": model, "setup": setup, "size": args.size, "seed": args.seed,
                    "time_budget_s": budget, "top_k": args.top_k, "rounds": args.rounds,
                    "choice_rounds": args.choice_rounds, "min_sample_s": args.min_sample_s,
                    "pin_cpus": not args.no_pin, "gloo_loop": args.gloo_loop,
                    "staged": [c for c in args.staged.split(",") if c],
                    "gnn": fused.checkpoint, "fused_estimator": fused.to_json(),
                    **_staged_settings(args)}
            if args.predict_only:
                spec.update(predict_only=True, hardware=args.hardware,
                            num_devices=hw.num_devices,
                            op_times=_op_times(args.op_times, model, args.size))
            else:
                spec["hardware"] = setup
            _say(f"== {model} ({args.size}) in {setup} "
                 f"[{time.perf_counter() - t0:.0f} s so far]")
            row = None
            for attempt in (1, 2):  # XLA:CPU's in-process rendezvous can abort a job
                try:
                    row = run_job(spec, args.timeout)
                    break
                except (RuntimeError, TimeoutError) as err:
                    _say(f"   {model} in {setup} failed (attempt {attempt}): {err}")
                    row = {"model": model, "setup": setup, "size": args.size,
                           "error": str(err)[:500]}
            rows.append(row)
            write_atomic(out, json.dumps(_document(rows, args, budget), indent=1))
    print(render_table(rows))
    print(TABLE_LEGEND)
    if not args.predict_only:
        plot = Path(args.plot) if args.plot else out.with_suffix(".png")
        if write_plot(rows, plot):
            _say(f"plot: {plot}")
    _say(f"rows: {out}")
    return 0


def _document(rows: Sequence[Mapping[str, Any]], args: argparse.Namespace,
              budget: float) -> dict[str, Any]:
    import platform
    import subprocess

    import jax

    commit = None  # git HEAD when the package runs from a git checkout
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                                    capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    return {"rows": list(rows),
            "meta": {"command": "disco " + " ".join(sys.argv[2:]) if len(sys.argv) > 1
                     else "disco bench", "size": args.size, "time_budget_s": budget,
                     "rounds": args.rounds, "choice_rounds": args.choice_rounds,
                     "top_k": args.top_k, "pin_cpus": not args.no_pin,
                     "gloo_loop": args.gloo_loop,
                     **_staged_settings(args), "jax_version": jax.__version__,
                     "machine": platform.platform(), "commit": commit,
                     "written": time.strftime("%Y-%m-%dT%H:%M:%S")}}


def _staged_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The staged enactments' pool threads and chunk bytes of a run (None: one
    collective per bucket)."""
    from disco_jax.enactment.staged import CHUNK_BYTES, POOL_THREADS

    chunk = CHUNK_BYTES if args.chunk_bytes is None else (args.chunk_bytes or None)
    return {"pool_threads": args.pool_threads or POOL_THREADS, "chunk_bytes": chunk}


def _gains(row: Mapping[str, Any]) -> dict[str, float | None]:
    """Speed-ups of a row: DisCo (measured) and FO (predicted) over the best baseline,
    and DisCo's share of the gain the bound shows.

    The share is DisCo's gain over the best baseline (measured; predicted in a
    predict-only row) as a part of FO's predicted gain over the predicted best baseline:
    ``(DisCo/best - 1) / (FO/best - 1)`` within ``[0, 1]``: 0 when DisCo gains nothing,
    1 when it gains at least what the bound shows (a measured gain can pass a predicted
    bound), None when the bound shows no gain. Both gains are relative to their own
    best baseline, so a prediction that is off in absolute terms does not turn the share
    negative."""
    pred = row["predicted_s"]
    # on GPU also XLA's combiner at the best swept threshold (predict-only rows)
    best_pred = min(pred[k] for k in (*BASELINE_KEYS, "xla_combine_best")
                    if pred.get(k) is not None)
    out: dict[str, float | None] = {
        "fo_speedup": best_pred / pred["fo"] if pred.get("fo") else None,
        "share": None, "disco_speedup": None, "best_baseline": None}
    meas = row.get("measured_s")
    if meas:
        best = min(BASELINE_KEYS, key=meas.__getitem__)
        out["disco_speedup"] = meas[best] / meas["disco"]
        out["best_baseline"] = best
    gain = (out["disco_speedup"] if meas else
            best_pred / pred["disco"] if pred.get("disco") else None)
    if gain is not None and out["fo_speedup"] is not None and out["fo_speedup"] > 1.0:
        out["share"] = min(max(gain - 1.0, 0.0) / (out["fo_speedup"] - 1.0), 1.0)
    return out


#: What the columns of :func:`render_table` mean, printed under it.
TABLE_LEGEND = """\
ms per iteration. meas: medians of interleaved rounds; pred: the cost model's prediction.
  no_fusion, op_fusion, allreduce_fusion, xla_default: XLA with neither its op fusion nor
    its AllReduce combiner, only the one, only the other, or both (the paper's baselines)
  bucketed: XLA's op fusion + hand bucketing (flat gradient buckets; the best size)
  disco: DisCo's choice; fo: that choice's full-overlap bound (all communication hidden)
  DisCo/best: measured speed-up over the fastest baseline; FO/best: the bound's
    predicted speed-up; share: the part of that gain DisCo reaches (measured, at most
    100%: a measured gain past the predicted bound counts as all of it);
    search s: seconds of the search"""


def render_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a text table (milliseconds; ``pred`` rows are predictions; the columns
    are explained by :data:`TABLE_LEGEND`)."""
    keys = (*BASELINE_KEYS, "disco", "fo")
    widths = [max(10, len(k) + 1) for k in keys]
    head = (f"{'model':14} {'setup':16} {'':5}" + "".join(f"{k:>{w}}" for k, w in
                                                          zip(keys, widths))
            + f"{'DisCo/best':>11} {'FO/best':>8} {'share':>6} {'search s':>9}")
    lines = [head, "-" * len(head)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['model']:14} {row['setup']:16} failed: {row['error'][:60]}")
            continue
        g = _gains(row)
        for kind in ("meas", "pred"):
            vals = row.get("measured_s" if kind == "meas" else "predicted_s")
            if not vals:
                continue
            cells = "".join(f"{vals[k] * 1e3:>{w}.2f}" if vals.get(k) is not None
                            else f"{'':>{w}}" for k, w in zip(keys, widths))
            if kind == "meas":
                tail = (f"{g['disco_speedup']:>10.2f}x {'':>8} {'':>6} "
                        f"{row.get('search_s', 0):>9.1f}")
                label = (row["model"], row["setup"])
            else:
                fo = f"{g['fo_speedup']:.2f}x" if g["fo_speedup"] else ""
                share = f"{g['share']:.0%}" if g["share"] is not None else ""
                tail = f"{'':>11} {fo:>8} {share:>6}"
                if "measured_s" not in row:
                    tail += f" {row.get('search_s', 0):>9.1f}"
                label = ("", "") if "measured_s" in row else (row["model"], row["setup"])
            lines.append(f"{label[0]:14} {label[1]:16} {kind:5}{cells}{tail}")
    return "\n".join(lines)


def write_plot(rows: Sequence[Mapping[str, Any]], path: Path) -> bool:
    """A bar chart of the measured times relative to XLA's default, one group per row
    (matplotlib, no display needed); False when there is nothing measured."""
    measured = [r for r in rows if r.get("measured_s")]
    if not measured:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hlo_tools.dirs import write_atomic

    keys = (*BASELINE_KEYS, "disco")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(measured)), 4.0))
    width = 0.8 / len(keys)
    for j, key in enumerate(keys):
        xs = [i + (j - len(keys) / 2 + 0.5) * width for i in range(len(measured))]
        ys = [r["measured_s"]["xla_default"] / r["measured_s"][key] for r in measured]
        ax.bar(xs, ys, width, label=key)
    ax.set_xticks(range(len(measured)))
    ax.set_xticklabels([f"{r['model']}\n{r['setup']}" for r in measured], fontsize=7)
    ax.set_ylabel("speed-up over XLA's default (measured)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
    return True
