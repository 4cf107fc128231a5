"""DisCo on the accelerator this process runs on: one script that checks and measures what a
GPU user meets, and writes it to ``benchmarks/results/gpu_check.json``.

Per zoo model and size (on every local device of the backend):

* **route**: whether the backend compiles hand-written fusions
  (:func:`hlo_tools.jax_bridge.probe_route`; on XLA:GPU through the PJRT plugin's own
  compile of HLO); a random plan with fusions (written for the backend,
  ``apply_plan(backend=...)``) and a plan of AllReduce buckets are compiled as that route
  compiles plans; each that compiles is run against ``jax.jit`` (rtol 1e-5), the fused
  plan's fusions are looked up in XLA's optimized module
  (:func:`hlo_tools.gpu_legal.fusions_kept`), and both are timed against ``jax.jit``'s own
  program, interleaved.
* **search phase**: ``disco_jax.jit`` under ``ENABLE_SEARCH=1`` (first-call seconds beside
  ``jax.jit``'s, the mode and choice, outputs against ``jax.jit``'s); **enactment phase**:
  a fresh wrapper under ``ENABLE_SEARCH=0`` (mode ``stored``, outputs).
* **speed**: XLA's default (``jax.jit``) and the stored program, interleaved rounds;
  ``measured_s`` holds their medians (DisCo must not be slower by more than 2%).
* **op times** (``--profiles DIR``): the step's ops timed in its no-fusion program here
  (an :class:`disco_estimator.ops.OpProfile`), for ``disco bench --predict-only
  --profile`` with the shipped GPU hardware files.

Then the wrapper's cost per call on a small step (``examples/train.py``'s MLP): ``jax.jit``
against ``disco_jax.jit`` with nothing stored (fallback) and with a stored program,
interleaved.

    python benchmarks/gpu_check.py                                  # on a GPU (~8 min)
    python benchmarks/gpu_check.py --models vgg --sizes tiny --budget 1 --rounds 3 \\
        --out /tmp/gpu_check.json                                   # a CPU rehearsal
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # CPU only

import jax  # noqa: E402
import numpy as np  # noqa: E402

import disco_jax  # noqa: E402
import hlo_tools  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from disco_jax import zoo  # noqa: E402
from disco_jax.jit import DiscoFallbackWarning  # noqa: E402
from disco_jax.pipeline.candidates import plan_compile_options  # noqa: E402
from hlo_tools import jax_bridge as jb  # noqa: E402
from hlo_tools import plan as P  # noqa: E402
from hlo_tools.dirs import write_atomic  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
RTOL, ATOL = 1e-5, 1e-6


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _same(got, want) -> tuple[bool, float]:
    """Whether two output pytrees agree within rtol/atol, and the largest difference."""
    worst, ok = 0.0, True
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            return False, float("inf")
        if a.size:
            worst = max(worst, float(np.max(np.abs(a - b))))
        ok = ok and bool(np.allclose(a, b, rtol=RTOL, atol=ATOL, equal_nan=True))
    return ok, worst


def _timed_first(fn, args) -> tuple[float, object]:
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - t, out


def _interleaved(runs: dict, args, rounds: int, min_sample_s: float) -> dict[str, float]:
    """Median seconds per call of each program: ``rounds`` rounds, each program once per
    round (order rotated), each sample ``k`` calls waited for at the end."""
    for fn in runs.values():
        jax.block_until_ready(fn(*args))
    k = 1
    while True:  # calls per sample: the slowest program's sample lasts min_sample_s
        t = time.perf_counter()
        for fn in runs.values():
            out = None
            for _ in range(k):
                out = fn(*args)
            jax.block_until_ready(out)
        if time.perf_counter() - t >= min_sample_s * len(runs) or k >= 4096:
            break
        k *= 2
    samples: dict[str, list[float]] = {n: [] for n in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, out = runs[name], None
            t = time.perf_counter()
            for _ in range(k):
                out = fn(*args)
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - t) / k)
    return {n: statistics.median(s) for n, s in samples.items()}


def _wrapped(step, flag: str | None, store: Path, budget: float):
    if flag is None:
        os.environ.pop("ENABLE_SEARCH", None)
    else:
        os.environ["ENABLE_SEARCH"] = flag
    return disco_jax.jit(step, store=store, time_budget_s=budget)


def _route_checks(step, args, want, plain, rounds: int, min_sample_s: float) -> dict:
    """The route and, for one plan with fusions (written for this backend) and one of
    buckets: whether it compiles as the route compiles plans, keeps its fusions in XLA's
    optimized module, computes what jax.jit computes, and how fast it runs against
    jax.jit's own program (interleaved rounds)."""
    from hlo_tools.gpu_legal import fusions_kept

    platform = jax.default_backend()
    backend = jb.platform_family(platform) or "cpu"
    route = jb.probe_route(platform)
    step = jb.fresh_function(step)
    module = hlo_tools.parse(jb.extract(step, *args))
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    fused = hlo_tools.random_plan(module, seed=0, moves=200)
    plans = {"fused_plan": (fused, {"exact": True, "library": True}),
             "bucket_plan": (P.bucket_plan(space, 4 << 20), plan_compile_options(route))}
    out = {"route": route.to_json()}
    for name, (plan, how) in plans.items():
        written = hlo_tools.apply_plan(module, plan, graph, backend=backend)
        text = hlo_tools.to_text(written)
        row = {"fusions": sum(1 for ms in plan.groups().values() if len(ms) > 1
                              and graph.opcodes[ms[0]] != "all-reduce"),
               "exact": how.get("exact", False)}
        try:
            t = time.perf_counter()
            run = jb.compile_module(text, jb.InPlaceOf(step, args), jb.CompileOptions(
                how["exact"], how.get("library", False), how.get("compiler_options")))
            row["compile_s"] = time.perf_counter() - t
            row["compiles"] = True
            row["same_as_jax_jit"], row["max_abs_diff"] = _same(run(*args), want)
            if how.get("exact"):
                kept = fusions_kept(written, hlo_tools.parse(run.as_text()))
                row["fusions_kept"] = kept._asdict()
            row["measured_s"] = _interleaved({"jax_jit": plain, name: run}, args, rounds,
                                             min_sample_s)
        except Exception as err:  # noqa: BLE001 - what the backend says is the finding
            row["compiles"] = row.get("compiles", False)
            row["error"] = (str(err).strip().splitlines() or [""])[0][:300]
        out[name] = row
    return out


