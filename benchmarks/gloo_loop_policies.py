"""Which scheduling policy of gloo's event loop serves both a fast and a 1 Gbit/s link?

A 2-process gloo job (each process pinned to a CPU, ``NPROC=2`` so XLA:CPU's pool has two
threads, as a staged enactment runs). Five programs, timed for 5 s each (median and p90
per call) with the loop of both processes at each policy in turn, twice:

* ``chain``: 16 dependent all-reduces of 16 KiB;
* ``mixed``: 16 times four 192x192 matmuls (tanh) and then one small all-reduce;
* ``big``: one all-reduce of 4 MiB;
* ``compute``: the 64 matmuls alone (one device, no collective);
* ``overlap``: ``big`` and ``compute`` at once, from two Python threads (a staged
  enactment's two streams).

Policies: ``asis`` (as jaxlib starts it), ``nice10``/``nice19`` (``SCHED_OTHER`` at that
nice level), ``batch`` (``SCHED_BATCH``), ``idle`` (``SCHED_IDLE``).

Run from the repository root, as root for the 1 Gbit/s link (about 5 minutes on the
host's loopback, 10 over 1 Gbit/s, where ``big`` takes 67 ms)::

    python benchmarks/gloo_loop_policies.py                 # the host's loopback
    python benchmarks/gloo_loop_policies.py --rate 1gbit --policies asis,batch,idle

Prints a table and writes ``benchmarks/results/gloo_loop_policies_<rate>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
K, SECONDS, PASSES = 16, 5.0, 2
POLICIES = ("asis", "nice10", "nice19", "batch", "idle")


def set_policy(tids: list[int], policy: str) -> None:
    for tid in tids:
        if policy == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif policy == "batch":
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 0 if policy == "asis" else int(policy[4:]))


def worker(process_id: int, port: int, out: str, policies: list[str]) -> None:
    from estimator.gloo import gloo_loop_threads, pin_to_own_cpu

    pin_to_own_cpu(process_id)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharded = NamedSharding(mesh, P("d"))
    x = jax.make_array_from_process_local_data(sharded, np.ones((4096,), np.float32))
    big = jax.make_array_from_process_local_data(sharded, np.ones((1 << 20,), np.float32))
    w_host = np.random.RandomState(0).rand(192, 192).astype(np.float32)
    w = jax.make_array_from_process_local_data(NamedSharding(mesh, P()), w_host)
    w_local = jax.device_put(w_host, jax.local_devices()[0])

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

    f_chain = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    f_mixed = jax.jit(jax.shard_map(mixed, mesh=mesh, in_specs=(P("d"), P()),
                                    out_specs=(P("d"), P())))
    f_big = jax.jit(jax.shard_map(lambda b: jax.lax.pmean(b, "d") * 0.5, mesh=mesh,
                                  in_specs=P("d"), out_specs=P("d")))
    f_compute = jax.jit(compute)

    def overlap():
        side = threading.Thread(target=lambda: f_compute(w_local).block_until_ready())
        side.start()
        f_big(big).block_until_ready()
        side.join()

    programs = {"chain": lambda: f_chain(x).block_until_ready(),
                "mixed": lambda: f_mixed(x, w)[0].block_until_ready(),
                "big": lambda: f_big(big).block_until_ready(),
                "compute": lambda: f_compute(w_local).block_until_ready(),
                "overlap": overlap}
    for fn in programs.values():
        fn()
    loops = gloo_loop_threads()
    if not loops:
        raise SystemExit("no gloo event loop found")
    rows = []
    for rep in range(PASSES):
        for policy in policies:
            set_policy(loops, policy)
            for name, fn in programs.items():
                if process_id == 0:
                    print(f"pass {rep}, {policy}: {name}", file=sys.stderr, flush=True)
                multihost_utils.sync_global_devices(f"{rep}{policy}{name}")
                times = []
                end = time.perf_counter() + SECONDS
                while time.perf_counter() < end:
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                rows.append({"pass": rep, "policy": policy, "program": name,
                             "calls": len(times), "median_s": float(np.median(times)),
                             "p90_s": float(np.percentile(times, 90))})
    if process_id == 0:
        Path(out).write_text(json.dumps({"rows": rows}))
    jax.distributed.shutdown()


def run(rate: str, parent_netns: str, policies: str) -> int:
    from estimator.gloo import child_env, free_port, set_loopback_rate, wait_all
    from hlo_tools.dirs import write_atomic

    qdisc = set_loopback_rate(rate, parent_netns, burst="128kb") if rate else ""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gloo_loop_policies_") as tmp:
        part = Path(tmp) / "p0.json"
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), str(port),
                                   str(part), policies], env=child_env(1, {"NPROC": "2"}))
                 for i in range(2)]
        rcs = wait_all(procs, time.monotonic() + 900,
                       lambda: any(p.poll() not in (None, 0) for p in procs), grace_s=20.0)
        if any(rcs):
            print(f"workers exited with {rcs}", file=sys.stderr)
            return 1
        result = json.loads(part.read_text())
    result["rate"], result["qdisc"] = rate, qdisc
    print(f"{'pass':>4} {'policy':7} {'program':8} {'median ms':>10} {'p90 ms':>8}")
    for r in result["rows"]:
        print(f"{r['pass']:>4} {r['policy']:7} {r['program']:8} {r['median_s'] * 1e3:>10.2f} "
              f"{r['p90_s'] * 1e3:>8.2f}")
    out = RESULTS / f"gloo_loop_policies_{rate or 'lo'}.json"
    write_atomic(out, json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="", help="tc rate of a private loopback (e.g. 1gbit)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="comma-separated, of: %(default)s")
    ap.add_argument("--parent-netns", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.policies or not set(args.policies.split(",")) <= set(POLICIES):
        ap.error(f"--policies: choose from {','.join(POLICIES)}")
    if args.rate and args.parent_netns is None:  # re-run in a private network namespace
        netns = os.readlink("/proc/self/ns/net")
        return subprocess.run(["unshare", "-n", sys.executable, __file__, "--rate", args.rate,
                               "--policies", args.policies, "--parent-netns", netns]).returncode
    return run(args.rate, args.parent_netns or "", args.policies)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5].split(","))
        raise SystemExit(0)
    raise SystemExit(main())
