"""Hardware files: the one home of reading, finding and writing them.

A hardware file is a TOML file (schema :data:`HARDWARE_SCHEMA`, documented at the top of
every written file, see :func:`hardware_toml`) holding the AllReduce model
``T(bytes) = C * bytes + D`` of one setup, what it was measured on, and optionally the
measured points and a ``[costs]`` table.

Where a hardware *name* is looked up, first match wins:

1. the user's config directory, :func:`user_hardware_dir`
   (``$DISCO_CONFIG_DIR/hardware``, else ``~/.config/disco_jax/hardware`` on Linux);
2. the files shipped with the package, :func:`shipped_hardware_dir`
   (``disco_estimator/hardware_files/*.toml``, package data).

A spec that is a path (an ``os.PathLike``, or a string ending in ``.toml`` or holding a
path separator) is read as that path. Importing this module does not import jax.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.resources
import json
import math
import os
import statistics
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disco_estimator.allreduce import AllReduceModel, MeasuredAllReduce
from hlo_tools.dirs import config_dir, write_atomic

if TYPE_CHECKING:
    from disco_estimator.allreduce import SetupResult

__all__ = [
    "HARDWARE_SCHEMA",
    "HardwareConfig",
    "HardwareError",
    "HardwareNotFoundError",
    "InvalidHardwareError",
    "available_hardware",
    "find_hardware",
    "hardware_toml",
    "load_hardware",
    "shipped_hardware_dir",
    "user_hardware_dir",
    "validate",
    "write_hardware",
    "write_hardware_text",
]

#: Schema version of hardware files (the ``schema`` key).
HARDWARE_SCHEMA = 1
_SUFFIX = ".toml"


# --------------------------------------------------------------------------- errors


class HardwareError(Exception):
    """Base of the errors of this module."""


class HardwareNotFoundError(HardwareError, FileNotFoundError):
    """No hardware file for a name or path; the message lists the valid names."""


class InvalidHardwareError(HardwareError, ValueError):
    """A hardware file that is not valid TOML or misses/mistypes a key; the message
    starts with the file's path."""


# --------------------------------------------------------------------------- locations


def user_hardware_dir() -> Path:
    """The user's hardware directory (``hlo_tools.dirs.config_dir("hardware")``): searched
    first, and where :func:`write_hardware` writes by default. It may not exist."""
    return config_dir("hardware")


def shipped_hardware_dir() -> Path:
    """The folder of the hardware files shipped with the package (package data,
    ``disco_estimator/hardware_files``), located with :mod:`importlib.resources`."""
    return Path(str(importlib.resources.files("disco_estimator") / "hardware_files"))


def _names_in(directory: Path) -> set[str]:
    try:
        return {p.name.removesuffix(_SUFFIX) for p in directory.iterdir()
                if p.name.endswith(_SUFFIX) and p.is_file()}
    except OSError:  # missing or unreadable directory
        return set()


def available_hardware() -> list[str]:
    """Sorted names of the hardware files of the user's directory and the shipped ones."""
    return sorted(_names_in(user_hardware_dir()) | _names_in(shipped_hardware_dir()))


def _is_path(spec: str | os.PathLike[str]) -> bool:
    if not isinstance(spec, str):
        return True
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return spec.endswith(_SUFFIX) or any(s in spec for s in seps)


def _not_found(spec: str | os.PathLike[str]) -> HardwareNotFoundError:
    known = ", ".join(available_hardware())
    return HardwareNotFoundError(
        f"hardware {os.fspath(spec)!r} not found (a .toml path or one of: {known})")


