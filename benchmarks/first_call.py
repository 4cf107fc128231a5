"""How long ``disco_jax.jit``'s first call takes under ``ENABLE_SEARCH=1``, against its
time budget, and what a short budget costs.

For each setup, step and budget ``B`` a fresh process (a fresh job of two processes for
``gloo2``) times ``jax.jit``'s first call of the step, then ``disco_jax.jit``'s with
``time_budget_s=B`` and an empty store: **added** is the second minus the first, the time
DisCo added, which the budget bounds (target: within 20% of ``B``). Then one process (one
job) loads the program each budget chose from its store (``ENABLE_SEARCH=0``) and
measures them side by side, interleaved: the **cost** of a budget is its choice's time
per step over the choice of ``4 B`` (1.00: nothing lost).

Steps: zoo models (``--models``, ``--size``) and ``examples/train.py``'s step
(``train``). Setups: ``inproc4`` (one process, 4 host devices), ``gloo2`` (two
processes over gloo on 127.0.0.1, one device each) and ``gloo2-1gbit`` (the same in a
private network namespace whose loopback ``tc`` limits to 1 Gbit/s; run as root). The
**profile** column is the in-context profile's share of ``B`` (its goal: a third at
most). Prints a table and writes ``benchmarks/results/first_call.json``.

    python benchmarks/first_call.py                                   # the full matrix
    python benchmarks/first_call.py --models vgg --setups inproc4 --budgets 5
    python benchmarks/first_call.py --no-reference-above 15           # 4 B only for B <= 15
    python benchmarks/first_call.py --setups gloo2 --keep first_call.json  # add a setup
    sudo python benchmarks/first_call.py --setups gloo2-1gbit --models transformer \
        --size medium --budgets 60 --no-reference-above 0 --out first_call_1gbit.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "first_call.json"
SETUPS = ("inproc4", "gloo2")
#: The emulated link of the ``gloo2-1gbit`` setup (``tc tbf``, as ``disco bench``'s).
RATE, BURST = "1gbit", "128kb"
#: the reference run's budget, times the budget
REFERENCE_FACTOR = 4


# ----------------------------------------------------------------------------- workers


def _step(model: str, size: str):
    """``(step, args)`` of a zoo model or of ``examples/train.py`` (``train``)."""
    import jax

    if model == "train":
        spec = importlib.util.spec_from_file_location("train_example",
                                                      ROOT / "examples" / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # Flax's dataclasses look their module up
        spec.loader.exec_module(module)
        return module.setup()
    from disco_jax import zoo

    return zoo.get(model)(jax.device_count(), size)


def _join_job() -> None:
    import disco_jax.activator

    disco_jax.activator.initialize_from_env()


def worker_first(a: argparse.Namespace) -> None:
    """One first call of each: ``jax.jit``, then ``disco_jax.jit`` (search)."""
    _join_job()
    import jax

    import disco_jax

    step, args = _step(a.model, a.size)
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(step)(*args))
    jax_first = time.perf_counter() - t0
    os.environ["ENABLE_SEARCH"] = "1"
    wrapped = disco_jax.jit(step, store=a.store, time_budget_s=a.budget)
    t0 = time.perf_counter()
    jax.block_until_ready(wrapped(*args))
    disco_first = time.perf_counter() - t0
    info = wrapped.last_run_info
    if jax.process_index() == 0:
        Path(a.out).write_text(json.dumps({
            "jax_first_s": jax_first, "disco_first_s": disco_first,
            "added_s": disco_first - jax_first, "mode": info.mode, "choice": info.choice,
            "reason": info.reason, "measured_s": info.measured_s,
            **_from_record(info.store_path)}))


def _from_record(path: str | None) -> dict:
    """The phases' seconds the store record keeps, and why the search was skipped (None:
    not found, or not skipped)."""
    f = Path(path) / "record.json" if path else None
    record = json.loads(f.read_text()) if f is not None and f.exists() else {}
    return {"pipeline_s": record.get("pipeline_s"),
            "skipped": (record.get("search") or {}).get("skipped")}


def worker_compare(a: argparse.Namespace) -> None:
    """Each budget's stored choice, measured interleaved (``ENABLE_SEARCH=0``)."""
    _join_job()
    import jax

    import disco_jax
    from disco_jax.pipeline.sync import job_sync

    os.environ["ENABLE_SEARCH"] = "0"
    step, args = _step(a.model, a.size)
    runs = {}
    for item in a.stores.split(","):
        budget, _, store = item.partition("=")
        runs[budget] = disco_jax.jit(step, store=store)
        jax.block_until_ready(runs[budget](*args))
        if runs[budget].last_run_info.mode != "stored":
            runs.pop(budget)

    def timed(fn, k):
        t0 = time.perf_counter()
        for _ in range(k):
            jax.block_until_ready(fn(*args))
        return (time.perf_counter() - t0) / k

    ks = {b: max(1, round(0.2 / max(timed(fn, 1), 1e-5))) for b, fn in runs.items()}
    sync = job_sync("first_call_compare")
    ks = sync.share("ks", ks)  # every process makes the same calls (each a collective)
    samples: dict[str, list[float]] = {b: [] for b in runs}
    names = sorted(runs, key=float)
    for r in range(a.rounds):
        for b in names[r % len(names):] + names[:r % len(names)]:
            samples[b].append(timed(runs[b], ks[b]))
    if jax.process_index() == 0:
        Path(a.out).write_text(json.dumps({
            "median_s": {b: statistics.median(s) for b, s in samples.items()},
            "choice": {b: runs[b].last_run_info.choice for b in runs},
            "samples_s": samples}))


