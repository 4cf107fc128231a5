"""Measured per-iteration time of the paper's four baselines on every zoo model.

For each model (``tiny`` by default) the four baselines of :mod:`hlo_tools.baselines`
(``no_fusion``, ``op_fusion``, ``allreduce_fusion``, ``xla_default``) are compiled in one
process with 4 host CPU devices. Each sample is the mean of ``inner`` back-to-back
iterations (each waited for with ``block_until_ready``), ``inner`` chosen per model so a
sample lasts at least ``--min-sample-ms``. The baselines are interleaved (rotated each
repeat) so that load from other processes on this shared machine falls on all of them
alike. Reported: median, p25 and p75 of ``--repeats`` samples after ``--warmup`` calls,
the ratio to ``xla_default``, what each baseline fused and combined
(:func:`hlo_tools.baselines.summary`), and the largest output difference to
``xla_default``. Writes ``benchmarks/results/baselines.json`` atomically.

Run from the repository root::

    python benchmarks/baselines.py [--size tiny] [--models vgg,resnet] [--repeats 30]
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()

import argparse  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.provenance import write_result  # noqa: E402
from disco_jax import zoo  # noqa: E402
from hlo_tools import baselines as bl  # noqa: E402
from hlo_tools.jax_bridge import CompiledHlo  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "baselines.json"
NUM_DEVICES = 4
REFERENCE = "xla_default"
MAX_INNER = 100

__all__ = ["main", "measure_model"]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", help="zoo size (tiny, small)")
    p.add_argument("--models", default=",".join(zoo.names()),
                   help="comma-separated zoo models (default: all)")
    p.add_argument("--repeats", type=int, default=30, help="timed samples per baseline")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per baseline")
    p.add_argument("--min-sample-ms", type=float, default=5.0,
                   help="each sample averages enough iterations to last this long")
    p.add_argument("--threshold-bytes", type=int, default=None,
                   help="AllReduce combine threshold (default: XLA's; 0 disables)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    return p.parse_args(argv)


def _call(run: CompiledHlo, args: tuple[Any, ...]) -> Any:
    """One iteration, waited for."""
    return jax.block_until_ready(run(*args))


def _compile_all(step: Any, args: tuple[Any, ...],
                 threshold: int | None) -> tuple[dict[str, CompiledHlo], dict[str, float]]:
    """Compiles every baseline; returns the programs and their compile seconds."""
    runs, seconds = {}, {}
    for name in bl.BASELINES:
        t0 = time.perf_counter()
        runs[name] = bl.compile_baseline(step, args, name, threshold_bytes=threshold)
        seconds[name] = time.perf_counter() - t0
    return runs, seconds


def _max_diff(out: Any, ref: Any) -> float:
    """Largest absolute difference between two output pytrees."""
    pairs = zip(jax.tree.leaves(out), jax.tree.leaves(ref))
    return max((float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0))
                for a, b in pairs), default=0.0)


def _inner(runs: dict[str, CompiledHlo], args: tuple[Any, ...], min_sample_s: float) -> int:
    """Iterations per sample so the fastest baseline's sample lasts ``min_sample_s``."""
    fastest = math.inf
    for run in runs.values():
        t0 = time.perf_counter()
        _call(run, args)
        fastest = min(fastest, time.perf_counter() - t0)
    return max(1, min(MAX_INNER, math.ceil(min_sample_s / max(fastest, 1e-9))))


def _sample(run: CompiledHlo, args: tuple[Any, ...], inner: int) -> float:
    """Mean seconds per iteration over ``inner`` back-to-back iterations."""
    t0 = time.perf_counter()
    for _ in range(inner):
        _call(run, args)
    return (time.perf_counter() - t0) / inner


def _time_interleaved(runs: dict[str, CompiledHlo], args: tuple[Any, ...], repeats: int,
                      inner: int) -> dict[str, list[float]]:
    """``repeats`` samples per baseline; the baseline order rotates every repeat."""
    names = list(runs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_sample(runs[name], args, inner))
    return samples


def _stats(xs: list[float]) -> dict[str, float]:
    p25, med, p75 = np.percentile(xs, [25, 50, 75])
    return {"median_s": float(med), "p25_s": float(p25), "p75_s": float(p75),
            "min_s": float(min(xs)), "max_s": float(max(xs))}


def measure_model(name: str, size: str, repeats: int, warmup: int, min_sample_s: float,
                  threshold: int | None) -> dict[str, Any]:
    """Compiles, checks and times the four baselines of one zoo model."""
    step, args = zoo.get(name)(NUM_DEVICES, size)
    runs, compile_s = _compile_all(step, args, threshold)
    outputs = {b: _call(run, args) for b, run in runs.items()}
    for _ in range(warmup - 1):
        for run in runs.values():
            _call(run, args)
    inner = _inner(runs, args, min_sample_s)
    samples = _time_interleaved(runs, args, repeats, inner)
    ref = _stats(samples[REFERENCE])["median_s"]
    rows = {}
    for b, run in runs.items():
        stats = _stats(samples[b])
        rows[b] = {
            **stats,
            "vs_xla_default": stats["median_s"] / ref,
            "compile_s": compile_s[b],
            "max_abs_diff_vs_xla_default": _max_diff(outputs[b], outputs[REFERENCE]),
            "compiler_options": dict(run.compiler_options),
            "emulated_threshold": run.hlo_text is not None,
            "summary": bl.summary(bl.module_from_compiled(run)),
        }
    return {"inner": inner, "repeats": repeats, "baselines": rows}


def _print_table(results: dict[str, dict[str, Any]]) -> None:
    head = (f"{'model':<15} {'baseline':<17} {'median ms':>9} {'p25-p75 ms':>15} "
            f"{'vs default':>10} {'multi-op fus':>12} {'all-reduces':>11} {'tensors':>7}")
    print(head)
    print("-" * len(head))
    for model, res in results.items():
        for b, row in res["baselines"].items():
            s = row["summary"]
            spread = f"{row['p25_s'] * 1e3:.3f}-{row['p75_s'] * 1e3:.3f}"
            print(f"{model:<15} {b:<17} {row['median_s'] * 1e3:>9.3f} {spread:>15} "
                  f"{row['vs_xla_default']:>10.3f} {s['multi_op_fusions']:>12} "
                  f"{s['all_reduces']:>11} {s['all_reduced_tensors']:>7}")


def _meta(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "size": args.size, "devices": NUM_DEVICES, "repeats": args.repeats,
        "warmup": args.warmup, "min_sample_ms": args.min_sample_ms,
        "threshold_bytes": args.threshold_bytes, "jax": jax.__version__,
        "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
        "load_avg_start": os.getloadavg(), "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 1 if some model failed."""
    args = _parse_args(argv)
    meta = _meta(args)
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    for name in [m for m in args.models.split(",") if m]:
        t0 = time.perf_counter()
        try:
            results[name] = measure_model(name, args.size, args.repeats, args.warmup,
                                          args.min_sample_ms / 1e3, args.threshold_bytes)
        except Exception:  # keep measuring the other models; report this one
            failures[name] = traceback.format_exc(limit=3)
            print(f"{name}: FAILED\n{failures[name]}")
            continue
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    meta["load_avg_end"] = os.getloadavg()
    _print_table(results)
    write_result(args.out, {"meta": meta, "models": results, "failures": failures})
    print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