def find_hardware(path_or_name: str | os.PathLike[str]) -> Path:
    """The file a hardware spec names.

    Args:
        path_or_name: a path (an ``os.PathLike``, or a string ending in ``.toml`` or
            holding a path separator), or a name looked up in :func:`user_hardware_dir`,
            then :func:`shipped_hardware_dir`.

    Returns:
        The path of the existing file.

    Raises:
        HardwareNotFoundError: no such file; the message lists the valid names.
    """
    if _is_path(path_or_name):
        path = Path(path_or_name)
        if path.is_file():
            return path
        raise _not_found(path_or_name)
    for directory in (user_hardware_dir(), shipped_hardware_dir()):
        path = directory / f"{path_or_name}{_SUFFIX}"
        if path.is_file():
            return path
    raise _not_found(path_or_name)


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
    """A loaded hardware file.

    Attributes:
        name: setup name.
        allreduce: the all-reduce model.
        hardware: the ``[hardware]`` table.
        raw: the whole parsed TOML.
    """

    name: str
    allreduce: AllReduceModel
    hardware: dict[str, Any]
    raw: dict[str, Any]

    @property
    def num_devices(self) -> int:
        """Devices taking part in each all-reduce (``[hardware] num_devices``, default 1)."""
        return int(self.hardware.get("num_devices", 1))

    def measured(self) -> MeasuredAllReduce | None:
        """Interpolation of the fitted points (None if the file has no points)."""
        pts = self.raw.get("allreduce", {}).get("points")
        if not pts or len(pts.get("bytes", [])) < 2:
            return None
        return MeasuredAllReduce(tuple(pts["bytes"]), tuple(pts["op_time_s"]), self.allreduce)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _problems(raw: Mapping[str, Any]) -> list[str]:
    """What is wrong with a parsed hardware file (empty if nothing)."""
    out = []
    if "schema" in raw and raw["schema"] != HARDWARE_SCHEMA:
        out.append(f"schema is {raw['schema']!r}, expected {HARDWARE_SCHEMA}")
    if "name" in raw and not isinstance(raw["name"], str):
        out.append("name must be a string")
    hw = raw.get("hardware", {})
    if not isinstance(hw, Mapping):
        out.append("[hardware] must be a table")
    elif "num_devices" in hw and not (_is_int(hw["num_devices"]) and hw["num_devices"] >= 1):
        out.append(f"[hardware] num_devices must be an integer >= 1, "
                   f"not {hw['num_devices']!r}")
    ar = raw.get("allreduce")
    if not isinstance(ar, Mapping):
        return out + ["missing table [allreduce]"]
    for key in ("c_s_per_byte", "d_s"):
        if key not in ar:
            out.append(f"[allreduce] misses {key}")
        elif not (_is_number(ar[key]) and ar[key] >= 0):
            out.append(f"[allreduce] {key} must be a number >= 0, not {ar[key]!r}")
    if "small_bytes" in ar and not (_is_int(ar["small_bytes"]) and ar["small_bytes"] >= 0):
        out.append(f"[allreduce] small_bytes must be an integer >= 0, "
                   f"not {ar['small_bytes']!r}")
    if "d_small_s" in ar and not (_is_number(ar["d_small_s"]) and ar["d_small_s"] >= 0):
        out.append(f"[allreduce] d_small_s must be a number >= 0, not {ar['d_small_s']!r}")
    if "d_tuple_extra_s" in ar and not _is_number(ar["d_tuple_extra_s"]):
        out.append(f"[allreduce] d_tuple_extra_s must be a number, "
                   f"not {ar['d_tuple_extra_s']!r}")
    pts = ar.get("points")
    if pts is not None:
        if not isinstance(pts, Mapping):
            out.append("[allreduce.points] must be a table")
        elif len(pts.get("bytes", [])) >= 2 and (
                len(pts.get("op_time_s", [])) != len(pts["bytes"])):
            out.append("[allreduce.points] op_time_s must have one time per entry of bytes")
    return out


def validate(raw: Mapping[str, Any], source: str | os.PathLike[str] = "<hardware>") -> None:
    """Checks a parsed hardware file.

    Args:
        raw: the parsed TOML.
        source: the file's path (or another label), put first in the message.

    Raises:
        InvalidHardwareError: ``"<source>: invalid hardware file: <problems>"``.
    """
    problems = _problems(raw)
    if problems:
        raise InvalidHardwareError(
            f"{os.fspath(source)}: invalid hardware file: {'; '.join(problems)}")


