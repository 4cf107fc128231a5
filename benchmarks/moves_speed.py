"""Moves per second (legality check included) and apply_plan time on the largest zoo
model. Prints a table and writes ``benchmarks/results/moves_speed.json``.

    python benchmarks/moves_speed.py [--model transformer] [--size small] [--moves 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import hlo_tools  # noqa: E402
from disco_jax import zoo  # noqa: E402
from hlo_tools import plan as P  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def time_moves(space, move, moves: int, seed: int = 0) -> tuple[float, int]:
    """Seconds for ``moves`` applications of ``move`` from plans along a random walk,
    and how many of them changed the plan."""
    rng = random.Random(seed)
    plan = P.initial_plan(space.graph)
    start_plans = [plan]
    for _ in range(200):  # a pool of realistic, partly fused starting points
        plan = P.random_moves(space, plan, rng, 5)
        start_plans.append(plan)
    changed = 0
    t0 = time.perf_counter()
    for k in range(moves):
        base = start_plans[k % len(start_plans)]
        changed += move(space, base, rng) is not base
    return time.perf_counter() - t0, changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--size", default="small")
    parser.add_argument("--moves", type=int, default=20000)
    args = parser.parse_args()
    step, fargs = zoo.get(args.model)(4, args.size)
    module = hlo_tools.parse(hlo_tools.extract(step, *fargs))
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    rows = []
    for move in (P.op_fusion_move, P.duplicate_fusion_move, P.allreduce_move):
        seconds, changed = time_moves(space, move, args.moves)
        rows.append({"move": move.__name__, "moves": args.moves, "seconds": seconds,
                     "moves_per_s": args.moves / seconds, "changed": changed})
    mixed = lambda s, p, r: P.random_moves(s, p, r, 1)  # noqa: E731
    seconds, changed = time_moves(space, mixed, args.moves)
    rows.append({"move": "mixed (0.6/0.15/0.25)", "moves": args.moves, "seconds": seconds,
                 "moves_per_s": args.moves / seconds, "changed": changed})
    plan = P.random_plan(module, seed=0, moves=500)
    t0 = time.perf_counter()
    for _ in range(5):
        text = hlo_tools.to_text(hlo_tools.apply_plan(module, plan, graph))
    apply_s = (time.perf_counter() - t0) / 5
    print(f"model {args.model}-{args.size}: {graph.num_nodes} nodes, "
          f"{len(space.allreduces)} gradient all-reduces")
    print(f"{'move':24} {'moves':>7} {'seconds':>8} {'moves/s':>9} {'changed':>8}")
    for r in rows:
        print(f"{r['move']:24} {r['moves']:>7} {r['seconds']:>8.3f} {r['moves_per_s']:>9.0f} "
              f"{r['changed']:>8}")
    print(f"apply_plan + to_text of a 500-move plan: {apply_s * 1e3:.1f} ms "
          f"({len(text.splitlines())} lines)")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "moves_speed.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": f"{args.model}-{args.size}", "nodes": graph.num_nodes,
                               "rows": rows, "apply_plan_s": apply_s}, indent=2))
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