def check_model(model: str, size: str, budget: float, rounds: int, min_sample_s: float,
                profiles: Path | None) -> dict:
    n = jax.local_device_count()
    step, args = zoo.get(model)(n, size)
    row: dict = {"model": model, "size": size, "devices": n}
    plain = jax.jit(step)
    row["jax_jit_first_call_s"], want = _timed_first(plain, args)
    row.update(_route_checks(step, args, want, plain, rounds, min_sample_s))
    with tempfile.TemporaryDirectory(prefix="gpu_check_store_") as tmp:
        store = Path(tmp)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            searched = _wrapped(step, "1", store, budget)
            row["search_first_call_s"], got = _timed_first(searched, args)
            info = searched.last_run_info
            stored = _wrapped(step, "0", store, budget)
            row["stored_first_call_s"], got0 = _timed_first(stored, args)
            info0 = stored.last_run_info
        row["warnings"] = [str(w.message)[:300] for w in seen
                           if issubclass(w.category, DiscoFallbackWarning)]
        row["search"] = {"mode": info.mode, "choice": info.choice, "reason": info.reason,
                         "predicted_s": info.predicted_s, "measured_s": info.measured_s}
        row["stored"] = {"mode": info0.mode, "choice": info0.choice, "reason": info0.reason}
        same1, diff1 = _same(got, want)
        same0, diff0 = _same(got0, want)
        row["same_as_jax_jit"] = same1 and same0
        row["max_abs_diff"] = max(diff1, diff0)
        if info.store_path:
            record = json.loads((Path(info.store_path) / "record.json").read_text())
            row["candidates_measured_s"] = record.get("measured_s")
            row["route_recorded"] = record.get("route")
            row["pipeline_s"] = record.get("pipeline_s")
        medians = _interleaved({"xla_default": plain, "disco": stored}, args, rounds,
                               min_sample_s)
    row["measured_s"] = medians
    row["speedup"] = medians["xla_default"] / medians["disco"]
    row["not_slower"] = medians["disco"] <= 1.02 * medians["xla_default"]
    if profiles is not None:
        from disco_estimator.ops import profile_ops

        text = jb.extract(jb.fresh_function(step), *args)
        run = jb.compile_module(text, jb.InPlaceOf(jb.fresh_function(step), args),
                                jb.CompileOptions(exact=True, library=True))
        prof = profile_ops(run, *args, iterations=5, warmup=2)
        path = profiles / f"gpu_op_times_{model}_{size}.json"
        write_atomic(path, json.dumps(prof.to_json()))
        row["op_times"] = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return row


