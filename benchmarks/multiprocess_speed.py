"""What a user of the product sees in a multi-process job: ``disco_jax.jit`` end to end.

Per zoo model, one job of 2 gloo processes, each pinned to its own CPU
(``NPROC`` = ``disco_jax.enactment.staged.POOL_THREADS``; ``--no-pin``: unpinned, as
``disco launch`` starts them), over an emulated 1 Gbit/s link (``unshare -n`` + ``tc``,
as ``disco bench``'s ``gloo2-1gbit``; needs root). In the job every process:

1. wraps the train step in ``disco_jax.jit`` with ``ENABLE_SEARCH=1`` and calls it once
   (profile, search, final choice by measurement, process 0 stores, the activator
   broadcasts the winner): the search phase, timed;
2. wraps it again with ``ENABLE_SEARCH=0`` and calls it once (process 0 reads its store,
   broadcasts the enactment, every process builds it): the enactment phase, timed; and
   the broadcast of the stored enactment's bytes alone;
3. measures, interleaved in the same processes, ``disco_jax.jit`` (the stored
   enactment), ``jax.jit`` and the hand-bucketed step (one flat gradient all-reduce,
   ``hlo_tools.baselines.compile_bucketed(step, args, None)``), and checks that 5 steps of
   ``disco_jax.jit`` give ``jax.jit``'s losses.

Prints a table and writes ``benchmarks/results/multiprocess_speed.json`` (atomically,
after every model)::

    sudo python benchmarks/multiprocess_speed.py --size medium

``--layout host_local`` builds the arguments as a user's job does (``jax.device_put`` of
jax arrays to a replicated ``NamedSharding``, the batch by
``host_local_array_to_global_array``) instead of as the zoo places them.

``--compare BENCH.json`` (nothing measured) sets these rows beside ``disco bench``'s rows of
the same size and setup (``disco bench --setups gloo2-1gbit --size medium --staged auto``):
per model DisCo's measured step in both, and its speed-up over XLA's default (``jax.jit``)
in both; writes ``benchmarks/results/multiprocess_speed_vs_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "multiprocess_speed.json"
MODELS = ("vgg", "resnet", "transformer", "rnnlm", "bert", "reformer")


def _host_local(step_args):
    """The arguments rebuilt as a user's job builds them: the variables and optimizer
    state by ``jax.device_put`` of jax arrays to a replicated ``NamedSharding`` of the
    global mesh, the batch from this process's rows with
    ``multihost_utils.host_local_array_to_global_array``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from disco_jax.zoo.common import AXIS

    params, opt_state, batch = step_args
    mesh = jax.tree.leaves(params)[0].sharding.mesh

    def local(x):
        return np.asarray(x.addressable_shards[0].data)

    replicated = NamedSharding(mesh, P())
    params, opt_state = (jax.device_put(jax.tree.map(lambda x: jnp.asarray(local(x)), t),
                                        replicated) for t in (params, opt_state))
    batch = jax.tree.map(lambda x: multihost_utils.host_local_array_to_global_array(
        local(x), mesh, P(AXIS)), batch)
    return params, opt_state, batch


