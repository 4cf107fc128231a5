"""Where the XLA:GPU plugin and the CUDA tools a compile needs are installed.

Found from module specs alone, importing nothing: a ``jax_plugins`` package's
``__init__`` registers the plugin with jax as a side effect, and ``nvidia`` packages may
preload CUDA libraries. A deviceless compile needs the plugin (the ``jax-cuda13-pjrt``
or ``jax-cuda12-pjrt`` wheel) and ``ptxas`` with ``libdevice`` (CUDA 13: the
``nvidia-cuda-nvcc`` and ``nvidia-nvvm`` wheels, which share ``nvidia/cu13``; CUDA 12:
``nvidia-cuda-nvcc-cu12``; or a CUDA toolkit XLA finds by itself).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

__all__ = [
    "CUDA_DATA_DIR_OPTION",
    "PLUGIN_ENV",
    "PLUGIN_MODULES",
    "TOOL_PACKAGES",
    "cuda_data_dir",
    "cuda_libraries",
    "plugin_path",
    "ptxas_path",
    "unavailable_reason",
]

#: The ``jax_plugins`` modules of the CUDA PJRT plugin wheels, newest CUDA first.
PLUGIN_MODULES = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
#: Names the plugin's shared library directly (e.g. a wheel unpacked where jax does not
#: look for plugins: an installed one makes jax try, and log its failure, to start a CUDA
#: backend on a machine without a GPU).
PLUGIN_ENV = "DISCO_PJRT_PLUGIN"
#: The plugin's shared library inside its module directory.
_PLUGIN_FILE = "xla_cuda_plugin.so"
#: The XLA debug option naming the directory with ``bin/ptxas`` and ``nvvm/libdevice``.
CUDA_DATA_DIR_OPTION = "xla_gpu_cuda_data_dir"
#: The packages of the CUDA tool wheels holding ``bin/ptxas`` and ``nvvm/libdevice``,
#: newest CUDA first: CUDA 13's ``nvidia-cuda-nvcc`` + ``nvidia-nvvm`` share one folder,
#: CUDA 12's ``nvidia-cuda-nvcc-cu12`` holds both.
TOOL_PACKAGES = ("nvidia.cu13", "nvidia.cuda_nvcc")
#: Where XLA looks for a CUDA toolkit when not told (besides ``PATH``).
_DEFAULT_CUDA_DIR = Path("/usr/local/cuda")


def _package_dirs(module: str) -> list[Path]:
    """The directories of a package found by its spec (not imported; a parent package
    that is a namespace package imports nothing)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or ())]


def plugin_path() -> str | None:
    """The CUDA PJRT plugin's shared library: the file ``$DISCO_PJRT_PLUGIN`` names, else
    the installed jax plugin wheel's (``jax_plugins.xla_cuda13``, else ``xla_cuda12``);
    None when there is none."""
    given = os.environ.get(PLUGIN_ENV, "").strip()
    if given:
        return given if Path(given).is_file() else None
    for module in PLUGIN_MODULES:
        for folder in _package_dirs(module):
            if (folder / _PLUGIN_FILE).is_file():
                return str(folder / _PLUGIN_FILE)
    return None


def _has_cuda_tools(folder: Path) -> bool:
    return (folder / "bin" / "ptxas").is_file() and (folder / "nvvm" / "libdevice").is_dir()


def cuda_data_dir() -> str | None:
    """The CUDA tool wheels' directory (``bin/ptxas``, ``nvvm/libdevice``; see
    :data:`TOOL_PACKAGES`): what compiles pass as ``xla_gpu_cuda_data_dir`` so that XLA
    uses the wheels' tools rather than whichever toolkit it would find first; None
    without the wheels."""
    for package in TOOL_PACKAGES:
        for folder in _package_dirs(package):
            if _has_cuda_tools(folder):
                return str(folder)
    return None


def cuda_libraries() -> list[str]:
    """The CUDA runtime libraries of the installed ``nvidia`` wheels (``nvidia/*/lib`` and
    ``nvidia/cu13/lib``: cudart, cuBLAS, cuDNN, NCCL, ...), which a GPU client of the
    plugin loads by name: jax's plugin package preloads them when jax starts, and a
    compile child that leaves jax unimported preloads them itself. Empty without them
    (a system CUDA on the library path serves then)."""
    found = []
    for folder in _package_dirs("nvidia"):
        found += sorted(str(p) for p in folder.glob("*/lib/lib*.so*") if p.is_file())
    return found


def ptxas_path() -> str | None:
    """A ``ptxas`` for a compile: the wheel's (:func:`cuda_data_dir`), else the toolkit's
    in ``$CUDA_DIR`` or ``/usr/local/cuda``, else one on ``PATH``; None when none is."""
    for folder in (cuda_data_dir(), os.environ.get("CUDA_DIR"), str(_DEFAULT_CUDA_DIR)):
        if folder and (Path(folder) / "bin" / "ptxas").is_file():
            return str(Path(folder) / "bin" / "ptxas")
    return shutil.which("ptxas")


def unavailable_reason() -> str | None:
    """None when a deviceless XLA:GPU compile can run here (the plugin and ``ptxas`` are
    installed); else why not, in a few words (e.g. a test's skip reason)."""
    if plugin_path() is None:
        given = os.environ.get(PLUGIN_ENV, "").strip()
        if given:
            return f"${PLUGIN_ENV} names no file: {given}"
        return "no CUDA PJRT plugin installed (jax-cuda12-pjrt or jax-cuda13-pjrt)"
    if ptxas_path() is None:
        return "no ptxas found (install nvidia-cuda-nvcc and nvidia-nvvm, or a CUDA toolkit)"
    return None
