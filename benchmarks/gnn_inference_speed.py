"""Throughput of the GNN fused-op estimator's batched inference (predictions per second).

The estimator (:class:`disco_estimator.gnn.estimator.GnnFusedEstimator`) predicts a batch of
fused subgraphs by keying each by its canonical form, encoding the uncached ones at once
(:func:`disco_estimator.gnn.features.encode_batch`), and running one jitted forward pass per
chunk of 511, padded to a static bucket. Measured here, in wall and process CPU time:

* **cold**: ``--n`` distinct subgraphs (empty cache) in one ``predict_subgraphs`` call,
  after a warm-up call on other subgraphs has compiled the buckets (the compilation,
  once per bucket per process, is reported apart as ``first_call_s``);
* **cached**: the same subgraphs again (every prediction a cache hit);
* **protocol**: ``predict_batch(graph, groups)`` -- what the cost model calls during
  the search -- on the fusion groups of random plans of the MLP fixture
  (``tests/fixtures/shard_map_mlp.pre.hlo``, analytic member times), cold and cached;
  this adds building each group's subgraph.

The subgraphs are the samples of the fused-op dataset (``--dataset``, default: this
backend's file in the cache) or, without one, the fixture's groups; each is repeated
with its member times scaled by random factors so that all ``--n`` are distinct. The
model is the checkpoint ``--checkpoint`` or a fresh one of the default sizes (the same
cost: weights do not change the arithmetic). The target of the issue is 10,000
predictions per second.

Prints a table and writes ``benchmarks/results/gnn_inference_speed.json`` atomically.
Run from the repository root: ``python -m benchmarks.gnn_inference_speed``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.provenance import write_result  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "gnn_inference_speed.json"
FIXTURE = Path(__file__).parents[1] / "tests" / "fixtures" / "shard_map_mlp.pre.hlo"
TARGET_PER_S = 10_000


def _fixture_groups() -> tuple[Any, Any, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The MLP fixture's graph, analytic cost model and random plans' groups."""
    import hlo_tools
    from disco_estimator.costs.cost_model import CostModel
    from disco_estimator.gnn.dataset import plan_groups

    graph = hlo_tools.device_graph(hlo_tools.parse(FIXTURE.read_text()))
    costs = CostModel("inproc4")
    groups = plan_groups(graph, 0, plans=64, moves=80)
    return graph, costs, groups


def base_subgraphs(dataset: str | None) -> tuple[list[Any], str]:
    """Subgraphs to scale: the dataset's, else the fixture's groups; and where from."""
    from disco_estimator.gnn.dataset import dataset_path, load_samples
    from disco_estimator.gnn.features import subgraph_from_group
    from disco_estimator.ops import backend_fingerprint

    path = Path(dataset) if dataset else dataset_path(backend_fingerprint())
    samples = load_samples(path)
    if samples:
        return [s.subgraph for s in samples], f"{len(samples)} dataset samples ({path})"
    graph, costs, groups = _fixture_groups()
    nodes = costs.node_costs(graph)
    return ([subgraph_from_group(graph, nodes, m, c) for m, c in groups],
            f"{len(groups)} groups of the MLP fixture")


def distinct(subs: list[Any], n: int, seed: int) -> list[Any]:
    """``n`` subgraphs cycling over ``subs``, member times scaled by random factors in
    [0.5, 2) (distinct canonical keys)."""
    rng = np.random.default_rng(seed)
    return [subs[k % len(subs)]._replace(
        time_s=subs[k % len(subs)].time_s * rng.uniform(0.5, 2.0, subs[k % len(subs)].num_nodes))
        for k in range(n)]


