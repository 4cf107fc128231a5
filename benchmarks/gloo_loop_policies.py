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
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
SECONDS, PASSES = 5.0, 2
POLICIES = ("asis", "nice10", "nice19", "batch", "idle")


def set_policy(tids: list[int], policy: str) -> None:
    from disco_estimator.gloo import LOOP_POLICIES

    for tid in tids:
        if policy in LOOP_POLICIES:
            os.sched_setscheduler(tid, LOOP_POLICIES[policy], os.sched_param(0))
        else:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 0 if policy == "asis" else int(policy[4:]))


def worker(process_id: int, port: int, out: str, policies: list[str]) -> None:
    from disco_estimator.gloo import gloo_loop_threads, pin_to_own_cpu

    pin_to_own_cpu(process_id)
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from benchmarks.gloo_loop_probe import make_programs, time_program

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    programs = make_programs(Mesh(np.array(jax.devices()), ("d",)))

    def overlap():
        side = threading.Thread(target=programs["compute"])
        side.start()
        programs["big"]()
        side.join()

    programs["overlap"] = overlap
    for fn in programs.values():
        fn()
    loops = gloo_loop_threads(attempts=50)
    if not loops:
        raise SystemExit("no gloo event loop found")
    rows = []
    for rep in range(PASSES):
        for policy in policies:
            set_policy(loops, policy)
            for name, fn in programs.items():
                if process_id == 0:
                    print(f"pass {rep}, {policy}: {name}", file=sys.stderr, flush=True)
                rows.append({"pass": rep, "policy": policy, "program": name,
                             **time_program(fn, SECONDS, f"{rep}{policy}{name}")})
    if process_id == 0:
        Path(out).write_text(json.dumps({"rows": rows}))
    jax.distributed.shutdown()


def run(rate: str, parent_netns: str, policies: str) -> int:
    from benchmarks.gloo_loop_probe import run_workers
    from benchmarks.provenance import write_result
    from disco_estimator.gloo import child_env, set_loopback_rate

    qdisc = set_loopback_rate(rate, parent_netns, burst="128kb") if rate else ""
    result = run_workers(__file__, [policies], child_env(1, {"NPROC": "2"}), 900)
    if result is None:
        return 1
    result["rate"], result["qdisc"] = rate, qdisc
    print(f"{'pass':>4} {'policy':7} {'program':8} {'median ms':>10} {'p90 ms':>8}")
    for r in result["rows"]:
        print(f"{r['pass']:>4} {r['policy']:7} {r['program']:8} {r['median_s'] * 1e3:>10.2f} "
              f"{r['p90_s'] * 1e3:>8.2f}")
    out = RESULTS / f"gloo_loop_policies_{rate or 'lo'}.json"
    write_result(out, result)
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