def load_hardware(path_or_name: str | os.PathLike[str]) -> HardwareConfig:
    """Loads a hardware file by path or by name (see :func:`find_hardware`).

    Raises:
        HardwareNotFoundError: no such file (a ``FileNotFoundError``).
        InvalidHardwareError: not TOML, or not a valid hardware file (a ``ValueError``);
            the message names the file.
    """
    path = find_hardware(path_or_name)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise InvalidHardwareError(f"{path}: invalid hardware file: {err}") from None
    validate(raw, path)
    ar = raw["allreduce"]
    model = AllReduceModel(float(ar["c_s_per_byte"]), float(ar["d_s"]),
                           int(ar.get("small_bytes", 0)), float(ar.get("d_small_s", 0.0)),
                           float(ar.get("d_tuple_extra_s", 0.0)))
    return HardwareConfig(raw.get("name", path.stem), model, dict(raw.get("hardware", {})), raw)


# --------------------------------------------------------------------------- writing


_SCHEMA_DOC = """\
# DisCo hardware description, schema 1. Units: seconds, bytes.
#
# schema              int     always 1
# name                str     setup name (= file name without .toml)
# description         str     what the setup is
# [hardware]
#   backend           str     jax backend ("cpu", "gpu")
#   device_kind       str     jax device_kind of the devices
#   num_devices       int     devices taking part in each all-reduce
#   num_processes     int     processes of the job
#   devices_per_process int
#   interconnect      str     how the devices are connected
#   host_cpus         int     CPU cores of the host (os.cpu_count(); 0 if not measured)
#   jax_version       str     jax version it was measured with ("" if not measured)
#   measured_on       str     ISO date of the measurement, or of the estimate
#   source            str     where the numbers come from
# [allreduce]         T(bytes) = c_s_per_byte * bytes + d_s, bytes = per-device buffer
#   model             str     "linear"
#   c_s_per_byte      float   seconds per byte (1 / effective bandwidth)
#   d_s               float   fixed latency per all-reduce, seconds
#   d_tuple_extra_s   float   optional: extra latency of each buffer of a variadic
#                             all-reduce on CPU (fitted in context; default 0)
#   time_metric       str     "op": all-reduce op duration from profiler traces, min over
#                             participants per iteration; "spec": derived from hardware
#                             specifications
#   time_statistic    str     statistic over iterations: "median", "p25" or "min"
#   fit_weighting     str     "relative": least squares on relative error (weights 1/T)
#   mean_rel_err      float   mean |fit - measured| / measured over the points
#   max_rel_err       float   max  |fit - measured| / measured over the points
#   min_bytes, max_bytes int  range of measured sizes
# [allreduce.wall]    same fit on host wall time per call (includes launch overhead)
# [allreduce.points]  bytes; op_time_s, wall_time_s: the fitted statistic per size;
#                     op_median_s, op_p25_s: median and 25th percentile of the op time
"""


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "nan")
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _toml_table(name: str | None, items: Mapping[str, Any]) -> list[str]:
    lines = [f"[{name}]"] if name else []
    lines += [f"{k} = {_toml_value(v)}" for k, v in items.items()]
    return lines + [""]


def _backend_family(backend: str) -> str:
    """``"cpu"``/``"gpu"`` for a jax platform name (the one map,
    ``hlo_tools.jax_bridge.platform_family``); other names unchanged."""
    from hlo_tools.jax_bridge import platform_family  # imports jax

    return platform_family(backend) or backend