# ----------------------------------------------------------------------------- driver


def _run(setup: str, argv: list[str], timeout_s: float, log: Path) -> None:
    """Runs this script's worker in a fresh process, or a fresh 2-process job, its output
    in ``log``.

    Raises:
        RuntimeError: it failed or timed out (the last lines of its output).
    """
    me = [sys.executable, str(Path(__file__).resolve()), *argv]
    env = dict(os.environ)
    if setup == "inproc4":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        cmd = me
    else:
        env.pop("XLA_FLAGS", None)
        cmd = [sys.executable, "-m", "disco_jax", "launch", "-n", "2",
               "--timeout", str(int(timeout_s)), "--", *me]
        if setup == "gloo2-1gbit":  # the job in a private namespace with a slow loopback
            cmd = ["unshare", "-n", sys.executable, str(Path(__file__).resolve()), "netns",
                   "--parent-netns", os.readlink("/proc/self/ns/net"), "--", *cmd]
    with open(log, "w") as out:
        try:
            done = subprocess.run(cmd, env=env, timeout=timeout_s + 60, stdout=out,
                                  stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            done = None
    if done is None or done.returncode != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-6:])
        what = "timed out" if done is None else f"exited {done.returncode}"
        raise RuntimeError(f"{' '.join(argv[:2])} {what}: {tail[-600:]}")


def bench(setup: str, model: str, size: str, budgets: list[float], ref_above: float | None,
          rounds: int, tmp: Path) -> list[dict]:
    refs = [b * REFERENCE_FACTOR for b in budgets
            if ref_above is None or b <= ref_above]
    every = sorted(set(budgets) | set(refs))
    first: dict[float, dict] = {}
    stores: dict[float, Path] = {}
    errors: dict[float | str, str] = {}
    for b in every:
        stores[b] = tmp / f"{setup}_{model}_{b:g}"
        out = tmp / f"{setup}_{model}_{b:g}.json"
        t0 = time.perf_counter()
        try:
            _run(setup, ["worker", "first", "--model", model, "--size", size, "--budget",
                         str(b), "--store", str(stores[b]), "--out", str(out)],
                 timeout_s=4 * b + 900, log=out.with_suffix(".log"))
        except RuntimeError as err:
            print(f"  {setup} {model} B={b:g} s: {err}", flush=True)
            errors[b] = str(err)
            continue
        first[b] = json.loads(out.read_text())
        print(f"  {setup} {model} B={b:g} s: first call +{first[b]['added_s']:.1f} s "
              f"({first[b]['mode']} {first[b]['choice']}; {time.perf_counter() - t0:.0f} s)",
              flush=True)
    out = tmp / f"{setup}_{model}_compare.json"
    med: dict[str, float] = {}
    try:
        _run(setup, ["worker", "compare", "--model", model, "--size", size, "--rounds",
                     str(rounds), "--out", str(out),
                     "--stores", ",".join(f"{b:g}={stores[b]}" for b in first)],
             timeout_s=900, log=out.with_suffix(".log"))
        med = json.loads(out.read_text())["median_s"]
    except RuntimeError as err:
        print(f"  {setup} {model} comparison: {err}", flush=True)
        errors["compare"] = str(err)
    rows = []
    for b in budgets:
        ref = b * REFERENCE_FACTOR
        if b not in first:
            rows.append({"setup": setup, "model": model, "size": size, "budget_s": b,
                         "error": errors[b]})
            continue
        f = first[b]
        cost = (med[f"{b:g}"] / med[f"{ref:g}"]
                if f"{ref:g}" in med and f"{b:g}" in med else None)
        rows.append({"setup": setup, "model": model, "size": size, "budget_s": b,
                     "jax_first_s": f["jax_first_s"], "disco_first_s": f["disco_first_s"],
                     "added_s": f["added_s"], "added_over_budget": f["added_s"] / b,
                     "within_20pct": f["added_s"] <= 1.2 * b, "mode": f["mode"],
                     "choice": f["choice"], "step_s": med.get(f"{b:g}"),
                     "reference_budget_s": ref if ref in first else None,
                     "reference_choice": first[ref]["choice"] if ref in first else None,
                     "reference_step_s": med.get(f"{ref:g}"), "cost": cost,
                     "pipeline_s": f["pipeline_s"], "skipped": f.get("skipped"),
                     "profile_share": ((f["pipeline_s"] or {}).get("profile") or 0.0) / b,
                     **({"compare_error": errors["compare"]} if "compare" in errors else {})})
    return rows


