"""One process of a 2-process gloo job compiling within ``compiles_shared``
(tests/test_shared_compiles.py).

Within the block it compiles, in every process: XLA's default of a ``shard_map`` step
(jax's own lowering), the step's text exactly, a per-device module, a text XLA rejects,
XLA's default again, and a module that differs between the processes. Then, in a second
block, two batches of per-device modules spread over the processes (``spread``), the
second with a module XLA rejects. It runs the programs and writes whether they compute
what ``jax.jit`` (or numpy) computes, a digest of the step's results, the errors, and the
blocks' counts; then a single-device module of its own (``Standalone``) and the route
probe's answer.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import time
from pathlib import Path

from step_helpers import local

# parsed by XLA, rejected by its verifier when compiled (operand shapes differ)
_SHAPE_BUG = """HloModule shape_bug

ENTRY main {
  x = f32[8]{0} parameter(0)
  y = f32[4]{0} parameter(1)
  ROOT bad_add = f32[8]{0} add(x, y)
}
"""

_STAGE = """HloModule stage

ENTRY main {
  p = f32[16,16]{1,0} parameter(0)
  d = f32[16,16]{1,0} dot(p, p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT t = f32[16,16]{1,0} tanh(d)
}
"""


def _step():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))

    def inner(w, x):
        g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
        return w - 0.1 * jax.lax.pmean(g, "data")

    def step(w, x):
        return jax.shard_map(inner, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                             check_vma=False)(w, x)

    w = jax.device_put(np.linspace(-1, 1, 64 * 64, dtype=np.float32).reshape(64, 64),
                       NamedSharding(mesh, P()))
    x = multihost_utils.host_local_array_to_global_array(
        np.full((8, 64), jax.process_index() + 1.0, np.float32), mesh, P("data"))
    return step, (w, x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=2, process_id=args.process_id)
    import numpy as np

    from hlo_tools import jax_bridge as jb

    step, step_args = _step()
    text = jb.extract(step, *step_args)
    mine = [d for d in jax.devices() if d.process_index == jax.process_index()]
    out: dict = {}
    t0 = time.perf_counter()
    with jb.compiles_shared(jb.Coordinator("sc", 120_000, watch_failures=True)) as shared:
        default = jb.compile_module(None, jb.InPlaceOf(step, step_args))
        exact = jb.compile_module(text, jb.InPlaceOf(step, step_args),
                                  jb.CompileOptions(exact=True))
        stage = jb.compile_module(_STAGE, jb.PerDevice(mine))
        try:
            jb.compile_module(_SHAPE_BUG, jb.PerDevice(mine))
        except jb.HloCompileError as err:
            out["error"] = str(err)
        again = jb.compile_module(None, jb.InPlaceOf(step, step_args))
        # a module written differently in process 1 at the same place: compiled there
        own_op = "negate" if jax.process_index() else "tanh"
        own = jb.compile_module(_STAGE.replace("tanh", own_op), jb.PerDevice(mine))
    out["seconds"] = time.perf_counter() - t0
    # a batch spread over the processes: process 0 compiles the programs 0 and 2,
    # process 1 the programs 1 and 3 (the same as 0); a batch whose program 1 XLA
    # rejects fails alike in both
    ops = ("tanh", "exponential", "negate", "tanh")
    with jb.compiles_shared(jb.Coordinator("sp", 120_000, watch_failures=True)) as spreading:
        batch = jb.spread([functools.partial(jb.compile_module, _STAGE.replace("tanh", op),
                                             jb.PerDevice(mine)) for op in ops])
        try:
            jb.spread([functools.partial(jb.compile_module, text, jb.PerDevice(mine))
                       for text in (_STAGE, _SHAPE_BUG, _STAGE.replace("tanh", "negate"))])
        except jb.HloCompileError as err:
            out["spread_error"] = str(err)
    want = local(jax.jit(step)(*step_args))
    got = {name: local(run(*step_args)) for name, run in (("default", default),
                                                          ("exact", exact), ("again", again))}
    # within rtol 1e-5 of the result's scale: XLA's programs of the step may sum in
    # another order than jax.jit's (on an AMD EPYC host 6.9e-6 apart on values up to 2.2,
    # where w - 0.1 * g cancels to near 0 and a per-element rtol asks for exact bits)
    scale = float(np.abs(want).max())
    out["close"] = {name: bool(np.allclose(v, want, rtol=1e-5, atol=1e-5 * scale))
                    for name, v in got.items()}
    out["bytes"] = {name: hashlib.sha256(v.tobytes()).hexdigest() for name, v in got.items()}
    x = jax.device_put(np.linspace(0, 0.1, 256, dtype=np.float32).reshape(16, 16), mine[0])
    got = np.asarray(stage([[x]])[0][0])
    out["stage_ok"] = bool(np.allclose(got, np.tanh(np.asarray(x) @ np.asarray(x)), rtol=1e-5))
    want_ops = {"tanh": np.tanh, "exponential": np.exp, "negate": np.negative}
    xx = np.asarray(x) @ np.asarray(x)
    out["own_ok"] = bool(np.allclose(np.asarray(own([[x]])[0][0]), want_ops[own_op](xx),
                                     rtol=1e-5))
    out["spread_ok"] = [bool(np.allclose(np.asarray(run([[x]])[0][0]), want_ops[op](xx),
                                         rtol=1e-5)) for op, run in zip(ops, batch)]
    # a module of its own on this process's device, and the route probe (which runs one)
    neg = jb.compile_module(_STAGE.replace("tanh", "negate"), jb.Standalone())
    (got,) = neg(np.asarray(x))
    out["standalone_ok"] = bool(np.allclose(got, -xx, rtol=1e-5))
    probed = jb.probe_route()
    out["route"] = probed.name
    # the job's route: every process's probe agrees, or the job takes buckets with the
    # reason of a process whose probe did not find hand-written fusions compile
    from disco_jax.pipeline.candidates import job_route
    from disco_jax.pipeline.sync import job_sync

    out["job_route"] = list(job_route(probed, job_sync("route_agreed")))
    failed = (jb.Route(jb.BUCKETS, probed.platform, "no fusion here")
              if jax.process_index() == 1 else probed)
    out["job_route_failed"] = list(job_route(failed, job_sync("route_failed")))
    out["counts"] = {"compiled": shared.compiled, "loaded": shared.loaded,
                     "local": shared.local}
    out["spread_counts"] = {"compiled": spreading.compiled, "loaded": spreading.loaded,
                            "local": spreading.local}
    Path(args.out).write_text(json.dumps(out))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
