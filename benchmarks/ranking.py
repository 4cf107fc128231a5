"""Does the cost model order the bench's programs as the measurement does?

Per row of ``disco bench`` results (one zoo model in one setup): the Kendall tau between
the predicted and the measured order of the six programs (the paper's four baselines,
hand bucketing and DisCo's choice; 1: the same order, -1: reversed) and each program's
prediction error, ``predicted / measured - 1``. Where DisCo's choice is one of the other
columns' programs (``choice.disco_is``), that program takes one place in the order:
counted twice, its pair with itself would be a tie that no prediction can order and its
pairs with the others would count twice. Beside it, tau over the pairs the
measurement separates (the rule of ``simulator_accuracy.separated_pairs``): two programs
whose interquartile ranges over the bench's rounds overlap have no measured order, so no
prediction can be right or wrong about them (a program without a spread counts as its
median alone). And the tau the measurement allows: the mean tau between the measured
medians and the medians of the same rounds resampled (a paired bootstrap over the
rounds of ``samples_s``; for rows without them, normal noise of the interquartile
range's width on each median): what a model that knew each program's true time would
score against measurements this noisy, at best. Per file and overall: the mean of the
three taus, the mean absolute error per program, and how many programs are predicted
within 10%, over all and over the programs beyond the fit's (no fusion and XLA's default
are the fit's own programs). A model measured in several files counts once, by its row in
the last of them.

``--predictions`` picks the row's predictions: ``predicted_s`` (the model fitted to the
bench's own rounds where the row has one, ``calibration_bench``), ``choice_fit`` (fitted
with the final choice's rounds pooled in) or ``start`` (the search's model). ``--restep``
prices a staged choice of an older row as the bench now does (:func:`restepped`).

The rows come from bench files (``benchmarks/results/bench*.json``, or ``--run``: the
bench is run first, one file per size and setup, as ``disco bench`` with the README's
flags; ``gloo2-1gbit`` needs root). Prints the table and writes
``benchmarks/results/ranking.json``.

    python benchmarks/ranking.py benchmarks/results/bench_large_1gbit.json
    sudo python benchmarks/ranking.py --run --sizes medium,large --setups gloo2-1gbit \\
        --models transformer,bert
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import write_result  # noqa: E402

from disco_jax.pipeline.bench import PROGRAMS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: ``disco bench``'s flags of the README's results table.
BENCH_FLAGS = ("--time-budget", "10", "--rounds", "7", "--choice-rounds", "3",
               "--min-sample-s", "0.3", "--staged", "auto")


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two equally long sequences: concordant minus discordant pairs
    over all pairs (a tie in either counts as neither)."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    return sum(_concordance(a, b, i, j) for i, j in pairs) / len(pairs) if pairs else 1.0


def _concordance(a: list[float], b: list[float], i: int, j: int) -> int:
    """+1 where ``a`` and ``b`` order items ``i`` and ``j`` alike, -1 where not, 0: a tie."""
    s = (a[i] - a[j]) * (b[i] - b[j])
    return (s > 0) - (s < 0)


def separated_tau(a: list[float], b: list[float],
                 spread: list[tuple[float, float]]) -> tuple[float | None, int]:
    """Kendall's tau of ``a`` (measured) against ``b`` (predicted) over the pairs whose
    measured ``(p25, p75)`` ranges do not overlap; also returns how many pairs those are
    (tau None: none)."""
    score = count = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        (lo_i, hi_i), (lo_j, hi_j) = spread[i], spread[j]
        if lo_i <= hi_j and lo_j <= hi_i:
            continue
        score += _concordance(a, b, i, j)
        count += 1
    return (score / count if count else None), count


#: The row's predictions by ``--predictions``.
PREDICTIONS = {"bench": "predicted_s", "choice_fit": "predicted_choice_fit_s",
               "start": "predicted_at_start_s"}
#: The programs whose measurement a fit takes as given: beyond them, a prediction is the
#: model's alone.
FIT_PROGRAMS = ("no_fusion", "xla_default")
#: Resamples of the bootstrap of the tau the measurement allows.
RESAMPLES = 400


def allowed_tau(medians: list[float], samples: list[list[float]] | None,
                quartiles: list[tuple[float, float]], seed: int = 0) -> float:
    """The mean Kendall tau between ``medians`` and the medians of resampled rounds: a
    paired bootstrap over the rounds of ``samples`` (one list per program, a round's
    samples at one index), else each median drawn from a normal of the interquartile
    range's width over sqrt(rounds) (7 rounds)."""
    rng = random.Random(seed)
    taus = []
    paired = samples is not None and len({len(s) for s in samples}) == 1 and samples[0]
    for _ in range(RESAMPLES):
        if paired:
            picks = [rng.randrange(len(samples[0])) for _ in samples[0]]
            again = [statistics.median(s[i] for i in picks) for s in samples]
        else:
            # the median of 7 samples: 1.25 sigma / sqrt(7), sigma = IQR / 1.349
            again = [rng.gauss(m, (hi - lo) / 1.349 * 1.2533 / 7 ** 0.5)
                     for m, (lo, hi) in zip(medians, quartiles)]
        taus.append(kendall_tau(medians, again))
    return statistics.fmean(taus)


