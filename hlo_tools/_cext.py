"""Builds and loads the optional C kernels of :mod:`hlo_tools` (CPython extensions).

A kernel's C source (a ``.c`` file shipped with the package) is compiled with the system
C compiler (``$CC``, default ``cc``) on first use into a cache directory
(``$DISCO_CACHE_DIR``, or ``disco_jax`` in ``$XDG_CACHE_HOME``, default ``~/.cache``),
under a name keyed by a hash of the source, the compiler, its flags, the Python headers,
the Python version and the machine, and is imported from there. A kernel is not built
without a compiler or the Python headers (``Python.h``); the code that would use it then
runs its pure-Python equivalent, after one warning.
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
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

CFLAGS = ("-O2", "-shared", "-fPIC", "-fno-strict-aliasing",
          *(("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()))


def cache_dir() -> Path:
    """``$DISCO_CACHE_DIR``, or ``disco_jax`` in the user's cache directory."""
    if os.environ.get("DISCO_CACHE_DIR"):
        return Path(os.environ["DISCO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disco_jax"


def _toolchain() -> tuple[str, str]:
    """The C compiler's path and the directory of the Python headers.

    Raises:
        OSError: no compiler, or no ``Python.h``.
    """
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError("no C compiler (cc) found")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"no Python.h in {include}")
    return cc, include


def _compile(cc: str, include: str, source: str, out: Path) -> None:
    """Compiles the C text ``source`` into the extension ``out``, atomically (build, rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        lib = Path(tmp) / out.name
        subprocess.run([cc, *CFLAGS, f"-I{include}", "-o", str(lib), str(src)], check=True,
                       capture_output=True, timeout=120)
        os.replace(lib, out)


def build(source: Path, prefix: str) -> Path:
    """Compiles ``source`` into the cache directory unless it is there already (into a
    fresh private temporary directory if the cache is not writable).

    Args:
        source: the C file.
        prefix: how the built file's name starts (a hash and the extension suffix follow).

    Returns:
        The built extension's path.

    Raises:
        OSError | subprocess.SubprocessError: no source, compiler or headers, or a failed
            compile.
    """
    cc, include = _toolchain()
    text = source.read_text()
    tag = "\0".join([text, cc, *CFLAGS, include, sys.version, platform.machine()]).encode()
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    name = f"{prefix}-{hashlib.sha256(tag).hexdigest()[:16]}{suffix}"
    out = cache_dir() / name
    if out.exists():
        return out
    try:
        _compile(cc, include, text, out)
    except PermissionError:
        out = Path(tempfile.mkdtemp(prefix="disco_jax-")) / name
        _compile(cc, include, text, out)
    return out


def _import(name: str, path: Path) -> ModuleType:
    """Loads the extension module ``name`` (init function ``PyInit_<name>``) from ``path``."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def choose(choice: str, what: str, load: Callable[[], Any]) -> Any:
    """The kernel a backend choice selects: ``"python"`` None, ``"auto"`` whatever ``load``
    gives (None without a kernel), ``"c"`` the kernel or an error.

    Args:
        choice: ``"auto"``, ``"c"`` or ``"python"``.
        what: whose backend, for the messages (``"parser"``, ``"simulator"``).
        load: returns the kernel, or None when it cannot be had.

    Raises:
        ValueError: another ``choice``.
        RuntimeError: ``"c"`` without a kernel.
    """
    if choice == "python":
        return None
    if choice not in ("auto", "c"):
        raise ValueError(f"unknown {what} backend {choice!r} (auto | c | python)")
    kernel = load()
    if kernel is None and choice == "c":
        raise RuntimeError(f"{what} backend 'c' requested but the C kernel is unavailable")
    return kernel


class Kernel:
    """One C kernel, built and imported by the first :meth:`load` (once, thread-safe).

    Attributes:
        module: the kernel module once loaded; None before, or when it is off or cannot
            be built.
        tried: whether :meth:`load` has run (later calls return ``module`` at once).
    """

    def __init__(self, source: Path, name: str, prefix: str, *, owner: str, fallback: str,
                 backend_var: str | None = None, stacklevel: int = 3) -> None:
        """Describes a kernel; builds nothing yet.

        Args:
            source: its C file.
            name: its module name (its init function is ``PyInit_<name>``).
            prefix: how its built file's name starts.
            owner: who uses it, for the warning (``"<owner>: C kernel unavailable ..."``).
            fallback: what runs without it, for the warning
                (``"... using the slower pure-Python <fallback>"``).
            backend_var: an environment variable that turns the kernel off when it is
                ``python``; None when the caller selects the backend itself.
            stacklevel: the warning's ``stacklevel``, as if warned in :meth:`load`.
        """
        self.source, self.name, self.prefix = source, name, prefix
        self.owner, self.fallback = owner, fallback
        self.backend_var, self.stacklevel = backend_var, stacklevel
        self.module: ModuleType | None = None
        self.tried = False
        self._lock = threading.Lock()

    def build(self) -> Path:
        """Builds the kernel (see :func:`build`); its path."""
        return build(self.source, self.prefix)

    def _off(self) -> bool:
        """Whether ``backend_var`` selects the pure-Python code."""
        return self.backend_var is not None and os.environ.get(self.backend_var) == "python"

    def load(self) -> ModuleType | None:
        """The kernel module (built on first call), or None for the pure-Python code: when
        ``backend_var`` is ``python``, or, with one warning, when it cannot be built."""
        if self.tried:
            return self.module
        with self._lock:
            if self.tried:
                return self.module
            if not self._off():
                try:
                    self.module = _import(self.name, self.build())
                except (OSError, ImportError, subprocess.SubprocessError) as err:
                    warnings.warn(f"{self.owner}: C kernel unavailable ({err}); using the "
                                  f"slower pure-Python {self.fallback}", RuntimeWarning,
                                  stacklevel=self.stacklevel)
            self.tried = True
        return self.module
