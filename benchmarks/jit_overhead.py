"""What ``disco_jax.jit`` adds to a train step's calls, with a plan stored.

* **First call** (``ENABLE_SEARCH=0``, a plan stored for the step): the wrapper lowers the
  step, prints its HLO, fingerprints it, reads and checks the store entry (JSON, sha256,
  XLA's parse of the stored HLO), then compiles the stored program. Measured: each of
  those parts alone, and the whole first call against compiling the stored program
  directly (:func:`disco_jax.enactment.build`) and calling it once.
* **Later calls**: the wrapper against calling the compiled program it runs directly
  (and against ``jax.jit`` of the step, for reference), interleaved in rounds, each
  sample ``--calls`` calls each waited for; medians. Target: within 2%.

The stored plan is the step's ``bucketed_1MiB`` program (no search needed to measure the
wrapper). Prints a table and writes ``benchmarks/results/jit_overhead.json`` atomically.

    python benchmarks/jit_overhead.py                  # vgg and transformer, tiny
    python benchmarks/jit_overhead.py --models vgg --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import disco_jax  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from disco_jax import store as st  # noqa: E402
from disco_jax.enactment import Enactment, build  # noqa: E402
from disco_jax.jit import DiscoFallbackWarning  # noqa: E402
from hlo_tools import baselines as bl  # noqa: E402
from hlo_tools.jax_bridge import fresh_function, lowered_text  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "jit_overhead.json"


def _stored_plan(step, args, root: Path) -> tuple[str, Enactment]:
    """Stores the step's 1 MiB-bucketed program as its plan; returns (key, enactment)."""
    cand = bl.compile_bucketed(fresh_function(step), args, 1 << 20)
    enactment = Enactment.single("bucketed_1MiB", cand.run.hlo_text, exact=False,
                                 compiler_options=dict(cand.run.compiler_options))
    key = st.source_fingerprint(lowered_text(jax.jit(step).lower(*args)))
    record = st.make_record(key, st.Setup.current(), enactment_fingerprint=enactment.fingerprint,
                            choice=enactment.name, hardware=None, hardware_sha256=None,
                            predicted_s={}, measured_s={}, search=None)
    st.write_entry(key, record, enactment, root=root)
    return key, enactment


def _timed(fn, args, k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / k


def first_call(step, args, root: Path, key: str, enactment: Enactment, reps: int) -> dict:
    """Seconds of the first call's parts, medians over ``reps`` fresh functions."""
    parts: dict[str, list[float]] = {k: [] for k in (
        "lower_and_print_s", "fingerprint_s", "store_lookup_s", "wrapper_first_call_s",
        "direct_build_and_call_s")}
    setup = st.Setup.current()
    for _ in range(reps):
        fn = fresh_function(step)
        t0 = time.perf_counter()
        text = lowered_text(jax.jit(fn).lower(*args))
        t1 = time.perf_counter()
        fp = st.source_fingerprint(text)
        t2 = time.perf_counter()
        lookup = st.load_entry(fp, setup, root=root)
        t3 = time.perf_counter()
        assert fp == key and lookup.entry is not None, lookup.reason
        parts["lower_and_print_s"].append(t1 - t0)
        parts["fingerprint_s"].append(t2 - t1)
        parts["store_lookup_s"].append(t3 - t2)

        wrapped = disco_jax.jit(fresh_function(step), store=root)
        t0 = time.perf_counter()
        jax.block_until_ready(wrapped(*args))
        parts["wrapper_first_call_s"].append(time.perf_counter() - t0)
        assert wrapped.last_run_info.mode == "stored", wrapped.last_run_info

        t0 = time.perf_counter()
        run = build(enactment, jax.jit(fresh_function(step)), args)
        jax.block_until_ready(run(*args))
        parts["direct_build_and_call_s"].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in parts.items()}
    out["added_s"] = out["wrapper_first_call_s"] - out["direct_build_and_call_s"]
    return out


def later_calls(step, args, root: Path, enactment: Enactment, rounds: int, calls: int
                ) -> dict:
    """Per-call seconds, interleaved rounds: wrapper, the compiled program, jax.jit."""
    wrapped = disco_jax.jit(fresh_function(step), store=root)
    jax.block_until_ready(wrapped(*args))
    direct = build(enactment, jax.jit(fresh_function(step)), args).compiled
    plain = jax.jit(fresh_function(step))
    runs = {"disco_jax.jit": wrapped, "compiled": direct, "jax.jit": plain}
    for fn in runs.values():
        _timed(fn, args, 3)
    samples: dict[str, list[float]] = {n: [] for n in runs}
    for r in range(rounds):
        order = list(runs)[r % 3:] + list(runs)[:r % 3]
        for name in order:
            samples[name].append(_timed(runs[name], args, calls))
    med = {n: statistics.median(s) for n, s in samples.items()}
    ratios = [w / c for w, c in zip(samples["disco_jax.jit"], samples["compiled"])]
    return {"median_s": med, "samples_s": samples,
            "wrapper_over_compiled": statistics.median(ratios),
            "added_us_per_call": (med["disco_jax.jit"] - med["compiled"]) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="vgg,transformer")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--calls", type=int, default=20, help="calls per sample (default 20)")
    ap.add_argument("--reps", type=int, default=3, help="first calls measured (default 3)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    os.environ["ENABLE_SEARCH"] = "0"
    warnings.simplefilter("error", DiscoFallbackWarning)
    rows = []
    with tempfile.TemporaryDirectory(prefix="disco_store_") as tmp:
        for model in a.models.split(","):
            step, args = disco_jax.zoo.get(model)(4, a.size)
            key, enactment = _stored_plan(step, args, Path(tmp))
            first = first_call(step, args, Path(tmp), key, enactment, a.reps)
            later = later_calls(step, args, Path(tmp), enactment, a.rounds, a.calls)
            rows.append({"model": model, "size": a.size, "first_call": first,
                         "later_calls": later})
            print(f"[{model}] done", file=sys.stderr, flush=True)
    print(f"\n{'model':<13}{'lower+print':>12}{'fingerprint':>12}{'lookup':>9}"
          f"{'1st: wrapper':>14}{'1st: direct':>13}{'added':>9}"
          f"{'later: wrapper':>16}{'compiled':>10}{'jax.jit':>9}{'ratio':>8}{'added':>10}")
    for r in rows:
        f, lc = r["first_call"], r["later_calls"]
        m = lc["median_s"]
        print(f"{r['model']:<13}{f['lower_and_print_s'] * 1e3:10.1f}ms"
              f"{f['fingerprint_s'] * 1e3:10.2f}ms{f['store_lookup_s'] * 1e3:7.1f}ms"
              f"{f['wrapper_first_call_s']:13.2f}s{f['direct_build_and_call_s']:12.2f}s"
              f"{f['added_s'] * 1e3:7.0f}ms"
              f"{m['disco_jax.jit'] * 1e3:14.3f}ms{m['compiled'] * 1e3:8.3f}ms"
              f"{m['jax.jit'] * 1e3:7.3f}ms{lc['wrapper_over_compiled']:8.3f}"
              f"{lc['added_us_per_call']:8.1f}us")
    write_result(a.out, {"rows": rows, "settings": vars(a),
                         "setup": st.Setup.current()._asdict(), "host_cpus": os.cpu_count()})
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
