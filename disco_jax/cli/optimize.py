"""``disco optimize IN.hlo -o OUT.hlo``: search the best plan of a module, write it as HLO.

The input is pre-optimization HLO text from anywhere (``lowered.as_text(dialect="hlo")``,
an XLA dump). Its per-device program (the shard_map body, else ENTRY) is searched by
:func:`disco_jax.pipeline.search.search` with the simulator as cost model -- built as
``disco simulate`` builds it (hardware file; single ops timed on this machine, cached;
``--profile`` first; in context by default when this process's devices can run the
module: profiled here and the AllReduce latency and compute scale fitted to it, see
``disco simulate --help``) -- from the no-fusion plan and the bucketed baselines. The best plan
is written back with :func:`hlo_tools.apply_plan`: compile it with
``hlo_tools.compile_module(text, hlo_tools.InPlaceOf(step, args),
hlo_tools.CompileOptions(exact=True))`` to run exactly that plan.

OUT is written atomically (a temporary file in its directory, then ``os.replace``): on
any error there is no partial file, and an existing OUT is left as it was. Beside it,
OUT.plan.json (written the same way) holds the plan itself, its predicted time and a
fingerprint of the module's per-device graph.

Memory: plans whose predicted peak memory per device (the simulator's live-range
estimate) exceeds ``--memory-budget`` (default: this machine's device memory) are
refused; the report gives the chosen plan's predicted peak beside the no-fusion plan's.
When not even a start plan fits, the command exits with an error and writes nothing.

Stopping: Ctrl-C (SIGINT) or SIGTERM during the search ends it as the time budget does:
the best plan so far is written to OUT and OUT.plan.json and the exit code is 130 (a
second Ctrl-C gives up at once, writing nothing; before the search starts, one is
enough). ``--resume`` starts the search again from the plan in OUT.plan.json, queued
with the usual start plans (so the result is never predicted worse than it); the plan
must be for the same module (its fingerprint), else the command refuses it. Without
such a file ``--resume`` starts afresh, with a note. Input files larger than 64 MiB are
refused (``$DISCO_MAX_INPUT_MB`` sets the limit).

This module holds the subcommand's parser (:func:`register`) and its run (:func:`run`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from disco_jax.cli import EXIT_INTERRUPTED, UserError
from disco_jax.cli.options import (
    add_cost_model_arguments,
    add_fused_estimator_argument,
    add_gnn_argument,
    add_in_context_argument,
    check_arguments,
    cost_model_in_context,
    fused_choice,
    fused_line,
    in_context_line,
    load_hardware_file,
    load_module,
)
from disco_jax.units import format_bytes
from hlo_tools.dirs import write_atomic

__all__ = ["PLAN_FORMAT", "graph_fingerprint", "plan_path", "register", "run"]

#: What ``disco optimize --help`` says (the module docstring is for developers).
HELP = """Search the best plan of an HLO module and write it back as HLO.