def hardware_toml(result: SetupResult,
                  carried: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The hardware TOML text (schema documented at its top) for a measured setup.

    Args:
        result: the measured setup (with probes: the in-program latency becomes ``d_s``
            and the overlap ``[costs] overlap``).
        carried: values not measured here, by table (``"allreduce"``, ``"costs"``), e.g.
            from the shipped file of the same setup; measured values win.
    """
    carried = carried or {}
    latency = overlap = None
    if result.probes:
        latency = statistics.median(p["latency_s"] for p in result.probes)
        overlap = statistics.median(p["overlap"] for p in result.probes)
    s, f, w = result.setup, result.fit, result.wall_fit
    facts = result.facts
    hw = {"backend": _backend_family(facts.get("backend", "cpu")),
          "device_kind": facts.get("device_kind", ""),
          "num_devices": s.num_devices, "num_processes": s.num_processes,
          "devices_per_process": s.num_devices // s.num_processes,
          "interconnect": s.description, "host_cpus": int(facts.get("host_cpus", 0)),
          "jax_version": facts.get("jax_version", ""),
          "measured_on": datetime.date.today().isoformat(),
          "source": "measured by benchmarks/allreduce_fit.py (disco_estimator.allreduce)"}
    ar = {"model": "linear", "c_s_per_byte": f.model.c_s_per_byte, "d_s": f.model.d_s,
          "time_metric": "op", "time_statistic": result.stat, "fit_weighting": f.weighting,
          "mean_rel_err": f.mean_rel_err, "max_rel_err": f.max_rel_err,
          "min_bytes": result.points[0].bytes, "max_bytes": result.points[-1].bytes}
    ar = {**carried.get("allreduce", {}), **ar}
    if latency is not None:  # what one all-reduce adds to a program, not to a microbenchmark
        ar.update(d_s=latency,
                  time_metric="program", microbenchmark_c_s_per_byte=f.model.c_s_per_byte,
                  microbenchmark_d_s=f.model.d_s)
        hw["source"] = ("measured by disco calibrate (disco_estimator.allreduce, "
                        "disco_estimator.probes)")
    wall = {"c_s_per_byte": w.model.c_s_per_byte, "d_s": w.model.d_s,
            "mean_rel_err": w.mean_rel_err, "max_rel_err": w.max_rel_err}
    pts = {"bytes": [p.bytes for p in result.points],
           "op_time_s": [p.op_time(result.stat) for p in result.points],
           "wall_time_s": [p.wall_time(result.stat) for p in result.points],
           "op_median_s": [p.op_time_s for p in result.points],
           "op_p25_s": [p.op_time("p25") for p in result.points]}
    lines = [_SCHEMA_DOC]
    lines += _toml_table(None, {"schema": HARDWARE_SCHEMA, "name": s.name,
                                "description": s.description})
    lines += _toml_table("hardware", hw) + _toml_table("allreduce", ar)
    lines += _toml_table("allreduce.wall", wall) + _toml_table("allreduce.points", pts)
    costs = {**carried.get("costs", {}), **({} if overlap is None else {"overlap": overlap})}
    if costs:
        lines += _toml_table("costs", costs)
    if result.probes:
        lines += _toml_table("probes", {"program_d_s": latency, **_probe_table(result.probes)})
    return "\n".join(lines)


def _probe_table(probes: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """What each process's probes measured, one list per quantity (index = process)."""
    keys = ("latency_s", "overlap", "comm_s", "compute_s", "both_s", "comm_bytes", "matmuls")
    return {k: [p[k] for p in probes] for k in keys}


def write_hardware_text(name: str, text: str,
                        directory: str | os.PathLike[str] | None = None) -> Path:
    """Validates a hardware file's text and writes it as ``<directory>/<name>.toml``
    atomically (a file another tool made or rewrote, e.g. with fitted constants).

    Args:
        name: the setup name (the file name without ``.toml``).
        text: the TOML text.
        directory: where to write; :func:`user_hardware_dir` when None.

    Raises:
        InvalidHardwareError: the text is not a valid hardware file (nothing is written).
    """
    base = Path(directory) if directory is not None else user_hardware_dir()
    path = base / f"{name}{_SUFFIX}"
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InvalidHardwareError(f"{path}: invalid hardware file: not TOML ({err})") from None
    validate(raw, path)
    write_atomic(path, text)
    return path


def write_hardware(result: SetupResult,
                   directory: str | os.PathLike[str] | None = None) -> Path:
    """Writes ``<directory>/<setup>.toml`` atomically (temporary file + ``os.replace``).

    Args:
        result: the measured setup (see :func:`hardware_toml`).
        directory: where to write; :func:`user_hardware_dir` when None (never into the
            installed package).

    Returns:
        The written file's path.
    """
    base = Path(directory) if directory is not None else user_hardware_dir()
    path = base / f"{result.setup.name}{_SUFFIX}"
    write_atomic(path, hardware_toml(result))
    return path
