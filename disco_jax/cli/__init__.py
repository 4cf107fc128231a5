"""The ``disco`` command line: the entry point, the dispatcher, user errors, exit codes.

Each subcommand lives in its own module of this package (``disco_jax/cli/<name>.py``)
exposing ``register(subparsers)``, which adds its parser and sets ``func`` to a function
taking the parsed arguments and returning the exit code. Adding a subcommand is adding
its module and its name to :data:`SUBCOMMANDS`. User errors raise :class:`UserError`
and are printed without a traceback (exit code :data:`EXIT_USAGE`). Two modules are no
subcommand: :mod:`disco_jax.cli.inputs` reads input files, :mod:`disco_jax.cli.options`
holds the options, input checks and cost model of the commands that cost a module.

The ``disco`` console script, ``python -m disco_jax`` and ``python -m disco_jax.cli`` run
:func:`main`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "SUBCOMMANDS", "UserError",
           "build_parser", "main"]

#: Subcommand modules of this package, in the order ``disco --help`` lists them.
SUBCOMMANDS = ("demo", "simulate", "optimize", "bench", "calibrate", "estimate", "train_estimator",
               "store", "launch")

#: Exit code of a successful run.
EXIT_OK = 0
#: Exit code of a user error (bad arguments or input) and of ``disco`` without a command.
EXIT_USAGE = 2
#: Exit code after Ctrl-C.
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """A mistake in the user's input: printed as ``disco: error: ...``, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    """The ``disco`` parser with every subcommand of :data:`SUBCOMMANDS` registered."""
    parser = argparse.ArgumentParser(
        prog="disco",
        description="DisCo for JAX: joint op fusion and AllReduce fusion for data-parallel "
                    "training.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


#: Subcommands that run the module they are given (in-context profiles): on CPU they get
#: as many host devices as it runs on.
_RUN_MODULE = ("simulate", "optimize")


def _host_devices(args: argparse.Namespace) -> None:
    """Gives this process as many host CPU devices as the module of ``disco simulate`` or
    ``disco optimize`` runs on (before jax starts), with a note on stderr; the module's
    file is read again by the command."""
    if args.command not in _RUN_MODULE or not getattr(args, "file", None):
        return
    import hlo_tools
    from disco_jax.cli.inputs import read_text
    from hlo_tools.devices import module_devices
    from hlo_tools.jax_bridge import give_host_devices

    try:
        count = module_devices(hlo_tools.parse(read_text(args.file)))
    except hlo_tools.HloParseError:
        return  # the command says where, with the file and line
    if give_host_devices(count):
        print(f"disco: note: {args.file} runs on {count} devices: this process has "
              f"{count} host CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count="
              f"{count})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Runs ``disco``; returns the exit code.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        _host_devices(args)
        return int(args.func(args) or EXIT_OK)
    except UserError as err:
        print(f"disco: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("disco: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
