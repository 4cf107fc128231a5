"""Fit the linear AllReduce model ``T = C * bytes + D`` on psum microbenchmarks.

Runs each setup (``inproc4``, ``gloo2``, ``gloo2-1gbit``; see ``disco_estimator.allreduce.SETUPS``)
in child processes, prints a table and writes ``benchmarks/results/allreduce_fit.json``;
with ``--write-config`` also the hardware file ``<setup>.toml``, into the user's hardware
directory (``disco_estimator.hardware.user_hardware_dir()``, searched before the shipped files) or
into ``--config-dir`` (``--config-dir disco_estimator/hardware_files`` refreshes the shipped ones).

    python benchmarks/allreduce_fit.py --quick
    python benchmarks/allreduce_fit.py --setups inproc4,gloo2,gloo2-1gbit --write-config

``gloo2-1gbit`` needs root (``unshare -n`` + ``tc``); it only shapes the loopback of a
private network namespace. Every setup is killed after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import write_result  # noqa: E402
from disco_estimator.allreduce import (  # noqa: E402
    FULL_SIZES,
    QUICK_SIZES,
    SETUPS,
    STATISTICS,
    SetupResult,
    run_setup,
)
from disco_estimator.hardware import write_hardware  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "allreduce_fit.json"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="inproc4,gloo2,gloo2-1gbit",
                    help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--quick", action="store_true",
                    help="7 sizes (powers of 16) and fewer repeats instead of 13 (powers of 4)")
    ap.add_argument("--write-config", action="store_true",
                    help="write the hardware file <setup>.toml (see --config-dir)")
    ap.add_argument("--config-dir", type=Path, default=None,
                    help="where --write-config writes (default: the user's hardware "
                         "directory, $DISCO_CONFIG_DIR/hardware or ~/.config/disco_jax/hardware)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per setup")
    ap.add_argument("--stat", choices=STATISTICS, default="median",
                    help="statistic over iterations to fit (p25: robust on a busy machine)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap.parse_args(argv)


def _row(r: SetupResult) -> str:
    f = r.fit
    bw = f.model.bandwidth_bytes_per_s / 1e9
    return (f"{r.setup.name:<12} {f.model.c_s_per_byte:11.4e} {f.model.d_s * 1e6:9.1f} "
            f"{bw:8.3f} {f.mean_rel_err * 100:8.1f} {f.max_rel_err * 100:8.1f} "
            f"{r.wall_fit.model.d_s * 1e6:11.1f} {r.wall_fit.mean_rel_err * 100:9.1f}")


def _print_table(results: list[SetupResult]) -> None:
    print(f"\n{'setup':<12} {'C [s/B]':>11} {'D [us]':>9} {'1/C GB/s':>8} {'mean err%':>8} "
          f"{'max err%':>8} {'wall D [us]':>11} {'wall err%':>9}")
    for r in results:
        print(_row(r))
    stat = results[0].stat if results else "median"
    print(f"\nC, D, errors: fit of the all-reduce op time (profiler trace, min over "
          f"participants, {stat} over iterations), weights 1/T.\nwall: same fit on host "
          "wall time per call (includes ~0.1-0.4 ms launch overhead).")


def _record(results: list[SetupResult], failures: dict[str, str],
            quick: bool) -> dict:
    return {"created": datetime.datetime.now().isoformat(timespec="seconds"),
            "quick": quick, "host_cpus": os.cpu_count(),
            "setups": {r.setup.name: r.to_json() for r in results}, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen setups; returns 1 if any failed."""
    args = _parse_args(argv)
    names = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        sys.exit(f"unknown setups {unknown}; choose from {list(SETUPS)}")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    results, failures = [], {}
    for i, name in enumerate(names, 1):
        print(f"== [{i}/{len(names)}] {name}: {SETUPS[name].description} "
              f"({len(sizes)} sizes, 4 B .. 64 MiB)", flush=True)
        t0 = time.monotonic()
        try:
            results.append(run_setup(name, sizes, args.quick, args.timeout, args.stat))
        except (RuntimeError, TimeoutError, OSError) as e:
            failures[name] = str(e)
            print(f"   FAILED: {e}", flush=True)
            continue
        print(f"   done in {time.monotonic() - t0:.0f} s", flush=True)
        if args.write_config:
            print(f"   wrote {write_hardware(results[-1], args.config_dir)}", flush=True)
    _print_table(results)
    write_result(args.out, _record(results, failures, args.quick))
    print(f"\nwrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
