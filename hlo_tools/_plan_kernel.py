"""Builds and loads the C kernel of the plan moves (``_plan_kernel.c``, a CPython extension).

The kernel is compiled with the system C compiler on first use into a cache directory
(:func:`hlo_tools.dirs.cache_dir`), as
the parser's kernel is (both by :mod:`hlo_tools.native`), and loaded as an extension module.
:mod:`hlo_tools.plan` uses it when it loads and otherwise runs its pure-Python code, which
makes the same decisions and random draws (its tests run both). ``DISCO_PLAN_BACKEND=python``
selects the pure-Python code; ``auto`` (the default) uses the kernel when it can be built. A
kernel is not built without the Python headers (``Python.h``) or a compiler; it then warns
once.
"""

from __future__ import annotations

from pathlib import Path

from hlo_tools import native

SOURCE = Path(__file__).with_name("_plan_kernel.c")
#: The extension's module name (its init function is ``PyInit__plan_kernel_ext``).
NAME = "_plan_kernel_ext"

#: The kernel and its state (``KERNEL.module``, ``KERNEL.tried``).
KERNEL = native.Kernel(SOURCE, NAME, "plankernel", owner="hlo_tools.plan", fallback="moves",
                      backend_var="DISCO_PLAN_BACKEND")
#: Compiles the kernel into the cache directory unless it is there already; its path.
build = KERNEL.build
#: The kernel module (built on first call), or None for the pure-Python moves.
load = KERNEL.load
