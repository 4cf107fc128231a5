"""Random plans on every zoo model: do they compile exactly as planned and compute the
same numbers? Prints a per-model table and writes ``benchmarks/results/random_plans.json``.

    python benchmarks/random_plans.py --plans 200 --moves 200      # the slow run
    python benchmarks/random_plans.py --plans 10 --models vgg,bert
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from disco_jax.plan_check import run_isolated
from disco_jax.zoo import MODELS

RESULTS = pathlib.Path(__file__).parent / "results"


def summarize(model: str, rows: list[dict]) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    exact = [r for r in ok if r["planned_fusions"] - r.get("foldable_fusions", 0)
             <= r["compiled_fusions"] <= r["planned_fusions"]
             and r["compiled_allreduces"] == r["planned_allreduces"]]
    return {
        "model": model, "plans": len(rows),
        "compiled": sum(r["status"] in ("ok", "mismatch") for r in rows),
        "matched": len(ok), "exact_structure": len(exact),
        "crashed": sum(r["status"] == "crashed" for r in rows),
        "bitwise": sum(bool(r.get("bitwise")) for r in ok),
        "mean_planned_fusions": _mean(r.get("planned_fusions", 0) for r in rows),
        "mean_planned_allreduces": _mean(r.get("planned_allreduces", 0) for r in rows),
        "max_abs_diff": max((r.get("max_abs_diff", 0.0) for r in ok), default=0.0),
        "failures": [r for r in rows if r["status"] != "ok"][:5],
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=10, help="random plans per model")
    parser.add_argument("--moves", type=int, default=200, help="random moves per plan")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=str(RESULTS / "random_plans.json"))
    args = parser.parse_args()
    summaries, t0 = [], time.time()
    for model in args.models.split(","):
        rows = run_isolated(model, list(range(args.plans)), args.moves)
        summaries.append(summarize(model, rows))
        s = summaries[-1]
        print(f"{model:16} plans {s['plans']:4}  compiled {s['compiled']:4}  matched "
              f"{s['matched']:4}  exact {s['exact_structure']:4}  crashed {s['crashed']:3}  "
              f"fusions/plan {s['mean_planned_fusions']:6.1f}  ARs/plan "
              f"{s['mean_planned_allreduces']:5.1f}  maxdiff {s['max_abs_diff']:.1e}",
              file=sys.stderr, flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"plans_per_model": args.plans, "moves": args.moves,
                               "seconds": round(time.time() - t0, 1),
                               "models": summaries}, indent=2))
    os.replace(tmp, out)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
