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
median alone). Per file and overall: the mean of both taus, the mean absolute error per
program, and how many programs are predicted within 10%.

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


def row_ranking(row: dict[str, Any]) -> dict[str, Any] | None:
    """Tau and per-program errors of one bench row (None: nothing measured)."""
    meas, pred = row.get("measured_s"), row.get("predicted_s")
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
    return {"model": row["model"], "setup": row["setup"], "size": row.get("size"),
            "tau": kendall_tau(a, b), "tau_separated": tau_sep, "separated_pairs": pairs,
            "error": errors}


def summarize(rankings: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean tau, mean absolute error per program and the share within 10%."""
    if not rankings:
        return {"rows": 0}
    per = {p: [abs(r["error"][p]) for r in rankings if p in r["error"]] for p in PROGRAMS}
    errors = [e for v in per.values() for e in v]
    separated = [r["tau_separated"] for r in rankings if r.get("tau_separated") is not None]
    return {"rows": len(rankings),
            "mean_tau": statistics.fmean(r["tau"] for r in rankings),
            "mean_tau_separated": statistics.fmean(separated) if separated else None,
            "mean_abs_error": {p: statistics.fmean(v) for p, v in per.items() if v},
            "within_10": sum(e <= 0.10 for e in errors) / len(errors)}


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
    head = f"{'model':14} {'setup':12} {'size':7} {'tau':>6} {'sep.':>9} " + "".join(
        f"{p[:12]:>13}" for p in PROGRAMS)
    lines = [head, "-" * len(head)]
    for name, rankings in files.items():
        lines.append(name)
        for r in rankings:
            cells = "".join(f"{r['error'][p]:>+13.0%}" if p in r["error"] else f"{'':>13}"
                            for p in PROGRAMS)
            sep = _tau_cell(r.get("tau_separated"), r.get("separated_pairs"))
            lines.append(f"{r['model']:14} {r['setup']:12} {r['size'] or '':7} "
                         f"{r['tau']:>+6.2f} {sep} {cells}")
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
    sep = s.get("mean_tau_separated")
    sep_cell = f"{'-' if sep is None else f'{sep:+.2f}':>9}"
    return (f"{label:14} {'|err|, tau':12} {'':7} {s['mean_tau']:>+6.2f} {sep_cell} {cells}"
            f"   within 10%: {s['within_10']:.0%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="bench result files (JSON)")
    ap.add_argument("--run", action="store_true", help="run disco bench first")
    ap.add_argument("--models", default="vgg,resnet,transformer,rnnlm,rnnlm_unrolled,bert,reformer")
    ap.add_argument("--sizes", default="medium,large")
    ap.add_argument("--setups", default="inproc4,gloo2-1gbit")
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
        per_file[path.name] = [r for r in map(row_ranking, rows) if r is not None]
    every = [r for rs in per_file.values() for r in rs]
    total = summarize(every)
    print(render(per_file, total))
    write_result(args.out, {"files": {n: {"rows": rs, "summary": summarize(rs)}
                                      for n, rs in per_file.items()},
                            "summary": total})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
