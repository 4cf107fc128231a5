"""The ``disco`` command line: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds
its parser and sets ``func`` to a function taking the parsed arguments and returning
the exit code. User errors raise :class:`UserError` and are printed without a
traceback (exit code 2).
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["UserError", "main"]

#: Subcommand modules, in the order ``disco --help`` lists them.
SUBCOMMANDS = ("disco_jax.cli_demo", "disco_jax.cli_simulate")


class UserError(Exception):
    """A mistake in the user's input: printed as ``disco: error: ...``, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="disco",
        description="DisCo for JAX: joint op fusion and AllReduce fusion for data-parallel "
                    "training.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs ``disco``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        print(f"disco: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("disco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
