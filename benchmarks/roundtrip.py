"""Round trip of every zoo train step through ``hlo_tools`` against real XLA:CPU.

For each model: instruction and all-reduce counts of the pre-optimization (``extract``)
and post-optimization (``compile().as_text()``) HLO, parse and print times, whether XLA's
canonical print of ``to_text(parse(text))`` equals that of the original, and whether our
re-printed pre-optimization text compiled with ``compile_module`` (exact=False/True) matches
``jax.jit(step)`` (rtol 1e-5, atol 1e-6; bitwise; max abs diff), plus whether it is
bitwise identical to jax's own lowering compiled with the same options. Prints a table and
writes ``benchmarks/results/roundtrip.json``. Run from the repository root:

    python benchmarks/roundtrip.py [--size tiny|small] [--models vgg resnet ...]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.provenance import write_result  # noqa: E402
from disco_jax import zoo  # noqa: E402
from hlo_tools import HloModule, parse, to_text  # noqa: E402
from hlo_tools.jax_bridge import (  # noqa: E402
    CompileOptions,
    InPlaceOf,
    compile_module,
    extract,
    xla_canonical_text,
)

RESULTS = pathlib.Path(__file__).parent / "results"
NUM_DEVICES = 4
RTOL, ATOL = 1e-5, 1e-6  # as in tests/test_roundtrip.py (explained there)
REPEATS = 3


def _timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _count(module: HloModule, *opcodes: str) -> int:
    """Instructions of ``module`` (all computations) with one of ``opcodes``."""
    return sum(instr.opcode in opcodes for _, instr in module.instructions())


def _canonical(text: str) -> str:
    """XLA's own print of HLO text after parsing it with XLA's parser."""
    return xla_canonical_text(text)


def text_stats(text: str) -> dict:
    """Counts, best-of-``REPEATS`` parse/print seconds and canonical equality of a text."""
    module = parse(text)
    ours = to_text(module)
    return {
        "instructions": module.instruction_count,
        "all_reduces": _count(module, "all-reduce", "all-reduce-start"),
        "fusions": _count(module, "fusion"),
        "parse_s": min(_timed(lambda: parse(text)) for _ in range(REPEATS)),
        "print_s": min(_timed(lambda: to_text(module)) for _ in range(REPEATS)),
        "idempotent": to_text(parse(ours)) == ours,
        "elided_constants": "{...}" in text,
        "canonical_equal": _canonical(ours) == _canonical(text),
    }


def compare(got: Any, want: Any) -> dict:
    """Whether two output pytrees match (same structure, allclose), bitwise, max abs diff."""
    if jax.tree.structure(got) != jax.tree.structure(want):
        return {"match": False, "bitwise": False, "max_abs_diff": float("inf")}
    pairs = [(np.asarray(g), np.asarray(w)) for g, w in zip(jax.tree.leaves(got),
                                                            jax.tree.leaves(want))]
    return {
        "match": all(g.shape == w.shape and np.allclose(g, w, rtol=RTOL, atol=ATOL)
                     for g, w in pairs),
        "bitwise": all(np.array_equal(g, w) for g, w in pairs),
        "max_abs_diff": max(float(np.max(np.abs(g - w), initial=0.0)) for g, w in pairs),
    }


def execution(jitted: Any, args: tuple, pre: str, expected: Any, exact: bool) -> dict:
    """Runs our re-printed ``pre`` with ``compile_module`` and compares it with the references.

    ``vs_jit`` compares with ``jax.jit(step)``; ``bitwise_vs_own`` with jax's own lowering
    compiled under the same options (isolates the text round trip from XLA's options).
    """
    ours = compile_module(to_text(parse(pre)), InPlaceOf(jitted, args),
                          CompileOptions(exact=exact))(*args)
    own = (compile_module(None, InPlaceOf(jitted, args), CompileOptions(exact=True))(*args)
           if exact else expected)
    return {**compare(ours, expected), "bitwise_vs_own": compare(ours, own)["bitwise"]}


def measure(name: str, size: str) -> dict:
    """All round-trip measurements of one zoo model."""
    t0 = time.perf_counter()
    step, args = zoo.get(name)(NUM_DEVICES, size)
    jitted = jax.jit(step)
    compiled = jitted.lower(*args).compile()
    pre, post = extract(jitted, *args), compiled.as_text()
    expected = compiled(*args)  # what jax.jit(step)(*args) runs
    row = {"model": name, "pre": text_stats(pre), "post": text_stats(post)}
    for exact in (False, True):
        row[f"exact_{exact}".lower()] = execution(jitted, args, pre, expected, exact)
    row["wall_s"] = time.perf_counter() - t0
    return row


def _flag(value: bool) -> str:
    """Compact yes/no for the table."""
    return "y" if value else "N"


def _row_text(r: dict) -> str:
    """One table line."""
    pre, post = r["pre"], r["post"]
    ex = [r["exact_false"], r["exact_true"]]
    match = "/".join(_flag(e["match"]) + _flag(e["bitwise"]) + _flag(e["bitwise_vs_own"])
                     for e in ex)
    return (f"{r['model']:15} {pre['instructions']:>6} {post['instructions']:>6} "
            f"{pre['all_reduces']:>4} {post['all_reduces']:>4} {post['fusions']:>5} "
            f"{pre['parse_s'] * 1e3:>7.1f} {pre['print_s'] * 1e3:>7.1f} "
            f"{post['parse_s'] * 1e3:>7.1f} {post['print_s'] * 1e3:>7.1f} "
            f"{_flag(pre['canonical_equal'])}/{_flag(post['canonical_equal'])}   "
            f"{match:>7} {ex[0]['max_abs_diff']:>9.2g} {ex[1]['max_abs_diff']:>9.2g}")


def print_table(rows: list[dict]) -> None:
    """Prints the per-model table with a legend."""
    print(f"{'model':15} {'instr':>6} {'instr':>6} {'AR':>4} {'AR':>4} {'fus':>5} "
          f"{'parse':>7} {'print':>7} {'parse':>7} {'print':>7} {'canon':5} {'exec':>7} "
          f"{'maxdiff':>9} {'maxdiff':>9}")
    print(f"{'':15} {'pre':>6} {'post':>6} {'pre':>4} {'post':>4} {'post':>5} "
          f"{'pre ms':>7} {'pre ms':>7} {'post ms':>7} {'post ms':>7} {'pr/po':5} {'F/T':>7} "
          f"{'exact=F':>9} {'exact=T':>9}")
    for r in rows:
        print(_row_text(r))
    print("exec F/T: for exact=False/True, three flags: matches jax.jit (rtol 1e-5, atol 1e-6),"
          " bitwise equal to jax.jit, bitwise equal to jax's own lowering compiled with the"
          " same options. maxdiff: max abs diff vs jax.jit.")


def write_json(rows: list[dict], size: str) -> pathlib.Path:
    """Writes the rows atomically (with their provenance) and returns the path."""
    meta = {"size": size, "devices": NUM_DEVICES, "jax": jax.__version__,
            "rtol": RTOL, "atol": ATOL, "parse_print_repeats": REPEATS}
    return write_result(RESULTS / "roundtrip.json", {**meta, "rows": rows}, indent=2)


def main() -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--models", nargs="*", default=zoo.names(),
                        help="zoo models (default: all, auto_sharded included)")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append(measure(name, args.size))
        print(f"# {name}: {rows[-1]['wall_s']:.1f} s", flush=True)
    print_table(rows)
    print(f"wrote {write_json(rows, args.size)}")


if __name__ == "__main__":
    main()
