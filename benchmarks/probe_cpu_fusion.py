"""Probes which opcodes XLA:CPU can compile inside a hand-written kLoop fusion.

Fusions written as HLO text reach XLA through jax's MLIR path before layout assignment,
and some emitters abort the whole process (a C++ CHECK) on them, so every candidate is
compiled in a fresh subprocess. For each opcode, one producer->consumer pair from a
small program is fused and compiled with ``exact=True``; the table says which opcodes
are safe as a fusion member. Run from the repository root:

    python benchmarks/probe_cpu_fusion.py

Writes ``benchmarks/results/cpu_fusion_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.provenance import write_result  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"

PROGRAM = r'''
import jax, jax.numpy as jnp
from jax import lax

def f(x, w, v, i):
    a = jnp.tanh(x) * 2.0 + 1.0                      # elementwise, broadcast, constant
    b = a.reshape(8, 4, 4).sum(axis=2)               # reshape, reduce
    c = b.T @ w                                      # transpose, dot
    d = jnp.concatenate([c, c * 2], axis=0)          # concatenate
    e = d[1:5, :]                                    # slice
    g = jnp.pad(e, ((1, 1), (0, 0)))                 # pad
    h = lax.rev(g, (0,)) + lax.convert_element_type(i, jnp.float32)   # reverse, convert
    k = jnp.where(h > 0, h, jnp.exp(h))              # compare, select, exp
    m = lax.dynamic_slice(k, (i, 0), (2, 4))         # dynamic-slice
    n = jnp.maximum(m, 0.0).max()                    # reduce max
    o = lax.iota(jnp.float32, 4) * v                 # iota
    return n + o.sum() + jnp.cumsum(v)[1]
ARGS = (jnp.ones((8, 16)) * 0.3, jnp.ones((8, 4)) * 0.1, jnp.arange(4.0), jnp.int32(1))
'''

ZOO = r'''
import os, sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
import jax
from disco_jax import zoo
f, ARGS = zoo.get(sys.argv[3])(4, "tiny")
'''

CHILD = r'''
import json, random, sys
import numpy as np
import hlo_tools
from hlo_tools import plan as P
from hlo_tools.graph import device_graph
from hlo_tools.jax_bridge import CompileOptions, InPlaceOf, compile_module, extract
from hlo_tools.rewrite import apply_plan
producer, consumer = int(sys.argv[1]), int(sys.argv[2])
module = hlo_tools.parse(extract(f, *ARGS))
graph = device_graph(module)
space = P.FusionSpace(graph, unfusible=frozenset() if sys.argv[4] == "all" else P.UNFUSIBLE_OPCODES)
base = P.initial_plan(graph)
if sys.argv[5] == "dup":
    plan = P.duplicate(space, base, producer, consumer)
else:
    plan = P.fuse(space, base, producer, consumer)
text = hlo_tools.to_text(apply_plan(module, plan, graph))
run = compile_module(text, InPlaceOf(f, ARGS), CompileOptions(exact=True))
got, want = jax.tree.leaves(run(*ARGS)), jax.tree.leaves(jax.jit(f)(*ARGS))
ok = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))
print(json.dumps({"ok": bool(ok)}))
'''

LIST = r'''
import json, sys
import hlo_tools
from hlo_tools import plan as P
from hlo_tools.graph import device_graph
from hlo_tools.jax_bridge import extract
module = hlo_tools.parse(extract(f, *ARGS))
graph = device_graph(module)
space = P.FusionSpace(graph, unfusible=frozenset() if sys.argv[2] == "all" else P.UNFUSIBLE_OPCODES)
plan = P.initial_plan(graph)
pairs = {}
for c in range(graph.num_nodes):
    for p in graph.operands[c]:
        for how, legal in (("fuse", P.can_fuse), ("dup", P.can_duplicate)):
            if legal(space, plan, p, c):
                label = f"{how} {graph.opcodes[p]}->{graph.opcodes[c]}"
                pairs.setdefault(label, (p, c, how))
print(json.dumps(pairs))
'''


def run_child(code: str, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=300, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", help="probe a zoo model (tiny) instead of the built-in program")
    parser.add_argument("--all", action="store_true",
                        help="probe every opcode, not only those the plans may fuse")
    args = parser.parse_args()
    program = (ZOO if args.zoo else PROGRAM)
    which = "all" if args.all else "allowed"
    listing = run_child(program + LIST, "x", which, args.zoo or "")
    if listing.returncode:
        sys.exit(listing.stderr[-2000:])
    pairs = json.loads(listing.stdout.strip().splitlines()[-1])
    rows = []
    for label, (p, c, how) in sorted(pairs.items()):
        proc = run_child(program + CHILD, str(p), str(c), args.zoo or "", which, how)
        if proc.returncode == 0:
            status = "ok" if json.loads(proc.stdout.strip().splitlines()[-1])["ok"] else "wrong"
        elif proc.returncode < 0 or "Check failed" in proc.stderr:
            status = "abort: " + next((ln for ln in proc.stderr.splitlines()
                                       if "Check failed" in ln), "signal")[-90:]
        else:
            status = "error: " + proc.stderr.strip().splitlines()[-1][-90:]
        rows.append({"program": args.zoo or "builtin", "pair": label, "status": status})
        print(f"{label:32} {status}", flush=True)
    out = RESULTS / f"cpu_fusion_probe{'_' + args.zoo if args.zoo else ''}.json"
    write_result(out, {"rows": rows}, indent=2)


if __name__ == "__main__":
    main()
