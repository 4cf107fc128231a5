"""Checks that random plans compile exactly as planned and compute the same numbers.

For a zoo model, each seed gives a random plan (op fusion, duplicate fusion and
AllReduce combination moves). The check applies it, verifies the module, has XLA parse
and compile it with ``exact=True``, counts the multi-op fusions and all-reduces in what
XLA compiled, runs it and compares every output with ``jax.jit`` of the original step.

XLA:CPU aborts the whole process on some fusions it cannot emit, so
:func:`run_isolated` runs the checks in a subprocess and survives such a crash: the
seed that was running is reported as ``crashed`` and the next seeds go on in a new
subprocess. Command line (one JSON object per plan on stdout)::

    python -m disco_jax.enactment.plan_check vgg --seeds 0:10 --moves 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["check_plans", "count_opcode", "multi_op_fusions", "reference_outputs", "run_isolated"]

RTOL, ATOL = 1e-5, 1e-6

#: Models whose plans may also match XLA's exact-mode compile of the unchanged program
#: instead of ``jax.jit``: XLA:CPU itself computes ResNet's multi-device convolution
#: gradients about 3e-4 (relative) off when fusion and the dot library rewriter are
#: disabled, for the unchanged program too (tests/test_roundtrip.py), and a plan's
#: fusions decide which of XLA's two answers it gets.
EXACT_REFERENCE = frozenset({"resnet"})


def multi_op_fusions(module) -> list[tuple[str, list[str]]]:
    """``(fusion name, fused opcodes)`` for every fusion holding more than one op."""
    comps = module.computations_by_name()
    found = []
    for _, instr in module.instructions():
        if instr.opcode != "fusion":
            continue
        body = comps[instr.called_computations[0]]
        ops = [i.opcode for i in body.instructions if i.opcode != "parameter"]
        if len(ops) > 1:
            found.append((instr.name, ops))
    return found


_NEVER_FOLDED = frozenset({"parameter", "rng", "rng-bit-generator", "rng-get-and-update-state",
                           "all-reduce", "custom-call", "infeed", "recv", "partition-id",
                           "replica-id", "while", "call", "conditional"})


def foldable_fusions(module, computation: str) -> int:
    """Distinct planned fusions whose inputs are all compile-time constants: XLA's
    constant folding may replace them by a constant (a causal mask, say)."""
    comp = module.computation(computation)
    const: set[str] = set()
    for instr in comp.instructions:
        if instr.opcode in _NEVER_FOLDED:
            continue
        if all(o in const for o in instr.operands):
            const.add(instr.name)
    comps = module.computations_by_name()
    return len({(tuple(i.operands), _body_key(comps[i.called_computations[0]], comps))
                for i in comp.instructions if i.opcode == "fusion" and i.name in const})


def distinct_fusions(module) -> int:
    """Planned (not XLA-wrapped) fusions that differ in what they compute.

    XLA:CPU wraps every unfused op into a single-op fusion calling ``wrapped_*``; every
    other fusion is one of ours, even where XLA's simplifier reduced it to one op (e.g.
    ``or(x, broadcast(false))``). XLA's CSE merges fusions with the same operands and
    the same fused computation (identical instructions of the unfused program are merged
    the same way), so those count once."""
    comps = module.computations_by_name()
    keys = set()
    for _, instr in module.instructions():
        if instr.opcode != "fusion":
            continue
        body = comps[instr.called_computations[0]]
        ops = sum(i.opcode != "parameter" for i in body.instructions)
        if ops > 1 or not body.name.startswith("wrapped_"):
            keys.add((tuple(instr.operands), _body_key(body, comps)))
    return len(keys)


def _body_key(body, comps) -> tuple:
    """A computation with its instruction names replaced by their positions and called
    computations (reducers) by their own keys: XLA's CSE compares them by structure."""
    from hlo_tools.ir import CALLED_COMPUTATION_ATTRS

    position = {i.name: k for k, i in enumerate(body.instructions)}
    key = []
    for i in body.instructions:
        attrs = tuple(
            (k, _body_key(comps[i.called_computations[0]], comps)
             if k in CALLED_COMPUTATION_ATTRS and i.called_computations else v)
            for k, v in i.attrs.items() if k != "metadata")
        key.append((i.opcode, str(i.shape.without_layout()), i.payload,
                    tuple(position[o] for o in i.operands), attrs))
    return tuple(key)


def count_opcode(module, opcode: str) -> int:
    return sum(1 for _, i in module.instructions() if i.opcode == opcode)


def _planned(space, plan) -> tuple[int, int]:
    """(live fusion groups, all-reduces) the plan should compile to."""
    from hlo_tools.plan import dead_groups

    graph = space.graph
    groups = plan.groups()
    dead = dead_groups(space, plan)
    fusions = sum(1 for gid, ms in groups.items()
                  if graph.opcodes[ms[0]] != "all-reduce" and gid not in dead)
    merged = sum(len(ms) - 1 for ms in groups.values() if graph.opcodes[ms[0]] == "all-reduce")
    return fusions, count_opcode(graph.module, "all-reduce") - merged


def reference_outputs(step: Any, args: Any, text: str, model: str) -> list[list[Any]]:
    """The outputs a plan of ``model``'s step may match: ``jax.jit``'s, and for the
    models of :data:`EXACT_REFERENCE` also those of the step's own text compiled exactly
    (each a list of output leaves)."""
    import jax

    import hlo_tools

    wants = [jax.tree.leaves(jax.jit(step)(*args))]
    if model in EXACT_REFERENCE:
        run = hlo_tools.compile_module(text, hlo_tools.InPlaceOf(step, args),
                                       hlo_tools.CompileOptions(exact=True))
        wants.append(jax.tree.leaves(run(*args)))
    return wants


