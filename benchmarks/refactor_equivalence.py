"""Behaviour unchanged, shown side by side: a refactored tree against an earlier commit.

    python benchmarks/refactor_equivalence.py --before 5378de7 [--seeds 200] [--moves 200]
                                              [--repeats 7] [--size tiny]

Both trees run the same child (``benchmarks/equivalence_worker.py``) on the same inputs,
made once here: the pre- and post-optimization HLO of every zoo model and the golden
fixtures. Compared:

* plans: the plan key (schedule order, groups, duplicated producers) of ``--seeds``
  random walks of ``--moves`` mixed moves per model;
* the simulator: ``iteration_s`` (bit-identical, as ``repr``) of XLA's plan and of 10
  of those plans under a fixed cost model (analytic op times, ``inproc4``), and the
  text ``apply_plan`` prints for those 10 plans;
* the parser and printer: the printed text of every fixture;
* throughput: parse (instructions per CPU second), mixed moves and the simulator (nodes
  per CPU second), one sample per tree in turn, ``--repeats`` times; best of each.

Prints a table and writes ``benchmarks/results/refactor_equivalence.json``. The earlier
commit is checked out with ``git worktree`` into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.provenance import write_result  # noqa: E402

WORKER = Path(__file__).with_name("equivalence_worker.py")
OUT = ROOT / "benchmarks" / "results" / "refactor_equivalence.json"

_MAKE_INPUTS = """
import os, sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
from pathlib import Path
import jax
from disco_jax import zoo
out, size = Path(sys.argv[1]), sys.argv[2]
for name in zoo.MODELS:
    step, args = zoo.get(name)(4, size)
    lowered = jax.jit(step).lower(*args)
    (out / f"{name}.pre.hlo").write_text(lowered.as_text(dialect="hlo"))
    (out / f"{name}.post.hlo").write_text(lowered.compile().as_text())
"""


def _run(tree: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, str(WORKER), *args], cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"worker failed in {tree}:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def _compare(before: dict, after: dict) -> dict:
    fixtures = sorted(set(before["fixtures"]) | set(after["fixtures"]))
    rows = {"fixtures": {"total": len(fixtures),
                         "same": sum(before["fixtures"].get(f) == after["fixtures"].get(f)
                                     for f in fixtures)},
            "models": {}}
    for name, b in before["models"].items():
        a = after["models"][name]
        diff = [s for s, (x, y) in enumerate(zip(b["plan_keys"], a["plan_keys"])) if x != y]
        rows["models"][name] = {
            "nodes": b["nodes"], "plans": len(b["plan_keys"]),
            "same_plans": len(b["plan_keys"]) - len(diff), "differing_seeds": diff,
            "sims": len(b["sim_iteration_s"]),
            "same_sims": sum(x == y for x, y in zip(b["sim_iteration_s"],
                                                      a["sim_iteration_s"])),
            "same_xla_sim": b["xla_iteration_s"] == a["xla_iteration_s"],
            "same_texts": sum(x == y for x, y in zip(b["rewritten_text"],
                                                       a["rewritten_text"]))}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision of the earlier tree")
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--moves", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="disco-equivalence-"))
    before_tree = work / "before"
    try:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach",
                        str(before_tree), args.before], check=True, capture_output=True)
        inputs = work / "inputs"
        (inputs / "models").mkdir(parents=True)
        shutil.copytree(ROOT / "tests" / "fixtures", inputs / "fixtures",
                        ignore=shutil.ignore_patterns("*.py", "snippets"))
        print(f"lowering and compiling the zoo ({args.size}) ...", flush=True)
        subprocess.run([sys.executable, "-c", _MAKE_INPUTS, str(inputs / "models"),
                        args.size], check=True, cwd=ROOT)
        common = [str(inputs), "--seeds", str(args.seeds), "--moves", str(args.moves)]
        print("decisions: before ...", flush=True)
        before = _run(before_tree, "decisions", *common)
        print("decisions: after ...", flush=True)
        after = _run(ROOT, "decisions", *common)
        speeds: dict[str, list[dict]] = {"before": [], "after": []}
        for k in range(args.repeats):
            print(f"throughput sample {k + 1}/{args.repeats} ...", flush=True)
            speeds["before"].append(_run(before_tree, "speed", str(inputs)))
            speeds["after"].append(_run(ROOT, "speed", str(inputs)))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(before_tree)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)

    rows = _compare(before, after)
    best = {side: {key: max(s[key] for s in samples) for key in samples[0]}
            for side, samples in speeds.items()}
    f = rows["fixtures"]
    print(f"\nfixtures printed identically: {f['same']}/{f['total']}")
    print(f"{'model':16} {'nodes':>6} {'same plans':>11} {'same sims':>10} {'xla sim':>8} "
          f"{'same text':>10}")
    for name, r in rows["models"].items():
        print(f"{name:16} {r['nodes']:>6} {r['same_plans']:>5}/{r['plans']:<5} "
              f"{r['same_sims']:>4}/{r['sims']:<5} {str(r['same_xla_sim']):>8} "
              f"{r['same_texts']:>4}/{r['sims']:<5}")
        if r["differing_seeds"]:
            print(f"{'':16} differing seeds: {r['differing_seeds']}")
    print(f"\n{'throughput (best of ' + str(args.repeats) + ')':32} {'before':>12} "
          f"{'after':>12} {'after/before':>13}")
    for key in best["before"]:
        b, a = best["before"][key], best["after"][key]
        print(f"{key:32} {b:>12.0f} {a:>12.0f} {a / b:>13.3f}")
    write_result(args.out, {"before": args.before, "seeds": args.seeds,
                            "moves": args.moves, "size": args.size,
                            "repeats": args.repeats, "comparison": rows,
                            "throughput_best": best, "throughput_samples": speeds}, indent=2)


if __name__ == "__main__":
    main()
