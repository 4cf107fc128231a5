"""The strategy store: what DisCo chose for each program, kept on disk between runs.

One entry per program, keyed by the **source fingerprint**: the sha256 (hex) of the
program's pre-optimization HLO text as jax lowers it (:func:`source_fingerprint`). An
entry is a directory ``<store>/<key>/`` holding

* ``enactment.json``: the :class:`~disco_jax.enactment.Enactment` (HLO as text inside
  JSON, its compiler options, or its stages and launch schedule);
* ``record.json``: where and how it was found (:func:`make_record`): the source
  fingerprint, jax/jaxlib versions, backend, device kind, device and process counts,
  the hardware file and its sha256, predicted and measured seconds per iteration of the
  chosen program and of every candidate and baseline, the search's settings and
  statistics, the creation time, the format version, and the sha256 of
  ``enactment.json``.

The store's directory is ``$DISCO_STORE`` when set, else ``store/`` in disco_jax's cache
directory (:func:`hlo_tools.dirs.cache_dir`: ``$DISCO_CACHE_DIR``, else the user cache
directory, ``~/.cache/disco_jax`` on Linux); every function takes ``root`` to override
both.

Writes are atomic (:func:`write_entry`): both files go into a temporary directory inside
the store (its name starts with ``.``, so it is never an entry), are flushed to disk,
and the directory is renamed to the key. A writer killed at any point leaves either no
entry or a whole one. Keys are 64 lowercase hex digits (:func:`check_key`), so no key
names a path outside the store. Reading parses JSON only; nothing from the store is
executed (no pickle), and :func:`load_entry` checks the HLO with XLA's parser before it
is ever compiled.

Typical use::

    key = source_fingerprint(hlo_text)
    lookup = load_entry(key, Setup.current())
    if lookup.entry is None:
        print("cannot use the store:", lookup.reason)
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from hlo_tools.dirs import cache_dir, write_atomic

__all__ = [
    "ENACTMENT_FILE",
    "FORMAT",
    "NOT_FOUND",
    "RECORD_FILE",
    "STORE_ENV",
    "Entry",
    "Listed",
    "Lookup",
    "Setup",
    "check_key",
    "list_entries",
    "load_entry",
    "make_record",
    "read_record",
    "remove_entry",
    "source_fingerprint",
    "store_dir",
    "write_entry",
]

#: Version of ``record.json``'s layout.
FORMAT = 1
#: The environment variable naming the store's directory.
STORE_ENV = "DISCO_STORE"
#: File names inside an entry.
RECORD_FILE = "record.json"
ENACTMENT_FILE = "enactment.json"
#: The reason :func:`load_entry` gives when there is no entry for the key.
NOT_FOUND = "no stored plan for this program"

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_STALE_S = 3600.0


def store_dir(root: str | os.PathLike[str] | None = None) -> Path:
    """The store's directory: ``root``, else ``$DISCO_STORE``, else ``<cache dir>/store``."""
    if root is not None:
        return Path(root)
    env = os.environ.get(STORE_ENV)
    return Path(env) if env else cache_dir("store")


def source_fingerprint(hlo_text: str) -> str:
    """The key of a program: sha256 (hex) of its pre-optimization HLO text."""
    return hashlib.sha256(hlo_text.encode("utf-8")).hexdigest()


def check_key(key: str) -> str:
    """Returns ``key`` if it is a store key (64 lowercase hex digits).

    Raises:
        ValueError: anything else (so no key names a path outside the store).
    """
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"not a store key (64 lowercase hex digits): {key!r}")
    return key


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Setup(NamedTuple):
    """What an entry must match to be used here.

    Attributes:
        jax: jax version.
        jaxlib: jaxlib version.
        backend: jax platform (``cpu``, ``gpu``, ...).
        device_kind: jax ``device_kind`` of the devices.
        num_devices: devices of the job (all processes).
        num_processes: processes of the job.
    """

    jax: str
    jaxlib: str
    backend: str
    device_kind: str
    num_devices: int
    num_processes: int

    @classmethod
    def current(cls) -> Setup:
        """This process's setup (imports jax)."""
        import jax
        import jaxlib.version

        devices = jax.devices()
        return cls(jax.__version__, jaxlib.version.__version__, jax.default_backend(),
                   devices[0].device_kind if devices else "", len(devices),
                   jax.process_count())

    def mismatch(self, record: Mapping[str, Any]) -> str | None:
        """Why an entry with ``record`` cannot run here (a sentence), or None."""
        found = record.get("setup", {})
        if not isinstance(found, Mapping):
            return "corrupt record: 'setup' is not an object"
        labels = {"jax": "jax version", "jaxlib": "jaxlib version", "backend": "backend",
                  "num_devices": "device count", "num_processes": "process count",
                  "device_kind": "device kind"}
        for field, label in labels.items():
            want, got = getattr(self, field), found.get(field)
            if got != want:
                return (f"the stored plan was made with {label} {got!r}, this process has "
                        f"{want!r}; run once with ENABLE_SEARCH=1 to search again here")
        return None


