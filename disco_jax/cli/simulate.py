"""``disco simulate FILE.hlo``: simulate one iteration of an HLO module as written.

The per-device program of the module (the shard_map body of a pre-optimization module,
else ENTRY) is costed by :func:`disco_jax.lower.sim_graph_from_module` and run through
the simulator: every instruction is a kernel, ``fusion`` instructions are *predicted*
from their members (never timed as fusions), all-reduces use the hardware file's
``T = C * bytes + D``. Single ops are timed on this machine by
:mod:`estimator.op_bench` (cached on disk; ``--no-bench`` uses only ``--profile`` and
the analytic model).

This module holds the subcommand's parser (:func:`register`), the reading and checking
of its input (:func:`load_module`, hardware and profile files) and its run and report
(:func:`run`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from disco_jax.cli import UserError

__all__ = [
    "add_cost_model_arguments",
    "check_arguments",
    "cost_model",
    "load_module",
    "register",
    "run",
]

#: Instruction names in a verifier message: quoted, or the leading ``name:``.
_PROBLEM_NAMES = re.compile(r"'([^']+)'|^([\w.\-]+):")


def register(subparsers: Any) -> None:
    """Adds the ``simulate`` subcommand."""
    p = subparsers.add_parser(
        "simulate", help="simulate one training iteration of an HLO module as written",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", metavar="FILE.hlo", help="HLO text (pre- or post-optimization)")
    add_cost_model_arguments(p)
    p.add_argument("--overlap", type=float, metavar="PHI",
                   help="override the hardware's compute/communication overlap phi in [0, 1]")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.set_defaults(func=run)


def add_cost_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options that choose a cost model (``--hardware``, ``--profile``,
    ``--no-bench``, ``--replicas``), shared by the commands that cost plans."""
    p.add_argument("--hardware", default="inproc4", metavar="NAME|PATH",
                   help="hardware file: a name (the user's hardware directory, then the "
                        "shipped files) or a .toml path (default: inproc4)")
    p.add_argument("--profile", metavar="PROFILE.json",
                   help="measured op times (estimator.profiler.OpProfile JSON), used first")
    p.add_argument("--no-bench", action="store_true",
                   help="do not time single ops on this machine (profile/analytic only)")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="devices that run each timed op at once (default: 1)")


# --------------------------------------------------------------------------- input


