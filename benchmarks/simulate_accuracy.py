"""``disco simulate`` on train steps that are not zoo models, given as XLA's compiled
module and as the pre-optimization module: predicted against measured iteration time.

For each held-out step (``benchmarks/heldout_steps.py``; one process, 4 host devices):

1. this process lowers and compiles the step and writes both modules to a temporary
   directory (``lowered.as_text(dialect="hlo")``, ``compiled.as_text()``);
2. ``disco simulate --json`` runs on each, a fresh process each, in context by default
   (the compiled module run as written, the pre-optimization one compiled with nothing
   fused and with one bucket), and once more on the compiled module with
   ``--no-in-context`` (its costs without running it: standalone op times and the
   fused-op rule);
3. this process measures what each file is, interleaved in rounds before and after the
   ``simulate`` processes (pooled): ``jax.jit``'s program of the step for the compiled
   module, and the pre-optimization module compiled as written (nothing fused, dots on
   the kernel library, as ``simulate`` compiles it) for the pre-optimization one; and
   beside them the compiled module compiled again from its text, as ``simulate`` runs it
   (``again/jit``: 1.00 when XLA makes the same program of it).

Error: ``|predicted - measured| / measured``. For the compiled module the table also
shows the simulator at the traced times, before the compute scale is fitted to the
iteration ``simulate`` measured itself. Prints a table and writes
``benchmarks/results/simulate_accuracy.json``.

    python benchmarks/simulate_accuracy.py
    python benchmarks/simulate_accuracy.py --steps mixer --rounds 3
    python benchmarks/simulate_accuracy.py --variant before=../other-checkout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import heldout_steps  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "simulate_accuracy.json"
DEVICES = 4
#: the target of the mean error, compiled and pre-optimization modules alike
TARGET = 0.10


def _simulate(path: Path, *extra: str, root: Path = ROOT) -> dict:
    """``disco simulate --json`` on ``path`` in a fresh process running the checkout at
    ``root``; its report and wall time."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "disco_jax", "simulate", "--json", *extra,
                           str(path)], capture_output=True, text=True, cwd=root, env=env,
                          timeout=900)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"disco simulate {path.name} {' '.join(extra)} exited "
                           f"{done.returncode}: {done.stderr.strip()[-500:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["simulate_wall_s"] = wall
    return report


def _error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def measure_step(name: str, size: str, rounds: int, repeats: int, tmp: Path,
                 variants: dict[str, Path] | None = None) -> dict:
    """One step's row: the modules, then ``repeats`` times the three ``simulate`` runs
    between two measurements; each repeat's error is against that repeat's measurements,
    the row's is the median over repeats.

    ``variants`` (label: checkout) run the same three ``simulate`` runs from other
    checkouts between the same two measurements, alternating with this one (the order
    alternates per repeat); their columns are named ``label:column``."""
    import jax

    import hlo_tools
    from disco_jax.pipeline.choose import measure
    from disco_jax.pipeline.profile import compile_again
    from hlo_tools.jax_bridge import CompileOptions, InPlaceOf, compile_module

    step, args = getattr(heldout_steps, name)(DEVICES, size)
    lowered = jax.jit(step).lower(*args)
    pre_text = lowered.as_text(dialect="hlo")
    compiled = lowered.compile()
    pre, post = tmp / f"{name}.pre.hlo", tmp / f"{name}.compiled.hlo"
    pre.write_text(pre_text)
    post.write_text(compiled.as_text())
    as_written = compile_module(pre_text, InPlaceOf(step, args),
                                CompileOptions(exact=True, library=True))
    again = compile_again(hlo_tools.parse(compiled.as_text()), DEVICES)
    inputs = again.put_random(0)
    runs = {"compiled": compiled, "pre": as_written,
            "compiled_again": lambda *_: again.run(inputs)}
    placed = [jax.device_put(a, s) for a, s in zip(args, compiled.input_shardings[0],
                                                     strict=True)]
    roots = [("", ROOT), *((f"{k}:", v) for k, v in (variants or {}).items())]
    truth_of = {f"{prefix}{k}": v for prefix, _ in roots for k, v in BASE_TRUTH.items()}
    reps, samples = [], {k: [] for k in runs}
    for rep in range(repeats):
        before = measure(runs, placed, rounds=rounds, tag=f"{name}_{rep}_before")
        reports = {}
        for prefix, root in roots if rep % 2 == 0 else roots[::-1]:
            reports[f"{prefix}compiled"] = _simulate(post, root=root)
            reports[f"{prefix}compiled_standalone"] = _simulate(post, "--no-in-context",
                                                                root=root)
            reports[f"{prefix}pre"] = _simulate(pre, root=root)
        after = measure(runs, placed, rounds=rounds, tag=f"{name}_{rep}_after")
        measured = {k: statistics.median([*before[k], *after[k]]) for k in runs}
        for k in runs:
            samples[k] += [*before[k], *after[k]]
        predicted = {k: r["iteration_s"] for k, r in reports.items()}
        for prefix, _ in roots:
            ic = reports[f"{prefix}compiled"]["in_context"]
            if ic.get("profiled"):
                predicted[f"{prefix}compiled_traced"] = ic["traced_s"]
                truth_of[f"{prefix}compiled_traced"] = "compiled"
        reps.append({
            "measured_s": measured, "predicted_s": predicted,
            "errors": {k: _error(p, measured[truth_of[k]]) for k, p in predicted.items()},
            "floor": {k: _error(statistics.median(before[k]), statistics.median(after[k]))
                      for k in ("compiled", "pre")},
            "in_context": {k: r["in_context"] for k, r in reports.items()},
            "simulate_wall_s": {k: r["simulate_wall_s"] for k, r in reports.items()}})

    def median_of(part: str) -> dict:
        keys = set.intersection(*(set(r[part]) for r in reps))
        return {k: statistics.median(r[part][k] for r in reps) for k in sorted(keys)}

    measured = {k: statistics.median(v) for k, v in samples.items()}
    return {"step": name, "size": size, "measured_s": measured, "samples_s": samples,
            "predicted_s": median_of("predicted_s"), "errors": median_of("errors"),
            "floor": median_of("floor"),
            "compiled_again_over_jit": measured["compiled_again"] / measured["compiled"],
            "repeats": reps}


