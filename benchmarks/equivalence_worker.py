"""Child process of ``benchmarks/refactor_equivalence.py``: runs against whichever tree
is first on ``PYTHONPATH`` (the landed one or the refactored one) and prints JSON.

    python benchmarks/equivalence_worker.py decisions INPUT_DIR --seeds 200 --moves 200
    python benchmarks/equivalence_worker.py speed INPUT_DIR

It reads only what both trees have in common (``hlo_tools.parse``, ``to_text``,
``device_graph``, ``apply_plan``, the plan moves, the cost model and the simulator),
through :func:`_api`, which knows the old and the new module names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")


def _api():
    """(CostModel, simulate_plan, sim_graph_from_module, simulate) in any layout."""
    import importlib

    for costs, lower, simulator in (
            ("disco_estimator.costs.cost_model", "disco_estimator.costs.lower",
             "disco_estimator.costs.simulator"),
            ("disco_jax.costs.cost_model", "disco_jax.costs.lower", "disco_jax.costs.simulator"),
            ("disco_jax.cost_model", "disco_jax.lower", "disco_jax.simulator"),
            ("disco_jax.costs", "disco_jax.costs", "disco_jax.simulator")):
        try:
            cm, lw, sm = (importlib.import_module(m) for m in (costs, lower, simulator))
            return cm.CostModel, lw.simulate_plan, lw.sim_graph_from_module, sm.simulate
        except (ImportError, AttributeError):
            continue
    raise ImportError("no known layout of the cost model")


def plan_key(plan) -> str:
    """A digest of what a plan decides: schedule order, groups and duplicated producers."""
    h = hashlib.sha256()
    h.update(bytes(plan.order))
    h.update(bytes(plan.group))
    h.update(repr(sorted(plan.dups)).encode())
    return h.hexdigest()[:16]


def decisions(inputs: Path, seeds: int, moves: int, sim_plans: int) -> dict:
    import hlo_tools
    from hlo_tools import plan as P

    CostModel, simulate_plan, sim_graph_from_module, simulate = _api()
    costs = CostModel("inproc4")  # no measured op times: deterministic analytic costs
    out: dict = {"fixtures": {}, "models": {}}
    for path in sorted((inputs / "fixtures").glob("*.hlo")):
        text = hlo_tools.to_text(hlo_tools.parse(path.read_text()))
        out["fixtures"][path.name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    for pre in sorted((inputs / "models").glob("*.pre.hlo")):
        name = pre.name[: -len(".pre.hlo")]
        module = hlo_tools.parse(pre.read_text())
        graph = hlo_tools.device_graph(module)
        space = P.FusionSpace(graph)
        start = P.initial_plan(graph)
        keys, sims, texts = [], [], []
        for seed in range(seeds):
            plan = P.random_moves(space, start, random.Random(seed), moves)
            keys.append(plan_key(plan))
            if seed < sim_plans:
                sims.append(repr(simulate_plan(graph, plan, costs).iteration_s))
                text = hlo_tools.to_text(hlo_tools.apply_plan(module, plan, graph))
                texts.append(hashlib.sha256(text.encode()).hexdigest()[:16])
        post = hlo_tools.parse((inputs / "models" / f"{name}.post.hlo").read_text())
        xla = repr(simulate(sim_graph_from_module(post, costs), costs.overlap,
                            check=False).iteration_s)
        out["models"][name] = {"nodes": graph.num_nodes, "plan_keys": keys,
                               "sim_iteration_s": sims, "xla_iteration_s": xla,
                               "rewritten_text": texts}
    return out


def speed(inputs: Path, moves: int) -> dict:
    """One sample of parse, moves and simulator throughput (the parent interleaves)."""
    import hlo_tools
    from hlo_tools import plan as P

    CostModel, _, _, simulate = _api()
    text = (inputs / "models" / "transformer.post.hlo").read_text()
    hlo_tools.parse(text)  # warm-up (kernel build, caches)
    n = text.count("\n")
    t0 = time.process_time()
    for _ in range(3):
        hlo_tools.parse(text)
    parse_rate = 3 * n / (time.process_time() - t0)

    module = hlo_tools.parse((inputs / "models" / "transformer.pre.hlo").read_text())
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    plan = P.initial_plan(graph)
    P.random_moves(space, plan, random.Random(0), 100)  # warm-up
    rng = random.Random(1)
    t0 = time.process_time()
    done = 0
    while done < moves:
        if done % 1000 == 0:
            plan = P.initial_plan(graph)
        plan = P.random_moves(space, plan, rng, 1)
        done += 1
    moves_rate = moves / (time.process_time() - t0)

    return {"parse_instr_per_cpu_s": parse_rate, "moves_per_cpu_s": moves_rate,
            "sim_nodes_per_cpu_s": _sim_rate(graph, plan, simulate, CostModel("inproc4"))}


def _sim_rate(graph, plan, simulate, costs) -> float:
    import importlib

    for module in ("disco_estimator.costs.lower", "disco_jax.costs.lower", "disco_jax.lower",
                   "disco_jax.costs"):
        try:
            sim_graph = importlib.import_module(module).sim_graph
            break
        except (ImportError, AttributeError):
            continue
    sg = sim_graph(graph, plan, costs)
    simulate(sg, costs.overlap, check=False)
    reps = 200
    t0 = time.process_time()
    for _ in range(reps):
        simulate(sg, costs.overlap, check=False)
    return reps * len(sg.duration_s) / (time.process_time() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/equivalence_worker.py")
    ap.add_argument("mode", choices=("decisions", "speed"))
    ap.add_argument("inputs", type=Path)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--moves", type=int, default=200)
    ap.add_argument("--sim-plans", type=int, default=10)
    args = ap.parse_args()
    if args.mode == "decisions":
        result = decisions(args.inputs, args.seeds, args.moves, args.sim_plans)
    else:
        result = speed(args.inputs, 20000)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
