"""``disco calibrate --setup NAME``: measure this machine and write a hardware file.

Runs the setup in child processes (``inproc4``: 4 host devices in one process; ``gloo2``:
2 gloo processes on 127.0.0.1; ``gloo2-1gbit``: the same over a loopback limited to
1 Gbit/s, which needs root for ``unshare -n`` and ``tc``) and measures:

* the AllReduce sweep, fitted as ``T = C * bytes + D`` (:mod:`disco_estimator.allreduce`);
* what one all-reduce adds to a program (chains of dependent small all-reduces), which
  becomes the model's ``D``: on gloo it is much larger than the sweep's latency;
* the overlap ``phi`` of compute and communication (a ``pmean`` program, an independent
  matmul program and both in one program; :mod:`disco_estimator.probes`).

The file is written atomically into the user's hardware directory
(``$DISCO_CONFIG_DIR/hardware`` or ``~/.config/disco_jax/hardware``; ``--out-dir``
overrides), where ``--hardware NAME`` finds it before the shipped file of that name.
The backend constants other than ``phi`` (kernel launch, memory cost per byte) and gloo's
latency for one-element buffers are those of the shipped file of the same name, when
there is one.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from disco_jax.cli import UserError

__all__ = ["register", "run"]

#: What ``disco calibrate --help`` says (the module docstring is for developers).
HELP = """Measure this machine's all-reduce cost and overlap, and write a hardware file.

Runs the setup in child processes (inproc4: 4 host devices in one process; gloo2: 2 gloo
processes on 127.0.0.1; gloo2-1gbit: the same over a 1 Gbit/s loopback, as root) and
measures the all-reduce sweep (fitted as T = C * bytes + D), what one all-reduce adds
inside a program (the model's D), and how far computation and communication overlap.
Writes NAME.toml into the user's hardware directory (~/.config/disco_jax/hardware,
$DISCO_CONFIG_DIR/hardware, or --out-dir), where --hardware NAME finds it first."""

#: Examples, after the options in ``--help``.
EXAMPLES = """example:
  disco calibrate --setup gloo2 && disco simulate step.hlo --hardware gloo2"""


def register(subparsers: Any) -> None:
    """Adds the ``calibrate`` subcommand."""
    p = subparsers.add_parser(
        "calibrate", help="measure this machine's AllReduce model and overlap, write a "
                          "hardware file", description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", required=True, metavar="NAME",
                   help="inproc4, gloo2 or gloo2-1gbit")
    p.add_argument("--quick", action="store_true",
                   help="fewer message sizes and repeats (about a minute)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="gloo setups: pin each process to a CPU of its own")
    p.add_argument("--out-dir", metavar="DIR",
                   help="write DIR/NAME.toml (default: the user's hardware directory)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="S",
                   help="bound on the measurement, seconds (default: 900)")
    p.set_defaults(func=run)


def _carried(name: str) -> dict[str, dict[str, Any]]:
    """What the calibration does not measure, from the shipped file ``name`` (if any): the
    backend's launch/memory constants and gloo's latency for one-element buffers."""
    from disco_estimator.hardware import load_hardware, shipped_hardware_dir

    path = shipped_hardware_dir() / f"{name}.toml"
    if not path.is_file():
        return {}
    raw = load_hardware(path).raw
    return {"costs": {k: v for k, v in raw.get("costs", {}).items() if k != "overlap"},
            "allreduce": {k: v for k, v in raw.get("allreduce", {}).items()
                          if k in ("small_bytes", "d_small_s")}}


def run(args: argparse.Namespace) -> int:
    """Measures the setup and writes its hardware file; prints what it found."""
    import os

    from disco_estimator.allreduce import SETUPS, run_setup
    from disco_estimator.hardware import hardware_toml, write_hardware_text

    setup = SETUPS.get(args.setup)
    if setup is None:
        raise UserError(f"unknown setup {args.setup!r}; valid: {', '.join(SETUPS)}")
    if setup.rate and os.geteuid() != 0:
        raise UserError(f"setup {setup.name} limits a private loopback with tc: run as root")
    print(f"calibrating {setup.name}: {setup.description}", file=sys.stderr)
    t0 = time.monotonic()
    try:
        result = run_setup(setup, quick=args.quick, timeout_s=args.timeout, probes=True,
                           pin_cpus=args.pin_cpus)
    except Exception as err:  # the workers' own messages are on stderr above
        raise UserError(f"measuring {setup.name} failed: {err}") from None
    text = hardware_toml(result, _carried(setup.name))
    path = write_hardware_text(setup.name, text, args.out_dir)
    probes = result.probes or []
    d = sorted(p["latency_s"] for p in probes)
    phi = sorted(p["overlap"] for p in probes)
    print(f"AllReduce sweep: C = {result.fit.model.c_s_per_byte * 1e9:.3f} ns/byte, "
          f"D = {result.fit.model.d_s * 1e3:.3f} ms (mean error "
          f"{result.fit.mean_rel_err * 100:.1f}%)")
    print(f"one all-reduce in a program: D = {d[len(d) // 2] * 1e3:.3f} ms "
          f"(per process: {', '.join(f'{x * 1e3:.3f}' for x in d)})")
    print(f"overlap phi = {phi[len(phi) // 2]:.3f} "
          f"(per process: {', '.join(f'{x:.3f}' for x in phi)})")
    print(f"wrote {path} in {time.monotonic() - t0:.0f} s; use it with --hardware {setup.name}")
    return 0