#: which measurement each predicted column is compared with
BASE_TRUTH = {"compiled": "compiled", "compiled_standalone": "compiled", "pre": "pre"}

COLUMNS = (("compiled", "compiled"), ("compiled_traced", "at traced times"),
           ("compiled_standalone", "not run (standalone)"), ("pre", "pre-optimization"))


def summarize(rows: list[dict], variants: tuple[str, ...] = ()) -> dict:
    """Mean and largest error per column over the rows that have it (``variants``: the
    labels of other checkouts' columns, ``label:column``)."""
    out = {}
    for key in [k for k, _ in COLUMNS] + [f"{v}:{k}" for v in variants for k, _ in COLUMNS]:
        errs = [r["errors"][key] for r in rows if key in r.get("errors", {})]
        if errs:
            out[key] = {"mean": statistics.mean(errs), "max": max(errs), "steps": len(errs)}
    for key in ("compiled", "pre"):
        floors = [r["floor"][key] for r in rows if "floor" in r]
        if floors:
            out[f"floor_{key}"] = {"mean": statistics.mean(floors), "max": max(floors),
                                   "steps": len(floors)}
    return out


def print_table(rows: list[dict], summary: dict) -> None:
    ms = 1e3
    print(f"{'step':12s} {'jax.jit':>9s} {'compiled':>9s} {'err':>6s} {'floor':>6s} "
          f"{'traced':>7s} {'not run':>8s} {'again/jit':>9s} | {'as written':>10s} "
          f"{'pre-opt':>9s} {'err':>6s} {'floor':>6s}")
    for r in rows:
        if "error" in r:
            print(f"{r['step']:12s} failed: {r['error']}")
            continue
        m, p, e = r["measured_s"], r["predicted_s"], r["errors"]
        traced = f"{e['compiled_traced']:.1%}" if "compiled_traced" in e else "-"
        f = r["floor"]
        print(f"{r['step']:12s} {m['compiled'] * ms:7.2f}ms {p['compiled'] * ms:7.2f}ms "
              f"{e['compiled']:6.1%} {f['compiled']:6.1%} {traced:>7s} "
              f"{e['compiled_standalone']:8.1%} {r['compiled_again_over_jit']:9.2f} | "
              f"{m['pre'] * ms:8.2f}ms {p['pre'] * ms:7.2f}ms {e['pre']:6.1%} {f['pre']:6.1%}")
    line = ", ".join(f"{label} {summary[k]['mean']:.1%} (max {summary[k]['max']:.1%})"
                     for k, label in COLUMNS if k in summary)
    print(f"mean error: {line}; target <= {TARGET:.0%} for compiled and pre-optimization")
    for variant in sorted({k.split(":")[0] for k in summary if ":" in k}):
        line = ", ".join(f"{label} {summary[f'{variant}:{k}']['mean']:.1%} "
                         f"(max {summary[f'{variant}:{k}']['max']:.1%})"
                         for k, label in COLUMNS if f"{variant}:{k}" in summary)
        print(f"mean error of {variant}, between the same measurements: {line}")
    floors = {k: statistics.mean(r["floor"][k] for r in rows if "floor" in r)
              for k in ("compiled", "pre")} if any("floor" in r for r in rows) else {}
    if floors:
        print(f"mean floor (the measurement before simulate against the one after): "
              f"compiled {floors['compiled']:.1%}, pre-optimization {floors['pre']:.1%}")
    print("jax.jit / as written: measured here, interleaved; compiled / pre-opt: what "
          "disco simulate predicts for the file (errors: median over repeats); traced: the "
          "simulator at the traced op times before the fit; not run: --no-in-context; "
          "again/jit: the compiled module compiled again from its text over jax.jit")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default=",".join(heldout_steps.STEPS),
                    help="held-out steps (default: %(default)s)")
    ap.add_argument("--size", default="small", help="their size (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds before and after simulate (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="simulate runs per file, each between two measurements "
                         "(default: %(default)s)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR",
                    help="also run disco simulate from the checkout DIR, alternating with this "
                         "one between the same measurements (an A/B of two cost models); "
                         "repeatable")
    ap.add_argument("--out", default=str(OUT), help="result JSON (default: %(default)s)")
    args = ap.parse_args(argv)
    variants = {}
    for item in args.variant:
        label, sep, where = item.partition("=")
        if not sep or not label or ":" in label or not (Path(where) / "disco_jax").is_dir():
            ap.error(f"--variant {item!r}: expected LABEL=DIR, DIR a checkout of the project")
        variants[label] = Path(where).resolve()
    rows = []
    with tempfile.TemporaryDirectory(prefix="disco_simulate_accuracy_") as tmp:
        for name in args.steps.split(","):
            print(f"== {name}", file=sys.stderr, flush=True)
            try:
                rows.append(measure_step(name, args.size, args.rounds, args.repeats,
                                         Path(tmp), variants))
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                rows.append({"step": name, "error": str(err)[:500]})
    summary = summarize([r for r in rows if "error" not in r], tuple(variants))
    print_table(rows, summary)
    write_result(args.out, {"rows": rows, "summary": summary, "meta": vars(args)})
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