Reads a pre-optimization module (jax's lowered.as_text(dialect="hlo")), searches op
fusion, duplicate fusion and AllReduce buckets with the simulator as cost model, and
writes the best plan as HLO to OUT (atomically), with OUT.plan.json beside it (the plan,
its predicted time). Compile OUT with hlo_tools.compile_module(text,
hlo_tools.InPlaceOf(step, args), hlo_tools.CompileOptions(exact=True)) to run exactly that
plan; --enactment writes what disco_jax.jit's store keeps. For a GPU hardware file the
plan holds AllReduce buckets only (XLA:GPU compiles no hand-written fusion). Ctrl-C stops
the search and keeps the best plan so far (exit code 130); --resume continues from it."""

#: Examples, after the options in ``--help``.
EXAMPLES = """examples:
  disco optimize step.hlo -o step.opt.hlo --hardware gloo2 --time-budget 30
  disco optimize step.hlo -o step.opt.hlo --enactment step.enactment.json"""

#: The ``format`` of OUT.plan.json.
PLAN_FORMAT = "disco-plan/1"


def register(subparsers: Any) -> None:
    """Adds the ``optimize`` subcommand."""
    p = subparsers.add_parser(
        "optimize", help="search the best plan of an HLO module and write it as HLO",
        description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="IN.hlo", help="pre-optimization HLO text")
    p.add_argument("-o", "--output", required=True, metavar="OUT.hlo",
                   help="where to write the optimized HLO (atomically)")
    p.add_argument("--time-budget", type=float, metavar="S",
                   help="search time budget in seconds (default: configs/search.toml)")
    p.add_argument("--patience", type=int, metavar="N",
                   help="stop after N candidates without a new best (default: "
                        "configs/search.toml)")
    p.add_argument("--seed", type=int, default=0, help="search seed (default: 0)")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="refuse plans whose predicted peak memory per device exceeds SIZE "
                        "(e.g. 512MiB, 8GiB; default: this machine's device memory)")
    p.add_argument("--resume", action="store_true",
                   help="start from the plan of OUT.plan.json (written by an earlier run, "
                        "also an interrupted one) besides the usual start plans")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--enactment", metavar="OUT.json",
                   help="also write what to run as an enactment (disco_jax.enactment: the "
                        "form the strategy store keeps and the activator broadcasts)")
    p.add_argument("--staged", metavar="plan|K",
                   help="with --enactment: a staged enactment (compute stages and one "
                        "all-reduce per bucket on two streams) of the plan's buckets "
                        "('plan') or of K buckets of equal bytes, instead of the single "
                        "optimized module")
    p.add_argument("--no-gpu-compile", dest="gpu_compile", action="store_false",
                   help="for a GPU hardware file, skip compiling the plan for an H100 "
                        "without a GPU (done when the gpu-compile extra is installed)")
    add_cost_model_arguments(p)
    add_gnn_argument(p)
    add_fused_estimator_argument(p)
    add_in_context_argument(p)
    p.set_defaults(func=run)


def _check_output(spec: str) -> Path:
    out = Path(spec)
    if out.is_dir():
        raise UserError(f"-o {spec}: is a directory, expected a file name")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise UserError(f"-o {spec}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UserError(f"-o {spec}: directory {parent} is not writable")
    return out


def plan_path(output: str | os.PathLike[str]) -> Path:
    """Where the plan of ``-o OUTPUT`` is written: ``OUTPUT.plan.json``."""
    out = Path(output)
    return out.with_name(out.name + ".plan.json")


def graph_fingerprint(graph: Any) -> str:
    """SHA-256 of a per-device graph's structure (names, opcodes, operands, bytes): a plan
    fits the graphs with its fingerprint."""
    data = json.dumps([graph.names, graph.opcodes, graph.operands, graph.out_bytes])
    return hashlib.sha256(data.encode()).hexdigest()


def _plan_problem(graph: Any, plan: Any) -> str | None:
    """Why ``plan`` cannot be a plan of ``graph`` (None when it can): node count, group
    ids, contiguous groups, and the rewritten module's structure (def-before-use)."""
    import hlo_tools

    n = graph.num_nodes
    if len(plan.order) != n:
        return f"it has {len(plan.order)} nodes, the module {n}"
    group = plan.group
    if any(not 0 <= g < n or group[g] != g or g > i for i, g in enumerate(group)):
        return "a group id is not the smallest node of its group"
    seen, last = set(), None
    for node in plan.order:
        g = group[node]
        if g != last:
            if g in seen:
                return f"group {g} is not contiguous in the schedule"
            seen.add(g)
            last = g
    if any(not (0 <= p < n and 0 <= g < n and group[g] == g) for p, g in plan.dups):
        return "a duplicated producer or its group is out of range"
    try:
        problems = hlo_tools.find_problems(hlo_tools.apply_plan(graph.module, plan, graph))
    except (ValueError, KeyError, IndexError) as err:
        return f"it cannot be applied ({type(err).__name__}: {err})"
    return problems[0] if problems else None


def _gpu_compile(written: Any, text: str) -> dict[str, Any]:
    """Compiles the plan as written for XLA:GPU without a GPU, for an H100 target, with the
    options of ``xla_passes.toml``'s ``[gpu]`` table (what the exact route compiles with),
    when the gpu-compile extra is installed: whether it compiles and keeps every planned
    fusion (:func:`hlo_tools.gpu_legal.fusions_kept`).

    Raises:
        UserError: XLA:GPU rejects the plan or loses a planned fusion (nothing is written).
    """
    import hlo_tools
    from hlo_tools.gpu_legal import fusions_kept
    from hlo_tools.jax_bridge import HloCompileError, exact_compiler_options, pjrt

    reason = pjrt.unavailable_reason()
    if reason is not None:
        return {"checked": False, "reason": reason}
    print("disco: compiling the plan for XLA:GPU (an H100 target, no GPU needed)",
          file=sys.stderr, flush=True)
    try:
        out = pjrt.compile_deviceless(text, exact_compiler_options("cuda"))
    except HloCompileError as err:
        raise UserError("the plan does not compile for XLA:GPU: "
                        f"{str(err).strip().splitlines()[0][:300]}") from None
    kept = fusions_kept(written, hlo_tools.parse(out.optimized_text))
    if kept.lost:
        raise UserError(f"XLA:GPU did not keep {len(kept.lost)} of the plan's "
                        f"{kept.planned} fusions (first: {' '.join(kept.lost[0])})")
    return {"checked": True, "seconds": round(out.seconds, 2), **kept._asdict()}


def _load_resume(path: Path, graph: Any) -> Any | None:
    """The plan to resume from (None, with a note, when ``path`` does not exist)."""
    from disco_jax.cli.inputs import read_text
    from hlo_tools.plan import Plan

    if not path.exists():
        print(f"disco: note: --resume: no plan at {path}; starting afresh", file=sys.stderr)
        return None
    text = read_text(path, "a plan written by disco optimize")
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(f"not a {PLAN_FORMAT} file")
        fingerprint = data["fingerprint"]
        plan = Plan.from_json(data["plan"])
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: --resume: not JSON: {err.msg}") from None
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{path}: --resume: not a plan file of disco optimize "
                        f"({type(err).__name__}: {err})") from None
    if fingerprint != graph_fingerprint(graph):
        raise UserError(f"{path}: --resume: the plan is for another module (fingerprint "
                        f"{str(fingerprint)[:12]}, this one {graph_fingerprint(graph)[:12]});"
                        " remove it or run without --resume")
    problem = _plan_problem(graph, plan)
    if problem:
        raise UserError(f"{path}: --resume: not a legal plan of this module: {problem}")
    return plan


