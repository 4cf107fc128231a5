"""How much one CPU's compute slows down while another CPU of the host computes too.

The CPU setups run two gloo processes pinned one to a CPU each, or four device threads of
one process on the host's CPUs. Where two CPUs share one physical core (hyperthreads of
one core, or a VM whose virtual CPUs a host runs on one core), a kernel's time depends on
whether the other CPU computes at the same moment: one price per kernel cannot hold for
every program (docs/findings.md, "The programs' kernels run at different speeds over 1
Gbit/s").

Per CPU pair, a single-threaded worker pinned to a CPU times a compute-bound matmul
(f32 512x512, about 0.27 GFLOP) and a memory-bound pass (32 MB read and written): alone,
then with an identical worker on the other CPU started at the same moment, then alone
again. ``slowdown`` is the time beside the other worker over the mean alone; 1.0 where
the CPUs share nothing, 2.0 where they share one core's execution units completely.

    python benchmarks/cpu_contention.py            # CPUs 0 and 1, about 20 s
    python benchmarks/cpu_contention.py --cpus 0,1 --repeats 3

Prints a table and writes ``benchmarks/results/cpu_contention.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "cpu_contention.json"
#: one thread per worker: the kernel library's pools would spread onto the other CPU
_ONE_THREAD = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                 "MKL_NUM_THREADS")}


def _worker(cpu: int, seconds: float) -> None:
    """Times both kernels on ``cpu`` for about ``seconds`` each; prints one JSON line of
    the median per-call milliseconds (a minimum would pick the moments the other worker
    was not computing, e.g. while it started)."""
    import numpy as np

    os.sched_setaffinity(0, {cpu})
    rng = np.random.default_rng(cpu)
    a = rng.random((512, 512), dtype=np.float32)
    b = rng.random((512, 512), dtype=np.float32)
    big = rng.random(8_000_000, dtype=np.float32)

    def per_call_ms(fn, reps: int) -> float:
        times = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 3:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t) / reps * 1e3)
        return statistics.median(times)

    a @ b, big * 1.0001  # noqa: B018  (warm-up)
    print(json.dumps({"matmul_ms": per_call_ms(lambda: a @ b, 10),
                      "stream_ms": per_call_ms(lambda: big * 1.0001, 3)}), flush=True)


def _spawn(cpu: int, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--worker", str(cpu), "--seconds",
                             str(seconds)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **_ONE_THREAD})


def _result(proc: subprocess.Popen) -> dict[str, float]:
    out, _ = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"cpu_contention: a worker failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def measure(cpus: tuple[int, int], seconds: float) -> dict[str, dict[str, float]]:
    """One repeat: CPU ``cpus[0]`` alone, both at once, then alone again."""
    first = _result(_spawn(cpus[0], seconds))
    both = [_spawn(c, seconds) for c in cpus]
    beside = [_result(p) for p in both]
    again = _result(_spawn(cpus[0], seconds))
    alone = {k: (first[k] + again[k]) / 2 for k in first}
    return {"alone": alone, "beside": beside[0], "other_beside": beside[1],
            "slowdown": {k: beside[0][k] / alone[k] for k in alone}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default="0,1", help="the two CPUs (default: 0,1)")
    ap.add_argument("--seconds", type=float, default=1.5, help="per kernel and run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.seconds)
        return
    try:
        cpus = tuple(int(c) for c in args.cpus.split(","))
    except ValueError:
        ap.error(f"--cpus: two CPU numbers, e.g. 0,1 (got {args.cpus!r})")
    if len(cpus) != 2 or cpus[0] == cpus[1]:
        ap.error(f"--cpus: two different CPUs (got {args.cpus!r})")
    usable = os.sched_getaffinity(0)
    if not set(cpus) <= usable:
        ap.error(f"--cpus: this process may run on CPUs {sorted(usable)} only")
    print(f"CPUs {cpus[0]} and {cpus[1]}, {args.repeats} repeats of about "
          f"{6 * args.seconds:.0f} s", flush=True)
    repeats = [measure(cpus, args.seconds) for _ in range(args.repeats)]
    summary = {k: statistics.median(r["slowdown"][k] for r in repeats)
               for k in ("matmul_ms", "stream_ms")}
    print(f"{'kernel':10s} {'alone ms':>9s} {'beside ms':>10s} {'slowdown':>9s}")
    for k, label in (("matmul_ms", "matmul"), ("stream_ms", "stream")):
        alone = statistics.median(r["alone"][k] for r in repeats)
        beside = statistics.median(r["beside"][k] for r in repeats)
        print(f"{label:10s} {alone:9.2f} {beside:10.2f} {summary[k]:8.2f}x")
    write_result(args.out, {"cpus": list(cpus), "seconds": args.seconds,
                            "repeats": repeats, "slowdown": summary})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
