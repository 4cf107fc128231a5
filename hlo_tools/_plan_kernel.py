"""Builds and loads the C kernel of the plan moves (``_plan_kernel.c``, a CPython extension).

The kernel is compiled with the system C compiler on first use into a cache directory
(``$DISCO_CACHE_DIR`` or ``$XDG_CACHE_HOME/disco_jax``, default ``~/.cache/disco_jax``), as
the simulator's kernel is, and loaded as an extension module. :mod:`hlo_tools.plan` uses it
when it loads and otherwise runs its pure-Python code, which makes the same decisions and
random draws (its tests run both). ``DISCO_PLAN_BACKEND=python`` selects the pure-Python
code; ``auto`` (the default) uses the kernel when it can be built. A kernel is not built
without the Python headers (``Python.h``) or a compiler; it then warns once.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("_plan_kernel.c")
#: The extension's module name (its init function is ``PyInit__plan_kernel_ext``).
NAME = "_plan_kernel_ext"
_CFLAGS = ("-O2", "-shared", "-fPIC", "-fno-strict-aliasing")

_module: ModuleType | None = None
_tried = False
_lock = threading.Lock()


def _cache_dir() -> Path:
    """``$DISCO_CACHE_DIR``, or ``disco_jax`` in the user's cache directory."""
    if os.environ.get("DISCO_CACHE_DIR"):
        return Path(os.environ["DISCO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disco_jax"


def _compile(cc: str, source: str, include: str, out: Path) -> None:
    """Compiles ``source`` into the extension ``out``, atomically (build + rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "plan_kernel.c"
        src.write_text(source)
        lib = Path(tmp) / out.name
        subprocess.run([cc, *_CFLAGS, f"-I{include}", "-o", str(lib), str(src)], check=True,
                       capture_output=True, timeout=120)
        os.replace(lib, out)


def build() -> Path:
    """Compiles the kernel into the cache directory unless it is already there (into a
    fresh private temporary directory if the cache is not writable); its path.

    Raises:
        OSError | subprocess.SubprocessError: no source, compiler or headers, or a failed
            compile.
    """
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError("no C compiler (cc) found")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"no Python.h in {include}")
    source = SOURCE.read_text()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    tag = "\0".join([source, cc, *_CFLAGS, include, sys.version, platform.machine()]).encode()
    name = f"plankernel-{hashlib.sha256(tag).hexdigest()[:16]}{suffix}"
    out = _cache_dir() / name
    if out.exists():
        return out
    try:
        _compile(cc, source, include, out)
    except PermissionError:
        out = Path(tempfile.mkdtemp(prefix="disco_jax-")) / name
        _compile(cc, source, include, out)
    return out


def _import(path: Path) -> ModuleType:
    """Loads the extension at ``path``."""
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The kernel module (built on first call), or None for the pure-Python code: when
    ``DISCO_PLAN_BACKEND=python``, or, with one warning, when it cannot be built."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if os.environ.get("DISCO_PLAN_BACKEND", "auto") != "python":
            try:
                _module = _import(build())
            except (OSError, ImportError, subprocess.SubprocessError) as err:
                warnings.warn(f"hlo_tools.plan: C kernel unavailable ({err}); using the "
                              "slower pure-Python moves", RuntimeWarning, stacklevel=3)
        _tried = True
    return _module
