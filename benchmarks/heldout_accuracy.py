"""Cost-model error on held-out train steps (not zoo models), in every shipped setup.

For each step of ``benchmarks/heldout_steps.py`` and each setup, one ``disco bench`` job
(:func:`disco_jax.pipeline.bench.run_job`: in-context profile and fit, search, final choice,
interleaved measurement) gives the measured and the predicted per-iteration time of
XLA's four baselines, hand bucketing and DisCo's choice, and of every candidate of the
final choice (the search's best plans, the bucketed sweep, XLA's default). The error of a
program is ``|predicted - measured| / measured``. The in-context fit matches three
programs exactly (no fusion and no fusion with one bucket, both with library dots; XLA's
default); the programs scored here are all others, compiled differently (XLA's fusion
without its combiner, buckets, plans; XLA's default is left out). With ``--profile
lean`` (the profile a short budget takes) the fit has no one-bucket program. Rows of the
code before 0ffdcc7, whose fit matched XLA's fusion of the one-bucket program instead of
XLA's default, leave out hand bucketing with one bucket and score XLA's default
(:func:`fitted`).

Two predictions of each program are scored: with the job's fit taken again on the fit's
programs with the samples of the final choice's rounds pooled in (``mean err``: the
model of the minute the programs were measured in) and with the search's fit of the
job's first minute (``at start``).

The floor under any cost model's error is how well a measurement repeats: XLA's
default, XLA's fusion alone and the chosen hand bucketing are each measured twice in a
job (in the final choice's rounds, then in the final interleaved measurement, a minute
or so apart). ``repeat`` is ``|second - first| / second`` for those programs, averaged
per setup next to the error.

Run from the repository root::

    python benchmarks/heldout_accuracy.py [--steps autoencoder,gru] [--setups gloo2] \
        [--profile lean]
    python benchmarks/heldout_accuracy.py --runs benchmarks/results/heldout_accuracy_a.json \
        benchmarks/results/heldout_accuracy_b.json   # several runs of the same code
    python benchmarks/heldout_accuracy.py --runs new_1.json new_2.json \
        --against old_1.json old_2.json   # beside another code's runs, taken in turn

Prints a table and writes ``benchmarks/results/heldout_accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.heldout_steps import STEPS, job_spec  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from disco_estimator.gloo import DEFAULT_LOOP_POLICY, LOOP_CHOICES  # noqa: E402
from disco_jax.pipeline.bench import SETUPS, run_job  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "heldout_accuracy.json"


def fit_program(row: dict) -> str:
    """The fused program a row's in-context fit priced exactly: ``xla_default`` (XLA's
    default, since 0ffdcc7 and in every lean profile) or ``one_bucket`` (XLA's fusion of
    the one-bucket program, which the fused-op scale was fitted to before: rows whose
    calibration has a ``fused_scale`` and no ``c_s_per_byte``, which 0ffdcc7 added)."""
    cal = row.get("calibration") or {}
    old = "fused_scale" in cal and "c_s_per_byte" not in cal and row.get("profile") != "lean"
    return "one_bucket" if old else "xla_default"


def fitted(row: dict) -> set[str]:
    """The programs of a row that its in-context fit measured itself (:func:`fit_program`),
    so that a row of either code is scored on its held-out programs only. XLA's default:
    as a candidate of the final choice, and as DisCo when it is the choice. XLA's fusion
    of the one-bucket program: hand bucketing with one bucket, as ``bucketed``, as a
    candidate and as DisCo when it is the choice."""
    choice = row["choice"]
    if fit_program(row) == "xla_default":
        names = {"xla_default"}  # the fitted program's names among the choice's
    else:
        names = {n for n, k in choice.get("bucket_counts", {}).items() if k == 1}
    columns = {"xla_default": "xla_default", "bucketed": choice.get("bucketed"),
               "disco": choice["disco"]}  # the final columns by the program each ran
    return {f"choice:{n}" for n in names} | {c for c, n in columns.items() if n in names}


def signed_errors(row: dict, key: str = "predicted_s") -> dict[str, float]:
    """``(pred - meas) / meas`` per program of a row (above 0: priced slow): the final six
    (the no-fusion baseline included: XLA's pipeline, not the fitted exact program) and
    the final choice's candidates (``choice:<name>``), less the programs the fit measured
    (:func:`fitted`). ``key``: the row's predictions to score, ``predicted_s`` (the fit
    with the final choice's samples pooled in) or ``predicted_at_start_s`` (the search's
    fit, from the job's first minute); rows without it score ``predicted_s``."""
    if key not in row:
        key = "predicted_s"
    out = {}
    for name, meas in row["measured_s"].items():
        out[name] = (row[key][name] - meas) / meas
    for name, meas in row["choice"]["medians_s"].items():
        out[f"choice:{name}"] = (row["choice"][key][name] - meas) / meas
    for name in fitted(row):
        out.pop(name, None)
    return out


def errors(row: dict, key: str = "predicted_s") -> dict[str, float]:
    """``|pred - meas| / meas`` per program of a row (:func:`signed_errors`)."""
    return {name: abs(e) for name, e in signed_errors(row, key).items()}


def repeats(row: dict) -> list[float]:
    """``|final - choice| / final`` for the programs a row measured twice: XLA's default,
    XLA's fusion alone and the chosen hand bucketing (final-choice rounds and final
    interleaved measurement of the same compiled program)."""
    choice, final = row["choice"]["medians_s"], row["measured_s"]
    pairs = [("xla_default", "xla_default"), ("op_fusion", "op_fusion"),
             (row["choice"]["bucketed"], "bucketed")]
    return [abs(choice[c] - final[f]) / final[f] for c, f in pairs if c in choice]


def summarize(rows: list[dict], setups: list[str]) -> dict[str, dict]:
    """Prints the per-step table and returns the per-setup summary."""
    summary = {}
    print(f"{'setup':14} {'step':12} {'programs':>9} {'mean err':>9} {'max err':>8} "
          f"{'at start':>9} {'repeat':>7}")
    for setup in setups:
        errs, starts, reps = [], [], []
        for row in rows:
            if row["setup"] != setup or "errors" not in row:
                continue
            e = list(row["errors"].values())
            e0 = list(row.get("errors_at_start", row["errors"]).values())
            errs += e
            starts += e0
            reps += row["repeat"]
            print(f"{setup:14} {row['model']:12} {len(e):>9} {statistics.mean(e):>8.1%} "
                  f"{max(e):>7.1%} {statistics.mean(e0):>8.1%} "
                  f"{statistics.mean(row['repeat']):>6.1%}")
        if errs:
            summary[setup] = {"programs": len(errs), "mean_rel_err": statistics.mean(errs),
                              "median_rel_err": statistics.median(errs),
                              "max_rel_err": max(errs),
                              "mean_rel_err_at_start": statistics.mean(starts),
                              "mean_repeat_diff": statistics.mean(reps)}
            print(f"{setup:14} {'ALL':12} {len(errs):>9} {statistics.mean(errs):>8.1%} "
                  f"{max(errs):>7.1%} {statistics.mean(starts):>8.1%} "
                  f"{statistics.mean(reps):>6.1%}")
    return summary


def program_key(row: dict, name: str) -> str:
    """The program a signed error of ``row`` belongs to across runs: ``<step> <program>``,
    the search's plans (``choice:plan_<i>``) as one ``choice:plan``."""
    return f"{row['model']} {'choice:plan' if name.startswith('choice:plan_') else name}"


def run_errors(run: dict, setup: str) -> list[tuple[str, float]]:
    """``(program_key, signed error)`` of every program a run scored in ``setup``
    (:func:`signed_errors`; jobs that failed are left out)."""
    return [(program_key(row, name), e) for row in run["rows"]
            if row["setup"] == setup and "error" not in row
            for name, e in signed_errors(row).items()]


def across_runs(runs: list[dict], top: int = 8) -> dict[str, dict]:
    """Several runs of the same code, per setup: each run's mean error, the mean over the
    runs (the verdict a single run is too noisy for) and the programs that hold the most
    of the error over all runs (:func:`program_key`), each with its share of the summed
    error and its signed errors.

    Args:
        runs: the JSON of each run (``rows`` as :func:`main` writes them).
        top: how many programs to list per setup.
    """
    out: dict[str, dict] = {}
    setups = list(dict.fromkeys(r["setup"] for run in runs for r in run["rows"]))
    for setup in setups:
        means, by_program = [], {}
        for run in runs:
            errs = run_errors(run, setup)
            for key, e in errs:
                by_program.setdefault(key, []).append(e)
            if errs:
                means.append(statistics.mean(abs(e) for _, e in errs))
        total = sum(abs(e) for v in by_program.values() for e in v) or 1.0
        worst = sorted(by_program.items(), key=lambda kv: -sum(map(abs, kv[1])))[:top]
        out[setup] = {"run_means": means,
                      "mean_over_runs": statistics.mean(means) if means else None,
                      "largest": [{"program": k, "share": sum(map(abs, v)) / total,
                                   "signed_errors": v} for k, v in worst]}
    return out


def _means_over(runs: list[dict], setup: str, programs: set[str]) -> list[float]:
    """Each run's mean error in ``setup`` over only ``programs``, which every run scored."""
    return [statistics.mean(abs(e) for k, e in run_errors(run, setup) if k in programs)
            for run in runs]


def against(runs: list[dict], baseline: list[dict]) -> dict[str, dict]:
    """Runs of this code beside runs of a baseline code taken in turn with them (so that
    the machine's drift between runs falls on both alike), per setup both measured.

    Each side's mean error per run and over its runs (:func:`across_runs`), then the same
    over only the programs (:func:`program_key`) that every run of both scored, so that
    a code which measures more programs (more plans, say) is not judged on more, nor on
    a program the other code's fit measured (:func:`fitted`), and per pair of runs (this
    code's i-th against the baseline's i-th) the difference of those means (above 0:
    this code is further off).
    """
    mine, theirs = across_runs(runs), across_runs(baseline)
    out: dict[str, dict] = {}
    for setup in mine:
        if setup not in theirs or None in (mine[setup]["mean_over_runs"],
                                           theirs[setup]["mean_over_runs"]):
            continue  # a setup one side did not measure, or whose every job failed
        common = set.intersection(*({k for k, _ in run_errors(run, setup)}
                                    for run in runs + baseline))
        a, b = ((_means_over(side, setup, common) if common else [])
                for side in (runs, baseline))
        out[setup] = {
            "run_means": mine[setup]["run_means"],
            "mean_over_runs": mine[setup]["mean_over_runs"],
            "baseline_run_means": theirs[setup]["run_means"],
            "baseline_mean_over_runs": theirs[setup]["mean_over_runs"],
            "common_programs": sorted(common),
            "common_run_means": a, "baseline_common_run_means": b,
            "common_mean_over_runs": statistics.mean(a) if a else None,
            "baseline_common_mean_over_runs": statistics.mean(b) if b else None,
            "paired_diffs": [x - y for x, y in zip(a, b)]}
    return out


def print_runs(summary: dict[str, dict]) -> None:
    """The table of :func:`across_runs`."""
    for setup, s in summary.items():
        runs = ", ".join(f"{m:.1%}" for m in s["run_means"])
        print(f"{setup}: mean error per run {runs}; over the {len(s['run_means'])} runs "
              f"{s['mean_over_runs']:.1%}")
        for p in s["largest"]:
            signed = " ".join(f"{e:+.0%}" for e in p["signed_errors"])
            print(f"  {p['program']:36s} {p['share']:6.1%} of the error  {signed}")


def print_against(summary: dict[str, dict]) -> None:
    """The table of :func:`against`."""
    def pct(xs: list[float]) -> str:
        return ", ".join(f"{x:.1%}" for x in xs)

    for setup, s in summary.items():
        print(f"{setup}: this code {s['mean_over_runs']:.1%} over {len(s['run_means'])} runs "
              f"({pct(s['run_means'])}); baseline {s['baseline_mean_over_runs']:.1%} over "
              f"{len(s['baseline_run_means'])} ({pct(s['baseline_run_means'])})")
        if s["common_programs"]:
            diffs = " ".join(f"{d:+.1%}" for d in s["paired_diffs"])
            print(f"  on the {len(s['common_programs'])} (step, program) both scored: this code "
                  f"{s['common_mean_over_runs']:.1%} ({pct(s['common_run_means'])}), "
                  f"baseline {s['baseline_common_mean_over_runs']:.1%} "
                  f"({pct(s['baseline_common_run_means'])}); per pair {diffs}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--size", default="small")
    ap.add_argument("--time-budget", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gnn", metavar="CHECKPOINT",
                    help="price fused ops with this GNN checkpoint (default: fallback rule)")
    ap.add_argument("--gloo-loop", choices=LOOP_CHOICES, default=DEFAULT_LOOP_POLICY,
                    help="gloo's event loops in the gloo setups (disco bench --gloo-loop; "
                         "default: %(default)s)")
    ap.add_argument("--profile", choices=("full", "lean"), default="full",
                    help="the in-context profile of every job (default: %(default)s)")
    ap.add_argument("--out", help=f"the JSON to write (default: {OUT.name} in "
                                  "benchmarks/results/; with --runs, none)")
    ap.add_argument("--reuse", metavar="JSON",
                    help="measure nothing: score the rows of an earlier run's JSON again "
                         "and write them with the summary to --out")
    ap.add_argument("--runs", nargs="+", metavar="JSON",
                    help="measure nothing: several runs' JSON of the same code, their mean "
                         "error per setup, its mean over the runs and the programs that "
                         "hold the most of it (written to --out when given)")
    ap.add_argument("--against", nargs="+", metavar="JSON",
                    help="with --runs: runs of a baseline code taken in turn with them; "
                         "both sides' mean error, also over the programs both scored, "
                         "and the difference per pair of runs")
    args = ap.parse_args(argv)
    if args.against and not args.runs:
        ap.error("--against compares with --runs: give this code's runs there")
    if args.runs:
        def read(files: list[str], flag: str) -> list[dict]:
            try:
                return [json.loads(Path(f).read_text()) for f in files]
            except (OSError, json.JSONDecodeError) as err:
                ap.error(f"{flag}: {err}")

        runs = read(args.runs, "--runs")
        if args.against:
            summary = against(runs, read(args.against, "--against"))
            print_against(summary)
        else:
            summary = across_runs(runs)
            print_runs(summary)
        if args.out:
            write_result(args.out, {"runs": args.runs, "against": args.against,
                                    "summary": summary})
            print(f"wrote {args.out}", file=sys.stderr)
        return 0
    args.out = args.out or str(OUT)
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        rows = old["rows"]
        for row in rows:
            if "error" not in row:
                row["errors"], row["repeat"] = errors(row), repeats(row)
                row["errors_at_start"] = errors(row, "predicted_at_start_s")
        setups = list(dict.fromkeys(row["setup"] for row in rows))
        write_result(args.out, {"rows": rows, "summary": summarize(rows, setups),
                                "meta": old.get("meta", vars(args))})
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    rows = []
    for setup in args.setups.split(","):
        for step in args.steps.split(","):
            spec = {**job_spec(step, args.size), "setup": setup, "hardware": setup,
                    "seed": 0,
                    "time_budget_s": args.time_budget, "top_k": 3, "rounds": args.rounds,
                    "choice_rounds": 4, "min_sample_s": 0.1, "pin_cpus": True, "gnn": args.gnn,
                    "gloo_loop": args.gloo_loop, "profile": args.profile}
            print(f"== {step} in {setup}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                row = run_job(spec, 1200)
            except (RuntimeError, TimeoutError) as err:
                rows.append({"model": step, "setup": setup, "error": str(err)[:300]})
                continue
            row["profile"] = args.profile
            row["errors"] = errors(row)
            row["errors_at_start"] = errors(row, "predicted_at_start_s")
            row["repeat"] = repeats(row)
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            write_result(args.out, {"rows": rows})
    summary = summarize(rows, args.setups.split(","))
    write_result(args.out, {"rows": rows, "summary": summary, "meta": vars(args)})
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
