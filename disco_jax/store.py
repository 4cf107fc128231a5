"""The strategy store: what DisCo chose for each program, kept on disk between runs.

One entry per program, keyed by the **source fingerprint**: the sha256 (hex) of the
program's pre-optimization HLO text as jax lowers it (:func:`source_fingerprint`). An
entry is a directory ``<store>/<key>/`` holding

* ``enactment.json``: the :class:`~disco_jax.enactment.Enactment` (HLO as text inside
  JSON, its compiler options, or its stages and launch schedule);
* ``record.json``: where and how it was found (:func:`make_record`): the source
  fingerprint, jax/jaxlib versions, backend, device kind, CPU model (``cpu`` backend),
  device and process counts, the hardware file and its sha256, predicted and measured
  seconds per iteration of the chosen program and of every candidate and baseline, the
  search's settings and statistics, the creation time, the format version, the sha256 of
  ``enactment.json``, and once it has run next to ``jax.jit`` its verdict
  (``verified``, :func:`record_verification`).

The store's directory is ``$DISCO_STORE`` when set, else ``store/`` in disco_jax's cache
directory (:func:`hlo_tools.dirs.cache_dir`: ``$DISCO_CACHE_DIR``, else the user cache
directory, ``~/.cache/disco_jax`` on Linux); every function takes ``root`` to override
both.

Writes are atomic (:func:`write_entry`): both files go into a temporary directory inside
the store (its name starts with ``.``, so it is never an entry), are flushed to disk,
and the directory is renamed to the key. A writer killed at any point leaves either no
entry or a whole one.

Concurrent writers and readers (several processes on one machine) are serialized by an
advisory ``fcntl.flock`` on the store's directory itself (no lock file): a writer holds
it exclusively only while it swaps the finished directory in (old entry renamed away, new
one renamed in) and while :func:`record_verification` rewrites a record; a reader holds
it shared only while it opens the entry's two files (open files stay readable after a
swap). So two processes writing the same key at once never fail and never mix files (the
last rename wins, the entry is always one writer's whole pair), and a reader never sees
the moment between the two renames. Rename alone cannot replace a non-empty directory
atomically (Linux's ``renameat2(RENAME_EXCHANGE)`` is not in Python's standard library),
hence the lock. Where ``flock`` is refused (some network file systems) the store works
without it: entries stay whole, but two simultaneous writers of one key may then fail.
``flock`` is advisory and local: it does not order writers on different machines.

Keys are 64 lowercase hex digits (:func:`check_key`), so no key names a path outside the
store, and an entry that is a symbolic link (or holds one) is refused, never followed.
Reading parses JSON only; nothing from the store is executed (no pickle, no eval, no
import), and :func:`load_entry` checks the HLO with XLA's parser before it is ever
compiled.

An entry may carry a verdict (:func:`record_verification`, the record's ``verified``
field): whether its program, run once next to ``jax.jit``'s on the same inputs, computed
the same outputs. The verdict holds for the enactment whose sha256 it names; an entry
refused by its verdict does not load (:func:`load_entry`), in this process or any later
one.

Typical use::

    key = source_fingerprint(hlo_text)
    lookup = load_entry(key, Setup.current())
    if lookup.entry is None:
        print("cannot use the store:", lookup.reason)
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import hashlib
import json
import math
import os
import platform
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from hlo_tools.dirs import cache_dir, write_atomic

try:
    import fcntl
except ImportError:  # not POSIX: no inter-process lock (rename still keeps entries whole)
    fcntl = None

__all__ = [
    "ENACTMENT_FILE",
    "FORMAT",
    "NOT_FOUND",
    "RECORD_FILE",
    "STORE_ENV",
    "Entry",
    "Listed",
    "Lookup",
    "Record",
    "Setup",
    "check_key",
    "hardware_mismatch",
    "hardware_sha256",
    "host_cpu",
    "list_entries",
    "load_entry",
    "make_record",
    "read_record",
    "record_verification",
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
_HARDWARE_MAX_BYTES = 64 << 20


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


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """This machine's CPU model (``model name`` of ``/proc/cpuinfo``, else
    :func:`platform.processor`, else :func:`platform.machine`)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "Model", "cpu model", "Hardware") \
                        and value.strip():
                    return value.strip()
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def _locked(base: Path, *, exclusive: bool) -> Iterator[None]:
    """Holds ``fcntl.flock`` on the store's directory itself (exclusive for writers,
    shared for readers; no lock file is created). Where there is no such lock (no
    directory yet, not POSIX, a file system that refuses ``flock``) it goes ahead
    without: renames still keep every entry whole."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _discard(path: Path) -> None:
    """Removes a renamed-away entry: a symbolic link is unlinked (what it points to is
    never touched), a directory removed."""
    with contextlib.suppress(OSError):
        if path.is_symlink() or not path.is_dir():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)


class Setup(NamedTuple):
    """What an entry must match to be used here.

    Attributes:
        jax: jax version.
        jaxlib: jaxlib version.
        backend: jax platform (``cpu``, ``gpu``, ...).
        device_kind: jax ``device_kind`` of the devices.
        num_devices: devices of the job (all processes).
        num_processes: processes of the job.
        cpu: on the ``cpu`` backend, the CPU model (:func:`host_cpu`; every CPU's jax
            ``device_kind`` is ``"cpu"``); ``""`` on accelerators, whose
            ``device_kind`` names them.
    """

    jax: str
    jaxlib: str
    backend: str
    device_kind: str
    num_devices: int
    num_processes: int
    cpu: str = ""

    @classmethod
    def current(cls) -> Setup:
        """This process's setup (imports jax)."""
        import jax
        import jaxlib.version

        devices = jax.devices()
        backend = jax.default_backend()
        return cls(jax.__version__, jaxlib.version.__version__, backend,
                   devices[0].device_kind if devices else "", len(devices),
                   jax.process_count(), host_cpu() if backend == "cpu" else "")

    def mismatch(self, record: Record) -> str | None:
        """Why an entry with ``record`` cannot run here (a sentence), or None."""
        labels = {"jax": "jax version", "jaxlib": "jaxlib version", "backend": "backend",
                  "num_devices": "device count", "num_processes": "process count",
                  "device_kind": "device kind", "cpu": "CPU"}
        for field, label in labels.items():
            want, got = getattr(self, field), getattr(record.setup, field)
            if got != want:
                return (f"the stored plan was made with {label} {got!r}, this process has "
                        f"{want!r}; run once with ENABLE_SEARCH=1 to search again here")
        return None