def _table(rows: list[dict]) -> str:
    head = (f"{'setup':<8} {'step':<12} {'B s':>5} {'jax.jit s':>9} {'added s':>8} "
            f"{'added/B':>7} {'profile':>7} {'choice':<16} {'ms/step':>8} {'4B choice':<16} "
            f"{'cost':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['setup']:<8} {r['model']:<12} {r['budget_s']:>5g} failed: "
                         f"{r['error'][:120]}")
            continue
        cost = f"{r['cost']:.2f}" if r["cost"] is not None else "-"
        step = f"{r['step_s'] * 1e3:.2f}" if r["step_s"] else "-"
        lines.append(
            f"{r['setup']:<8} {r['model']:<12} {r['budget_s']:>5g} {r['jax_first_s']:>9.2f} "
            f"{r['added_s']:>8.1f} {r['added_over_budget']:>7.2f} "
            f"{r.get('profile_share', 0.0):>7.0%} {str(r['choice']):<16} "
            f"{step:>8} {str(r['reference_choice'] or '-'):<16} {cost:>5}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="(internal) one measured process")
    w.add_argument("what", choices=("first", "compare"))
    w.add_argument("--model", required=True)
    w.add_argument("--size", default="small")
    w.add_argument("--budget", type=float)
    w.add_argument("--store")
    w.add_argument("--stores")
    w.add_argument("--rounds", type=int, default=7)
    w.add_argument("--out", required=True)
    n = sub.add_parser("netns", help="(internal) limit this namespace's loopback, then run")
    n.add_argument("--parent-netns", required=True)
    n.add_argument("command", nargs=argparse.REMAINDER)
    ap.add_argument("--models", default="vgg,transformer,resnet,train",
                    help="zoo models and 'train' (examples/train.py's step)")
    ap.add_argument("--size", default="small", help="zoo size (default small)")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--budgets", default="5,15,60", help="seconds (default 5,15,60)")
    ap.add_argument("--no-reference-above", type=float, default=None, metavar="S",
                    help=f"run the {REFERENCE_FACTOR}x reference only for budgets <= S "
                         "(their cost shows '-' above)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the "
                    "comparison (default 7)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--keep", metavar="JSON",
                    help="keep the rows of an earlier run (this script's JSON) for the setups "
                         "and steps not measured now; its provenance goes under 'kept_from'")
    a = ap.parse_args()
    if a.cmd == "worker":
        (worker_first if a.what == "first" else worker_compare)(a)
        return
    if a.cmd == "netns":
        from disco_estimator.gloo import set_loopback_rate

        set_loopback_rate(RATE, a.parent_netns, BURST)
        command = a.command[1:] if a.command[:1] == ["--"] else a.command
        raise SystemExit(subprocess.run(command).returncode)
    from benchmarks.provenance import write_result

    budgets = [float(b) for b in a.budgets.split(",")]
    now = {(s, m) for s in a.setups.split(",") for m in a.models.split(",")}
    kept: list[dict] = []
    extra: dict = {}
    if a.keep:
        old = json.loads(Path(a.keep).read_text())
        kept = [r for r in old["rows"] if (r["setup"], r["model"]) not in now]
        extra = {"kept_from": old.get("provenance")}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="disco_first_call_") as tmp:
        for setup in a.setups.split(","):
            for model in a.models.split(","):
                rows += bench(setup, model, a.size, budgets, a.no_reference_above,
                              a.rounds, Path(tmp))
                write_result(a.out, {"rows": kept + rows, "reference_factor": REFERENCE_FACTOR,
                                     **extra})
    rows = kept + rows
    print()
    print(_table(rows))
    print("added: disco_jax.jit's first call minus jax.jit's (target: within 20% of B); "
          f"cost: time per step of B's choice over {REFERENCE_FACTOR} B's, measured "
          "interleaved")
    print(f"rows: {a.out}")


if __name__ == "__main__":
    main()