class Entry(NamedTuple):
    """A usable store entry.

    Attributes:
        key: its source fingerprint.
        record: ``record.json``.
        enactment: the :class:`~disco_jax.enactment.Enactment` to run.
        path: its directory.
    """

    key: str
    record: dict[str, Any]
    enactment: Any
    path: Path


class Lookup(NamedTuple):
    """The answer of :func:`load_entry`: the entry, or None and why not.

    Attributes:
        entry: the :class:`Entry` (None when it cannot be used).
        reason: why not (a sentence a user can act on; :data:`NOT_FOUND` when there is
            no entry); ``""`` with an entry.
    """

    entry: Entry | None
    reason: str = ""


class Listed(NamedTuple):
    """One entry of :func:`list_entries`.

    Attributes:
        key: its key.
        record: ``record.json`` (None when it cannot be read).
        problem: why the record cannot be read (``""`` when it can).
        path: its directory.
    """

    key: str
    record: dict[str, Any] | None
    problem: str
    path: Path


def make_record(key: str, setup: Setup, *, enactment_fingerprint: str, choice: str,
                hardware: str | None, hardware_sha256: str | None,
                predicted_s: Mapping[str, float | None], measured_s: Mapping[str, float],
                search: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:
    """The ``record.json`` of an entry (JSON-able).

    Args:
        key: the source fingerprint.
        setup: where it was found.
        enactment_fingerprint: :attr:`Enactment.fingerprint` of the chosen program.
        choice: the chosen program's name.
        hardware: the hardware file's name.
        hardware_sha256: sha256 of the hardware file's bytes.
        predicted_s: predicted seconds per iteration of every candidate by name (None:
            no prediction).
        measured_s: measured seconds per iteration (medians) of every candidate.
        search: the search's settings and statistics.
        extra: anything else to keep (e.g. the in-context calibration).
    """
    return {
        "format": FORMAT,
        "key": check_key(key),
        "setup": setup._asdict(),
        "choice": choice,
        "enactment_fingerprint": enactment_fingerprint,
        "hardware": {"name": hardware, "sha256": hardware_sha256},
        "predicted_s": dict(predicted_s),
        "measured_s": dict(measured_s),
        "search": dict(search) if search is not None else None,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **dict(extra or {}),
    }


def _clean_stale(root: Path) -> None:
    """Removes temporary directories of writers that died more than an hour ago."""
    now = time.time()
    for child in root.iterdir():
        if child.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            with contextlib.suppress(OSError):
                if now - child.stat().st_mtime > _STALE_S:
                    shutil.rmtree(child)


def write_entry(key: str, record: Mapping[str, Any], enactment: Any, *,
                root: str | os.PathLike[str] | None = None) -> Path:
    """Writes (or replaces) the entry ``key`` atomically.

    Args:
        key: the source fingerprint (:func:`check_key`).
        record: its ``record.json`` (:func:`make_record`); the sha256 of the enactment
            file is added.
        enactment: the :class:`~disco_jax.enactment.Enactment`.
        root: the store's directory (default: :func:`store_dir`).

    Returns:
        The entry's directory.

    Raises:
        ValueError: a bad key.
        OSError: the store cannot be written.
    """
    check_key(key)
    base = store_dir(root)
    base.mkdir(parents=True, exist_ok=True)
    _clean_stale(base)
    data = json.dumps(enactment.to_json(), sort_keys=True).encode("utf-8")
    full = {**dict(record), "enactment_sha256": _sha256(data)}
    tmp = base / f"{_TMP_PREFIX}{key[:16]}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        write_atomic(tmp / ENACTMENT_FILE, data, mkdir=False)
        write_atomic(tmp / RECORD_FILE, json.dumps(full, indent=1, sort_keys=True),
                     mkdir=False)
        target = base / key
        trash = None
        if target.exists():
            trash = base / f"{_TRASH_PREFIX}{key[:16]}-{uuid.uuid4().hex}"
            os.rename(target, trash)
        os.rename(tmp, target)
        fd = os.open(base, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"corrupt entry: {path.name} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"corrupt entry: {path.name} cannot be read ({err})") from None


def read_record(key: str, *, root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``record.json`` of entry ``key``, checked for its format and key.

    Raises:
        FileNotFoundError: no such entry.
        ValueError: a bad key, or a record that is truncated, malformed, of another format
            version or of another key (the message says which).
    """
    path = store_dir(root) / check_key(key)
    if not path.is_dir():
        raise FileNotFoundError(f"no entry {key} in {store_dir(root)}")
    record = _read_json(path / RECORD_FILE)
    if not isinstance(record, dict):
        raise ValueError("corrupt entry: record.json is not a JSON object")
    if record.get("format") != FORMAT:
        raise ValueError(f"record format {record.get('format')!r}, this version reads "
                         f"{FORMAT}; run once with ENABLE_SEARCH=1 to search again")
    if record.get("key") != key:
        raise ValueError(f"corrupt entry: record.json is for key {record.get('key')!r}")
    return record


def _check_texts(enactment: Any) -> str | None:
    """Why XLA's parser rejects a text of the enactment, or None."""
    from hlo_tools.jax_bridge import HloCompileError, xla_parse_ok

    for i, text in enumerate(enactment.texts):
        try:
            xla_parse_ok(text)
        except HloCompileError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            which = "" if len(enactment.texts) == 1 else f" (stage {i})"
            return f"the stored HLO{which} does not parse: {first[:300]}"
    return None


def load_entry(key: str, setup: Setup | None, *, root: str | os.PathLike[str] | None = None,
               check_hlo: bool = True) -> Lookup:
    """Reads entry ``key`` and says whether it can run here.

    Never executes anything from the store: JSON is parsed, hashes compared, and (with
    ``check_hlo``) each HLO text is parsed by XLA's parser.

    Args:
        key: the source fingerprint of the program.
        setup: this process's :class:`Setup` (None: do not check the setup).
        root: the store's directory (default: :func:`store_dir`).
        check_hlo: parse the stored HLO with XLA's parser.

    Returns:
        A :class:`Lookup`: the entry, or None and the reason (:data:`NOT_FOUND`, a corrupt
        or truncated file, another jax version, backend, device or process count, HLO
        that does not parse).
    """
    from disco_jax.enactment import Enactment

    try:
        record = read_record(key, root=root)
    except FileNotFoundError:
        return Lookup(None, NOT_FOUND)
    except ValueError as err:
        return Lookup(None, str(err))
    path = store_dir(root) / key
    if setup is not None:
        why = setup.mismatch(record)
        if why is not None:
            return Lookup(None, why)
    try:
        data = (path / ENACTMENT_FILE).read_bytes()
    except OSError as err:
        return Lookup(None, f"corrupt entry: {ENACTMENT_FILE} cannot be read ({err})")
    if _sha256(data) != record.get("enactment_sha256"):
        return Lookup(None, f"corrupt entry: {ENACTMENT_FILE} does not match its record "
                            "(truncated or changed)")
    try:
        enactment = Enactment.from_json(json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as err:
        return Lookup(None, f"corrupt entry: {ENACTMENT_FILE}: {err}")
    if check_hlo:
        why = _check_texts(enactment)
        if why is not None:
            return Lookup(None, why)
    return Lookup(Entry(key, record, enactment, path))


def list_entries(*, root: str | os.PathLike[str] | None = None) -> list[Listed]:
    """Every entry of the store (temporary directories of writers are not entries),
    newest first; an entry whose record cannot be read is listed with its problem."""
    base = store_dir(root)
    if not base.is_dir():
        return []
    out = []
    for child in base.iterdir():
        if not (_KEY_RE.fullmatch(child.name) and child.is_dir()):
            continue
        try:
            out.append(Listed(child.name, read_record(child.name, root=base), "", child))
        except (OSError, ValueError) as err:
            out.append(Listed(child.name, None, str(err), child))
    return sorted(out, key=lambda e: ((e.record or {}).get("created", ""), e.key),
                  reverse=True)


def remove_entry(key: str, *, root: str | os.PathLike[str] | None = None) -> bool:
    """Removes entry ``key`` (renamed away first, so readers never see half of it);
    returns False when there was none.

    Raises:
        ValueError: a bad key.
    """
    base = store_dir(root)
    target = base / check_key(key)
    if not target.is_dir():
        return False
    trash = base / f"{_TRASH_PREFIX}{key[:16]}-{uuid.uuid4().hex}"
    os.rename(target, trash)
    shutil.rmtree(trash, ignore_errors=True)
    return True