class _Signals:
    """SIGINT and SIGTERM while ``disco optimize`` runs (main thread only).

    Before the search: KeyboardInterrupt at once (exit 130, nothing written). During the
    search: the first sets :attr:`received`, which the search reads as its ``stop``; a
    second raises KeyboardInterrupt. After it: noted, and the outputs are still written.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.phase = "before"
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.phase == "before" or (self.phase == "search" and self.received):
            raise KeyboardInterrupt
        self.received = self.received or signum

    def stop(self) -> bool:
        return self.received is not None


def run(args: argparse.Namespace) -> int:
    """Runs ``disco optimize``; returns the exit code."""
    with _Signals() as signals:
        return _run(args, signals)


def _run(args: argparse.Namespace, signals: _Signals) -> int:
    import hlo_tools
    from disco_jax.pipeline.search import MemoryBudgetError, baseline_plans, search
    from disco_jax.units import parse_bytes
    from hlo_tools.jax_bridge import EXACT, device_memory_bytes, platform_family
    from hlo_tools.plan import FusionSpace

    check_arguments(args)
    fused = fused_choice(args)  # a bad checkpoint or setting fails before any profiling
    out = _check_output(args.output)
    if args.staged and not args.enactment:
        raise UserError("--staged needs --enactment OUT.json")
    if args.time_budget is not None and not args.time_budget > 0:
        raise UserError(f"--time-budget must be > 0, got {args.time_budget}")
    if args.patience is not None and args.patience < 1:
        raise UserError(f"--patience must be >= 1, got {args.patience}")
    try:
        budget = (parse_bytes(args.memory_budget) if args.memory_budget is not None
                  else device_memory_bytes())
    except ValueError as err:
        raise UserError(f"--memory-budget: {err}") from None
    try:
        module = load_module(args.file)
    except UserError as err:  # one line: file:line:col and the reason, not the quote
        raise UserError(str(err).splitlines()[0]) from None
    if module.header_attrs.get("is_scheduled") == "true":
        raise UserError(
            f"{args.file}:1: a compiled module (is_scheduled=true: XLA already fused and "
            "combined it, so there is nothing left to plan); give the pre-optimization "
            "module: jax.jit(step).lower(*args).as_text(dialect='hlo') (or "
            "hlo_tools.jax_bridge.extract(step, *args))")
    try:
        graph = hlo_tools.device_graph(module)
    except ValueError as err:
        raise UserError(f"{args.file}: {err}") from None
    plan_file = plan_path(out)
    route = _route(args)
    resumed = _load_resume(plan_file, graph) if args.resume else None
    if resumed is not None and route.name != EXACT and (
            resumed.dups or _fusions_and_buckets(graph, resumed)[0]):
        raise UserError(f"{plan_file}: --resume: the plan fuses ops, which "
                        f"{route.platform} cannot compile ({route.reason})")
    costs, in_context = cost_model_in_context(module, args)
    space = FusionSpace(graph)
    starts = baseline_plans(space)
    if resumed is not None:
        starts["resumed"] = resumed
    print("disco: searching (Ctrl-C stops it and keeps the best plan so far)",
          file=sys.stderr, flush=True)
    signals.phase = "search"
    try:
        outcome = search(graph, costs, seed=args.seed, time_budget_s=args.time_budget,
                         patience=args.patience, start_plans=starts, space=space,
                         stop=signals.stop, memory_budget_bytes=budget,
                         buckets_only=route.name != EXACT)
    except MemoryBudgetError as err:
        raise UserError(f"{args.file}: {err}") from None
    signals.phase = "after"
    backend = platform_family(route.platform) or "cpu"
    written = hlo_tools.apply_plan(module, outcome.plan, graph, backend=backend)
    text = hlo_tools.to_text(written)
    gpu_compile = _gpu_compile(written, text) if backend == "gpu" and args.gpu_compile else None
    record = {"format": PLAN_FORMAT, "file": str(args.file), "output": str(out),
              "computation": graph.computation.name, "nodes": graph.num_nodes,
              "fingerprint": graph_fingerprint(graph), "predicted_s": outcome.cost_s,
              "seed": outcome.seed, "stop_reason": outcome.stats.stop_reason,
              "fused_estimator": fused.to_json(), "plan": outcome.plan.to_json()}
    enactment = _enactment(args, module, graph, outcome.plan, text, route)
    try:
        write_atomic(plan_file, json.dumps(record), mkdir=False)
        write_atomic(out, text, mkdir=False)
        if enactment is not None:
            write_atomic(args.enactment, json.dumps(enactment.to_json()), mkdir=False)
    except OSError as err:
        raise UserError(f"cannot write the output: {err.strerror or err}") from None
    report = _report(args, graph, outcome, costs)
    report["in_context"] = in_context
    report["fused_estimator"] = fused.to_json()
    report["route"] = route.to_json()
    report["plan_file"] = str(plan_file)
    report["resumed"] = resumed is not None
    report["gpu_compile"] = gpu_compile
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_report(report, fused)
    if signals.received is not None:
        name = signal.Signals(signals.received).name
        print(f"disco: interrupted ({name}): the best plan so far is in {out} and "
              f"{plan_file}; --resume continues from it", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _route(args: argparse.Namespace) -> Any:
    """How plans reach the hardware file's backend (:func:`hlo_tools.jax_bridge.known_route`:
    probed when this process runs that backend); a note on stderr when the plans can hold
    AllReduce buckets only."""
    from hlo_tools.jax_bridge import EXACT, known_route

    backend = str(load_hardware_file(args.hardware).hardware.get("backend", "cpu"))
    route = known_route(backend)
    if route.name != EXACT:
        print(f"disco: note: plans for {backend} hold AllReduce buckets only, over XLA's own "
              f"fusion: {route.reason}", file=sys.stderr)
    return route


def _fusions_and_buckets(graph: Any, plan: Any) -> tuple[int, int]:
    """How many groups of ``plan`` are fusions of ops, and how many AllReduce buckets."""
    groups = plan.groups()
    buckets = sum(1 for ms in groups.values() if graph.opcodes[ms[0]] == "all-reduce")
    return len(groups) - buckets, buckets


def _enactment(args: argparse.Namespace, module: Any, graph: Any, plan: Any,
               text: str, route: Any) -> Any:
    """The enactment ``--enactment`` asks for (None without it)."""
    if not args.enactment:
        return None
    from disco_jax.enactment import Enactment
    from disco_jax.enactment.staged import even_buckets, staged_plan
    from disco_jax.pipeline.candidates import plan_compile_options
    from hlo_tools.plan import FusionSpace, bucket_members

    if not args.staged:  # as the route compiles plans (exact: dots on the library)
        return Enactment.single("disco_optimize", text, **plan_compile_options(route))
    try:
        if args.staged == "plan":
            buckets = bucket_members(FusionSpace(graph), plan)
        elif args.staged.isdigit() and int(args.staged) >= 1:
            buckets = even_buckets(graph, int(args.staged))
        else:
            raise UserError(f"--staged must be 'plan' or a bucket count, got {args.staged!r}")
        return Enactment.of_stages(f"staged_{args.staged}", staged_plan(module, buckets, graph))
    except ValueError as err:
        raise UserError(f"{args.file}: cannot stage: {err}") from None


def _report(args: argparse.Namespace, graph: Any, outcome: Any, costs: Any) -> dict[str, Any]:
    from disco_estimator.costs.lower import simulate_plan
    from hlo_tools.plan import initial_plan

    fusions, buckets = _fusions_and_buckets(graph, outcome.plan)
    stats = outcome.stats
    return {
        "file": str(args.file),
        "output": str(args.output),
        "computation": graph.computation.name,
        "nodes": graph.num_nodes,
        "predicted_s": outcome.cost_s,
        "start_predicted_s": outcome.start_costs_json(),
        "best_start": outcome.best_start,
        "fo_bound_s": outcome.fo_bound_s,
        "memory": {"peak_bytes": outcome.peak_bytes,
                   "no_fusion_peak_bytes": simulate_plan(graph, initial_plan(graph),
                                                         costs).peak_bytes,
                   "budget_bytes": outcome.memory_budget_bytes,
                   "refused": stats.over_budget},
        "plan": {"fusions": fusions, "buckets": buckets,
                 "duplicated_producers": len(outcome.plan.dups)},
        "search": {"seed": outcome.seed, "evaluated": stats.evaluated, "pops": stats.pops,
                   "duplicates": stats.duplicates, "seconds": stats.seconds,
                   "stop_reason": stats.stop_reason, "config": outcome.config._asdict()},
        "cost_model": costs.describe(),
    }


def _fmt_ms(t: float) -> str:
    return f"{t * 1e3:10.3f} ms" if math.isfinite(t) else str(t)


def _print_report(r: dict[str, Any], fused: Any) -> None:
    out = sys.stdout
    print(f"{r['file']}: {r['computation']}, {r['nodes']} nodes -> {r['output']}", file=out)
    best = r["start_predicted_s"][r["best_start"]]
    for name, t in r["start_predicted_s"].items():
        shown = "refused: over the memory budget" if t is None else _fmt_ms(t)
        print(f"  {'start ' + name:28s} {shown}", file=out)
    print(f"  {'optimized plan':28s} {_fmt_ms(r['predicted_s'])}  "
          f"({best / r['predicted_s']:.2f}x the best start, {r['best_start']})", file=out)
    print(f"  {'full-overlap bound':28s} {_fmt_ms(r['fo_bound_s'])}", file=out)
    p, s = r["plan"], r["search"]
    print(f"plan: {p['fusions']} fusions, {p['duplicated_producers']} duplicated producers, "
          f"{p['buckets']} AllReduce buckets", file=out)
    m = r["memory"]
    print(f"memory: predicted peak {format_bytes(m['peak_bytes'])} per device (no fusion "
          f"{format_bytes(m['no_fusion_peak_bytes'])}; budget {format_bytes(m['budget_bytes'])}"
          f", {m['refused']} candidates refused)", file=out)
    print(fused_line(fused), file=out)
    print(in_context_line(r["in_context"]), file=out)
    print(f"search: {s['evaluated']} candidates, {s['pops']} pops in {s['seconds']:.1f} s "
          f"(seed {s['seed']}, stopped by {s['stop_reason']})", file=out)
