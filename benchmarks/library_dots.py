"""Exact plans with and without library kernels for dots and convolutions (XLA:CPU).

For each zoo model one random plan (seed 0, 200 moves) is compiled twice with
``exact=True``: as before (XLA's own dot/convolution emitters) and with ``library=True``
(YNNPACK for single dots and convolutions, as in XLA's default pipeline;
``jax_bridge.plan_library_options``). The two programs run interleaved in one process with
4 host devices; each sample is the mean of enough back-to-back iterations to last
``--min-sample-ms``. Reported: median, p25 and p75 of ``--repeats`` samples each, the
speed-up, and the number of library fusions. Then rnnlm's backward recurrent dot
``f32[8,512] x f32[128,512]^T`` is timed standalone both ways. Writes
``benchmarks/results/library_dots.json`` atomically.

Run from the repository root::

    python benchmarks/library_dots.py [--size small] [--models rnnlm,vgg] [--repeats 20]
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=4"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import hlo_tools  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from disco_jax import zoo  # noqa: E402
from hlo_tools import jax_bridge as jb  # noqa: E402
from hlo_tools import plan as P  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "library_dots.json"
WAYS = ("exact", "exact+library")
RNNLM_DOT = """HloModule rnnlm_backward_dot

ENTRY main {
  a = f32[8,512]{1,0} parameter(0)
  b = f32[128,512]{1,0} parameter(1)
  ROOT d = f32[8,128]{1,0} dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""

__all__ = ["main", "measure_model", "measure_rnnlm_dot"]


def _stats(samples: list[float]) -> dict[str, float]:
    p25, med, p75 = np.percentile(samples, [25, 50, 75])
    return {"median_s": float(med), "p25_s": float(p25), "p75_s": float(p75),
            "samples": len(samples)}


def _interleaved(calls: dict[str, Any], repeats: int, warmup: int,
                 min_sample_s: float) -> dict[str, dict[str, float]]:
    """Per-call seconds of each callable (``call() -> None`` waits for its result),
    sampled in rotating order."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    inner = {}
    for name, call in calls.items():
        t = time.perf_counter()
        call()
        one = max(time.perf_counter() - t, 1e-7)
        inner[name] = max(1, min(1000, int(min_sample_s / one)))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call, n = calls[name], inner[name]
            t = time.perf_counter()
            for _ in range(n):
                call()
            samples[name].append((time.perf_counter() - t) / n)
    return {name: _stats(s) for name, s in samples.items()}


def _library_fusions(text: str) -> int:
    return sum(1 for line in text.splitlines()
               if "kind=kCustom" in line and "__ynn_fusion" in line)


def measure_model(model: str, size: str, repeats: int, warmup: int,
                  min_sample_s: float, seed: int = 0, moves: int = 200) -> dict[str, Any]:
    """Both compilations of one random plan of ``model``, timed interleaved."""
    step, args = zoo.get(model)(4, size)
    module = hlo_tools.parse(hlo_tools.extract(step, *args))
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed), moves)
    text = hlo_tools.to_text(hlo_tools.apply_plan(module, plan, graph))
    runs, compile_s = {}, {}
    for way in WAYS:
        t = time.perf_counter()
        runs[way] = jb.compile_module(text, jb.InPlaceOf(step, args),
                                      jb.CompileOptions(exact=True, library=way != "exact"))
        compile_s[way] = time.perf_counter() - t
    outs = {way: jax.tree.leaves(run(*args)) for way, run in runs.items()}
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(*outs.values()))
    calls = {way: (lambda run=run: jax.block_until_ready(run(*args))) for way, run in runs.items()}
    times = _interleaved(calls, repeats, warmup, min_sample_s)
    return {"model": model, "size": size, "seed": seed, "moves": moves, "times": times,
            "speedup": times["exact"]["median_s"] / times["exact+library"]["median_s"],
            "library_fusions": _library_fusions(runs["exact+library"].as_text()),
            "compile_s": compile_s, "max_abs_diff": diff}


def measure_rnnlm_dot(repeats: int, warmup: int, min_sample_s: float) -> dict[str, Any]:
    """rnnlm's backward recurrent dot, standalone, on XLA's dot thunk and in YNNPACK."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 512), dtype=np.float32)
    b = rng.standard_normal((128, 512), dtype=np.float32)
    runs = {"exact": jb.compile_module(RNNLM_DOT, jb.Standalone(), jb.CompileOptions(exact=True)),
            # a plan's library options (plan_library_options), as a planned dot runs
            "exact+library": jb.compile_module(RNNLM_DOT, jb.Standalone(),
                                               jb.CompileOptions(exact=True, library=True))}
    placed = {way: run.put(a, b) for way, run in runs.items()}
    calls = {way: (lambda run=run, p=placed[way]: run.run(p)) for way, run in runs.items()}
    times = _interleaved(calls, repeats, warmup, min_sample_s)
    return {"shape": "f32[8,512] x f32[128,512]^T", "times": times,
            "speedup": times["exact"]["median_s"] / times["exact+library"]["median_s"],
            "library_fusions": _library_fusions(runs["exact+library"].as_text())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="zoo size (tiny, small)")
    p.add_argument("--models", default=",".join(sorted(zoo.MODELS)))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-sample-ms", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    min_s = a.min_sample_ms / 1000
    rows = []
    print(f"{'model':16} {'size':6} {'exact ms (p25-p75)':>26} {'+library ms (p25-p75)':>26} "
          f"{'speedup':>8} {'ynn':>4}")
    for model in a.models.split(","):
        row = measure_model(model, a.size, a.repeats, a.warmup, min_s)
        rows.append(row)
        e, lib = row["times"]["exact"], row["times"]["exact+library"]
        print(f"{model:16} {a.size:6} "
              f"{e['median_s']*1e3:9.3f} ({e['p25_s']*1e3:.3f}-{e['p75_s']*1e3:.3f}) "
              f"{lib['median_s']*1e3:9.3f} ({lib['p25_s']*1e3:.3f}-{lib['p75_s']*1e3:.3f}) "
              f"{row['speedup']:8.2f} {row['library_fusions']:4d}", flush=True)
    dot = measure_rnnlm_dot(a.repeats, a.warmup, min_s)
    e, lib = dot["times"]["exact"], dot["times"]["exact+library"]
    print(f"rnnlm backward dot {dot['shape']}: exact {e['median_s']*1e6:.1f} us "
          f"({e['p25_s']*1e6:.1f}-{e['p75_s']*1e6:.1f}), library {lib['median_s']*1e6:.1f} us "
          f"({lib['p25_s']*1e6:.1f}-{lib['p75_s']*1e6:.1f}), speedup {dot['speedup']:.2f}")
    write_result(a.out, {"backend": jb.backend_info(), "rows": rows, "rnnlm_dot": dot,
                         "repeats": a.repeats, "min_sample_ms": a.min_sample_ms})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
