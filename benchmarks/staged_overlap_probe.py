"""How far a staged step stays from "first stage + all communication", per setting.

Transformer (``--model``, ``--size large``) as a 4-bucket staged step in 2 gloo processes,
each pinned to its own CPU, over the emulated 1 Gbit/s link (``unshare -n`` + ``tc tbf
rate 1gbit burst 128kb``; needs root). One launch per setting (a setting is the pool size
``NPROC`` and the all-reduce chunking: settings cannot share a process); in each, the
staged step's median over 9 calls, ``jax.jit``'s beside it, every program alone
(:meth:`disco_jax.enactment.staged.StagedStep.parts`) and the self-test. ``lost`` is the staged
step minus (first stage + communication alone), the within-step bound with the two
streams not sharing the CPU.

    sudo python benchmarks/staged_overlap_probe.py [--settings nproc4:1mib,nproc2:none]

Prints a table and writes ``benchmarks/results/staged_overlap_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "staged_overlap_probe.json"
SETTINGS = "nproc4:1mib,nproc4:none,nproc2:1mib,nproc2:none"


def _worker(a: argparse.Namespace) -> None:
    from disco_estimator.gloo import pin_to_own_cpu

    pin_to_own_cpu(a.process_id)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(a.coordinator, num_processes=2, process_id=a.process_id,
                               initialization_timeout=120)
    from jax.experimental import multihost_utils as mu

    from disco_jax import zoo
    from disco_jax.enactment.staged import CHUNK_BYTES, staged_step

    step, args = zoo.get(a.model)(jax.device_count(), a.size)
    chunk = None if a.chunk == "none" else CHUNK_BYTES
    staged, plain = staged_step(step, args, buckets=4, chunk_bytes=chunk), jax.jit(step)

    def timed(fn, n):
        out = []
        for _ in range(n):
            mu.sync_global_devices("t")
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out.append(time.perf_counter() - t0)
        return out

    timed(staged, 2), timed(plain, 2)
    got: dict[str, list[float]] = {"staged": [], "jax.jit": []}
    for _ in range(3):  # interleaved
        got["staged"] += timed(staged, 3)
        got["jax.jit"] += timed(plain, 3)
    parts = staged.parts(*args, barrier=mu.sync_global_devices)
    check = staged.self_test(*args, barrier=mu.sync_global_devices)
    if a.process_id == 0:
        Path(a.out).write_text(json.dumps({
            "staged_s": statistics.median(got["staged"]),
            "jit_s": statistics.median(got["jax.jit"]), "samples_s": got,
            "stage_s": parts.stage_s, "comm_s": parts.comm_s,
            "bound_s": parts.stage_s[0] + sum(parts.comm_s), "self_test": check._asdict()}))
    jax.distributed.shutdown()


def _launch(a: argparse.Namespace) -> None:
    from disco_estimator.gloo import child_env, run_local_job, set_loopback_rate

    print(set_loopback_rate("1gbit", a.parent_netns, "128kb"), file=sys.stderr)
    if any(run_local_job(
            lambda i, coordinator: [sys.executable, __file__, "worker", "--model", a.model,
                                    "--size", a.size, "--chunk", a.chunk, "--out", a.out,
                                    "--coordinator", coordinator, "--process-id", str(i)],
            2, timeout_s=900, env=child_env(1, {"NPROC": a.nproc}), grace_s=30.0)):
        raise SystemExit("workers failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="parent", choices=("parent", "launch", "worker"))
    ap.add_argument("--settings", default=SETTINGS)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--size", default="large")
    ap.add_argument("--nproc", default="4")
    ap.add_argument("--chunk", default="1mib")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--parent-netns", default="")
    a = ap.parse_args()
    if a.mode == "worker":
        return _worker(a)
    if a.mode == "launch":
        return _launch(a)
    from benchmarks.provenance import write_result
    from disco_estimator.gloo import child_env, run_bounded

    rows = []
    print(f"{'setting':14s} {'staged':>7s} {'jax.jit':>8s} {'first':>6s} {'comm':>6s} "
          f"{'bound':>6s} {'lost':>6s}  self-test together/alone (ms)")
    for setting in a.settings.split(","):
        nproc, _, chunk = setting.partition(":")
        tmp = Path(a.out).with_suffix(".part")
        run_bounded(["unshare", "-n", sys.executable, __file__, "launch", "--model", a.model,
                     "--size", a.size, "--nproc", nproc.removeprefix("nproc"),
                     "--chunk", chunk, "--out", str(tmp),
                     "--parent-netns", os.readlink("/proc/self/ns/net")], child_env(1), 1000)
        r = {"setting": setting, **json.loads(tmp.read_text())}
        tmp.unlink()
        rows.append(r)
        st = r["self_test"]
        print(f"{setting:14s} {r['staged_s'] * 1e3:7.0f} {r['jit_s'] * 1e3:8.0f} "
              f"{r['stage_s'][0] * 1e3:6.0f} {sum(r['comm_s']) * 1e3:6.0f} "
              f"{r['bound_s'] * 1e3:6.0f} {(r['staged_s'] - r['bound_s']) * 1e3:+6.0f}  "
              f"{st['together_s'] * 1e3:.0f}/{(st['wait_s'] + st['compute_s']) * 1e3:.0f}",
              flush=True)
        write_result(a.out, {"rows": rows, "meta": vars(a)})


if __name__ == "__main__":
    main()
