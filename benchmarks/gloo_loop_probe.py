"""gloo's event loop, as jaxlib leaves it, at ``SCHED_BATCH`` and at ``SCHED_IDLE``, in a
2-process gloo job.

Both processes pinned to a CPU each (as the bench's gloo setups run). Three programs,
timed for 8 s each (median and p90 per call), in turn with the loop as it is and moved
to ``SCHED_BATCH`` and ``SCHED_IDLE`` (:func:`disco_estimator.gloo.quiet_gloo_loops`), twice:

* ``chain``: 16 dependent all-reduces of 16 KiB (nothing else);
* ``mixed``: 16 times four 192x192 matmuls (tanh) and then one small all-reduce;
* ``compute``: the 64 matmuls alone, no collective (one device).

Run from the repository root (about 3 minutes)::

    python benchmarks/gloo_loop_probe.py

Prints a table and writes ``benchmarks/results/gloo_loop_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "gloo_loop_probe.json"
K, SECONDS, PASSES = 16, 8.0, 2


def make_programs(mesh) -> dict:
    """The probe's programs on ``mesh`` (a 1-axis mesh ``"d"`` over the job's devices),
    each a callable of no arguments that runs once and blocks: ``chain``, ``mixed``,
    ``compute`` (see the module's docstring) and ``big`` (one all-reduce of 4 MiB)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def chain(x):
        for _ in range(K):
            x = jax.lax.pmean(x, "d") * 1.0001 + 1.0
        return x

    def mixed(x, w):
        for _ in range(K):
            for _ in range(4):
                w = jnp.tanh(w @ w * 0.01)
            x = jax.lax.pmean(x + w[0, :16].sum(), "d")
        return x, w

    def compute(w):
        for _ in range(4 * K):
            w = jnp.tanh(w @ w * 0.01)
        return w

    sharded = NamedSharding(mesh, P("d"))
    f_chain = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    f_mixed = jax.jit(jax.shard_map(mixed, mesh=mesh, in_specs=(P("d"), P()),
                                    out_specs=(P("d"), P())))
    f_big = jax.jit(jax.shard_map(lambda b: jax.lax.pmean(b, "d") * 0.5, mesh=mesh,
                                  in_specs=P("d"), out_specs=P("d")))
    f_compute = jax.jit(compute)
    x = jax.make_array_from_process_local_data(sharded, np.ones((4096,), np.float32))
    big = jax.make_array_from_process_local_data(sharded, np.ones((1 << 20,), np.float32))
    w_host = np.random.RandomState(0).rand(192, 192).astype(np.float32)
    w = jax.make_array_from_process_local_data(NamedSharding(mesh, P()), w_host)
    w_local = jax.device_put(w_host, jax.local_devices()[0])
    return {"chain": lambda: f_chain(x).block_until_ready(),
            "mixed": lambda: f_mixed(x, w)[0].block_until_ready(),
            "big": lambda: f_big(big).block_until_ready(),
            "compute": lambda: f_compute(w_local).block_until_ready()}


def time_program(fn, seconds: float, tag: str) -> dict:
    """Calls ``fn`` about ``seconds`` long after a barrier of every process (``tag`` names
    it); returns ``calls``, ``median_s`` and ``p90_s`` per call.

    Every process makes the same number of calls (process 0's count from 5 pilot calls):
    with a deadline read on each process's own clock, one process could start a call
    whose collective the other never joins, and the job would hang.
    """
    import numpy as np
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(tag)
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    per_call = (time.perf_counter() - t0) / 5
    calls = int(multihost_utils.broadcast_one_to_all(
        np.int32(max(1, min(1 << 20, round(seconds / max(per_call, 1e-6)))))))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"calls": len(times), "median_s": float(np.median(times)),
            "p90_s": float(np.percentile(times, 90))}


def worker(process_id: int, port: int, out: str) -> None:
    from disco_estimator.gloo import gloo_loop_threads, pin_to_own_cpu, quiet_gloo_loops

    pin_to_own_cpu(process_id)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    loops = quiet_gloo_loops("idle")  # found once; set back and forth below
    if not loops:
        raise SystemExit("no gloo event loop found")
    programs = {name: fn for name, fn in make_programs(mesh).items() if name != "big"}
    for fn in programs.values():
        fn()
    rows = []
    for rep in range(PASSES):
        for loop, policy in (("as is", os.SCHED_OTHER), ("SCHED_BATCH", os.SCHED_BATCH),
                             ("SCHED_IDLE", os.SCHED_IDLE)):
            for tid in loops:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            for name, fn in programs.items():
                if process_id == 0:
                    print(f"pass {rep}, loop {loop}: {name}", file=sys.stderr, flush=True)
                rows.append({"pass": rep, "loop": loop, "program": name,
                             **time_program(fn, SECONDS, f"{rep}{loop}{name}")})
    if process_id == 0:
        Path(out).write_text(json.dumps({"rows": rows, "loops_found": len(loops),
                                         "loop_found_again": gloo_loop_threads() == loops}))
    jax.distributed.shutdown()


def run_workers(script: str, extra: list[str], env: dict, timeout_s: float) -> dict | None:
    """Runs ``script --worker <pid> <port> <out> *extra`` as a 2-process job; returns what
    process 0 wrote to ``out`` (JSON), or None (said on stderr) when a worker failed."""
    from disco_estimator.gloo import run_local_job

    with tempfile.TemporaryDirectory(prefix="gloo_loop_") as tmp:
        part = Path(tmp) / "p0.json"
        rcs = run_local_job(
            lambda i, coordinator: [sys.executable, script, "--worker", str(i),
                                    coordinator.rsplit(":", 1)[1], str(part), *extra],
            2, timeout_s=timeout_s, env=env, grace_s=20.0)
        if any(rcs):
            print(f"workers exited with {rcs}", file=sys.stderr)
            return None
        return json.loads(part.read_text())


def main() -> int:
    from benchmarks.provenance import write_result
    from disco_estimator.gloo import child_env

    result = run_workers(__file__, [], child_env(1), 600)
    if result is None:
        return 1
    print(f"{'pass':>4} {'loop':11} {'program':8} {'median ms':>10} {'p90 ms':>8}")
    for r in result["rows"]:
        print(f"{r['pass']:>4} {r['loop']:11} {r['program']:8} {r['median_s'] * 1e3:>10.2f} "
              f"{r['p90_s'] * 1e3:>8.2f}")
    write_result(OUT, result)
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        raise SystemExit(0)
    argparse.ArgumentParser(
        description="gloo's event loop as jaxlib leaves it, at SCHED_BATCH and at SCHED_IDLE, "
                    "in a pinned 2-process gloo job (about 3 minutes); writes "
                    "benchmarks/results/gloo_loop_probe.json").parse_args()
    raise SystemExit(main())