def row_ranking(row: dict[str, Any], predictions: str = "bench") -> dict[str, Any] | None:
    """Tau and per-program errors of one bench row under its ``predictions``
    (:data:`PREDICTIONS`; None: nothing measured or predicted)."""
    meas, pred = row.get("measured_s"), row.get(PREDICTIONS[predictions])
    if not meas or not pred:
        return None
    names = [p for p in PROGRAMS if meas.get(p) and pred.get(p)]
    errors = {p: pred[p] / meas[p] - 1.0 for p in names}
    # DisCo's choice may be one of the other columns' programs: one program, one place
    if (row.get("choice") or {}).get("disco_is") in names:
        names = [p for p in names if p != "disco"]
    a, b = [meas[p] for p in names], [pred[p] for p in names]
    spread = row.get("spread_s") or {}
    quartiles = [(spread[p]["p25_s"], spread[p]["p75_s"]) if p in spread else (m, m)
                 for p, m in zip(names, a)]
    tau_sep, pairs = separated_tau(a, b, quartiles)
    rounds = row.get("samples_s")
    samples = [rounds[p] for p in names] if rounds and all(p in rounds for p in names) \
        else None
    return {"model": row["model"], "setup": row["setup"], "size": row.get("size"),
            "tau": kendall_tau(a, b), "tau_separated": tau_sep, "separated_pairs": pairs,
            "tau_allowed": allowed_tau(a, samples, quartiles),
            "bootstrap": samples is not None, "error": errors}


