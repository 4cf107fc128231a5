"""Which fused-op estimator the product uses by default: the GNN or the fallback rule.

For each held-out train step (``benchmarks/heldout_steps.py``, not zoo models) and setup,
one ``disco bench`` job (:func:`disco_jax.pipeline.bench.run_job`) profiles the step in
context, searches, compiles the final choice's candidates (the search's best plans, the
bucketed sweep, XLA's default) and measures them interleaved. The same measurements are
then priced with the fallback rule and with the GNN of each ``--checkpoints`` file as the
fused-op estimator, each fitted to the same in-context programs
(``spec["compare_fused"]``). Per job and estimator:

* **error**: the mean over the candidates of ``|predicted - measured| / measured``
  (end-to-end: a whole iteration, simulated);
* **ranking**: Kendall's tau between the predicted and the measured iteration times of
  the candidates (1: the model orders them as they ran).

A GNN becomes the default where it is no worse than the fallback rule on both, averaged
over the jobs (``decision`` in the JSON: per checkpoint, and the one chosen). Prints a
table and writes ``benchmarks/results/fused_estimator_choice.json``. Run from the repository root::

    python -m benchmarks.fused_estimator_choice [--setups inproc4,gloo2] [--checkpoints A,B]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.heldout_steps import STEPS, job_spec  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fused_estimator_choice.json"
#: The fallback rule's name in a row (the cost model's class name).
FALLBACK = "FallbackFusedEstimator"


def score(measured: dict[str, float], predicted: dict[str, float | None]) -> dict[str, Any]:
    """Mean relative error and Kendall's tau of one estimator's predictions of the
    candidates that were both measured and predicted."""
    from scipy.stats import kendalltau

    names = [n for n in measured if predicted.get(n) is not None]
    m = [measured[n] for n in names]
    p = [float(predicted[n]) for n in names]
    errors = [abs(a - b) / b for a, b in zip(p, m)]
    tau = kendalltau(p, m).statistic if len(names) >= 2 else float("nan")
    return {"n": len(names), "mean_err": statistics.fmean(errors) if errors else None,
            "tau": float(tau)}


def job_scores(row: dict[str, Any]) -> dict[str, Any]:
    """Both estimators' scores of one job's row."""
    choice = row["choice"]
    by = choice.get("predicted_by_estimator_s") or {}
    return {("fallback" if k == FALLBACK else k): score(choice["medians_s"], v)
            for k, v in by.items()}


def decide(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean error and tau of each estimator over the jobs, whether each GNN is no worse
    than the fallback rule on both, and the default: the GNN no worse with the lowest
    error, else the fallback rule."""
    done = [r["scores"] for r in rows if r.get("scores")]
    names = list(dict.fromkeys(n for s in done for n in s))
    means = {}
    for name in names:
        got = [s[name] for s in done if name in s]
        errs = [g["mean_err"] for g in got if g["mean_err"] is not None]
        taus = [g["tau"] for g in got if g["tau"] == g["tau"]]
        means[name] = {"mean_err": statistics.fmean(errs) if errs else None,
                       "tau": statistics.fmean(taus) if taus else None, "jobs": len(errs)}
    f = means.get("fallback")
    no_worse = {}
    for name in names:
        g = means[name]
        if name == "fallback" or f is None:
            continue
        ok = None not in (g["mean_err"], f["mean_err"], g["tau"], f["tau"])
        no_worse[name] = bool(ok and g["mean_err"] <= f["mean_err"] and g["tau"] >= f["tau"])
    winners = sorted((n for n, ok in no_worse.items() if ok),
                     key=lambda n: means[n]["mean_err"])
    return {"estimators": means, "no_worse_on_both": no_worse,
            "default": winners[0] if winners else "fallback"}


def main(argv: list[str] | None = None) -> int:
    from disco_estimator.gnn.checkpoint import pretrained
    from disco_jax.pipeline.bench import run_job

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--setups", default="inproc4,gloo2")
    ap.add_argument("--size", default="small")
    ap.add_argument("--checkpoints", default=str(pretrained("cpu")),
                    help="GNN checkpoints, comma-separated (default: the shipped one)")
    ap.add_argument("--top-k", type=int, default=5, help="plans in the final choice")
    ap.add_argument("--time-budget", type=float, default=20.0, help="search seconds")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    rows = []
    for setup in args.setups.split(","):
        for step in args.steps.split(","):
            spec = {**job_spec(step, args.size), "setup": setup, "hardware": setup,
                    "seed": 0,
                    "time_budget_s": args.time_budget, "top_k": args.top_k, "rounds": 3,
                    "choice_rounds": 5, "min_sample_s": 0.1, "pin_cpus": True,
                    "compare_fused": args.checkpoints.split(",")}
            print(f"== {step} in {setup}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                row = run_job(spec, 1200)
            except (RuntimeError, TimeoutError) as err:
                rows.append({"model": step, "setup": setup, "error": str(err)[:300]})
                continue
            rows.append({"model": step, "setup": setup, "scores": job_scores(row),
                         "measured_s": row["choice"]["medians_s"],
                         "predicted_by_estimator_s": row["choice"]["predicted_by_estimator_s"],
                         "calibration": row.get("calibration_refit"),
                         "wall_s": time.perf_counter() - t0})
            write_result(args.out, {"rows": rows})
    decision = decide(rows)
    write_result(args.out, {"rows": rows, "decision": decision,
                            "meta": vars(args)})
    names = list(decision["estimators"])
    print(f"{'step':12} {'setup':8} {'n':>3} " + " ".join(f"{n[:24]:>24}" for n in names))
    print(f"{'':25} " + " ".join(f"{'err / tau':>24}" for _ in names))
    for r in rows:
        if "scores" not in r:
            print(f"{r['model']:12} {r['setup']:8} error: {r['error'][:60]}")
            continue
        sc = r["scores"]
        n = sc["fallback"]["n"]
        print(f"{r['model']:12} {r['setup']:8} {n:3d} " + " ".join(
            f"{sc[k]['mean_err']:15.1%} / {sc[k]['tau']:5.2f}" for k in names))
    est = decision["estimators"]
    print(f"{'mean':12} {'':8} {'':3} " + " ".join(
        f"{est[k]['mean_err']:15.1%} / {est[k]['tau']:5.2f}" for k in names))
    print(f"no worse than the fallback rule on both: {decision['no_worse_on_both']}; "
          f"default: {decision['default']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
