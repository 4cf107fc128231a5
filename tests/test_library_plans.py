"""Plans compiled exactly with library kernels (``CompileOptions(exact=True, library=True)``).

Each random plan (200 moves, as in tests/test_random_plans.py) is compiled twice on real
XLA:CPU, exact without and with library kernels, and must come out the same program but
for the dots and convolutions: the same multi-op fusions (as opcode lists), the same
all-reduces (the planned number), and every ``kind=kCustom`` library fusion holds exactly
one ``dot`` or ``convolution`` that the plan left alone (a bare dot or convolution of the
library-free compile). Its outputs must match ``jax.jit`` of the step (rtol 1e-5; resnet
may instead match XLA's exact compile of the unchanged program, see
``disco_jax.enactment.plan_check.EXACT_REFERENCE``).

XLA:CPU aborts the process on fusions it cannot emit, so the checks run in a subprocess
(this file run as a script): a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest

PLANS_FAST = {"rnnlm": [0]}  # dot-heavy; convolutions (resnet, vgg) in the slow test
SEEDS_SLOW = [0, 1, 2]
MOVES = 200
LIBRARY_OPS = ("dot", "convolution")


def _run(model: str, seeds: list[int]) -> list[dict]:
    env = dict(os.environ)
    flag = "--xla_force_host_platform_device_count=4"
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, model, ",".join(map(str, seeds))],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"checker exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _assert_rows(model: str, rows: list[dict], seeds: list[int]) -> None:
    assert [r["seed"] for r in rows] == seeds, rows
    for r in rows:
        msg = json.dumps(r, indent=1)
        assert r["match"], msg
        assert r["multi_op_fusions_library"] == r["multi_op_fusions_exact"], msg
        assert r["all_reduces_library"] == r["all_reduces_exact"] == r["planned_all_reduces"], msg
        assert r["bad_library_fusions"] == [], msg
        # every library fusion replaces one bare dot/convolution of the library-free
        # program (XLA may run a convolution of one as a dot in the other: resnet)
        total = sum(r["library_fusions"].values()) + sum(r["bare_library"].values())
        assert total == sum(r["bare_exact"].values()), msg
        assert r["planned_multi_op_fusions"] > 0, msg
    if model in ("rnnlm", "resnet", "vgg", "transformer", "bert", "reformer"):
        assert any(sum(r["library_fusions"].values()) for r in rows), rows


def test_plan_library_options():
    from hlo_tools import jax_bridge as jb

    exact = jb.exact_compiler_options("cpu")["xla_disable_hlo_passes"].split(",")
    options = jb.plan_library_options("cpu")
    disabled = options["xla_disable_hlo_passes"].split(",")
    assert "dot-library-rewriter" in exact and "dot-library-rewriter" not in disabled
    assert set(disabled) == set(exact) - {"dot-library-rewriter"}
    assert options["xla_cpu_experimental_ynn_fusion_type"] == (
        "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION")
    # standalone library timing (disco_estimator.ops) keeps the library's default choice of ops
    assert "xla_cpu_experimental_ynn_fusion_type" not in jb.exact_compiler_options(
        "cpu", library=True)


@pytest.mark.parametrize("model", sorted(PLANS_FAST))
def test_library_plans_exact_and_match(model):
    seeds = PLANS_FAST[model]
    _assert_rows(model, _run(model, seeds), seeds)


@pytest.mark.slow
def test_library_plans_every_zoo_model():
    from disco_jax.zoo import MODELS

    for model in sorted(MODELS):
        _assert_rows(model, _run(model, SEEDS_SLOW), SEEDS_SLOW)


# ------------------------------------------------------------- the checker (subprocess)


def _top_level(module) -> list:
    """Instructions outside fused computations."""
    bodies = {c for _, i in module.instructions() if i.opcode == "fusion"
              for c in i.called_computations}
    return [i for comp in module.computations if comp.name not in bodies
            for i in comp.instructions]


def _structure(text: str) -> dict:
    """Multi-op fusions (sorted opcode lists), all-reduces, library fusions by op, the
    library fusions holding anything but one dot/convolution, and dots/convolutions run
    outside any library fusion (bare or in an XLA ``wrapped_*`` fusion)."""
    from disco_jax.enactment.plan_check import count_opcode, multi_op_fusions
    from hlo_tools import parse

    module = parse(text)
    comps = module.computations_by_name()
    library, bad, bare = collections.Counter(), [], collections.Counter()
    for instr in _top_level(module):
        if instr.opcode in LIBRARY_OPS:
            bare[instr.opcode] += 1
        if instr.opcode != "fusion":
            continue
        ops = [i.opcode for i in comps[instr.called_computations[0]].instructions
               if i.opcode != "parameter"]
        if instr.attrs.get("kind") == "kCustom":
            if len(ops) == 1 and ops[0] in LIBRARY_OPS:
                library[ops[0]] += 1
            else:
                bad.append(ops)
        elif len(ops) == 1 and ops[0] in LIBRARY_OPS:
            bare[ops[0]] += 1
    fusions = sorted(ops for _, ops in multi_op_fusions(module)
                     if ops not in bad)
    return {"multi_op_fusions": fusions, "all_reduces": count_opcode(module, "all-reduce"),
            "library_fusions": dict(library), "bad": bad, "bare": dict(bare)}


def _check(model: str, seeds: list[int]) -> None:
    import random

    import jax
    import numpy as np

    import hlo_tools
    from disco_jax import zoo
    from disco_jax.enactment.plan_check import count_opcode, reference_outputs
    from hlo_tools import plan as P

    step, args = zoo.get(model)(4, "tiny")
    text = hlo_tools.extract(step, *args)
    wants = reference_outputs(step, args, text, model)
    module = hlo_tools.parse(text)
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    for seed in seeds:
        plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed), MOVES)
        out = hlo_tools.apply_plan(module, plan, graph)
        planned = hlo_tools.to_text(out)
        target = hlo_tools.InPlaceOf(step, args)
        exact = hlo_tools.compile_module(planned, target, hlo_tools.CompileOptions(exact=True))
        lib = hlo_tools.compile_module(planned, target,
                                       hlo_tools.CompileOptions(exact=True, library=True))
        s_exact, s_lib = _structure(exact.as_text()), _structure(lib.as_text())
        got = jax.tree.leaves(lib(*args))
        match = any(all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
                        for a, b in zip(got, want)) for want in wants)
        print(json.dumps({
            "model": model, "seed": seed, "match": bool(match),
            "planned_multi_op_fusions": sum(
                1 for ms in plan.groups().values() if graph.opcodes[ms[0]] != "all-reduce"),
            "planned_all_reduces": count_opcode(out, "all-reduce"),
            "multi_op_fusions_exact": s_exact["multi_op_fusions"],
            "multi_op_fusions_library": s_lib["multi_op_fusions"],
            "all_reduces_exact": s_exact["all_reduces"],
            "all_reduces_library": s_lib["all_reduces"],
            "library_fusions": s_lib["library_fusions"],
            "bad_library_fusions": s_lib["bad"] + s_exact["bad"],
            "bare_exact": s_exact["bare"], "bare_library": s_lib["bare"],
        }), flush=True)


if __name__ == "__main__":
    _check(sys.argv[1], [int(s) for s in sys.argv[2].split(",")])