def _timed(fn: Any, *args: Any) -> tuple[float, float]:
    """Wall and process CPU seconds of ``fn(*args)``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0


def measure(n: int, reps: int, dataset: str | None, checkpoint: str | None, seed: int
            ) -> dict[str, Any]:
    """The measurements (see the module docstring)."""
    import jax

    from disco_estimator.gnn.estimator import GnnFusedEstimator
    from disco_estimator.gnn.model import GnnConfig, init_params
    from disco_estimator.gnn.train import make_batch

    base, origin = base_subgraphs(dataset)
    if checkpoint:
        make = lambda: GnnFusedEstimator.from_checkpoint(checkpoint)  # noqa: E731
        model = checkpoint
    else:
        config = GnnConfig()
        params = init_params(config, make_batch(base[:8])[0], seed)
        make = lambda: GnnFusedEstimator(params, config)  # noqa: E731
        model = f"fresh {config}"
    sizes = [s.num_nodes for s in base]
    warm = distinct(base, n, seed + 1)
    est = make()
    first_s, _ = _timed(est.predict_subgraphs, warm)
    cold, cached = [], []
    for r in range(reps):
        subs = distinct(base, n, seed + 10 + r)
        est.cache.clear()
        cold.append(_timed(est.predict_subgraphs, subs))
        cached.append(_timed(est.predict_subgraphs, subs))
    # The protocol path on the fixture graph.
    graph, costs, groups = _fixture_groups()
    proto = make().bind(costs)
    proto.predict_batch(graph, groups)  # compile its buckets
    reps_groups = groups * max(1, n // max(len(groups), 1))
    p_cold, p_cached = [], []
    for _ in range(reps):
        proto.cache.clear()
        p_cold.append(_timed(proto.predict_batch, graph, reps_groups))
        p_cached.append(_timed(proto.predict_batch, graph, reps_groups))

    def rate(runs: list[tuple[float, float]], count: int) -> dict[str, float]:
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        return {"count": count, "median_wall_s": wall, "median_cpu_s": cpu,
                "per_s": count / wall, "per_cpu_s": count / cpu if cpu > 0 else float("nan")}

    return {
        "subgraphs": origin,
        "nodes_per_subgraph": {"mean": float(np.mean(sizes)), "max": int(np.max(sizes))},
        "model": model,
        "n": n, "reps": reps, "chunk": est.chunk,
        "first_call_s": first_s,
        "cold": rate(cold, n),
        "cached": rate(cached, n),
        "protocol_distinct_groups": len(groups),
        "protocol_cold": {**rate(p_cold, len(reps_groups)),
                          "note": f"{len(groups)} distinct groups (the rest repeat them: "
                                  "cache hits after the first of each)"},
        "protocol_cached": rate(p_cached, len(reps_groups)),
        "target_per_s": TARGET_PER_S,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "jax": jax.__version__, "backend": jax.default_backend()},
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20_000, help="distinct subgraphs per run")
    p.add_argument("--reps", type=int, default=3, help="runs (median kept)")
    p.add_argument("--dataset", help="dataset file (default: this backend's in the cache)")
    p.add_argument("--checkpoint", help="GNN checkpoint (default: fresh default sizes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS), help="JSON output (default: %(default)s)")
    args = p.parse_args(argv)
    if args.n < 1 or args.reps < 1:
        p.error("--n and --reps must be >= 1")

    random.seed(args.seed)
    r = measure(args.n, args.reps, args.dataset, args.checkpoint, args.seed)
    print(f"GNN inference: {r['subgraphs']}, mean {r['nodes_per_subgraph']['mean']:.1f} "
          f"nodes; {r['n']} distinct subgraphs, median of {r['reps']} runs; first call "
          f"(compiles the buckets) {r['first_call_s']:.2f} s")
    print(f"  {'path':28s} {'count':>7s} {'wall s':>8s} {'pred/s':>10s} {'pred/CPU-s':>11s}")
    for name in ("cold", "cached", "protocol_cold", "protocol_cached"):
        x = r[name]
        print(f"  {name:28s} {x['count']:>7d} {x['median_wall_s']:>8.3f} {x['per_s']:>10,.0f} "
              f"{x['per_cpu_s']:>11,.0f}")
    ok = r["cold"]["per_s"] >= TARGET_PER_S
    print(f"target {TARGET_PER_S:,}/s (cold, distinct): {'met' if ok else 'NOT met'}")
    write_result(args.out, r, indent=2, sort_keys=True)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
