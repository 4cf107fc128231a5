"""Simulator throughput on synthetic training-step graphs (1k, 10k, 100k nodes).

Prints a table (nodes, seconds per simulation, simulated nodes per second) for
the C kernel and the pure-Python fallback and writes
``benchmarks/results/simulator_speed.json``. Times are end-to-end
``simulate(graph)`` calls (validation, scheduling, memory and overlap included)
unless the row says ``check=False``; each is the median of repeated calls, in
wall time (throughput) and in process CPU time.

Run from the repository root: ``python benchmarks/simulator_speed.py [--max-nodes N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from disco_jax import simulator as sim

RESULTS = Path(__file__).parent / "results" / "simulator_speed.json"


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


def main() -> None:
    """Runs the benchmark and writes the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-nodes", type=int, default=100_000)
    args = parser.parse_args()
    sizes = [n for n in (1_000, 10_000, 100_000, 1_000_000) if n <= args.max_nodes]
    print(f"{'nodes':>9} {'config':<15} {'wall':>13} {'throughput':>17} {'cpu':>13}")
    rows = measure(sizes)
    record = {
        "benchmark": "simulator_speed",
        "graph": "disco_jax.simulator.synthetic_graph(n, seed=0)",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_avg_1min": os.getloadavg()[0],
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, RESULTS)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
