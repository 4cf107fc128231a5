"""The options and helpers shared by the ``disco`` commands that cost a module
(``simulate``, ``optimize``, ``estimate``, ``bench``, ``demo``).

* Options: the cost model's (:func:`add_cost_model_arguments`: ``--hardware``,
  ``--profile``, ``--no-bench``, ``--replicas``), the fused-op estimator's
  (:func:`add_gnn_argument`, :func:`add_fused_estimator_argument`) and the in-context
  profile's (:func:`add_in_context_argument`), checked by :func:`check_arguments`.
* Input: an HLO file read, parsed and checked (:func:`load_module`), a hardware file
  (:func:`load_hardware_file`, :func:`default_hardware_here`), a GNN checkpoint
  (:func:`load_gnn`); every mistake a :class:`~disco_jax.cli.UserError`.
* The cost model the options choose (:func:`cost_model`), profiled and calibrated in
  context when asked or possible (:func:`cost_model_in_context`), and the fused-op
  estimator they choose (:func:`fused_choice`).
* Report lines on those choices (:func:`fused_line`, :func:`in_context_line`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from disco_jax.cli import UserError
from disco_jax.cli.inputs import read_text
from disco_jax.units import format_seconds

__all__ = [
    "add_cost_model_arguments",
    "add_fused_estimator_argument",
    "add_gnn_argument",
    "add_in_context_argument",
    "check_arguments",
    "cost_model",
    "cost_model_in_context",
    "default_hardware_here",
    "fused_choice",
    "fused_line",
    "in_context_line",
    "load_gnn",
    "load_hardware_file",
    "load_module",
]

#: Instruction names in a verifier message: quoted, or the leading ``[computation/]name:``
#: (the instruction the problem is about, whose line is reported first).
_PROBLEM_NAMES = re.compile(r"'([^']+)'|^(?:[\w.\-]+/)?([\w.\-]+):")



# --------------------------------------------------------------------------- options


def add_cost_model_arguments(p: argparse.ArgumentParser) -> None:
    """The options that choose a cost model (``--hardware``, ``--profile``,
    ``--no-bench``, ``--replicas``), shared by the commands that cost plans."""
    p.add_argument("--hardware", metavar="NAME|PATH",
                   help="hardware file: a name (the user's hardware directory, then the "
                        "shipped files) or a .toml path (default: the shipped file of this "
                        "machine's backend: inproc4 on CPU, gpu_nvlink8 on GPU)")
    p.add_argument("--profile", metavar="PROFILE.json",
                   help="measured op times (disco_estimator.ops.OpProfile JSON), used first")
    p.add_argument("--no-bench", action="store_true",
                   help="do not time single ops on this machine (profile/analytic only)")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="devices that run each timed op at once (default: 1)")


def add_gnn_argument(p: argparse.ArgumentParser) -> None:
    """``--gnn CHECKPOINT``: price fused ops with this GNN (see :func:`fused_choice`)."""
    p.add_argument("--gnn", metavar="CHECKPOINT",
                   help="price fused ops with this GNN estimator checkpoint (disco "
                        "train-estimator --out; 'pretrained': the one shipped for this "
                        "backend) instead of the fallback rule")


def add_fused_estimator_argument(p: argparse.ArgumentParser) -> None:
    """``--fused-estimator {gnn,fallback}``: which estimator prices fused ops (see
    :func:`fused_choice`)."""
    from disco_estimator.costs.fused_choice import (
        DEFAULT_FUSED_ESTIMATOR,
        FUSED_ESTIMATOR_ENV,
        FUSED_ESTIMATORS,
    )

    p.add_argument("--fused-estimator", choices=FUSED_ESTIMATORS,
                   help="price fused ops with the GNN (the local checkpoint of disco "
                        "train-estimator --local when it beat the shipped one, else the "
                        "shipped one) or the fallback rule (default: "
                        f"${FUSED_ESTIMATOR_ENV}, else {DEFAULT_FUSED_ESTIMATOR})")


def _checkpoint_file(path: str, option: str) -> str:
    """``path``, or for ``pretrained`` the checkpoint shipped for this backend
    (:func:`disco_estimator.gnn.checkpoint.pretrained`); raises :class:`UserError` naming
    ``option`` when none ships."""
    if path != "pretrained":
        return path
    import jax

    from disco_estimator.gnn import checkpoint as ckpt_io

    shipped = ckpt_io.pretrained(jax.default_backend())
    if shipped is None:
        raise UserError(f"{option} pretrained: no checkpoint ships for "
                        f"{jax.default_backend()!r}; train one with disco train-estimator "
                        "--out")
    return str(shipped)


def _choose(option: str, name: str | None = None, checkpoint: str | None = None,
            platform: str = "cpu") -> Any:
    """:func:`disco_estimator.costs.fused_choice.choose_fused_estimator`, its errors as
    :class:`UserError` naming ``option``."""
    from disco_estimator.costs.fused_choice import choose_fused_estimator

    try:
        return choose_fused_estimator(name, platform=platform, checkpoint=checkpoint,
                                      origin=option)
    except FileNotFoundError:
        raise UserError(f"{option} {checkpoint}: no such file") from None
    except OSError as err:
        raise UserError(f"{option} {checkpoint}: cannot read: {err.strerror or err}") \
            from None
    except ValueError as err:
        raise UserError(str(err)) from None


def load_gnn(path: str, option: str = "--gnn") -> Any:
    """The GNN fused-op estimator of checkpoint ``path`` (``pretrained``: the one shipped
    for this backend, :func:`disco_estimator.gnn.checkpoint.pretrained`; no member-time source
    bound yet); raises :class:`UserError` naming ``option`` for a missing or bad file."""
    return _choose(option, checkpoint=_checkpoint_file(path, option)).estimator


def fused_choice(args: argparse.Namespace, platform: str | None = None) -> Any:
    """The fused-op estimator the options choose
    (:class:`~disco_estimator.costs.fused_choice.FusedChoice`): ``--gnn CHECKPOINT`` (the GNN of
    that checkpoint), else ``--fused-estimator``, else ``$DISCO_FUSED_ESTIMATOR``, else the
    default. Chosen once per run (kept on ``args``).

    Args:
        args: the parsed options.
        platform: whose shipped and local checkpoints (default: the ``--hardware``
            file's backend, ``cpu`` without one).

    Raises:
        UserError: a missing or bad checkpoint, a bad ``$DISCO_FUSED_ESTIMATOR``, or
            ``--gnn`` with ``--fused-estimator fallback``.
    """
    chosen = getattr(args, "fused_choice", None)
    if chosen is not None:
        return chosen
    gnn, name = getattr(args, "gnn", None), getattr(args, "fused_estimator", None)
    if gnn:
        if name == "fallback":
            raise UserError("--gnn prices fused ops with a GNN: it does not go with "
                            "--fused-estimator fallback")
        chosen = _choose("--gnn", checkpoint=_checkpoint_file(gnn, "--gnn"))
    else:
        hardware = getattr(args, "hardware", None)
        if platform is None:
            platform = (str(load_hardware_file(hardware).hardware.get("backend", "cpu"))
                        if hardware else "cpu")
        chosen = _choose("--fused-estimator", name, platform=platform)
    args.fused_choice = chosen
    return chosen


def _apply_gnn(costs: Any, args: argparse.Namespace) -> None:
    """Swaps the chosen fused-op estimator (:func:`fused_choice`) into the cost model (a
    no-op for the fallback rule, the cost model's own)."""
    gnn = fused_choice(args).estimator
    if gnn is not None:
        costs.set_fused_estimator(gnn.bind(costs))


def add_in_context_argument(p: argparse.ArgumentParser) -> None:
    """``--in-context`` / ``--no-in-context`` (default: when possible), for the commands
    that cost a module with :func:`cost_model_in_context`."""
    p.add_argument("--in-context", action=argparse.BooleanOptionalAction, default=None,
                   help="profile the module here first, on this process's devices, and fit "
                        "the cost model to it: a pre-optimization module compiled with "
                        "nothing fused and with one gradient bucket (the AllReduce latency "
                        "and compute scale fitted), XLA's compiled module compiled again "
                        "from its ops (every instruction at its traced time, the compute "
                        "scale fitted) (default: when this process's devices can run the "
                        "module and the hardware file is for this kind of setup; else a "
                        "note on stderr)")


# --------------------------------------------------------------------------- input


def _line_of(text: str, name: str) -> int:
    """1-based line where instruction ``name`` is defined (0 if not found)."""
    match = re.search(rf"^\s*(?:ROOT\s+)?%?{re.escape(name)}\s*=", text, re.MULTILINE)
    return text.count("\n", 0, match.start()) + 1 if match else 0


def load_module(path: str | os.PathLike) -> Any:
    """Reads (:func:`disco_jax.cli.inputs.read_text`), parses and structurally checks an
    HLO file.

    Raises:
        UserError: with ``file:line`` for unreadable, malformed or invalid input.
    """
    import hlo_tools
    from hlo_tools.verify import find_problems

    path = Path(path)
    text = read_text(path)
    try:
        module = hlo_tools.parse(text, source=str(path))
    except hlo_tools.HloParseError as err:
        raise UserError(str(err)) from None
    problems = find_problems(module)
    if problems:
        found = _PROBLEM_NAMES.findall(problems[0])
        names = [lead for _, lead in found if lead] + [q for q, _ in found if q]
        line = next((n for n in (_line_of(text, nm) for nm in names) if n), 1)
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise UserError(f"{path}:{line}: invalid module: {problems[0]}{more}")
    return module


def load_hardware_file(spec: str) -> Any:
    """The hardware file ``spec`` names (:func:`disco_estimator.hardware.load_hardware`).

    Raises:
        UserError: no such file (the message lists the known names), or an invalid one.
    """
    from disco_estimator.hardware import HardwareError, load_hardware

    try:
        return load_hardware(spec)
    except HardwareError as err:
        raise UserError(str(err)) from None
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(f"hardware {spec!r}: invalid hardware file: {err}") from None


def default_hardware_here() -> str:
    """The shipped hardware file of this process's backend (one process); on another
    backend than CPU a note on stderr names it."""
    import jax

    from disco_jax.pipeline.fit import default_hardware

    platform = jax.default_backend()
    try:
        name = default_hardware(1, platform)
    except ValueError as err:
        raise UserError(f"--hardware is needed here: {err}") from None
    if platform != "cpu":
        print(f"disco: note: hardware {name} (the default on {platform}; --hardware chooses "
              "another)", file=sys.stderr)
    return name


def _profile(spec: str | None) -> Any:
    if spec is None:
        return None
    from disco_estimator.ops import OpProfile

    try:
        return OpProfile.load(spec)
    except FileNotFoundError:
        raise UserError(f"{spec}: no such file") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{spec}:{err.lineno}: not a JSON profile: {err.msg}") from None
    except (KeyError, ValueError, TypeError, OSError) as err:
        raise UserError(f"{spec}: not an op profile (disco_estimator.ops.OpProfile): {err}") \
            from None


def check_arguments(args: argparse.Namespace) -> None:
    """Checks the cost-model options (and ``--overlap``, ``--trace`` where the command
    has them); raises :class:`UserError`."""
    overlap, trace = getattr(args, "overlap", None), getattr(args, "trace", None)
    if args.hardware is None:
        args.hardware = default_hardware_here()
    if overlap is not None and not 0.0 <= overlap <= 1.0:
        raise UserError(f"--overlap must be in [0, 1], got {overlap}")
    if args.replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {args.replicas}")
    if trace is not None:
        parent = Path(args.trace).resolve().parent
        if not parent.is_dir():
            raise UserError(f"--trace {args.trace}: directory {parent} does not exist")


# --------------------------------------------------------------------------- cost model


def cost_model(module: Any, args: argparse.Namespace) -> Any:
    """The :class:`~disco_estimator.costs.cost_model.CostModel` the options choose, with op times
    covering ``module``; raises :class:`UserError` for a bad hardware or profile file."""
    from disco_estimator.costs.cost_model import CostModel

    hardware = load_hardware_file(args.hardware)
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
    _apply_overlap(costs, args)
    _apply_gnn(costs, args)
    return costs


def _apply_overlap(costs: Any, args: argparse.Namespace) -> None:
    if getattr(args, "overlap", None) is not None:
        costs.set_overlap(args.overlap, "--overlap")


def _setup_mismatch(hardware: Any, platform: str) -> str | None:
    """Why an in-context profile here would not describe the hardware file's setup
    (None when it would)."""
    from hlo_tools.jax_bridge import platform_family

    backend = hardware.hardware.get("backend", "cpu")
    if platform_family(platform) != backend:
        return f"hardware {hardware.name} is a {backend} setup, this process runs on {platform}"
    processes = int(hardware.hardware.get("num_processes", 1))
    if processes > 1:
        return (f"hardware {hardware.name} is a job of {processes} processes, the profile "
                "would be taken in this one process")
    return None


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else type(err).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def cost_model_in_context(module: Any, args: argparse.Namespace
                          ) -> tuple[Any, dict[str, Any]]:
    """The cost model the options choose, profiled and calibrated in context when asked
    (``args.in_context`` True), or by default (None) when possible.

    In context: :func:`disco_jax.pipeline.profile.profile_module_in_context` measures the module
    here; op times come from ``--profile``, then that profile, then standalone timings
    (unless ``--no-bench``), then the analytic model; ``--overlap`` is applied, and the
    AllReduce latency and compute scale are fitted to the two measured programs
    (:func:`disco_jax.pipeline.fit.calibrate_in_context`). XLA's compiled module is
    compiled again and each instruction priced at its traced time instead
    (:func:`_compiled_in_context`). By default, when that is not possible
    here -- the devices cannot run the module, XLA rejects it, the hardware file is for
    another backend or a multi-process job -- a one-line note goes to stderr and the
    model is :func:`cost_model`'s.

    Returns:
        The cost model and the in-context report: ``{"profiled": True, "devices",
        "platform", "wall_s", "predicted_s", "d_s", "compute_scale"}`` (``wall_s`` and
        ``predicted_s``: ``{"no_fusion", "one_bucket"}`` seconds per iteration, measured
        and after the fit; for a compiled module ``{"as_written"}``, with ``"as_written":
        True``, ``"traced_s"``, the simulated iteration at the traced times, and
        ``"timed_nodes"``) or ``{"profiled": False, "reason"}``.

    Raises:
        UserError: a bad hardware or profile file; with ``--in-context``, a module that
            cannot be profiled here.
    """
    mode = getattr(args, "in_context", False)
    if mode is False:
        return cost_model(module, args), {"profiled": False, "reason": "--no-in-context"}
    import jax

    from disco_jax.pipeline.fit import in_context_costs
    from disco_jax.pipeline.profile import profile_module_in_context
    from hlo_tools.compiled import is_compiled
    from hlo_tools.jax_bridge import HloCompileError

    hardware = load_hardware_file(args.hardware)
    op_profile = _profile(args.profile)
    platform = jax.default_backend()
    reason = _setup_mismatch(hardware, platform) if mode is None else None
    if reason is None and is_compiled(module):
        return _compiled_in_context(module, hardware, args, mode)
    measured = None
    if reason is None:
        try:
            measured = profile_module_in_context(module)
        except (HloCompileError, RuntimeError, ValueError) as err:
            reason = _one_line(err)
    if measured is None:
        if mode:
            raise UserError(f"--in-context: {reason}")
        print(f"disco: note: not profiling in context: {reason}; costing without it "
              "(--no-in-context hides this note)", file=sys.stderr)
        return cost_model(module, args), {"profiled": False, "reason": reason}
    replicas = args.replicas
    if not args.no_bench and replicas > 1:
        replicas = min(replicas, jax.local_device_count())
    try:
        costs, cal = in_context_costs(module, hardware, measured, bench=not args.no_bench,
                                      op_profile=op_profile, replicas=replicas,
                                      fused=fused_choice(args).estimator,
                                      overlap=getattr(args, "overlap", None))
    except ValueError as err:
        raise UserError(f"hardware {args.hardware!r}: {err}") from None
    names = ("no_fusion", "one_bucket")
    wall, predicted = dict(zip(names, cal.wall_s)), dict(zip(names, cal.predicted_s))
    if cal.fused_wall_s is not None:
        wall["xla_default"] = cal.fused_wall_s
        predicted["xla_default"] = cal.fused_predicted_s
    return costs, {"profiled": True, "devices": len(measured.profile.per_device_s) or 1,
                   "platform": platform, "wall_s": wall, "predicted_s": predicted,
                   "d_s": cal.d_s, "compute_scale": cal.compute_scale,
                   "saving_share": cal.saving_share, "d_tuple_extra_s": cal.d_tuple_extra_s,
                   "copy_s_per_byte": cal.copy_s_per_byte, "overlap": costs.overlap}


def _compiled_in_context(module: Any, hardware: Any, args: argparse.Namespace,
                         mode: bool | None) -> tuple[Any, dict[str, Any]]:
    """:func:`cost_model_in_context` for XLA's compiled module: compiled again and run
    here (:func:`disco_jax.pipeline.profile.profile_compiled_in_context`), each
    instruction at its traced time, the compute scale fitted to the measured iteration
    (:func:`disco_jax.pipeline.fit.compiled_in_context_costs`)."""
    import jax

    from disco_jax.pipeline.fit import compiled_in_context_costs
    from disco_jax.pipeline.profile import profile_compiled_in_context
    from hlo_tools.jax_bridge import HloCompileError

    try:
        measured = profile_compiled_in_context(module)
    except (HloCompileError, RuntimeError, ValueError) as err:
        if mode:
            raise UserError(f"--in-context: {_one_line(err)}") from None
        print(f"disco: note: not profiling in context: {_one_line(err)}; costing without "
              "it (--no-in-context hides this note)", file=sys.stderr)
        return cost_model(module, args), {"profiled": False, "reason": _one_line(err)}
    costs, fit = compiled_in_context_costs(module, hardware, measured,
                                           overlap=getattr(args, "overlap", None))
    _apply_gnn(costs, args)
    return costs, {"profiled": True, "as_written": True, "devices": measured.devices,
                   "platform": jax.default_backend(), "wall_s": {"as_written": fit.wall_s},
                   "predicted_s": {"as_written": fit.predicted_s},
                   "traced_s": fit.traced_s, "compute_scale": fit.compute_scale,
                   "timed_nodes": len(measured.node_s)}


# --------------------------------------------------------------------------- report lines


def fused_line(choice: Any) -> str:
    """One line of a report on the fused-op estimator (:func:`fused_choice`)."""
    what = f"the GNN of {choice.checkpoint}" if choice.checkpoint else "the fallback rule"
    return f"fused ops: {what} ({choice.why})"


def in_context_line(ic: dict[str, Any]) -> str:
    """One line of a report on the in-context step (:func:`cost_model_in_context`)."""
    if not ic["profiled"]:
        return f"in context: not profiled ({ic['reason']})"
    wall, pred = ic["wall_s"], ic["predicted_s"]
    if ic.get("as_written"):
        return (f"in context on {ic['devices']} {ic['platform']} devices: compiled again "
                f"and run, {ic['timed_nodes']} instructions timed; measured "
                f"{format_seconds(wall['as_written'])}, at the traced times the simulator gives "
                f"{format_seconds(ic['traced_s'])}; fit (compute scale "
                f"{ic['compute_scale']:.3g}) predicts {format_seconds(pred['as_written'])}")
    return (f"in context on {ic['devices']} {ic['platform']} devices: measured no fusion "
            f"{format_seconds(wall['no_fusion'])}, one bucket "
            f"{format_seconds(wall['one_bucket'])}; fit "
            f"(D = {ic['d_s']:.3g} s, compute scale {ic['compute_scale']:.3g}) predicts "
            f"{format_seconds(pred['no_fusion'])}, {format_seconds(pred['one_bucket'])}")