def _train_module():
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # flax's dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_overhead(width: int, batch: int, rounds: int, calls: int, budget: float) -> dict:
    """``jax.jit`` against ``disco_jax.jit`` with nothing stored and with a stored program,
    on ``examples/train.py``'s MLP: median seconds per step of ``calls`` back-to-back steps
    (state fed back), rounds interleaved."""
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as PS

    ex = _train_module()
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
    model, optimizer = ex.MLP(width=width), optax.adam(1e-3)
    step = ex.make_train_step(model, optimizer, mesh)
    rng = np.random.default_rng(0)
    x_host = rng.normal(size=(batch, 784)).astype(np.float32)
    y_host = rng.integers(0, 10, batch).astype(np.int32)
    params = model.init(jax.random.key(0), x_host[:1])["params"]
    params = jax.device_put(params, NamedSharding(mesh, PS()))
    x = jax.device_put(x_host, NamedSharding(mesh, PS("data")))
    y = jax.device_put(y_host, NamedSharding(mesh, PS("data")))
    state = (params, jax.device_put(optimizer.init(params), NamedSharding(mesh, PS())))
    with tempfile.TemporaryDirectory(prefix="gpu_check_overhead_") as tmp:
        store = Path(tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fallback = _wrapped(step, None, store / "empty", budget)
            searched = _wrapped(step, "1", store / "s", budget)
            jax.block_until_ready(searched(*state, {"x": x, "y": y}))
            stored = _wrapped(step, "0", store / "s", budget)
            runs = {"jax_jit": jax.jit(step), "fallback": fallback, "stored": stored}
            for fn in runs.values():
                jax.block_until_ready(fn(*state, {"x": x, "y": y}))
        modes = {"fallback": fallback.last_run_info.mode, "stored": stored.last_run_info.mode}
        samples: dict[str, list[float]] = {n: [] for n in runs}
        names = list(runs)
        for r in range(rounds):
            for name in names[r % 3:] + names[:r % 3]:
                fn, (p, o) = runs[name], state
                t = time.perf_counter()
                for _ in range(calls):
                    p, o, loss = fn(p, o, {"x": x, "y": y})
                jax.block_until_ready(loss)
                samples[name].append((time.perf_counter() - t) / calls)
    med = {n: statistics.median(s) for n, s in samples.items()}
    return {"width": width, "batch": batch, "calls": calls, "rounds": rounds, "modes": modes,
            "step_s": med, "ratio": {n: med[n] / med["jax_jit"] for n in ("fallback", "stored")},
            "within_2pct": all(med[n] <= 1.02 * med["jax_jit"] for n in ("fallback", "stored"))}


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="vgg,resnet,transformer,bert", help="zoo models")
    ap.add_argument("--sizes", default="medium,large", help="zoo sizes")
    ap.add_argument("--budget", type=float, default=8.0, help="search budget, seconds")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--min-sample-s", type=float, default=0.1, help="seconds per sample")
    ap.add_argument("--overhead-calls", type=int, default=300,
                    help="steps per sample of the per-call check (0: skip it)")
    ap.add_argument("--overhead-width", type=int, default=512, help="MLP width")
    ap.add_argument("--overhead-batch", type=int, default=256, help="MLP global batch")
    ap.add_argument("--profiles", metavar="DIR", help="also write each step's op times here")
    ap.add_argument("--out", default=str(OUT), help="JSON output (written after every row)")
    args = ap.parse_args()
    profiles = Path(args.profiles) if args.profiles else None
    if profiles is not None:
        profiles.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    result = {"device": device.device_kind, "platform": device.platform,
              "devices": jax.local_device_count(), "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "commit": _commit(),
              "command": " ".join(sys.argv), "rows": [], "overhead": None}
    _say(f"{result['devices']} x {result['device']} ({result['platform']}), jax "
         f"{result['jax']}")
    for model in args.models.split(","):
        for size in args.sizes.split(","):
            _say(f"{model} {size}")
            try:
                row = check_model(model, size, args.budget, args.rounds, args.min_sample_s,
                                  profiles)
            except Exception as err:  # noqa: BLE001 - keep the other rows
                row = {"model": model, "size": size, "error": repr(err)[:500],
                       "traceback": traceback.format_exc()[-3000:]}
            result["rows"].append(row)
            write_result(args.out, result)
            _say(json.dumps({k: row.get(k) for k in ("measured_s", "speedup", "same_as_jax_jit",
                                                     "search_first_call_s", "error")}))
    if args.overhead_calls:
        _say("per-call cost of the wrapper")
        try:
            result["overhead"] = check_overhead(args.overhead_width, args.overhead_batch,
                                                args.rounds, args.overhead_calls, args.budget)
        except Exception as err:  # noqa: BLE001
            result["overhead"] = {"error": repr(err)[:500]}
        write_result(args.out, result)
    print(f"{'model':12s} {'size':7s} {'xla ms':>9s} {'disco ms':>9s} {'x':>6s} {'same':>5s} "
          f"{'search s':>9s} {'route':>8s}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['model']:12s} {r['size']:7s} error: {r['error'][:80]}")
            continue
        m = r["measured_s"]
        print(f"{r['model']:12s} {r['size']:7s} {m['xla_default'] * 1e3:9.3f} "
              f"{m['disco'] * 1e3:9.3f} {r['speedup']:6.3f} {str(r['same_as_jax_jit']):>5s} "
              f"{r['search_first_call_s']:9.1f} {r['route']['name']:>8s}")
    if result["overhead"] and "ratio" in result["overhead"]:
        o = result["overhead"]
        print(f"per call: jax.jit {o['step_s']['jax_jit'] * 1e3:.3f} ms, fallback "
              f"{o['ratio']['fallback']:.3f}x, stored {o['ratio']['stored']:.3f}x")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
