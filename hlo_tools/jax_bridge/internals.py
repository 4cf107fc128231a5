"""The one module of the project that imports jax and jaxlib internals.

Everything the bridge needs from ``jax._src`` and ``xla_client`` goes through a small
function here, so that a jax upgrade touches this file alone. The jax versions these
internals were checked on are :data:`VERIFIED_VERSIONS`; importing the bridge under
another version warns once (:func:`check_versions`).

What differs between the verified versions is written down where the difference is
handled, one place per difference, named after the behaviour:

* XLA:CPU's ``small-while-loop-hoisting`` (jaxlib >= 0.12) turns a small ``while`` loop
  into a ``call`` run as one thunk (``xla_cpu_small_call="true"``), so a profile no
  longer shows the loop body's ops: exact mode disables it (``xla_passes.toml``).
* From jaxlib 0.12 on XLA:CPU wraps every op left outside a fusion in its own
  ``wrapped_*`` fusion after scheduling, whatever ``xla_disable_hlo_passes`` says (before,
  disabling ``fusion-wrapper`` left single ops bare). The bridge never disables it: a
  single op is a ``wrapped_*`` fusion on every version.
* From jaxlib 0.11 on XLA reads shardings as HloShardingV3 by default, and a module whose
  Shardy shardings are frontend attributes (the form HLO text carries them in: the text
  ``extract`` prints of a ``shard_map`` step) makes it log, per compile, that the module
  looks like a stale export before it switches V3 off for that module:
  :func:`frontend_sharding_options` switches it off up front.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jaxlib.version
import numpy as np
from jax._src import distributed as jax_distributed
from jax._src import sharding_impls as jax_sharding_impls
from jax._src import xla_bridge as jax_xla_bridge
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir

__all__ = [
    "JAX_VERSION",
    "JAXLIB_VERSION",
    "VERIFIED_VERSIONS",
    "backend",
    "check_versions",
    "compile_on_client",
    "computation",
    "computation_to_mlir",
    "coordination_client",
    "frontend_sharding_options",
    "gspmd_sharding",
    "hlo_module_from_text",
    "install_module",
    "is_c_api_client",
    "lowered_platform",
    "lowered_signature",
    "parse_mlir",
    "print_options",
    "version_tuple",
]

#: jax versions whose internals this module was checked on (jax and jaxlib alike):
#: the whole test suite passes on each (CPU).
VERIFIED_VERSIONS = frozenset({"0.10.2", "0.11.2", "0.12.0.1"})
JAX_VERSION: str = jax.__version__
JAXLIB_VERSION: str = jaxlib.version.__version__


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)`` (a suffix such as ``.dev`` ends the tuple)."""
    out = []
    for part in version.split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


_WARNED_VERSIONS = False


def check_versions(*, warn: bool = True) -> bool:
    """Whether jax and jaxlib are one of the :data:`VERIFIED_VERSIONS`.

    Args:
        warn: emit one ``RuntimeWarning`` per process when they are not.

    Returns:
        True when both versions are verified.
    """
    global _WARNED_VERSIONS
    found = {"jax": JAX_VERSION, "jaxlib": JAXLIB_VERSION}
    ok = all(v in VERIFIED_VERSIONS for v in found.values())
    if not ok and warn and not _WARNED_VERSIONS:
        _WARNED_VERSIONS = True
        warnings.warn(
            f"hlo_tools.jax_bridge was verified on jax/jaxlib "
            f"{', '.join(sorted(VERIFIED_VERSIONS, key=version_tuple))}, found {found}; "
            "the jax internals it uses may have changed.",
            RuntimeWarning,
            stacklevel=2,
        )
    return ok


# ------------------------------------------------------------------ HLO text and MLIR


def print_options(metadata: bool) -> Any:
    """XLA's print options for re-parsable text with every constant printed in full."""
    opts = xc.hlo.HloPrintOptions.short_parsable()
    opts.print_large_constants = True
    opts.print_metadata = metadata
    return opts


def hlo_module_from_text(hlo_text: str) -> Any:
    """XLA's ``HloModule`` of HLO text (XLA's own parser; raises on bad text)."""
    return xc.hlo.hlo_module_from_text(hlo_text)


def computation(hlo_module: Any) -> Any:
    """An ``XlaComputation`` of an XLA ``HloModule``."""
    return xc.XlaComputation(hlo_module.as_serialized_hlo_module_proto())


def computation_to_mlir(comp: Any) -> str:
    """MLIR text (StableHLO; a ``fusion`` stays ``mhlo.fusion``) of an ``XlaComputation``."""
    return xc._xla.mlir.xla_computation_to_mlir_module(comp)