def _line_of(text: str, name: str) -> int:
    """1-based line where instruction ``name`` is defined (0 if not found)."""
    match = re.search(rf"^\s*(?:ROOT\s+)?%?{re.escape(name)}\s*=", text, re.MULTILINE)
    return text.count("\n", 0, match.start()) + 1 if match else 0


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; errors name the file (and line for bad bytes)."""
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if path.is_dir():
        raise UserError(f"{path}: is a directory, expected an HLO text file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x}); "
                        "expected an HLO text file") from None
    if not text.strip():
        raise UserError(f"{path}:1: empty file, expected an HLO module")
    return text


def load_module(path: str | os.PathLike) -> Any:
    """Reads, parses and structurally checks an HLO file.

    Raises:
        UserError: with ``file:line`` for unreadable, malformed or invalid input.
    """
    import hlo_tools
    from hlo_tools.verify import find_problems

    path = Path(path)
    text = _read_text(path)
    try:
        module = hlo_tools.parse(text, source=str(path))
    except hlo_tools.HloParseError as err:
        raise UserError(str(err)) from None
    problems = find_problems(module)
    if problems:
        names = [q or lead for q, lead in _PROBLEM_NAMES.findall(problems[0])]
        line = next((n for n in (_line_of(text, nm) for nm in names) if n), 1)
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise UserError(f"{path}:{line}: invalid module: {problems[0]}{more}")
    return module


def _hardware(spec: str) -> Any:
    """The hardware file ``spec`` names (:func:`estimator.hardware.load_hardware`).

    Raises:
        UserError: no such file (the message lists the known names), or an invalid one.
    """
    from estimator.hardware import HardwareError, load_hardware

    try:
        return load_hardware(spec)
    except HardwareError as err:
        raise UserError(str(err)) from None
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(f"hardware {spec!r}: invalid hardware file: {err}") from None


def _profile(spec: str | None) -> Any:
    if spec is None:
        return None
    from estimator.profiler import OpProfile

    try:
        return OpProfile.load(spec)
    except FileNotFoundError:
        raise UserError(f"{spec}: no such file") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{spec}:{err.lineno}: not a JSON profile: {err.msg}") from None
    except (KeyError, ValueError, TypeError, OSError) as err:
        raise UserError(f"{spec}: not an op profile (estimator.profiler.OpProfile): {err}") \
            from None


def check_arguments(args: argparse.Namespace) -> None:
    """Checks the cost-model options (and ``--overlap``, ``--trace`` where the command
    has them); raises :class:`UserError`."""
    overlap, trace = getattr(args, "overlap", None), getattr(args, "trace", None)
    if overlap is not None and not 0.0 <= overlap <= 1.0:
        raise UserError(f"--overlap must be in [0, 1], got {overlap}")
    if args.replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {args.replicas}")
    if trace is not None:
        parent = Path(args.trace).resolve().parent
        if not parent.is_dir():
            raise UserError(f"--trace {args.trace}: directory {parent} does not exist")


# --------------------------------------------------------------------------- run


def cost_model(module: Any, args: argparse.Namespace) -> Any:
    """The :class:`~disco_jax.cost_model.CostModel` the options choose, with op times
    covering ``module``; raises :class:`UserError` for a bad hardware or profile file."""
    import dataclasses

    from disco_jax.cost_model import CostModel

    hardware = _hardware(args.hardware)
    profile = _profile(args.profile)
    replicas = args.replicas
    if not args.no_bench and replicas > 1:
        import jax

        replicas = min(replicas, jax.local_device_count())
    try:
        costs = CostModel.for_module(module, hardware, profile=profile,
                                     bench=not args.no_bench, replicas=replicas)
    except ValueError as err:
        raise UserError(f"hardware {args.hardware!r}: {err}") from None
    if getattr(args, "overlap", None) is not None:
        costs.constants = dataclasses.replace(costs.constants, overlap=args.overlap,
                                              source="--overlap")
    return costs


def run(args: argparse.Namespace) -> int:
    """Runs ``disco simulate``; returns the exit code."""
    from disco_jax.lower import sim_graph_from_module
    from disco_jax.simulator import full_overlap_bound, simulate
    from hlo_tools.graph import device_graph

    check_arguments(args)
    module = load_module(args.file)
    costs = cost_model(module, args)
    graph = device_graph(module)
    sim = sim_graph_from_module(module, costs)
    result = simulate(sim, costs.overlap)
    summary = costs.graph_costs(graph).summary()
    report = {
        "iteration_s": result.iteration_s,
        "compute_s": result.compute_s,
        "compute_work_s": float(sim.duration_s[~sim.is_comm].sum()),
        "comm_s": result.comm_s,
        "overlap_s": result.overlap_s,
        "peak_bytes": result.peak_bytes,
        "fo_bound_s": full_overlap_bound(sim),
        "file": str(args.file),
        "computation": graph.computation.name,
        "nodes": len(sim.names),
        "comm_nodes": int(sim.is_comm.sum()),
        "time_sources": summary["sources"],
        "estimated_nodes": summary["estimated_nodes"],
        "cost_model": costs.describe(),
    }
    if args.trace is not None:
        from disco_jax.trace import write_trace

        write_trace(args.trace, result, sim, label=f"{Path(args.file).name} (simulated)")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_report(report, args)
    return 0


def _fmt_s(t: float) -> str:
    if not math.isfinite(t):
        return str(t)
    if t >= 1.0:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _print_report(r: dict[str, Any], args: argparse.Namespace) -> None:
    cm = r["cost_model"]
    out = sys.stdout
    print(f"{r['file']}: {r['computation']}, {r['nodes']} nodes ({r['comm_nodes']} "
          f"communication)", file=out)
    print(f"hardware {cm['hardware']}: overlap phi = {cm['overlap']:g}, compute scale "
          f"{cm['compute_scale']:g}, AllReduce T = {cm['allreduce']['c_s_per_byte']:.3g} "
          f"s/B * bytes + {cm['allreduce']['d_s']:.3g} s", file=out)
    rows = [("iteration", _fmt_s(r["iteration_s"])),
            ("compute (stream occupied)", _fmt_s(r["compute_s"])),
            ("compute work (kernels)", _fmt_s(r["compute_work_s"])),
            ("communication (channel busy)", _fmt_s(r["comm_s"])),
            ("overlap (both busy)", _fmt_s(r["overlap_s"])),
            ("full-overlap bound", _fmt_s(r["fo_bound_s"])),
            ("peak memory", _fmt_bytes(r["peak_bytes"]))]
    for label, value in rows:
        print(f"  {label:30s} {value:>12s}", file=out)
    sources = ", ".join(f"{k} {v}" for k, v in r["time_sources"].items())
    print(f"node times: {sources}; {r['estimated_nodes']} estimated", file=out)
    if args.trace:
        print(f"trace written to {args.trace}", file=out)