def _worker(args: argparse.Namespace) -> None:
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[args.process_id % len(cpus)]})
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=2,
                               process_id=args.process_id, initialization_timeout=120)
    import numpy as np

    import disco_jax
    from disco_jax import zoo
    from disco_jax.activator import broadcast_bytes
    from disco_jax.pipeline.choose import measure
    from disco_jax.pipeline.sync import job_sync
    from hlo_tools.baselines import compile_bucketed

    os.environ["DISCO_STORE"] = str(Path(args.tmp) / f"store{args.process_id}")
    step, step_args = zoo.get(args.model)(2, args.size)
    if args.layout == "host_local":
        step_args = _host_local(step_args)
    row: dict = {"model": args.model, "size": args.size, "layout": args.layout}

    def first_call(flag: str):
        os.environ["ENABLE_SEARCH"] = flag
        wrapped = disco_jax.jit(step, time_budget_s=args.time_budget)
        t0 = time.perf_counter()
        jax.block_until_ready(wrapped(*step_args))
        return wrapped, time.perf_counter() - t0, wrapped.last_run_info

    _, row["search_first_call_s"], info1 = first_call("1")
    stored, row["stored_first_call_s"], info0 = first_call("0")
    row["searched"] = {"mode": info1.mode, "choice": info1.choice,
                       "fingerprint": info1.hlo_fingerprint, "reason": info1.reason}
    row["stored"] = {"mode": info0.mode, "choice": info0.choice,
                     "fingerprint": info0.hlo_fingerprint, "reason": info0.reason}
    payload = None
    if jax.process_index() == 0 and info1.store_path:
        payload = (Path(info1.store_path) / "enactment.json").read_bytes()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        got = broadcast_bytes(payload)
        times.append(time.perf_counter() - t0)
    row["broadcast_bytes"], row["broadcast_s"] = len(got), statistics.median(times)

    plain = jax.jit(step)
    hand = compile_bucketed(step, step_args, None).run
    runs = {"disco_jax.jit": stored, "jax.jit": plain, "hand_bucketed": hand}
    samples = measure(runs, step_args, rounds=args.rounds, sync=job_sync("mp_speed"),
                      tag="mp", min_sample_s=0.3)
    row["median_s"] = {n: statistics.median(s) for n, s in samples.items()}
    row["samples_s"] = samples

    def losses(fn):
        out, (p, o, b) = [], step_args
        for _ in range(5):
            p, o, loss = fn(p, o, b)
            out.append(float(np.asarray(loss.addressable_shards[0].data)))
        return out

    row["losses"] = {"disco_jax.jit": losses(stored), "jax.jit": losses(plain)}
    if jax.process_index() == 0:
        Path(args.out).write_text(json.dumps(row))
    jax.distributed.shutdown()


def _pin_flag(args: argparse.Namespace) -> list[str]:
    return [] if args.pin else ["--no-pin"]


def _launch(args: argparse.Namespace) -> None:
    """Inside ``unshare -n``: limits the loopback, starts the two workers."""
    from disco_estimator.gloo import child_env, run_local_job, set_loopback_rate
    from disco_jax.enactment.staged import POOL_THREADS

    print(set_loopback_rate("1gbit", args.parent_netns, "128kb"), file=sys.stderr)
    rcs = run_local_job(
        lambda i, coordinator: [sys.executable, __file__, "worker", "--model", args.model,
                                "--size", args.size, "--time-budget", str(args.time_budget),
                                "--rounds", str(args.rounds), "--tmp", args.tmp,
                                "--layout", args.layout, *_pin_flag(args),
                                "--out", args.out, "--coordinator", coordinator,
                                "--process-id", str(i)],
        2, timeout_s=args.timeout,
        env=child_env(1, {"NPROC": str(POOL_THREADS)} if args.pin else None), grace_s=30.0)
    if any(rcs):
        raise SystemExit(f"workers exited with {rcs}")


def _table(rows: list[dict]) -> str:
    head = (f"{'model':12s} {'jax.jit':>9s} {'hand 1-bkt':>10s} {'disco.jit':>10s} "
            f"{'vs jit':>7s} {'vs hand':>7s}  {'choice':16s} {'search 1st':>10s} "
            f"{'stored 1st':>10s} {'bcast':>12s}  losses")
    out = [head, "-" * len(head)]
    for r in rows:
        m = r["median_s"]
        same = all(abs(a - b) <= 1e-5 * abs(b) + 1e-6
                   for a, b in zip(r["losses"]["disco_jax.jit"], r["losses"]["jax.jit"]))
        out.append(
            f"{r['model']:12s} {m['jax.jit'] * 1e3:9.1f} {m['hand_bucketed'] * 1e3:10.1f} "
            f"{m['disco_jax.jit'] * 1e3:10.1f} {m['jax.jit'] / m['disco_jax.jit']:6.2f}x "
            f"{m['hand_bucketed'] / m['disco_jax.jit']:6.2f}x  {r['stored']['choice']:16s} "
            f"{r['search_first_call_s']:9.1f}s {r['stored_first_call_s']:9.2f}s "
            f"{r['broadcast_s'] * 1e3:5.1f}ms/{r['broadcast_bytes'] >> 10:4d}K  "
            + ("equal (rtol 1e-5)" if same else "DIFFER"))
    return "\n".join(out)