def parse_mlir(mlir_text: str) -> ir.Module:
    """The MLIR module of ``mlir_text`` in a jax MLIR context (runs the verifier)."""
    with jax_mlir.make_ir_context():
        return ir.Module.parse(mlir_text)


#: Whether XLA has the ``xla_enable_hlo_sharding_v3`` debug option (jaxlib >= 0.11).
HAS_HLO_SHARDING_V3 = version_tuple(JAXLIB_VERSION) >= (0, 11)


def frontend_sharding_options(hlo_text: str) -> dict[str, Any]:
    """XLA options for compiling HLO text whose Shardy shardings are frontend attributes
    (``xla.sdy.*``, as printed text carries them): HloShardingV3 off where XLA has it,
    which XLA does itself for such a module after a warning per compile; ``{}`` for
    other text and older versions."""
    if HAS_HLO_SHARDING_V3 and "xla.sdy." in hlo_text:
        return {"xla_enable_hlo_sharding_v3": False}
    return {}


# ------------------------------------------------------------------ lowered programs


def lowered_platform(lowered: Any) -> str:
    """The jax platform a ``Lowered`` targets (``cpu``, ``cuda``, ...)."""
    platforms = getattr(lowered._lowering, "_platforms", None) or (jax.default_backend(),)
    return platforms[0]


def lowered_signature(lowered: Any) -> Any:
    """The entry program shape of a ``Lowered``'s module."""
    return lowered.compiler_ir("hlo").program_shape()


def install_module(lowered: Any, module: ir.Module) -> Any:
    """A copy of ``lowered`` whose module is ``module``.

    jax caches lowerings per function and signature, so the module goes into shallow
    copies of the ``Lowered`` and its lowering: writing into the cached object would make
    later ``jax.jit(fn)`` calls run it.

    Raises:
        TypeError: a lowering of a kind that holds no module to replace.
    """
    import copy

    if not hasattr(lowered._lowering, "_hlo"):
        raise TypeError(f"unsupported lowering type {type(lowered._lowering).__name__}")
    installed = copy.copy(lowered)
    installed._lowering = copy.copy(lowered._lowering)
    installed._lowering._hlo = module
    if hasattr(installed._lowering, "_executable"):
        installed._lowering._executable = None
    return installed


# ------------------------------------------------------------------ backends and devices


@functools.cache
def backends_initialized() -> bool:
    """Whether jax has started its backends (after which ``XLA_FLAGS`` no longer
    changes them, e.g. the host device count)."""
    return bool(jax_xla_bridge.backends_are_initialized())


def backend(platform: str) -> Any:
    """jax's client of a platform (``cpu``, ``cuda``, ...)."""
    return jax_xla_bridge.get_backend(platform)


def is_c_api_client(platform: str) -> bool:
    """Whether the platform's client is a PJRT C-API plugin (XLA:GPU is), which hands
    XLA portable StableHLO: a module with ``mhlo.fusion`` does not serialize to it."""
    version = getattr(backend(platform), "platform_version", "") or ""
    return "PJRT C API" in version


def compile_on_client(mlir_text: str, devices: Sequence[Any], *, replicas: int,
                      device_ids: Sequence[int] | None, options: dict[str, Any]) -> Any:
    """Compiles MLIR text on the devices' client as ``replicas`` replicas of one
    partition (``device_ids``: the assignment; default the first ``replicas`` ids),
    with ``options`` as XLA debug options. Returns the loaded executable."""
    compile_options = xc.CompileOptions()
    compile_options.num_replicas = replicas
    compile_options.num_partitions = 1
    ids = np.arange(replicas) if device_ids is None else np.array(list(device_ids))
    compile_options.device_assignment = xc.DeviceAssignment.create(ids.reshape(replicas, 1))
    compile_options.env_option_overrides = list(options.items())
    client = backend(devices[0].platform)
    return client.compile_and_load(mlir_text, xc.DeviceList(tuple(devices)), compile_options)


def gspmd_sharding(devices: Sequence[Any], hlo_sharding_text: str | None) -> Any:
    """A jax sharding over ``devices`` of an HLO sharding's text (replicated: None).

    Raises:
        ValueError: XLA does not read the text, or it is a tuple sharding.
    """
    try:
        hlo = (xc.HloSharding.from_string(hlo_sharding_text) if hlo_sharding_text
               else xc.HloSharding.replicate())
    except Exception as err:  # noqa: BLE001 - XLA's error type differs between versions
        raise ValueError(str(err)) from err
    if hlo.tuple_elements():
        raise ValueError("tuple shardings are not supported")
    return jax_sharding_impls.GSPMDSharding(tuple(devices), hlo)


# ------------------------------------------------------------------ multi-process jobs


def coordination_client() -> Any:
    """The ``jax.distributed`` coordination service client (None before initialize)."""
    return jax_distributed.global_state.client
