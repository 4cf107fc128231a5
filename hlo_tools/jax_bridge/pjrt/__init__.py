"""XLA:GPU through its PJRT C-API plugin: compile HLO text as written, with or without a GPU.

jax's own GPU client hands XLA portable StableHLO, which cannot carry a hand-written
``fusion``; the plugin's C API takes the module itself (program format ``hlo``). Its CUDA
plugin also compiles without a GPU, for a described one, which lets CI check that a GPU
plan compiles and keeps its fusions. Modules by job:

* :mod:`~hlo_tools.jax_bridge.pjrt.capi` -- the ctypes binding of the C API (no jax);
* :mod:`~hlo_tools.jax_bridge.pjrt.locate` -- the installed plugin and CUDA tools;
* :mod:`~hlo_tools.jax_bridge.pjrt.target` -- the described GPU (an H100 by default);
* :mod:`~hlo_tools.jax_bridge.pjrt.driver` -- compiles, each in a child process
  (:mod:`~hlo_tools.jax_bridge.pjrt.child`), since XLA aborts on some illegal modules.

Typical use::

    if pjrt.unavailable_reason() is None:
        out = pjrt.compile_deviceless(text, {"xla_disable_hlo_passes": "priority-fusion"})
        print(out.optimized_text)
"""

from __future__ import annotations

from hlo_tools.jax_bridge.pjrt.capi import PjrtError
from hlo_tools.jax_bridge.pjrt.driver import (
    CLIENT_OPTIONS,
    DevicelessCompile,
    compile_deviceless,
    compile_options,
    compile_serialized,
)
from hlo_tools.jax_bridge.pjrt.locate import (
    cuda_data_dir,
    plugin_path,
    ptxas_path,
    unavailable_reason,
)
from hlo_tools.jax_bridge.pjrt.target import TARGET_CONFIG_ENV, h100_target_config, target_config

__all__ = [
    "CLIENT_OPTIONS",
    "TARGET_CONFIG_ENV",
    "DevicelessCompile",
    "PjrtError",
    "compile_deviceless",
    "compile_options",
    "compile_serialized",
    "cuda_data_dir",
    "h100_target_config",
    "plugin_path",
    "ptxas_path",
    "target_config",
    "unavailable_reason",
]
