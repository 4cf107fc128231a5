"""Moves per second (legality check included) and apply_plan time on the largest zoo
model. Prints a table and writes ``benchmarks/results/moves_speed.json``.

    python benchmarks/moves_speed.py [--model transformer] [--size small] [--moves 20000]
                                     [--backend auto|python]

Each kind of move (and the mix ``random_moves`` draws, 0.6/0.15/0.25) is applied
``--moves`` times, each time to one of 201 plans along a random walk (realistic, partly
fused starting points), as a search does with its candidates. The ``walk`` row instead
applies mixed moves one after the other, each to the plan the previous one made, as
``random_plan`` does. Rates are the best of ``--repeat`` runs (other processes share this
machine; the load average is recorded with them), in wall-clock and in CPU time. The
moves run in their C kernel when it can be built (``--backend python``: the pure-Python
moves, as ``DISCO_PLAN_BACKEND=python`` selects them); the backend is recorded too.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import random
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import hlo_tools  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from disco_jax import zoo  # noqa: E402
from hlo_tools import plan as P  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def start_plans(space: P.FusionSpace, seed: int = 0) -> list[P.Plan]:
    """A pool of realistic, partly fused starting points: every 5 moves of a walk."""
    rng = random.Random(seed)
    plan = P.initial_plan(space.graph)
    plans = [plan]
    for _ in range(200):
        plan = P.random_moves(space, plan, rng, 5)
        plans.append(plan)
    return plans


def time_moves(space, move, moves: int, plans: list[P.Plan],
               seed: int = 0) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds) for ``moves`` applications of ``move``, each to one of
    ``plans``, and how many of them changed the plan."""
    rng = random.Random(seed)
    changed = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(moves):
        base = plans[k % len(plans)]
        changed += move(space, base, rng) is not base
    return time.perf_counter() - t0, time.process_time() - c0, changed


def time_walk(space, moves: int, seed: int = 0) -> tuple[float, float, int]:
    """Like :func:`time_moves` for a walk of ``moves`` mixed moves from the initial plan
    (restarted every 1000 moves, so that it does not only time a fully fused plan)."""
    rng = random.Random(seed)
    changed = 0
    t0, c0 = time.perf_counter(), time.process_time()
    plan = P.initial_plan(space.graph)
    for k in range(moves):
        if k % 1000 == 0:
            plan = P.initial_plan(space.graph)
        new = P.random_moves(space, plan, rng, 1)
        changed += new is not plan
        plan = new
    return time.perf_counter() - t0, time.process_time() - c0, changed


def _mixed(space, plan, rng):
    return P.random_moves(space, plan, rng, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--size", default="small")
    parser.add_argument("--moves", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--backend", choices=("auto", "python"), default=None,
                        help="the moves' backend (default: $DISCO_PLAN_BACKEND, else auto)")
    args = parser.parse_args()
    if args.backend:
        os.environ["DISCO_PLAN_BACKEND"] = args.backend
    backend = "c" if P.c_kernel_available() else "python"
    step, fargs = zoo.get(args.model)(4, args.size)
    module = hlo_tools.parse(hlo_tools.extract(step, *fargs))
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    plans = start_plans(space)
    cases = [(move.__name__, lambda n, s, move=move: time_moves(space, move, n, plans, s))
             for move in P.MOVES]
    cases += [("mixed (0.6/0.15/0.25)", lambda n, s: time_moves(space, _mixed, n, plans, s)),
              ("walk (mixed)", lambda n, s: time_walk(space, n, s))]
    rows = []
    for name, run in cases:
        best = None
        for seed in range(args.repeat):
            wall, cpu, changed = run(args.moves, seed)
            if best is None or wall < best[0]:
                best = (wall, cpu, changed)
        wall, cpu, changed = best
        rows.append({"move": name, "moves": args.moves, "seconds": wall, "cpu_seconds": cpu,
                     "moves_per_s": args.moves / wall, "moves_per_cpu_s": args.moves / cpu,
                     "changed": changed})
    plan = P.random_plan(module, seed=0, moves=500)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        text = hlo_tools.to_text(hlo_tools.apply_plan(module, plan, graph))
        times.append(time.perf_counter() - t0)
    apply_s = min(times)
    print(f"model {args.model}-{args.size}: {graph.num_nodes} nodes, "
          f"{len(space.allreduces)} gradient all-reduces; {backend} moves; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'move':24} {'moves':>7} {'seconds':>8} {'moves/s':>9} {'per CPU s':>9} "
          f"{'changed':>8}")
    for r in rows:
        print(f"{r['move']:24} {r['moves']:>7} {r['seconds']:>8.3f} {r['moves_per_s']:>9.0f} "
              f"{r['moves_per_cpu_s']:>9.0f} {r['changed']:>8}")
    print(f"apply_plan + to_text of a 500-move plan: {apply_s * 1e3:.1f} ms "
          f"({len(text.splitlines())} lines)")
    write_result(RESULTS / "moves_speed.json", {
        "model": f"{args.model}-{args.size}", "nodes": graph.num_nodes,
        "gradient_allreduces": len(space.allreduces), "repeat": args.repeat,
        "backend": backend,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_avg_1min": os.getloadavg()[0], "python": platform.python_version()},
        "rows": rows, "apply_plan_s": apply_s}, indent=2)


if __name__ == "__main__":
    main()