def _compare(mp_path: str, bench_path: str) -> dict:
    """Rows of ``multiprocess_speed.json`` beside ``disco bench``'s gloo2-1gbit rows."""
    mp = {r["model"]: r for r in json.loads(Path(mp_path).read_text())["rows"]}
    bench = {r["model"]: r for r in json.loads(Path(bench_path).read_text())["rows"]
             if r["setup"] == "gloo2-1gbit"}
    rows = []
    for model in [m for m in MODELS if m in mp and m in bench]:
        m, b = mp[model], bench[model]
        dj, jj = m["median_s"]["disco_jax.jit"], m["median_s"]["jax.jit"]
        bd, bx = b["measured_s"]["disco"], b["measured_s"]["xla_default"]
        rows.append({"model": model, "jit_disco_s": dj, "bench_disco_s": bd,
                     "step_ratio": dj / bd, "jit_speedup_vs_jax_jit": jj / dj,
                     "bench_speedup_vs_xla_default": bx / bd,
                     "jit_choice": m["stored"]["choice"], "bench_choice": b["choice"]["disco"]})
    return {"multiprocess": mp_path, "bench": bench_path, "rows": rows}


def _compare_table(result: dict) -> str:
    head = (f"{'model':12s} {'jit ms':>8s} {'bench ms':>9s} {'jit/bench':>9s} "
            f"{'jit vs jax.jit':>14s} {'bench vs xla':>12s}  {'jit choice':16s} bench choice")
    out = [head, "-" * len(head)]
    for r in result["rows"]:
        out.append(f"{r['model']:12s} {r['jit_disco_s'] * 1e3:8.1f} "
                   f"{r['bench_disco_s'] * 1e3:9.1f} {r['step_ratio']:9.3f} "
                   f"{r['jit_speedup_vs_jax_jit']:13.2f}x "
                   f"{r['bench_speedup_vs_xla_default']:11.2f}x  {r['jit_choice']:16s} "
                   f"{r['bench_choice']}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="parent", choices=("parent", "launch", "worker"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--model", default="")
    ap.add_argument("--size", default="medium")
    ap.add_argument("--time-budget", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=1500.0)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tmp", default="")
    ap.add_argument("--layout", default="zoo", choices=("zoo", "host_local"),
                    help="how the arguments are built: as the zoo places them, or as a "
                         "user's job does (device_put of jax arrays, the batch by "
                         "host_local_array_to_global_array)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="leave the processes unpinned, as `disco launch` starts them (both "
                         "share the machine's cores, XLA:CPU's pool its own size)")
    ap.add_argument("--coordinator", default="")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--parent-netns", default="")
    ap.add_argument("--compare", metavar="BENCH.json",
                    help="set the rows of --out beside disco bench's rows (measures nothing)")
    args = ap.parse_args()
    if args.compare:
        from benchmarks.provenance import write_result

        result = _compare(args.out, args.compare)
        write_result(RESULTS.with_name("multiprocess_speed_vs_bench.json"), result)
        print(_compare_table(result))
        return None
    if args.mode == "worker":
        return _worker(args)
    if args.mode == "launch":
        return _launch(args)
    from benchmarks.provenance import write_result
    from disco_estimator.gloo import child_env, run_bounded
    from disco_jax.enactment.staged import POOL_THREADS

    rows = []
    for model in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="disco_mp_") as tmp:
            out = Path(tmp) / "row.json"
            print(f"== {model} ({args.size})", file=sys.stderr, flush=True)
            run_bounded(["unshare", "-n", sys.executable, __file__, "launch", "--model", model,
                         "--size", args.size, "--time-budget", str(args.time_budget),
                         "--rounds", str(args.rounds), "--timeout", str(args.timeout),
                         "--tmp", tmp, "--out", str(out), "--layout", args.layout,
                         *_pin_flag(args), "--parent-netns", os.readlink("/proc/self/ns/net")],
                        child_env(1), args.timeout + 60)
            rows.append(json.loads(out.read_text()))
        write_result(args.out, {"rows": rows, "meta": {
            "size": args.size, "time_budget_s": args.time_budget, "rounds": args.rounds,
            "layout": args.layout,
            "setup": (f"2 gloo processes, each pinned to a CPU, NPROC={POOL_THREADS}"
                      if args.pin else "2 gloo processes, unpinned")
            + ", tc tbf 1gbit burst 128kb"}})
        print(_table(rows), flush=True)


if __name__ == "__main__":
    main()
