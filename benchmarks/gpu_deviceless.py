"""Random plans written for XLA:GPU: do they compile for an H100 without one, and does XLA
keep every planned fusion? Prints a table and writes ``benchmarks/results/gpu_deviceless.json``.

    python benchmarks/gpu_deviceless.py                  # vgg, resnet, transformer, bert
    python benchmarks/gpu_deviceless.py --models vgg --seeds 0 --size tiny

Per zoo model (its step for ONE device: a 1-device ``"data"`` mesh, which is what a single
GPU runs; the all-reduces then sum over one device) and seed: a random plan
(:func:`hlo_tools.random_plan`, ``--moves`` moves) is written with
``apply_plan(backend="gpu")`` (fusions made legal by :func:`hlo_tools.gpu_legal.gpu_legal`)
and compiled by XLA:GPU's PJRT plugin for a described H100
(:func:`hlo_tools.jax_bridge.pjrt.compile_deviceless`, in a child process) with the
exact-mode options of ``xla_passes.toml``'s ``[gpu]`` table. A planned multi-op fusion is
*kept* when a fusion of the optimized module holds the same ops
(:func:`hlo_tools.gpu_legal.fusions_kept`); XLA renames
instructions, so fusions are compared as multisets of sorted opcode lists, the copies and
bitcasts at their edges left out (``gpu_legal`` adds copies, and XLA may turn a copy that
changes no layout into a bitcast) and a fusion's constants counted once (XLA's CSE merges
equal constants inside a fused computation: rnnlm seed 1 at ``small``, two ``-inf``).
A planned fusion not found is *merged* when a fusion with the same ops is kept: XLA's CSE
merges two equal fusions of equal operands into one (reformer seed 1 at ``small``: the
same attention mask computed in two layers; a pass dump shows the pass ``cse`` of the
``simplification`` pipeline remove them), which changes nothing the plan decided; else it
is *lost*. A row also counts the planned fusions that read nothing but constants
(``constant_only``): XLA may fold those into a constant. The run passes when every plan
compiles and none loses a fusion.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the plugin runs in the compile's child
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import hlo_tools  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from hlo_tools import jax_bridge as jb  # noqa: E402
from hlo_tools.gpu_legal import EDGE_OPS, fusions_kept  # noqa: E402
from hlo_tools.jax_bridge import pjrt  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"
MODELS = ("vgg", "resnet", "transformer", "bert")


def constant_only(module) -> int:
    """How many multi-op fusions of ``module`` read nothing (only constants): XLA may fold
    those into a constant."""
    comps = module.computations_by_name()
    return sum(1 for _, i in module.instructions() if i.opcode == "fusion" and not i.operands
               and sum(op.opcode not in EDGE_OPS
                       for op in comps[i.called_computations[0]].instructions) > 1)


def check(model: str, size: str, seeds: list[int], moves: int, timeout_s: float) -> list[dict]:
    """One row per seed (see the module docstring)."""
    from disco_jax import zoo

    step, args = zoo.get(model)(1, size)
    module = hlo_tools.parse(jb.extract(step, *args))
    graph = hlo_tools.device_graph(module)
    options = jb.exact_compiler_options("cuda")
    rows = []
    for seed in seeds:
        row: dict = {"model": model, "size": size, "seed": seed, "moves": moves}
        plan = hlo_tools.random_plan(module, seed, moves)
        written = hlo_tools.apply_plan(module, plan, graph, backend="gpu")
        text = hlo_tools.to_text(written)
        row["planned"] = fusions_kept(written, written).planned
        row["constant_only"] = constant_only(written)
        t = time.perf_counter()
        try:
            out = pjrt.compile_deviceless(text, options, timeout_s=timeout_s)
        except jb.HloCompileError as err:
            row.update(compiled=False, kept=None, seconds=round(time.perf_counter() - t, 1),
                       error=(str(err).strip().splitlines() or [""])[0][:300])
        else:
            found = fusions_kept(written, hlo_tools.parse(out.optimized_text))
            row.update(compiled=True, kept=found.kept, merged=found.merged,
                       lost=[list(key) for key in found.lost],
                       seconds=round(out.seconds, 1), error="")
        rows.append(row)
        print(f"{model:15s} {seed:4d} {str(row['compiled']):8s} {row['planned']:7d} "
              f"{str(row['kept']):>5s} {str(row.get('merged')):>6s} "
              f"{len(row.get('lost') or []):4d} {row['constant_only']:6d} "
              f"{row['seconds']:7.1f}  {row['error'][:100]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--size", default="small")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--moves", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=300, help="per compile, seconds")
    parser.add_argument("--out", default=str(RESULTS / "gpu_deviceless.json"))
    a = parser.parse_args(argv)
    reason = pjrt.unavailable_reason()
    if reason is not None:
        print(f"no deviceless XLA:GPU compile here: {reason}")
        return 2
    seeds = [int(s) for s in a.seeds.split(",")]
    print(f"{'model':15s} {'seed':>4s} {'compiled':8s} {'planned':>7s} {'kept':>5s} "
          f"{'merged':>6s} {'lost':>4s} {'const':>6s} {'seconds':>7s}  error")
    rows = []
    for model in a.models.split(","):
        rows += check(model, a.size, seeds, a.moves, a.timeout)
    ok = all(r["compiled"] and not r["lost"] for r in rows)
    write_result(a.out, {"options": jb.exact_compiler_options("cuda"),
                         "plugin": str(pjrt.plugin_path()), "rows": rows, "all_kept": ok})
    print(f"every plan compiled and lost no fusion: {ok}; wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
