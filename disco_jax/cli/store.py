"""``disco store list|show|rm``: look at the strategy store that ``disco_jax.jit`` fills.

* ``disco store list``: one line per entry (newest first): key prefix, the step (its
  qualified function name), devices, processes and backend, the chosen program, its
  measured time and speed-up over XLA's default and hand bucketing, creation time, and
  whether it was verified.
* ``disco store show KEY``: an entry's record (``--json``: as JSON) and whether it can
  run in this process (``--check``: compares the setup and parses the HLO; imports jax).
* ``disco store rm KEY... | --all``: removes entries.

KEY is a full key or a unique prefix of at least 4 hex digits. The store is
``--store DIR``, else ``$DISCO_STORE``, else the user cache directory
(:func:`disco_jax.store.store_dir`). Nothing read from the store is executed.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from disco_jax.cli import UserError

__all__ = ["list_rows", "register", "run_list", "run_rm", "run_show"]

#: What ``disco store --help`` says (the module docstring is for developers).
HELP = """List, show or remove the programs disco_jax.jit stored.

The store is --store DIR, else $DISCO_STORE, else the user cache directory. KEY is a
store key or a unique prefix of at least 4 hex digits. Nothing read from the store is
executed."""

#: Examples, after the options in ``--help``.
EXAMPLES = """examples:
  disco store list
  disco store show 5c25 --check      # would it run in this process?
  disco store rm 5c25"""

_PREFIX_RE = re.compile(r"[0-9a-f]{4,64}")


def register(subparsers: Any) -> None:
    """Adds the ``store`` subcommand and its ``list``, ``show`` and ``rm``."""
    p = subparsers.add_parser(
        "store", help="list, show or remove the stored plans of disco_jax.jit",
        description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="store_command", metavar="ACTION")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--store", metavar="DIR",
                       help="the store's directory (default: $DISCO_STORE, else the user "
                            "cache directory)")

    q = sub.add_parser("list", help="one line per entry")
    common(q)
    q.add_argument("--json", action="store_true", help="print the records as JSON")
    q.set_defaults(func=run_list)
    q = sub.add_parser("show", help="an entry's record")
    common(q)
    q.add_argument("key", metavar="KEY", help="a key or a unique prefix (>= 4 hex digits)")
    q.add_argument("--json", action="store_true", help="print the record as JSON")
    q.add_argument("--check", action="store_true",
                   help="say whether it can run in this process (imports jax)")
    q.set_defaults(func=run_show)
    q = sub.add_parser("rm", help="remove entries")
    common(q)
    q.add_argument("keys", metavar="KEY", nargs="*", help="keys or unique prefixes")
    q.add_argument("--all", action="store_true", help="remove every entry")
    q.set_defaults(func=run_rm)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _resolve(prefix: str, root: str | None) -> str:
    """The one key starting with ``prefix``; a :class:`UserError` otherwise."""
    from disco_jax.store import list_entries, store_dir

    if not _PREFIX_RE.fullmatch(prefix):
        raise UserError(f"{prefix!r} is not a key (4 to 64 lowercase hex digits)")
    matches = [e.key for e in list_entries(root=root) if e.key.startswith(prefix)]
    if not matches:
        raise UserError(f"no entry {prefix} in {store_dir(root)}")
    if len(matches) > 1:
        raise UserError(f"{prefix} is ambiguous: {len(matches)} entries start with it")
    return matches[0]


def _ms(value: Any) -> str:
    return f"{value * 1e3:.2f} ms" if isinstance(value, (int, float)) else "-"


def _speedup(record: Any, over: list[str]) -> str:
    """The chosen program's measured speed-up over the fastest of ``over`` (``1.31x``),
    or ``-`` when either was not measured."""
    measured = record.measured_s
    mine = measured.get(record.choice)
    theirs = [measured[n] for n in over if isinstance(measured.get(n), (int, float))]
    if not isinstance(mine, (int, float)) or mine <= 0 or not theirs:
        return "-"
    return f"{min(theirs) / mine:.2f}x"


def _verified(record: Any) -> str:
    verdict = record.verdict
    if verdict is None:
        return "not yet"
    return "yes" if verdict.get("ok") else "refused"


def list_rows(entries: list[Any]) -> list[dict[str, str]]:
    """One row of ``disco store list`` per entry: key prefix, step, setup, choice, its
    measured speed-up over XLA's default and over the best hand bucketing, when, and
    whether it was verified against ``jax.jit``."""
    rows = []
    for e in entries:
        if e.record is None:
            rows.append({"key": e.key[:12], "step": f"(unreadable: {e.problem})"})
            continue
        r = e.record
        bucketed = sorted(n for n in r.measured_s
                          if n.startswith(("bucketed_", "xla_combine_")))
        rows.append({
            "key": e.key[:12],
            "step": str(r.extra.get("function") or "-"),
            "setup": f"{r.setup.num_devices} dev x {r.setup.num_processes} proc "
                     f"{r.setup.backend}",
            "choice": r.choice,
            "measured": _ms(r.measured_s.get(r.choice)),
            "vs XLA": _speedup(r, ["xla_default"]),
            "vs buckets": _speedup(r, bucketed),
            "created": r.created[:19],
            "verified": _verified(r),
        })
    return rows


def run_list(args: argparse.Namespace) -> int:
    """Runs ``disco store list``."""
    from rich.console import Console
    from rich.table import Table

    from disco_jax.store import list_entries, store_dir

    entries = list_entries(root=args.store)
    if args.json:
        print(json.dumps([{"key": e.key, "record": e.record and e.record.to_json(),
                           "problem": e.problem}
                          for e in entries], indent=1))
        return 0
    if not entries:
        print(f"no entries in {store_dir(args.store)}")
        return 0
    rows = list_rows(entries)
    table = Table(title=f"{len(entries)} entries in {store_dir(args.store)}",
                  title_justify="left", box=None, header_style="bold")
    columns = ("key", "step", "setup", "choice", "measured", "vs XLA", "vs buckets",
               "created", "verified")
    for name in columns:
        table.add_column(name, justify="right" if name in ("measured", "vs XLA", "vs buckets")
                         else "left", overflow="fold")
    for row in rows:
        table.add_row(*(row.get(c, "") for c in columns))
    Console(width=max(120, Console().width), highlight=False).print(table)
    print("vs XLA, vs buckets: the chosen program's measured speed-up over XLA's default "
          "and over the best hand bucketing measured beside it; verified: its outputs "
          "compared with jax.jit's on a first call")
    return 0


def run_show(args: argparse.Namespace) -> int:
    """Runs ``disco store show``."""
    from disco_jax.store import read_record, store_dir

    key = _resolve(args.key, args.store)
    try:
        record = read_record(key, root=args.store)
    except ValueError as err:
        raise UserError(f"entry {key}: {err}") from None
    usable = None
    if args.check:
        from disco_jax.store import Setup, load_entry
        from hlo_tools.jax_bridge import give_host_devices

        processes, devices = record.setup.num_processes, record.setup.num_devices
        if isinstance(processes, int) and processes > 1:
            usable = (f"a plan of a {processes}-process job ({devices} devices): it runs in "
                      f"such a job (e.g. disco launch -n {processes} -- python train.py), "
                      "not in this one process")
        else:
            if record.setup.backend == "cpu" and isinstance(devices, int):
                # the CLI's own device count is not the program's: give this process
                # the host devices the entry was made with
                give_host_devices(devices)
            lookup = load_entry(key, Setup.current(), root=args.store)
            usable = lookup.reason or "usable here"
    if args.json:
        print(json.dumps({"key": key, "record": record.to_json(),
                          **({"check": usable} if usable else {})}, indent=1))
        return 0
    print(f"entry {key}\n  in {store_dir(args.store) / key}")
    setup, hw = record.setup, record.hardware
    print(f"  setup: {setup.num_devices} devices, {setup.num_processes} processes, "
          f"{setup.backend} ({setup.device_kind}), jax {setup.jax} / jaxlib {setup.jaxlib}")
    print(f"  hardware file: {hw.name} (sha256 {str(hw.sha256)[:12]})")
    print(f"  created: {record.created}; choice: {record.choice} "
          f"(enactment {record.enactment_fingerprint[:12]})")
    predicted, measured = record.predicted_s, record.measured_s
    print(f"  {'program':<18}{'predicted':>12}{'measured':>12}")
    for name in sorted(set(predicted) | set(measured), key=lambda n: measured.get(n, 1e9)):
        mark = " <- chosen" if name == record.choice else ""
        print(f"  {name:<18}{_ms(predicted.get(name)):>12}{_ms(measured.get(name)):>12}{mark}")
    search = record.search or {}
    if search:
        print(f"  search: {search.get('evaluated')} candidates in "
              f"{search.get('seconds', 0):.1f} s ({search.get('stop_reason')}); settings "
              f"{search.get('settings')}")
    if usable is not None:
        print(f"  here: {usable}")
    return 0


def run_rm(args: argparse.Namespace) -> int:
    """Runs ``disco store rm``."""
    from disco_jax.store import list_entries, remove_entry

    if args.all == bool(args.keys):
        raise UserError("give the keys to remove, or --all (not both)")
    keys = [e.key for e in list_entries(root=args.store)] if args.all else \
        [_resolve(k, args.store) for k in args.keys]
    for key in keys:
        remove_entry(key, root=args.store)
        print(f"removed {key}")
    if not keys:
        print("nothing to remove")
    return 0
