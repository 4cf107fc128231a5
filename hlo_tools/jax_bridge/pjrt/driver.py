"""Compiling HLO text with XLA:GPU through its PJRT plugin, each compile in a child process.

* :func:`compile_deviceless`: for a described GPU (no device needed), returning the
  optimized HLO text: what CI uses to check that a GPU plan compiles and keeps its
  fusions;
* :func:`compile_serialized`: on this machine's GPU, returning the plugin's serialized
  executable.

The text becomes a serialized ``HloModuleProto`` here (XLA's parser; bad text fails
before any child starts), the child (:mod:`~hlo_tools.jax_bridge.pjrt.child`) runs the
plugin, and whatever goes wrong there (the plugin's error, a CHECK failure that aborts
the child, a timeout) comes back as :class:`~hlo_tools.jax_bridge.errors.HloCompileError`
with XLA's own words.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from hlo_tools.jax_bridge import internals
from hlo_tools.jax_bridge.errors import HloCompileError
from hlo_tools.jax_bridge.pjrt import target
from hlo_tools.jax_bridge.pjrt.capi import PjrtError, code_name
from hlo_tools.jax_bridge.pjrt.locate import (
    CUDA_DATA_DIR_OPTION,
    cuda_data_dir,
    cuda_libraries,
    plugin_path,
    unavailable_reason,
)

__all__ = [
    "CLIENT_OPTIONS",
    "STDERR_LINES",
    "DevicelessCompile",
    "child_bootstrap",
    "compile_deviceless",
    "compile_options",
    "compile_serialized",
    "failure_message",
    "topology_name",
]

#: The GPU client's create options for :func:`compile_serialized`: allocate device memory
#: on demand (a compile needs little, and another process may hold the GPU). A caller
#: may add e.g. ``memory_fraction`` (a float: the share of the GPU's memory the client
#: may take) through ``client_options``.
CLIENT_OPTIONS: Mapping[str, Any] = {"platform_name": "cuda", "preallocate": False}
#: How many of a crashed child's last stderr lines an error carries.
STDERR_LINES = 12
#: A fatal log line (absl ``F<date>``) or a CHECK failure in XLA's stderr.
_FATAL = re.compile(r"^F\d{4} |Check failed|FATAL|Aborted")
#: An error log line (absl ``E<date>``): XLA logs some reasons there only (e.g. why a
#: target description does not parse) and returns a vaguer error.
_ERROR_LOG = re.compile(r"^E\d{4} ")
#: How many error log lines a plugin error carries.
_ERROR_LOG_LINES = 5


class DevicelessCompile(NamedTuple):
    """A deviceless compile's outcome.

    Attributes:
        optimized_text: the optimized module (after XLA:GPU's pipeline) as HLO text.
        seconds: the plugin's compile time (in the child, not counting its start).
    """

    optimized_text: str
    seconds: float


def compile_options(xla_options: Mapping[str, Any] | None = None, *, replicas: int = 1,
                    partitions: int = 1) -> bytes:
    """A serialized ``CompileOptionsProto`` for the plugin: ``replicas`` x ``partitions``
    with ``xla_options`` as XLA debug options, plus ``xla_gpu_cuda_data_dir`` set to the
    ``nvidia-cuda-nvcc`` wheel (:func:`~hlo_tools.jax_bridge.pjrt.locate.cuda_data_dir`)
    when it is installed and the options do not set it."""
    options = dict(xla_options or {})
    tools = cuda_data_dir()
    if tools is not None:
        options.setdefault(CUDA_DATA_DIR_OPTION, tools)
    return internals.compile_options_proto(replicas=replicas, partitions=partitions,
                                           options=options)


def topology_name(devices: int) -> str:
    """XLA:GPU's topology of ``devices`` GPUs on one host: ``slices x hosts x devices``."""
    return f"1x1x{devices}"


def _module_proto(hlo_text: str) -> bytes:
    try:
        return internals.hlo_module_proto(hlo_text)
    except Exception as err:  # noqa: BLE001 - XLA's error type differs between versions
        raise HloCompileError(f"XLA cannot parse the HLO text: {err}") from err


def _plugin() -> str:
    path = plugin_path()
    if path is None:
        raise HloCompileError(f"cannot compile for XLA:GPU: {unavailable_reason()}")
    return path


def failure_message(returncode: int, stderr: str, lines: int = STDERR_LINES) -> str:
    """What a child that died without a result says: how it ended (exit status or
    signal), XLA's fatal lines (CHECK failures) and its last ``lines`` stderr lines."""
    if returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"exit status {returncode}"
    text = stderr.rstrip().splitlines()
    fatal = [line for line in text if _FATAL.search(line)]
    tail = [line for line in text[-lines:] if line not in fatal]
    parts = [f"XLA:GPU compile process ended without a result ({how})"]
    parts += fatal + tail
    return "\n".join(parts)


#: The packages above the child module, with their folders: the child gets empty
#: stand-ins for them (a ``__path__`` only), since their ``__init__`` modules import jax.
_PACKAGES = (
    ("hlo_tools", Path(__file__).parents[2]),
    ("hlo_tools.jax_bridge", Path(__file__).parents[1]),
    ("hlo_tools.jax_bridge.pjrt", Path(__file__).parent),
)


def child_bootstrap() -> str:
    """The ``python -c`` code that runs :mod:`~hlo_tools.jax_bridge.pjrt.child` as
    ``__main__`` without importing the packages' ``__init__`` modules: the child then
    imports only itself, :mod:`~hlo_tools.jax_bridge.pjrt.capi` and the bridge's
    errors, not jax (which would cost a second per compile, and whose plugin discovery
    may touch the same plugin)."""
    packages = [(name, str(folder)) for name, folder in _PACKAGES]
    return (
        "import runpy, sys, types\n"
        f"for name, folder in {packages!r}:\n"
        "    sys.modules[name] = types.ModuleType(name)\n"
        "    sys.modules[name].__path__ = [folder]\n"
        "runpy.run_module('hlo_tools.jax_bridge.pjrt.child', run_name='__main__',"
        " alter_sys=True)\n"
    )


def _write_request(folder: Path, mode: str, module: bytes, options: bytes,
                   create_options: Mapping[str, Any]) -> None:
    """Writes a request for :mod:`~hlo_tools.jax_bridge.pjrt.child` into ``folder``."""
    request = {"mode": mode, "plugin": _plugin(), "options": dict(create_options),
               "libraries": cuda_libraries() if mode == "client" else []}
    (folder / "request.json").write_text(json.dumps(request))
    (folder / "module.pb").write_bytes(module)
    (folder / "options.pb").write_bytes(options)


def _start_child(folder: Path, timeout_s: float) -> tuple[int, str]:
    """Runs the child on the request in ``folder`` (jax's backends off: the child only
    needs the plugin); returns its exit status and stderr.

    Raises:
        HloCompileError: it did not finish within ``timeout_s`` (it is killed).
    """
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-c", child_bootstrap(), str(folder)]
    with open(folder / "stderr.txt", "w+b") as err_file:
        try:
            proc = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=err_file, env=env, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as err:
            raise HloCompileError(
                f"XLA:GPU compile did not finish within {timeout_s:g} s") from err
        err_file.seek(0)
        return proc.returncode, err_file.read().decode(errors="replace")


def _read_result(folder: Path, returncode: int, stderr: str) -> tuple[bytes, float]:
    """The child's result bytes and compile seconds.

    Raises:
        PjrtError: the plugin's error, with XLA's error log lines.
        HloCompileError: the child died without a result (:func:`failure_message`).
    """
    result = folder / "result.json"
    if not result.is_file():
        raise HloCompileError(failure_message(returncode, stderr))
    outcome = json.loads(result.read_text())
    if not outcome["ok"]:
        code = int(outcome.get("code", -1))
        logged = [line for line in stderr.splitlines() if _ERROR_LOG.search(line)]
        message = "\n".join([f"XLA:GPU compile failed ({code_name(code)}): {outcome['error']}",
                              *logged[-_ERROR_LOG_LINES:]])
        raise PjrtError(message, code)
    return (folder / "result.bin").read_bytes(), float(outcome["seconds"])


def _run_child(mode: str, module: bytes, options: bytes, create_options: Mapping[str, Any],
               timeout_s: float) -> tuple[bytes, float]:
    """Runs one compile in a child process; returns its result bytes and compile seconds.

    Raises:
        HloCompileError: the plugin's error (a :class:`PjrtError`), a crash or a timeout.
    """
    with tempfile.TemporaryDirectory(prefix="disco_pjrt_") as tmp:
        folder = Path(tmp)
        _write_request(folder, mode, module, options, create_options)
        returncode, stderr = _start_child(folder, timeout_s)
        return _read_result(folder, returncode, stderr)


def compile_deviceless(hlo_text: str, xla_options: Mapping[str, Any] | None = None, *,
                       replicas: int = 1, partitions: int = 1,
                       target_config: str | None = None,
                       timeout_s: float = 600) -> DevicelessCompile:
    """Compiles HLO text with XLA:GPU for a described GPU, without one.

    The module goes to the plugin as written (program format ``hlo``), so hand-written
    fusions reach XLA's GPU pipeline; with the fusion passes disabled in
    ``xla_options`` they stay as written.

    Args:
        hlo_text: the module (pre-optimization HLO text).
        xla_options: XLA debug options, e.g. ``{"xla_disable_hlo_passes":
            "priority-fusion,fusion"}``.
        replicas: the compile's replica count.
        partitions: the compile's partition count.
        target_config: a ``GpuTargetConfigProto`` text; None: the file named by
            ``$DISCO_GPU_TARGET_CONFIG``, else an H100 SXM
            (:func:`~hlo_tools.jax_bridge.pjrt.target.h100_target_config`).
        timeout_s: the child's time limit.

    Returns:
        The optimized module's text and the compile's seconds.

    Raises:
        HloCompileError: the text does not parse, no plugin is installed, or XLA
            rejects the module (its message; a crash: its fatal lines and stderr tail);
            a plugin error is the subclass ``PjrtError``.
    """
    module = _module_proto(hlo_text)
    options = compile_options(xla_options, replicas=replicas, partitions=partitions)
    topology = {"target_config": target.target_config(target_config),
                "topology": topology_name(replicas * partitions)}
    optimized, seconds = _run_child("deviceless", module, options, topology, timeout_s)
    return DevicelessCompile(internals.hlo_text_of_proto(optimized), seconds)


def compile_serialized(hlo_text: str, compile_options: bytes, *,
                       client_options: Mapping[str, Any] | None = None,
                       timeout_s: float = 600) -> bytes:
    """Compiles HLO text on this machine's GPU; returns the plugin's serialized
    executable (for ``PJRT_Executable_DeserializeAndLoad``).

    Args:
        hlo_text: the module (pre-optimization HLO text).
        compile_options: a serialized ``CompileOptionsProto`` (e.g. of
            :func:`compile_options`).
        client_options: the client's create options; None: :data:`CLIENT_OPTIONS`.
        timeout_s: the child's time limit.

    Raises:
        HloCompileError: no GPU or plugin, or XLA rejects the module (its message); a
            plugin error is the subclass ``PjrtError``.
    """
    module = _module_proto(hlo_text)
    client = CLIENT_OPTIONS if client_options is None else client_options
    executable, _ = _run_child("client", module, compile_options, client, timeout_s)
    return executable
