"""Simulator throughput on synthetic training-step graphs (1k, 10k, 100k nodes), and the
time of re-costing a plan.

Prints a table (nodes, seconds per simulation, simulated nodes per second) for
the C kernel and the pure-Python fallback and writes
``benchmarks/results/simulator_speed.json``. Times are end-to-end
``simulate(graph)`` calls (validation, scheduling, memory and overlap included)
unless the row says ``check=False``; each is the median of repeated calls, in
wall time (throughput) and in process CPU time.

Re-costing (``"recost"`` in the JSON): a plan of 30 random moves over the MLP fixture
(``tests/fixtures/shard_map_mlp.pre.hlo``) turned into its SimGraph
(:func:`disco_estimator.costs.lower.sim_graph`, per-graph costs and fused-op estimates cached, as in
the search) and simulated (:func:`disco_estimator.costs.lower.simulate_plan`), analytic op times.

Run from the repository root: ``python benchmarks/simulator_speed.py [--max-nodes N]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.provenance import write_result  # noqa: E402
from disco_estimator.costs import simulator as sim  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "simulator_speed.json"
FIXTURE = Path(__file__).parents[1] / "tests" / "fixtures" / "shard_map_mlp.pre.hlo"


def time_calls(graph: sim.SimGraph, reps: int, **kwargs: Any) -> dict[str, float]:
    """Wall (median, min) and CPU (median) seconds of ``simulate(graph, **kwargs)`` calls.

    CPU time (``time.process_time``) is reported too because this machine's two
    cores are shared: it is less disturbed by other processes than wall time.
    """
    sim.simulate(graph, **kwargs)  # warm-up (and kernel build)
    wall, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        sim.simulate(graph, **kwargs)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "median_s": statistics.median(wall),
        "min_s": min(wall),
        "cpu_median_s": statistics.median(cpu),
    }


def measure(sizes: list[int]) -> list[dict[str, Any]]:
    """One row per (size, configuration)."""
    configs: list[tuple[str, dict[str, Any], int]] = [
        ("c", {"backend": "c"}, 400_000),
        ("c check=False", {"backend": "c", "check": False}, 400_000),
        ("c overlap=0.5", {"backend": "c", "overlap": 0.5}, 400_000),
        ("python", {"backend": "python"}, 100_000),
    ]
    if not sim.c_kernel_available():
        configs = [cfg for cfg in configs if not cfg[0].startswith("c")]
    rows = []
    for n in sizes:
        graph = sim.synthetic_graph(n, seed=0)
        for name, kwargs, budget_nodes in configs:
            reps = max(3, min(200, budget_nodes // n))
            t = time_calls(graph, reps, **kwargs)
            rows.append(
                {
                    "nodes": n,
                    "edges": int(graph.pred_idx.shape[0]),
                    "comm_nodes": int(graph.is_comm.sum()),
                    "config": name,
                    "reps": reps,
                    **t,
                    "nodes_per_s": n / t["median_s"],
                }
            )
            print(
                f"{n:>9,d} {name:<15} {t['median_s'] * 1e3:10.3f} ms "
                f"{n / t['median_s'] / 1e6:8.2f} M nodes/s {t['cpu_median_s'] * 1e3:10.3f} ms"
            )
    return rows


def measure_recost(reps: int = 200) -> dict[str, Any]:
    """Seconds to turn a plan into its SimGraph with warm caches, and to simulate it."""
    import random

    import hlo_tools
    from disco_estimator.costs.cost_model import CostModel
    from disco_estimator.costs.lower import sim_graph, simulate_plan
    from hlo_tools import plan as P

    graph = hlo_tools.device_graph(hlo_tools.parse(FIXTURE.read_text()))
    costs = CostModel("inproc4")
    plan = P.random_moves(P.FusionSpace(graph), P.initial_plan(graph), random.Random(0), 30)
    row: dict[str, Any] = {"graph": str(FIXTURE.relative_to(FIXTURE.parents[2])),
                           "nodes": graph.num_nodes, "moves": 30, "reps": reps}
    for name, fn in (("sim_graph", sim_graph), ("simulate_plan", simulate_plan)):
        fn(graph, plan, costs)  # warm-up: per-graph costs, fused-op estimates
        wall = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(graph, plan, costs)
            wall.append(time.perf_counter() - t0)
        row[f"{name}_median_s"] = statistics.median(wall)
        print(f"re-costing: {name:<14} {row[f'{name}_median_s'] * 1e3:8.3f} ms "
              f"({graph.num_nodes} nodes)")
    return row


def main() -> None:
    """Runs the benchmark and writes the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-nodes", type=int, default=100_000)
    args = parser.parse_args()
    sizes = [n for n in (1_000, 10_000, 100_000, 1_000_000) if n <= args.max_nodes]
    print(f"{'nodes':>9} {'config':<15} {'wall':>13} {'throughput':>17} {'cpu':>13}")
    rows = measure(sizes)
    recost = measure_recost()
    record = {
        "benchmark": "simulator_speed",
        "graph": "disco_estimator.costs.simulator.synthetic_graph(n, seed=0)",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_avg_1min": os.getloadavg()[0],
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "rows": rows,
        "recost": recost,
    }
    write_result(RESULTS, record, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
