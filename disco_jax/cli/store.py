"""``disco store list|show|rm``: look at the strategy store that ``disco_jax.jit`` fills.

* ``disco store list``: one line per entry (newest first): key prefix, chosen program,
  its measured time, device and process counts, backend, jax version, creation time.
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

__all__ = ["register", "run_list", "run_rm", "run_show"]

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


def run_list(args: argparse.Namespace) -> int:
    """Runs ``disco store list``."""
    from disco_jax.store import list_entries, store_dir

    entries = list_entries(root=args.store)
    if args.json:
        print(json.dumps([{"key": e.key, "record": e.record, "problem": e.problem}
                          for e in entries], indent=1))
        return 0
    if not entries:
        print(f"no entries in {store_dir(args.store)}")
        return 0
    print(f"{len(entries)} entries in {store_dir(args.store)}")
    print(f"{'key':<14}{'choice':<16}{'measured':>11}  {'setup':<26}{'jax':<9}created")
    for e in entries:
        if e.record is None:
            print(f"{e.key[:12]:<14}{'(unreadable)':<16}{'':>11}  {e.problem}")
            continue
        r = e.record
        setup = r.get("setup", {})
        where = (f"{setup.get('num_devices')} dev x {setup.get('num_processes')} proc "
                 f"{setup.get('backend')}")
        print(f"{e.key[:12]:<14}{str(r.get('choice')):<16}"
              f"{_ms((r.get('measured_s') or {}).get(r.get('choice'))):>11}  {where:<26}"
              f"{str(setup.get('jax')):<9}{r.get('created', '')}")
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

        lookup = load_entry(key, Setup.current(), root=args.store)
        usable = lookup.reason or "usable here"
    if args.json:
        print(json.dumps({"key": key, "record": record,
                          **({"check": usable} if usable else {})}, indent=1))
        return 0
    print(f"entry {key}\n  in {store_dir(args.store) / key}")
    setup = record.get("setup", {})
    print(f"  setup: {setup.get('num_devices')} devices, {setup.get('num_processes')} "
          f"processes, {setup.get('backend')} ({setup.get('device_kind')}), jax "
          f"{setup.get('jax')} / jaxlib {setup.get('jaxlib')}")
    hw = record.get("hardware") or {}
    print(f"  hardware file: {hw.get('name')} (sha256 {str(hw.get('sha256'))[:12]})")
    print(f"  created: {record.get('created')}; choice: {record.get('choice')} "
          f"(enactment {str(record.get('enactment_fingerprint'))[:12]})")
    predicted, measured = record.get("predicted_s") or {}, record.get("measured_s") or {}
    print(f"  {'program':<18}{'predicted':>12}{'measured':>12}")
    for name in sorted(set(predicted) | set(measured), key=lambda n: measured.get(n, 1e9)):
        mark = " <- chosen" if name == record.get("choice") else ""
        print(f"  {name:<18}{_ms(predicted.get(name)):>12}{_ms(measured.get(name)):>12}{mark}")
    search = record.get("search") or {}
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
