"""Child processes of ``benchmarks/simulator_accuracy.py``.

Run by path, with the repository on ``PYTHONPATH`` (the benchmark does both)::

    python benchmarks/accuracy_worker.py {launch,run,screen} ...

``launch`` (run under ``unshare -n``): brings up the loopback of the private network
namespace and starts a gloo job of ``run`` workers on a free 127.0.0.1 port, bounded in
time. ``run``: one process of that job. It builds the zoo model on the job's devices
(one CPU device per process), compiles every variant of the job spec -- XLA's default
plan and plans of :func:`hlo_tools.plan.random_moves` enacted with ``exact=True`` -- and
then, for each setup of the spec, sets the loopback's ``tc`` rate (process 0; every
setup of a job shares the namespace, ``gloo2`` is the namespace's loopback without a
qdisc, ``gloo2-1gbit`` the same loopback under ``tbf rate 1gbit``), and times the
variants interleaved. ``screen``: compiles one variant alone (one process, two host
devices) to find out whether it aborts XLA:CPU. With ``keep_awake`` in the spec, ``launch``
also runs one ``SCHED_IDLE`` busy loop per CPU for the job's lifetime (see
:func:`_start_spinners`); with ``pin_cpus``, each ``run`` process is pinned to a CPU of
its own (:func:`disco_estimator.gloo.pin_to_own_cpu`). The network namespace, ``tc``, port
and process helpers are those of :mod:`disco_estimator.gloo`.

Timing. Each sample is ``K`` back-to-back calls waited for at the end, divided by ``K``
(``K`` per variant, agreed by the processes, so that a sample lasts about
``min_sample_s``). All processes meet at a barrier before each sample; the parent takes
per sample the *minimum over processes* (the last to arrive measures the iteration from
the moment every participant is there, as :mod:`disco_estimator.allreduce` does for single
all-reduces). Rounds visit the variants in a seeded random order that every process
shares. After each round one iteration of the no-fusion variant is traced: its
per-instruction times over all rounds are the cost model's in-context op times (every
process keeps its own; the parent takes the median over processes). After the timed
rounds each variant is traced (:mod:`jax.profiler`) for a few iterations: per iteration
its span, busy compute, all-reduce time and kernel count are kept, and, on request, the
events of one iteration (a measured trace).

Compiling. Every process compiles every variant (in the same order). Compiles go
through jax's persistent compilation cache, but only process 0 gains from it: jax
writes entries from process 0 only, and on jax 0.10.2 the other processes' cache keys
differ from process 0's, so ``jax_share_binary_between_hosts`` waits forever; handing
process 0's executable over with :mod:`jax.experimental.serialize_executable` fails
when process 1 runs it (``NOT_FOUND: Function wrapped_broadcast.29 not found``). Before
each variant a process appends ``start NAME`` to its progress file and ``done NAME``
after it; when XLA:CPU aborts a process, the parent reads which compiles were
unfinished, screens them, and relaunches without the culprit.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from disco_estimator.gloo import in_private_netns, run_local_job, set_loopback_rate
from hlo_tools.opcodes import is_collective

__all__ = ["build_variant", "iteration_stats", "main", "plan_for", "plan_json"]

#: This file, which ``launch`` starts again (as ``run``) for every process of a job.
WORKER = Path(__file__).resolve()

_BARRIER_MS = 600_000


def _log(tag: str, text: str) -> None:
    print(f"[{tag}] {text}", file=sys.stderr, flush=True)


def _write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Writes JSON atomically (temporary file + ``os.replace``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- variants


def plan_for(graph: Any, variant: Mapping[str, Any]) -> Any:
    """The plan of a plan variant: the initial plan (``moves == 0``) or ``random_moves``."""
    from hlo_tools import plan as P

    start = P.initial_plan(graph)
    moves = int(variant.get("moves", 0))
    if moves == 0:
        return start
    return P.random_moves(P.FusionSpace(graph), start, random.Random(int(variant["seed"])),
                          moves)


def plan_json(plan: Any) -> dict[str, Any]:
    """A plan as JSON lists (``order``, ``group``, ``dups``) with a short hash."""
    order, group = list(plan.order), list(plan.group)
    dups = sorted([int(p), int(g)] for p, g in plan.dups)
    digest = hashlib.sha1(json.dumps([order, group, dups]).encode()).hexdigest()[:16]
    return {"order": order, "group": group, "dups": dups, "hash": digest}


def build_variant(variant: Mapping[str, Any], step: Any, args: Sequence[Any], module: Any,
                  graph: Any) -> tuple[Any, dict[str, Any] | None]:
    """Compiles one variant; returns ``(CompiledHlo, plan_json or None)``."""
    import hlo_tools
    from hlo_tools.baselines import compile_baseline

    if variant["kind"] == "xla_default":
        return compile_baseline(step, args, "xla_default"), None
    plan = plan_for(graph, variant)
    text = hlo_tools.to_text(hlo_tools.apply_plan(module, plan, graph))
    return (hlo_tools.compile_module(text, hlo_tools.InPlaceOf(step, args),
                                     hlo_tools.CompileOptions(exact=True)), plan_json(plan))


def _setup_jax(spec: Mapping[str, Any]) -> None:
    import jax

    cache = spec.get("cache_dir")
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _model(spec: Mapping[str, Any]) -> tuple[Any, tuple[Any, ...], str, Any, Any]:
    """``(step, args, pre-optimization HLO text, module, graph)`` of the spec's model."""
    import hlo_tools
    from disco_jax import zoo
    from hlo_tools import jax_bridge

    step, args = zoo.get(spec["model"])(int(spec["num_devices"]), spec["size"])
    text = hlo_tools.extract(jax_bridge.fresh_function(step), *args)
    module = hlo_tools.parse(text)
    return step, args, text, module, hlo_tools.device_graph(module)


