"""Search quality: the default search against a long one, per zoo model.

For each model (4 host devices, single ops timed on this machine, hardware ``inproc4``)
the default :func:`disco_jax.pipeline.search.search` (the config's budget, at most 60 s) and a
long search (``--long-budget`` seconds, patience unlimited) with the same seed; prints the
predicted iteration time of both, the gap of the default to the long one in %, the best
start plan's time, the search seconds and stop reasons, and writes
``benchmarks/results/search_quality.json``.

    python benchmarks/search_quality.py                               # 600 s long searches
    python benchmarks/search_quality.py --models transformer,vgg --long-budget 180
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.provenance import write_result  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def measure(name: str, size: str, hardware: str, long_budget: float, seed: int) -> dict:
    import hlo_tools
    from disco_jax import zoo
    from disco_jax.costs.cost_model import CostModel
    from disco_jax.pipeline.search import load_config, search
    from hlo_tools import plan as P

    step, args = zoo.get(name)(4, size)
    module = hlo_tools.parse(hlo_tools.extract(step, *args))
    graph = hlo_tools.device_graph(module)
    costs = CostModel.for_module(module, hardware, progress=False)
    space = P.FusionSpace(graph)
    config = load_config()
    short = search(graph, costs, seed=seed, space=space, progress=False)
    long = search(graph, costs, seed=seed, space=space, progress=False,
                  time_budget_s=long_budget, patience=1 << 62)
    best_start = min(short.start_costs_s.values())
    return {
        "model": name, "size": size, "nodes": graph.num_nodes,
        "default_s": short.cost_s, "long_s": long.cost_s,
        "gap_pct": 100.0 * (short.cost_s - long.cost_s) / long.cost_s,
        "best_start": short.best_start, "best_start_s": best_start,
        "fo_bound_s": short.fo_bound_s, "long_fo_bound_s": long.fo_bound_s,
        "default_search_s": short.stats.seconds, "long_search_s": long.stats.seconds,
        "default_evaluated": short.stats.evaluated, "long_evaluated": long.stats.evaluated,
        "default_stop": short.stats.stop_reason, "long_stop": long.stats.stop_reason,
        "default_budget_s": config.time_budget_s, "long_budget_s": long_budget,
    }


def main() -> None:
    from disco_jax.zoo import MODELS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated zoo models (default: all shard_map models)")
    parser.add_argument("--size", default="small")
    parser.add_argument("--hardware", default="inproc4")
    parser.add_argument("--long-budget", type=float, default=600.0,
                        help="seconds of the long search (default: 600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "search_quality.json"))
    args = parser.parse_args()

    rows = []
    t0 = time.time()
    print(f"{'model':12} {'nodes':>6} {'best start ms':>14} {'default ms':>11} "
          f"{'long ms':>9} {'gap %':>7} {'default s':>10} {'long s':>8} {'stops':>24}",
          flush=True)
    for name in args.models.split(","):
        r = measure(name, args.size, args.hardware, args.long_budget, args.seed)
        rows.append(r)
        print(f"{name:12} {r['nodes']:>6} {r['best_start_s'] * 1e3:>14.3f} "
              f"{r['default_s'] * 1e3:>11.3f} {r['long_s'] * 1e3:>9.3f} "
              f"{r['gap_pct']:>7.2f} {r['default_search_s']:>10.1f} "
              f"{r['long_search_s']:>8.1f} {r['default_stop'] + '/' + r['long_stop']:>24}",
              flush=True)
    gaps = [r["gap_pct"] for r in rows]
    summary = {"max_gap_pct": max(gaps) if gaps else math.nan,
               "max_default_search_s": max((r["default_search_s"] for r in rows),
                                           default=math.nan)}
    print(f"max gap {summary['max_gap_pct']:.2f}%, longest default search "
          f"{summary['max_default_search_s']:.1f} s")
    out = pathlib.Path(args.out)
    write_result(out, {
        "command": "python benchmarks/search_quality.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "seconds": time.time() - t0, "summary": summary, "rows": rows}, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