def check_plans(model: str, seeds: list[int], moves: int = 200,
                size: str = "tiny") -> Iterator[dict]:
    """Yields one result dict per seed (see the module docstring)."""
    import random

    import numpy as np

    import hlo_tools
    from disco_jax import zoo
    from hlo_tools import plan as P

    step, args = zoo.get(model)(4, size)
    text = hlo_tools.extract(step, *args)
    want = reference_outputs(step, args, text, model)
    module = hlo_tools.parse(text)
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    for seed in seeds:
        t0 = time.perf_counter()
        plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed), moves)
        fusions, allreduces = _planned(space, plan)
        row = {"model": model, "seed": seed, "moves": moves, "planned_fusions": fusions,
               "reference": "jit or exact" if model in EXACT_REFERENCE else "jit",
               "planned_allreduces": allreduces, "dups": len(plan.dups)}
        yield _check_one(row, module, graph, plan, step, args, want, np) | {
            "seconds": round(time.perf_counter() - t0, 3)}


def _check_one(row, module, graph, plan, step, args, want, np) -> dict:
    import jax

    import hlo_tools

    out = hlo_tools.apply_plan(module, plan, graph)
    problems = hlo_tools.find_problems(out)
    if problems:
        return row | {"status": "invalid", "error": problems[0]}
    row = row | {"planned_fusions": distinct_fusions(out),
                 "foldable_fusions": foldable_fusions(out, graph.computation.name)}
    try:
        run = hlo_tools.compile_module(hlo_tools.to_text(out), hlo_tools.InPlaceOf(step, args),
                                       hlo_tools.CompileOptions(exact=True))
    except Exception as err:  # XLA's own error, reported as data
        return row | {"status": "compile_error", "error": str(err)[:500]}
    compiled = hlo_tools.parse(run.as_text())
    got = jax.tree.leaves(run(*args))
    best = min((_compare(got, ref, np) for ref in want), key=lambda c: (not c[0], c[2]))
    match, bitwise, diff = best
    return row | {
        "status": "ok" if match else "mismatch",
        "compiled_fusions": distinct_fusions(compiled),
        "compiled_allreduces": count_opcode(compiled, "all-reduce"),
        "bitwise": bitwise, "max_abs_diff": diff,
    }


def _compare(got: list, want: list, np) -> tuple[bool, bool, float]:
    """(within rtol/atol, bitwise equal, max absolute difference) over all leaves."""
    diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, want)]
    match = all(np.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(got, want))
    bitwise = all(np.array_equal(a, b) for a, b in zip(got, want))
    return match, bitwise, max(diffs) if diffs else 0.0


def run_isolated(model: str, seeds: list[int], moves: int = 200, size: str = "tiny",
                 timeout_s: float = 1800.0,
                 on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Runs :func:`check_plans` in subprocesses; a seed whose compile kills the process is
    reported with ``status == "crashed"`` and the remaining seeds run in a new one.

    Args:
      on_row: called with each result as soon as it is known (long runs log it, so
        that an interrupted run loses nothing it finished).
      timeout_s: limit for a single plan's check, in seconds.
    """
    results: list[dict] = []
    todo = list(seeds)

    def record(row: dict) -> None:
        results.append(row)
        if on_row is not None:
            on_row(row)

    while todo:
        cmd = [sys.executable, "-m", "disco_jax.enactment.plan_check", model, "--size", size,
               "--moves", str(moves), "--seeds", ",".join(map(str, todo))]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        done, returncode, stderr, timed_out = _stream(cmd, env, timeout_s, record)
        todo = todo[done:]
        if todo and timed_out:
            record({"model": model, "seed": todo[0], "moves": moves, "status": "timeout",
                    "error": f"no result within {timeout_s:.0f} s (killed)"})
            todo = todo[1:]
        elif todo and returncode != 0:
            tail = "\n".join(line for line in stderr.splitlines()
                             if not line.startswith("    @"))[-600:]
            record({"model": model, "seed": todo[0], "moves": moves,
                    "status": "crashed", "error": tail})
            todo = todo[1:]
        elif todo:
            raise RuntimeError(f"plan_check stopped early without an error: {stderr}")
    return results


def _stream(cmd: list[str], env: dict, timeout_s: float,
            record: Callable[[dict], None]) -> tuple[int, int, str, bool]:
    """Runs ``cmd``, passing each JSON line of its stdout to ``record`` as it comes;
    kills it when one line takes longer than ``timeout_s`` (wall clock: a run paused
    with SIGSTOP for longer counts as timed out, not as crashed).
    Returns (rows read, exit status, stderr, whether it was killed for time)."""
    import tempfile
    import threading

    killed = threading.Event()

    def kill() -> None:
        killed.set()
        proc.kill()

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        timer = threading.Timer(timeout_s, kill)
        timer.start()
        done = 0
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    record(json.loads(line))
                    done += 1
                    timer.cancel()
                    timer = threading.Timer(timeout_s, kill)
                    timer.start()
            returncode = proc.wait()
        finally:
            timer.cancel()
        err.seek(0)
        return done, returncode, err.read(), killed.is_set()


def _parse_seeds(text: str) -> list[int]:
    if ":" in text:
        start, stop = text.split(":")
        return list(range(int(start), int(stop)))
    return [int(s) for s in text.split(",") if s]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--seeds", default="0:10", help="A:B (range) or a,b,c")
    parser.add_argument("--moves", type=int, default=200)
    parser.add_argument("--size", default="tiny")
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    for row in check_plans(args.model, _parse_seeds(args.seeds), args.moves, args.size):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
