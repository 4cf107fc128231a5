"""Random plans on every zoo model: do they compile exactly as planned and compute the
same numbers? Prints a per-model table and writes ``benchmarks/results/random_plans.json``.

    python benchmarks/random_plans.py --plans 200 --moves 200      # the slow run
    python benchmarks/random_plans.py --plans 10 --models vgg,bert

Every finished plan is appended to a JSON-lines log (``--log``; by default next to
``--out``), and a run given the same log skips the (model, seed, moves) it already
holds: an interrupted slow run resumes where it stopped. ``--report`` runs nothing and
summarizes what the log holds so far (into ``OUT`` with ``_so_far`` added).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.provenance import write_result  # noqa: E402
from disco_jax.enactment.plan_check import run_isolated  # noqa: E402
from disco_jax.zoo import MODELS  # noqa: E402

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
        "timed_out": sum(r["status"] == "timeout" for r in rows),
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
    parser.add_argument("--log", default=None,
                        help="JSON-lines log of finished plans (default: OUT with .jsonl)")
    parser.add_argument("--report", action="store_true",
                        help="only summarize the plans the log holds; run nothing")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    log = pathlib.Path(args.log) if args.log else out.with_suffix(".jsonl")
    out.parent.mkdir(exist_ok=True)
    seen = _read_log(log, args.moves)
    summaries, t0 = [], time.time()
    with log.open("a") as sink:
        def append(row: dict) -> None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

        for model in args.models.split(","):
            rows = seen.get(model, {})
            todo = [] if args.report else [s for s in range(args.plans) if s not in rows]
            if todo:
                print(f"{model}: {len(rows)} plans in {log.name}, {len(todo)} to run",
                      file=sys.stderr, flush=True)
            for row in run_isolated(model, todo, args.moves, on_row=append):
                rows[row["seed"]] = row
            summaries.append(summarize(model, [rows[s] for s in range(args.plans)
                                               if s in rows]))
            _print(summaries[-1])
    if args.report:
        out = out.with_name(out.stem + "_so_far.json")
    write_result(out, {"plans_per_model": args.plans, "moves": args.moves,
                       "seconds_this_run": round(time.time() - t0, 1),
                       "plan_seconds": round(sum(r.get("seconds", 0.0) for m in seen.values()
                                                 for r in m.values()), 1),
                       "log": log.name, "models": summaries}, indent=2)
    print(f"wrote {out}", file=sys.stderr)


def _read_log(log: pathlib.Path, moves: int) -> dict[str, dict[int, dict]]:
    """{model: {seed: row}} of the plans with ``moves`` moves already in ``log``."""
    seen: dict[str, dict[int, dict]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if row.get("moves") == moves:
                seen.setdefault(row["model"], {})[row["seed"]] = row
    return seen


def _print(s: dict) -> None:
    print(f"{s['model']:16} plans {s['plans']:4}  compiled {s['compiled']:4}  matched "
          f"{s['matched']:4}  exact {s['exact_structure']:4}  crashed {s['crashed']:3}  "
          f"fusions/plan {s['mean_planned_fusions']:6.1f}  ARs/plan "
          f"{s['mean_planned_allreduces']:5.1f}  maxdiff {s['max_abs_diff']:.1e}",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