# --------------------------------------------------------------------------- compiling


def _compile_all(spec: Mapping[str, Any], pid: int, step: Any, args: Sequence[Any],
                 module: Any, graph: Any, tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Compiles the spec's variants; returns ``({name: CompiledHlo}, {name: info})``."""
    progress = Path(spec["progress_dir"]) / f"p{pid}.log"
    runs: dict[str, Any] = {}
    info: dict[str, Any] = {}
    for v in spec["variants"]:
        name = v["name"]
        with open(progress, "a") as f:
            f.write(f"start {name}\n")
        t0 = time.perf_counter()
        try:
            run, plan = build_variant(v, step, args, module, graph)
        except Exception as err:  # XLA's error as data; the variant is dropped
            info[name] = {"error": str(err)[:400]}
            _log(tag, f"{name}: compile error: {str(err)[:200]}")
        else:
            runs[name] = run
            info[name] = {"compile_s": time.perf_counter() - t0, "plan": plan}
        with open(progress, "a") as f:
            f.write(f"done {name}\n")
    return runs, info


def _first_loss(run: Any, args: Sequence[Any]) -> float:
    import jax
    import numpy as np

    out = jax.block_until_ready(run(*args))
    leaves = jax.tree.leaves(out)
    return float(np.asarray(leaves[-1].addressable_data(0)))


# --------------------------------------------------------------------------- timing


def _timed(run: Any, args: Sequence[Any], k: int) -> float:
    """Seconds per iteration of ``k`` back-to-back calls (waited for at the end)."""
    import jax

    t0 = time.perf_counter()
    out = None
    for _ in range(k):
        out = run(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / k


def _choose_k(runs: Mapping[str, Any], args: Sequence[Any], spec: Mapping[str, Any],
              coord: Any, pid: int, phase: str) -> dict[str, int]:
    """Warm-up calls; process 0 picks K per variant (shared with every process)."""
    warm: dict[str, float] = {}
    for name, run in runs.items():
        coord.barrier(f"{phase}_warm")
        warm[name] = min(_timed(run, args, 1) for _ in range(int(spec["warmup"])))
    target = float(spec["min_sample_s"])
    ks = {n: max(1, min(int(spec.get("max_k", 50)), round(target / max(t, 1e-6))))
          for n, t in warm.items()}
    return coord.share(f"k_{phase}", ks, pid)


def _rounds(runs: Mapping[str, Any], args: Sequence[Any], ks: Mapping[str, int],
            spec: Mapping[str, Any], coord: Any, phase: str,
            tag: str) -> tuple[dict[str, list[float]], list[Any]]:
    """The timed rounds: every variant once per round, in a shared seeded order.

    After each round (untimed) one iteration of the no-fusion program is traced, so that
    its per-instruction profile is a median over the whole measurement, like the timed
    samples, and not a picture of one moment (on this VM a process's kernels can run
    ~25% slower for seconds at a time). Returns the samples and those traced events.
    """
    names = sorted(runs)
    rng = random.Random(f"{spec['model']}/{phase}")
    samples: dict[str, list[float]] = {n: [] for n in names}
    spread: list[Any] = []
    t_start = time.monotonic()
    for r in range(int(spec["repeats"])):
        rng.shuffle(names)
        for name in names:
            coord.barrier(phase)
            samples[name].append(_timed(runs[name], args, ks[name]))
        if "no_fusion" in runs:
            events = _trace_calls(runs["no_fusion"], args, 1, coord, f"{phase}_spread")
            spread += [dataclasses.replace(ev, run_id=f"{r}/{ev.run_id}") for ev in events]
        if r == 0 or (r + 1) % 5 == 0:
            _log(tag, f"{phase}: round {r + 1}/{spec['repeats']} "
                      f"({time.monotonic() - t_start:.0f} s)")
    return samples, spread


# --------------------------------------------------------------------------- profiling


def _is_comm(name: str, comm: frozenset[str]) -> bool:
    return name in comm or is_collective(name)


def _union_s(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def iteration_stats(events: Sequence[Any], comm: frozenset[str]) -> list[dict[str, float]]:
    """Per iteration (run id, in start order): span, busy compute (union of kernel
    intervals), summed compute and all-reduce durations, kernel and all-reduce counts."""
    from disco_estimator.ops import iteration_order

    by_run: dict[str, list[Any]] = {}
    for ev in events:
        by_run.setdefault(ev.run_id, []).append(ev)
    out = []
    for rid in iteration_order(events):
        evs = by_run[rid]
        lo = min(e.start_s for e in evs)
        hi = max(e.start_s + e.dur_s for e in evs)
        cmp_ = [e for e in evs if not _is_comm(e.name, comm)]
        com = [e for e in evs if _is_comm(e.name, comm)]
        out.append({"span_s": hi - lo,
                    "compute_busy_s": _union_s([(e.start_s, e.start_s + e.dur_s) for e in cmp_]),
                    "compute_sum_s": sum(e.dur_s for e in cmp_),
                    "comm_sum_s": sum(e.dur_s for e in com),
                    "busy_s": _union_s([(e.start_s, e.start_s + e.dur_s) for e in evs]),
                    "kernels": len(cmp_), "comm_events": len(com)})
    return out


def _comm_names(hlo_text: str) -> frozenset[str]:
    import hlo_tools

    return frozenset(i.name for _, i in hlo_tools.parse(hlo_text).instructions()
                     if is_collective(i.opcode))


def _trace_calls(run: Any, args: Sequence[Any], n: int, coord: Any,
                 phase: str) -> list[Any]:
    """Traces ``n`` blocked calls; returns the program's instruction events."""
    import jax

    from disco_estimator.ops import find_trace_file, module_name, op_events, read_trace_events

    tmp = tempfile.mkdtemp(prefix="disco_acc_trace_")
    try:
        coord.barrier(f"{phase}_trace")
        jax.profiler.start_trace(tmp)
        try:
            for _ in range(n):
                coord.barrier(f"{phase}_traced")
                jax.block_until_ready(run(*args))
        finally:
            jax.profiler.stop_trace()
        raw = read_trace_events(find_trace_file(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return op_events(raw, module_name(run.as_text()))


def _profile(runs: Mapping[str, Any], args: Sequence[Any], spec: Mapping[str, Any],
             coord: Any, phase: str, want_trace: str | None,
             spread: Sequence[Any] = ()) -> dict[str, Any]:
    """Traced iterations of every variant: per-iteration stats, the no-fusion program's
    per-instruction profile (from ``spread``, the iterations traced between the timed
    rounds, when there are any), and (on request) one iteration's events."""
    from disco_estimator.ops import iteration_order, summarize

    out: dict[str, Any] = {"stats": {}}
    n = int(spec["profile_iterations"])
    for name in sorted(runs):
        events = _trace_calls(runs[name], args, n, coord, phase)
        text = runs[name].as_text()
        out["stats"][name] = iteration_stats(events, _comm_names(text))
        if name == "no_fusion" and (spread or events):
            picked = list(spread) or events
            prof = summarize(picked[0].module, text, picked, [])
            out["program_profile"] = _profile_json(prof)
            out["program_profile_spread"] = bool(spread)
        if name == want_trace and events:
            stats = out["stats"][name]
            spans = [s["span_s"] for s in stats]
            pick = iteration_order(events)[spans.index(statistics.median_low(spans))]
            out["trace"] = {"variant": name, "comm": sorted(_comm_names(text)),
                            "events": [ev.__dict__ for ev in events if ev.run_id == pick]}
    return out


def _profile_json(prof: Any) -> dict[str, Any]:
    """A :class:`~disco_estimator.ops.ProgramProfile` as JSON (device keys as strings)."""
    return {"module": prof.module, "hlo_text": prof.hlo_text, "times_s": prof.times_s,
            "per_device_s": {str(d): v for d, v in prof.per_device_s.items()},
            "samples_s": {str(d): v for d, v in prof.samples_s.items()},
            "counts": prof.counts, "wall_times_s": prof.wall_times_s,
            "trace_iteration_s": prof.trace_iteration_s}


# --------------------------------------------------------------------------- run


def _run(args: argparse.Namespace) -> None:
    spec = json.loads(Path(args.spec).read_text())
    pid, nproc = args.process_id, int(spec["num_processes"])
    tag = f"{spec['model']} p{pid}"
    if spec.get("pin_cpus"):
        from disco_estimator.gloo import pin_to_own_cpu

        pin_to_own_cpu(pid)
    import jax

    from hlo_tools import jax_bridge

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _setup_jax(spec)
    jax.distributed.initialize(args.coordinator, num_processes=nproc, process_id=pid,
                               initialization_timeout=120)
    coord = jax_bridge.Coordinator("acc", _BARRIER_MS)
    step, fargs, text, module, graph = _model(spec)
    runs, info = _compile_all(spec, pid, step, fargs, module, graph, tag)
    everywhere = coord.all_values("compiled", sorted(runs), pid, nproc)
    common = set.intersection(*(set(v) for v in everywhere))
    runs = {n: runs[n] for n in sorted(common)}  # one call order on every process
    _log(tag, f"compiled {len(runs)} variants")
    for name, run in runs.items():
        info[name]["loss"] = _first_loss(run, fargs)
    result: dict[str, Any] = {"process": pid, "variants": info, "setups": {},
                              "facts": _facts()}
    if pid == 0:
        result["hlo_text"] = text
        if "xla_default" in runs:
            result["xla_default_text"] = runs["xla_default"].as_text()
    for setup in spec["setups"]:
        result["setups"][setup["name"]] = _phase(spec, setup, runs, fargs, coord, pid, tag,
                                                 args.parent_netns)
    _write_json(args.out, result)
    coord.barrier("end")
    jax.distributed.shutdown()


def _phase(spec: Mapping[str, Any], setup: Mapping[str, Any], runs: Mapping[str, Any],
           fargs: Sequence[Any], coord: Any, pid: int, tag: str,
           parent_netns: str) -> dict[str, Any]:
    """One setup: set the loopback rate, warm up, timed rounds, traced iterations."""
    phase = setup["name"]
    qdisc = set_loopback_rate(setup.get("rate") or "", parent_netns) if pid == 0 else ""
    coord.barrier(f"{phase}_net")
    ks = _choose_k(runs, fargs, spec, coord, pid, phase)
    t0 = time.monotonic()
    samples, spread = _rounds(runs, fargs, ks, spec, coord, phase, tag)
    timed_s = time.monotonic() - t0
    trace = spec.get("trace") or {}
    want = trace.get("variant") if trace.get("setup") == phase else None
    prof = _profile(runs, fargs, spec, coord, phase, want, spread)
    return {"qdisc": qdisc, "k": ks, "samples_s": samples, "timed_s": timed_s, **prof}


def _facts() -> dict[str, Any]:
    import jax

    return {"jax_version": jax.__version__, "backend": jax.default_backend(),
            "num_devices": jax.device_count(), "num_processes": jax.process_count(),
            "host_cpus": os.cpu_count() or 0}


# --------------------------------------------------------------------------- launch


def _launch(args: argparse.Namespace) -> None:
    """Starts the job's processes inside this (private) namespace and waits for them."""
    if not in_private_netns(args.parent_netns):
        raise SystemExit("launch must run in a private network namespace (unshare -n)")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
    spec = json.loads(Path(args.spec).read_text())
    outs = [Path(args.out_dir) / f"p{i}.json" for i in range(int(spec["num_processes"]))]
    spinners = _start_spinners(args.timeout) if spec.get("keep_awake") else []
    try:
        rcs = run_local_job(
            lambda i, coordinator: [sys.executable, str(WORKER), "run", "--spec", args.spec,
                                    "--out", str(outs[i]), "--coordinator", coordinator,
                                    "--process-id", str(i), "--parent-netns", args.parent_netns],
            len(outs), timeout_s=args.timeout, grace_s=10.0)
    finally:
        for sp in spinners:
            sp.kill()
            sp.wait()
    if any(rcs):
        raise SystemExit(f"workers exited with {rcs}")


#: A busy loop at SCHED_IDLE priority: it runs only when a CPU would otherwise idle.
_SPIN = ("import os, time\n"
         "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
         "end = time.monotonic() + {seconds}\n"
         "while time.monotonic() < end:\n"
         "    pass\n")


def _start_spinners(seconds: float) -> list[subprocess.Popen]:
    """One SCHED_IDLE busy loop per CPU (bounded by ``seconds``).

    On this VM an idle vCPU halts, and waking it again (a gloo receive after a wait)
    costs a host reschedule of up to a few milliseconds; the spinners keep the vCPUs
    from halting, so a wake-up is an in-guest preemption. They only take CPU time
    nothing else in the guest wants, but the host sees the vCPUs busy.
    """
    code = _SPIN.format(seconds=float(seconds))
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 1)]


# --------------------------------------------------------------------------- screen


def _screen(args: argparse.Namespace) -> None:
    """Compiles one variant in this process (host devices); exit 0 if it compiled."""
    spec = json.loads(Path(args.spec).read_text())
    _setup_jax({})
    variant = next(v for v in spec["variants"] if v["name"] == args.variant)
    step, fargs, _, module, graph = _model(spec)
    try:
        build_variant(variant, step, fargs, module, graph)
    except Exception as err:
        print(f"compile error: {str(err)[:300]}", file=sys.stderr)
        raise SystemExit(3) from None


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python benchmarks/accuracy_worker.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch")
    la.add_argument("--spec", required=True)
    la.add_argument("--out-dir", required=True)
    la.add_argument("--timeout", type=float, default=900.0)
    la.add_argument("--parent-netns", required=True)
    ru = sub.add_parser("run")
    ru.add_argument("--spec", required=True)
    ru.add_argument("--out", required=True)
    ru.add_argument("--coordinator", required=True)
    ru.add_argument("--process-id", type=int, required=True)
    ru.add_argument("--parent-netns", required=True)
    sc = sub.add_parser("screen")
    sc.add_argument("--spec", required=True)
    sc.add_argument("--variant", required=True)
    args = ap.parse_args(argv)
    {"launch": _launch, "run": _run, "screen": _screen}[args.cmd](args)


if __name__ == "__main__":
    main()