def restepped(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with a staged choice priced as ``disco bench`` now prices it, its staged
    step cost fitted again to the reference bucketing's median in the choice rounds
    (:func:`~disco_estimator.costs.staged_cost.restep`), for rows written before the bench
    did so; any other row as it is."""
    from disco_estimator.costs.staged_cost import restep

    staged, choice = row.get("staged") or {}, row.get("choice") or {}
    name, ref = choice.get("disco") or "", staged.get("reference")
    start = choice.get("predicted_at_start_s") or {}
    again = (choice.get("medians_s") or {}).get(ref)
    if ("choice_shift_s" in staged or not name.startswith("staged") or again is None
            or ref not in start or name not in start):
        return row
    shift = restep(start[ref], staged["fit"]["step_s"], again)
    out = dict(row)
    for key in ("predicted_s", "predicted_choice_fit_s"):
        if "disco" in (row.get(key) or {}):
            out[key] = {**row[key], "disco": start[name] + shift}
    return out


def summarize(rankings: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean tau, mean absolute error per program and the share within 10%."""
    if not rankings:
        return {"rows": 0}
    per = {p: [abs(r["error"][p]) for r in rankings if p in r["error"]] for p in PROGRAMS}
    errors = [e for v in per.values() for e in v]
    beyond = [e for p, v in per.items() if p not in FIT_PROGRAMS for e in v]
    separated = [r["tau_separated"] for r in rankings if r.get("tau_separated") is not None]
    allowed = [r["tau_allowed"] for r in rankings if r.get("tau_allowed") is not None]
    return {"rows": len(rankings),
            "mean_tau": statistics.fmean(r["tau"] for r in rankings),
            "mean_tau_separated": statistics.fmean(separated) if separated else None,
            "mean_tau_allowed": statistics.fmean(allowed) if allowed else None,
            "mean_abs_error": {p: statistics.fmean(v) for p, v in per.items() if v},
            "within_10": sum(e <= 0.10 for e in errors) / len(errors),
            "within_10_beyond_fit": (sum(e <= 0.10 for e in beyond) / len(beyond)
                                     if beyond else None)}


def run_bench(models: str, sizes: list[str], setups: list[str]) -> list[Path]:
    """Runs ``disco bench`` once per size and setup; returns the files it wrote."""
    files = []
    for size, setup in itertools.product(sizes, setups):
        out = RESULTS / f"bench_{size}_{setup}.json"
        cmd = [sys.executable, "-m", "disco_jax.cli", "bench", "--models", models,
               "--setups", setup, "--size", size, *BENCH_FLAGS, "--out", str(out)]
        print("$", " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)
        files.append(out)
    return files


def render(files: dict[str, list[dict[str, Any]]], total: dict[str, Any]) -> str:
    """The table: one line per row, a summary line per file and overall."""
    head = f"{'model':14} {'setup':12} {'size':7} {'tau':>6} {'sep.':>9} {'allows':>6} " \
        + "".join(f"{p[:12]:>13}" for p in PROGRAMS)
    lines = [head, "-" * len(head)]
    for name, rankings in files.items():
        lines.append(name)
        for r in rankings:
            cells = "".join(f"{r['error'][p]:>+13.0%}" if p in r["error"] else f"{'':>13}"
                            for p in PROGRAMS)
            sep = _tau_cell(r.get("tau_separated"), r.get("separated_pairs"))
            lines.append(f"{r['model']:14} {r['setup']:12} {r['size'] or '':7} "
                         f"{r['tau']:>+6.2f} {sep} {r['tau_allowed']:>+6.2f} {cells}")
        s = summarize(rankings)
        if s["rows"]:
            lines.append(_summary_line("  mean", s))
    lines.append(_summary_line("all", total))
    return "\n".join(lines)


def _tau_cell(tau: float | None, pairs: int | None) -> str:
    """Separated tau and its pair count, e.g. ``+0.80/10`` (``-`` where none)."""
    if pairs is None:
        return f"{'':>9}"
    return f"{'-' if tau is None else f'{tau:+.2f}':>5}/{pairs:<3}"


def _summary_line(label: str, s: dict[str, Any]) -> str:
    if not s["rows"]:
        return f"{label}: no measured rows"
    cells = "".join(f"{s['mean_abs_error'].get(p, float('nan')):>13.0%}" for p in PROGRAMS)
    sep, allowed, beyond = (s.get("mean_tau_separated"), s.get("mean_tau_allowed"),
                            s.get("within_10_beyond_fit"))
    sep_cell = f"{'-' if sep is None else f'{sep:+.2f}':>9}"
    allowed_cell = f"{'-' if allowed is None else f'{allowed:+.2f}':>6}"
    beyond_cell = "" if beyond is None else f" ({beyond:.0%} beyond the fit's programs)"
    return (f"{label:14} {'|err|, tau':12} {'':7} {s['mean_tau']:>+6.2f} {sep_cell} "
            f"{allowed_cell} {cells}   within 10%: {s['within_10']:.0%}{beyond_cell}")


def latest_rows(per_file: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Each model, setup and size once: its row in the last file given that has one (a
    model measured again replaces its earlier row; the files keep their order)."""
    def key(r: dict[str, Any]) -> tuple:
        return r["model"], r["setup"], r["size"]

    last = {key(r): name for name, rs in per_file.items() for r in rs}
    for name, rs in per_file.items():
        for r in rs:
            if last[key(r)] != name:
                print(f"{' '.join(map(str, key(r)))}: the row of {last[key(r)]} replaces "
                      f"{name}'s")
    return {name: [r for r in rs if last[key(r)] == name] for name, rs in per_file.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="bench result files (JSON)")
    ap.add_argument("--run", action="store_true", help="run disco bench first")
    ap.add_argument("--models", default="vgg,resnet,transformer,rnnlm,rnnlm_unrolled,bert,reformer")
    ap.add_argument("--sizes", default="medium,large")
    ap.add_argument("--setups", default="inproc4,gloo2-1gbit")
    ap.add_argument("--predictions", choices=sorted(PREDICTIONS), default="bench",
                    help="the row's predictions to rank (default: %(default)s, the model "
                         "fitted to the bench's own rounds where the row has one)")
    ap.add_argument("--restep", action="store_true",
                    help="price a staged choice of rows written before disco bench fitted "
                         "the staged step cost again to the choice rounds as it now does")
    ap.add_argument("--out", default=str(RESULTS / "ranking.json"))
    args = ap.parse_args(argv)
    paths = [Path(f) for f in args.files]
    if args.run:
        paths += run_bench(args.models, args.sizes.split(","), args.setups.split(","))
    if not paths:
        ap.error("give bench files or --run")
    per_file: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        try:
            rows = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError) as err:
            print(f"{path}: not a bench result file ({err})", file=sys.stderr)
            return 2
        if args.restep:
            rows = [restepped(row) for row in rows]
        per_file[path.name] = [r for r in (row_ranking(row, args.predictions) for row in rows)
                               if r is not None]
    per_file = latest_rows(per_file)
    every = [r for rs in per_file.values() for r in rs]
    total = summarize(every)
    print(render(per_file, total))
    write_result(args.out, {"files": {n: {"rows": rs, "summary": summarize(rs)}
                                      for n, rs in per_file.items()},
                            "summary": total, "predictions": args.predictions,
                            "restep": args.restep})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
