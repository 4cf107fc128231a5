"""One process of a 2-process gloo job for tests/test_gloo_loops.py.

Starts jax's gloo backend (pinned to its own CPU, as the bench's gloo setups run), finds
gloo's TCP event loop, moves it to ``--policy`` (``batch`` or ``idle``) with
:func:`disco_estimator.gloo.quiet_gloo_loops`, then runs a chain of 8 dependent ``pmean``s
and writes what it found and computed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", default="batch")
    args = ap.parse_args()
    from disco_estimator.gloo import gloo_loop_threads, pin_to_own_cpu, quiet_gloo_loops

    pin_to_own_cpu(args.process_id)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=2,
                               process_id=args.process_id, initialization_timeout=60)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    before_backend = gloo_loop_threads()
    mesh = Mesh(np.array(jax.devices()), ("d",))  # starts the backend (and gloo's loop)
    quieted = quiet_gloo_loops(args.policy)
    policies = {tid: os.sched_getscheduler(tid) for tid in quieted}
    others = [int(t) for t in os.listdir("/proc/self/task") if int(t) not in quieted]
    other_policies = {os.sched_getscheduler(t) for t in others
                      if Path(f"/proc/self/task/{t}").exists()}

    def chain(x):
        for _ in range(8):
            x = jax.lax.pmean(x, "d") * 2.0 + 1.0
        return x

    fn = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    local = np.full((1024,), float(args.process_id), np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
    got = np.asarray(fn(x).addressable_data(0))
    want = np.full((1024,), 0.5, np.float64)
    for _ in range(8):
        want = want * 2.0 + 1.0
    Path(args.out).write_text(json.dumps({
        "before_backend": before_backend, "quieted": quieted,
        "policies": list(policies.values()),
        "other_policies": sorted(other_policies),
        "max_abs_diff": float(np.max(np.abs(got - want)))}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
