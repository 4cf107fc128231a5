"""Builds and loads the optional C kernels (the one builder of the project).

Two kinds of kernel, both compiled with the system C compiler (``$CC``, default ``cc``)
on first use into the cache directory (:func:`hlo_tools.dirs.cache_dir`) under a name
keyed by a hash of the source, the compiler and its flags (and, for extensions, the
Python headers and version) and the machine:

* CPython extensions (:class:`Kernel`, :func:`build`): the parser's and the plan moves'
  kernels, imported as modules;
* plain shared libraries (:class:`SharedLibrary`): the simulator's kernel, loaded with
  ``ctypes``.

A kernel is not built without a compiler (or, for an extension, the Python headers);
the code that would use it then runs its pure-Python equivalent, after one warning.
:func:`choose` turns a backend choice (``auto | c | python``) into a kernel or None.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from hlo_tools.dirs import cache_dir

CFLAGS = ("-O2", "-shared", "-fPIC", "-fno-strict-aliasing",
          *(("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()))


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


def _compile(cc: str, flags: Sequence[str], source: str, out: Path) -> None:
    """Compiles the C text ``source`` into ``out``, atomically (build, rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source)
        lib = Path(tmp) / out.name
        subprocess.run([cc, *flags, "-o", str(lib), str(src)], check=True,
                       capture_output=True, timeout=120)
        os.replace(lib, out)


def _cached_build(cc: str, flags: Sequence[str], source: str, name: str) -> Path:
    """``name`` in the cache directory, compiled there first unless it is there already
    (into a fresh private temporary directory if the cache is not writable)."""
    out = cache_dir() / name
    if out.exists():
        return out
    try:
        _compile(cc, flags, source, out)
    except PermissionError:
        out = Path(tempfile.mkdtemp(prefix="disco_jax-")) / name
        _compile(cc, flags, source, out)
    return out


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
    return _cached_build(cc, (*CFLAGS, f"-I{include}"), text, name)


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


class SharedLibrary:
    """A C kernel built as a plain shared library and loaded with ``ctypes`` by the first
    :meth:`load` (once, thread-safe); None, with one warning, when it cannot be built.

    Args:
        source: the C text.
        prefix: how the built file's name starts (a hash and ``.so`` follow).
        cflags: compiler flags (``-shared -fPIC`` among them).
        setup: called with the loaded ``ctypes.CDLL`` to declare argument types.
        owner, fallback: for the warning, as in :class:`Kernel`.
    """

    def __init__(self, source: str, prefix: str, cflags: tuple[str, ...], *,
                 setup: Callable[[Any], None], owner: str, fallback: str,
                 stacklevel: int = 3) -> None:
        self.source, self.prefix, self.cflags = source, prefix, cflags
        self.setup, self.owner, self.fallback = setup, owner, fallback
        self.stacklevel = stacklevel
        self.library: Any = None
        self.tried = False
        self._lock = threading.Lock()

    def build(self) -> Path:
        """Compiles the library into the cache directory unless it is there already (into
        a fresh private temporary directory if the cache is not writable); its path.

        Raises:
            OSError | subprocess.SubprocessError: no compiler, or a failed compile.
        """
        cc = shutil.which(os.environ.get("CC", "cc"))
        if cc is None:
            raise OSError("no C compiler (cc) found")
        tag = "\0".join([self.source, cc, *self.cflags, platform.machine()]).encode()
        name = f"{self.prefix}-{hashlib.sha256(tag).hexdigest()[:16]}.so"
        return _cached_build(cc, self.cflags, self.source, name)

    def load(self) -> Any:
        """The loaded library (built on first call), or None after one warning."""
        if self.tried:
            return self.library
        with self._lock:
            if self.tried:
                return self.library
            try:
                import ctypes

                lib = ctypes.CDLL(str(self.build()))
                self.setup(lib)
                self.library = lib
            except (OSError, subprocess.SubprocessError) as err:
                warnings.warn(f"{self.owner}: C kernel unavailable ({err}); using the "
                              f"slower pure-Python {self.fallback}", RuntimeWarning,
                              stacklevel=self.stacklevel)
            self.tried = True
        return self.library