class HardwareRef(NamedTuple):
    """The hardware file a search's cost model used: its name and the sha256 of its
    bytes (None: unknown)."""

    name: str | None = None
    sha256: str | None = None


class Record(NamedTuple):
    """An entry's ``record.json``: where and how its program was found.

    Attributes:
        key: the source fingerprint.
        setup: where it was found.
        choice: the chosen program's name.
        enactment_fingerprint: :attr:`Enactment.fingerprint` of the chosen program.
        hardware: the hardware file of the search's cost model.
        predicted_s: predicted seconds per iteration of every candidate by name (None:
            no prediction).
        measured_s: measured seconds per iteration (medians) of every candidate.
        search: the search's settings and statistics (None: none).
        created: when, ISO 8601 in UTC.
        enactment_sha256: sha256 of ``enactment.json`` (set by :func:`write_entry`).
        verified: the last verdict of :func:`record_verification` (None: never).
        extra: everything else kept (the in-context calibration, the route, the fused-op
            estimator, the pipeline's seconds, the step's function and source).
    """

    key: str
    setup: Setup
    choice: str
    enactment_fingerprint: str
    hardware: HardwareRef = HardwareRef()
    predicted_s: Mapping[str, float | None] = {}
    measured_s: Mapping[str, float] = {}
    search: Mapping[str, Any] | None = None
    created: str = ""
    enactment_sha256: str = ""
    verified: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = {}

    @property
    def verdict(self) -> Mapping[str, Any] | None:
        """The verdict that holds for this record's enactment, or None (never verified,
        or verified for another enactment: a replaced ``enactment.json`` is verified
        again)."""
        v = self.verified
        return v if v is not None and v.get("enactment_sha256") == self.enactment_sha256 \
            else None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``record.json`` (``extra``'s keys at the top level)."""
        out = {"format": FORMAT, **dict(self.extra), "key": self.key,
               "setup": self.setup._asdict(), "choice": self.choice,
               "enactment_fingerprint": self.enactment_fingerprint,
               "hardware": self.hardware._asdict(), "predicted_s": dict(self.predicted_s),
               "measured_s": dict(self.measured_s),
               "search": dict(self.search) if self.search is not None else None,
               "created": self.created, "enactment_sha256": self.enactment_sha256}
        if self.verified is not None:
            out["verified"] = dict(self.verified)
        return out

    @classmethod
    def from_json(cls, data: Any) -> Record:
        """Reads ``record.json``'s object.

        Raises:
            ValueError: another format version, or a field missing or of the wrong type
                (the message names it).
        """
        if not isinstance(data, Mapping):
            raise ValueError("corrupt record: not a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"record format {data.get('format')!r}, this version reads "
                             f"{FORMAT}; run once with ENABLE_SEARCH=1 to search again")

        def field(name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
            value = data.get(name, default)
            if value is ...:
                raise ValueError(f"corrupt record: {name!r} is missing")
            if not isinstance(value, kind):
                raise ValueError(f"corrupt record: {name!r} is not {_KIND[kind]}")
            return value

        found = field("setup", Mapping)
        try:
            setup = Setup(**{**{"cpu": ""}, **{k: found[k] for k in Setup._fields
                                                if k in found}})
        except TypeError as err:
            raise ValueError(f"corrupt record: 'setup' is incomplete ({err})") from None
        hw = field("hardware", (Mapping, type(None)), None) or {}
        known = set(cls._fields) | {"format"}
        return cls(field("key", str), setup, field("choice", str),
                   field("enactment_fingerprint", str),
                   HardwareRef(hw.get("name"), hw.get("sha256")),
                   field("predicted_s", Mapping, {}), field("measured_s", Mapping, {}),
                   field("search", (Mapping, type(None)), None), field("created", str, ""),
                   field("enactment_sha256", str, ""),
                   field("verified", (Mapping, type(None)), None),
                   {k: v for k, v in data.items() if k not in known})


_KIND = {Mapping: "an object", str: "a string", (Mapping, type(None)): "an object or null"}


class Entry(NamedTuple):
    """A usable store entry.

    Attributes:
        key: its source fingerprint.
        record: its :class:`Record`.
        enactment: the :class:`~disco_jax.enactment.Enactment` to run.
        path: its directory.
    """

    key: str
    record: Record
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
        record: its :class:`Record` (None when it cannot be read).
        problem: why the record cannot be read (``""`` when it can).
        path: its directory.
    """

    key: str
    record: Record | None
    problem: str
    path: Path


def make_record(key: str, setup: Setup, *, enactment_fingerprint: str, choice: str,
                hardware: str | None, hardware_sha256: str | None,
                predicted_s: Mapping[str, float | None], measured_s: Mapping[str, float],
                search: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None
                ) -> Record:
    """The :class:`Record` of a new entry, created now.

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
        extra: anything else to keep, JSON-able (e.g. the in-context calibration).
    """
    return Record(check_key(key), setup, choice, enactment_fingerprint,
                  HardwareRef(hardware, hardware_sha256), dict(predicted_s),
                  dict(measured_s), dict(search) if search is not None else None,
                  datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  extra=dict(extra or {}))


def hardware_sha256(name: str | None) -> str | None:
    """sha256 of the hardware file ``name`` names here
    (:func:`disco_estimator.hardware.find_hardware`), or None: no name, no such regular file,
    or larger than 64 MiB (a store record names it: nothing unbounded is read)."""
    from disco_estimator.hardware import find_hardware

    if not name:
        return None
    try:
        path = find_hardware(name)
        if path.stat().st_size > _HARDWARE_MAX_BYTES:
            return None
        return _sha256(path.read_bytes())
    except (OSError, ValueError):
        return None


def hardware_mismatch(record: Record) -> str | None:
    """Why an entry's hardware file differs from this machine's (a sentence), or None.

    The record names the hardware file its search's cost model used and its sha256
    (:func:`make_record`); here the same name must find a file with the same sha256. A
    record without a name or hash (no hardware file) has nothing to compare.
    """
    name, want = record.hardware
    if not name or not want:
        return None
    here = hardware_sha256(str(name))
    if here is None:
        return (f"the stored plan was made with hardware file {name!r} (sha256 "
                f"{str(want)[:12]}), which this machine does not have; run once with "
                "ENABLE_SEARCH=1 to search again here")
    if here != want:
        return (f"the stored plan was made with hardware file {name!r} sha256 "
                f"{str(want)[:12]}, this machine's {name!r} has sha256 {here[:12]}; run once "
                "with ENABLE_SEARCH=1 to search again here")
    return None


def _clean_stale(root: Path) -> None:
    """Removes temporary directories of writers that died more than an hour ago."""
    now = time.time()
    for child in root.iterdir():
        if child.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            with contextlib.suppress(OSError):
                if now - child.lstat().st_mtime > _STALE_S:
                    _discard(child)


def write_entry(key: str, record: Record, enactment: Any, *,
                root: str | os.PathLike[str] | None = None) -> Path:
    """Writes (or replaces) the entry ``key`` atomically.

    Args:
        key: the source fingerprint (:func:`check_key`).
        record: its :class:`Record` (:func:`make_record`); the sha256 of the enactment
            file is set.
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
    full = record._replace(enactment_sha256=_sha256(data)).to_json()
    tmp = base / f"{_TMP_PREFIX}{key[:16]}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        write_atomic(tmp / ENACTMENT_FILE, data, mkdir=False)
        write_atomic(tmp / RECORD_FILE, json.dumps(full, indent=1, sort_keys=True),
                     mkdir=False)
        target = base / key
        trash = None
        with _locked(base, exclusive=True):  # one swap at a time; readers wait for it
            if os.path.lexists(target):
                trash = base / f"{_TRASH_PREFIX}{key[:16]}-{uuid.uuid4().hex}"
                os.rename(target, trash)  # a symbolic link is renamed, not followed
            os.rename(tmp, target)
            fd = os.open(base, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if trash is not None:
            _discard(trash)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _read_files(base: Path, key: str, names: tuple[str, ...], *, lock: bool = True
                ) -> dict[str, bytes | OSError]:
    """The bytes of files ``names`` of entry ``key``, all from the same directory (opened
    together under the shared lock, or with ``lock=False`` under the caller's exclusive
    one; a concurrent swap cannot mix two writers' files), or the error of each that
    cannot be opened. Symbolic links are never followed.

    Raises:
        FileNotFoundError: no entry ``key``.
        ValueError: the entry is a symbolic link or not a directory.
    """
    path = base / key
    fds: dict[str, int | OSError] = {}
    with _locked(base, exclusive=False) if lock else contextlib.nullcontext():
        try:
            dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise FileNotFoundError(f"no entry {key} in {base}") from None
        except OSError as err:
            if path.is_symlink():
                raise ValueError(f"unsafe entry: {key} is a symbolic link (to "
                                 f"{os.readlink(path)!r}); an entry must be a directory "
                                 "inside the store") from None
            raise ValueError(f"corrupt entry: {key} cannot be opened as a directory "
                             f"({err})") from None
        try:
            for name in names:
                try:
                    fds[name] = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK,
                                        dir_fd=dfd)
                except OSError as err:
                    fds[name] = err
        finally:
            os.close(dfd)
    out: dict[str, bytes | OSError] = {}
    for name, fd in fds.items():
        if isinstance(fd, OSError):
            if fd.errno == errno.ELOOP:
                fd = OSError(errno.ELOOP, "a symbolic link (not followed)")
            out[name] = fd
            continue
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                out[name] = OSError(errno.EINVAL, "not a regular file")
                continue
            try:
                out[name] = fh.read()
            except OSError as err:
                out[name] = err
    return out


def _parse_record(data: bytes | OSError, key: str) -> Record:
    """``record.json``'s bytes, checked for its format and key (ValueError if not)."""
    if isinstance(data, FileNotFoundError):
        raise ValueError(f"corrupt entry: {RECORD_FILE} is missing")
    if isinstance(data, OSError):
        raise ValueError(f"corrupt entry: {RECORD_FILE} cannot be read ({data})")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"corrupt entry: {RECORD_FILE} cannot be read ({err})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"corrupt entry: {RECORD_FILE} is not a JSON object")
    record = Record.from_json(obj)
    if record.key != key:
        raise ValueError(f"corrupt entry: record.json is for key {record.key!r}")
    return record


def read_record(key: str, *, root: str | os.PathLike[str] | None = None) -> Record:
    """The :class:`Record` of entry ``key``, checked for its format and key.

    Raises:
        FileNotFoundError: no such entry.
        ValueError: a bad key, an entry that is a symbolic link, or a record that is
            truncated, malformed, of another format version or of another key (the
            message says which).
    """
    base = store_dir(root)
    check_key(key)
    return _parse_record(_read_files(base, key, (RECORD_FILE,))[RECORD_FILE], key)


def record_verification(key: str, *, enactment_sha256: str, ok: bool,
                        max_abs_diff: float | None, detail: str = "",
                        root: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """Records in entry ``key``'s ``record.json`` whether its program computed what
    ``jax.jit`` computes (the ``verified`` field), atomically and under the store's lock.

    Args:
        key: the entry.
        enactment_sha256: the ``enactment_sha256`` of the record that was verified; if the
            entry was replaced meanwhile (another sha256), nothing is written.
        ok: the outputs matched.
        max_abs_diff: the largest absolute difference of any output (None: not finite
            or not comparable).
        detail: what differed, in words.
        root: the store's directory (default: :func:`store_dir`).

    Returns:
        The verdict written (``{"ok", "max_abs_diff", "detail", "when",
        "enactment_sha256"}``), or None when the entry is gone or was replaced.

    Raises:
        ValueError: a bad key.
        OSError: the store cannot be written.
    """
    base = store_dir(root)
    check_key(key)
    if max_abs_diff is not None and not math.isfinite(max_abs_diff):
        max_abs_diff = None
    with _locked(base, exclusive=True):
        try:
            record = _parse_record(
                _read_files(base, key, (RECORD_FILE,), lock=False)[RECORD_FILE], key)
        except (FileNotFoundError, ValueError):
            return None
        if record.enactment_sha256 != enactment_sha256:
            return None
        verdict = {"ok": bool(ok), "max_abs_diff": max_abs_diff, "detail": detail,
                   "when": datetime.datetime.now(datetime.UTC).isoformat(
                       timespec="seconds"),
                   "enactment_sha256": enactment_sha256}
        write_atomic(base / key / RECORD_FILE,
                     json.dumps(record._replace(verified=verdict).to_json(), indent=1,
                                sort_keys=True),
                     mkdir=False)
    return verdict


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
               check_hlo: bool = True, check_hardware: bool = False) -> Lookup:
    """Reads entry ``key`` and says whether it can run here.

    Never executes anything from the store: JSON is parsed, hashes compared, and (with
    ``check_hlo``) each HLO text is parsed by XLA's parser. Nothing is imported on the
    way and no symbolic link is followed.

    Args:
        key: the source fingerprint of the program.
        setup: this process's :class:`Setup` (None: do not check the setup).
        root: the store's directory (default: :func:`store_dir`).
        check_hlo: parse the stored HLO with XLA's parser.
        check_hardware: the record's hardware file must have the same sha256 here
            (:func:`hardware_mismatch`).

    Returns:
        A :class:`Lookup`: the entry, or None and the reason (:data:`NOT_FOUND`, a corrupt
        or truncated file, an entry that is a symbolic link, another jax version,
        backend, device kind, CPU, device or process count, another hardware file, a
        failed verification (:func:`record_verification`), HLO that does not parse, a
        key that is not a store key).
    """
    from disco_jax.enactment import Enactment

    base = store_dir(root)
    try:
        files = _read_files(base, check_key(key), (RECORD_FILE, ENACTMENT_FILE))
        record = _parse_record(files[RECORD_FILE], key)
    except FileNotFoundError:
        return Lookup(None, NOT_FOUND)
    except ValueError as err:
        return Lookup(None, str(err))
    path = base / key
    if setup is not None:
        why = setup.mismatch(record)
        if why is not None:
            return Lookup(None, why)
    if check_hardware:
        why = hardware_mismatch(record)
        if why is not None:
            return Lookup(None, why)
    data = files[ENACTMENT_FILE]
    if isinstance(data, OSError):
        return Lookup(None, f"corrupt entry: {ENACTMENT_FILE} cannot be read ({data})")
    if _sha256(data) != record.enactment_sha256:
        return Lookup(None, f"corrupt entry: {ENACTMENT_FILE} does not match its record "
                            "(truncated or changed)")
    verdict = record.verdict
    if verdict is not None and not verdict.get("ok"):
        diff = verdict.get("max_abs_diff")
        return Lookup(None, f"the stored plan failed its verification against jax.jit on "
                            f"{verdict.get('when')} (largest difference "
                            f"{'not finite' if diff is None else f'{diff:.3g}'}); run once "
                            "with ENABLE_SEARCH=1 to search again")
    try:
        enactment = Enactment.from_json(json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as err:
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
        if not (_KEY_RE.fullmatch(child.name) and (child.is_dir() or child.is_symlink())):
            continue
        try:
            out.append(Listed(child.name, read_record(child.name, root=base), "", child))
        except (OSError, ValueError) as err:
            out.append(Listed(child.name, None, str(err), child))
    return sorted(out, key=lambda e: (e.record.created if e.record else "", e.key),
                  reverse=True)


def remove_entry(key: str, *, root: str | os.PathLike[str] | None = None) -> bool:
    """Removes entry ``key`` (renamed away first, so readers never see half of it);
    returns False when there was none.

    Raises:
        ValueError: a bad key.
    """
    base = store_dir(root)
    target = base / check_key(key)
    if not os.path.lexists(target):
        return False
    trash = base / f"{_TRASH_PREFIX}{key[:16]}-{uuid.uuid4().hex}"
    with _locked(base, exclusive=True):
        os.rename(target, trash)  # a symbolic link is renamed, not followed
    _discard(trash)
    return True
