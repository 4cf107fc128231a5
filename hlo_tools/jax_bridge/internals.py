"""The one module of the project that imports jax and jaxlib internals.

Everything the bridge needs from ``jax._src`` and ``xla_client`` goes through a small
function here, so that a jax upgrade touches this file alone. The jax versions these
internals were checked on are :data:`VERIFIED_VERSIONS`; importing the bridge under
another version warns once (:func:`check_versions`). The supported range ends before
:data:`FIRST_UNSUPPORTED`, the first release known not to work.

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
* Serialized executables (:func:`split_serialized`) do not differ: jaxlib 0.10 and 0.12
  alike write jax's varint-length-prefixed ``SerializedXlaExecutableMetadata`` followed by
  the backend's bytes (XLA:CPU's bytes of either even load and run under the other). Only
  XLA's error on bytes it cannot read does: ``Failed to parse message of type
  xla.ExecutableAndOptionsProto`` from 0.12 on, ``proto deserialization failed`` before.
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
    "FIRST_UNSUPPORTED",
    "JAX_VERSION",
    "JAXLIB_VERSION",
    "VERIFIED_VERSIONS",
    "backend",
    "check_versions",
    "compile_on_client",
    "compile_options_proto",
    "computation",
    "computation_to_mlir",
    "coordination_client",
    "frontend_sharding_options",
    "gspmd_sharding",
    "hlo_module_from_text",
    "hlo_module_proto",
    "hlo_text_of_proto",
    "install_module",
    "is_c_api_client",
    "kept_arguments",
    "load_with_prefix",
    "lowered_compile_options_proto",
    "lowered_platform",
    "lowered_signature",
    "parse_compile_options",
    "parse_mlir",
    "print_options",
    "split_serialized",
    "version_tuple",
]

#: jax versions whose internals this module was checked on (jax and jaxlib alike):
#: the whole test suite passes on each (CPU).
VERIFIED_VERSIONS = frozenset({"0.10.2", "0.11.2", "0.12.0.1"})
#: The first jax release the bridge is known not to work on, where pyproject's range ends:
#: 0.12.1 turns ``jax_use_simplified_jaxpr_constants`` on, so closed-over constants become
#: parameters of the lowered program, and 2-process gloo jobs stop in it.
FIRST_UNSUPPORTED = "0.12.1"
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


def hlo_module_proto(hlo_text: str) -> bytes:
    """The serialized ``HloModuleProto`` of HLO text (the PJRT C API's ``hlo`` program
    format: XLA reads it as written, hand-written fusions included)."""
    return hlo_module_from_text(hlo_text).as_serialized_hlo_module_proto()


def hlo_text_of_proto(module_proto: bytes, *, metadata: bool = False) -> str:
    """HLO text of a serialized ``HloModuleProto`` (e.g. a PJRT executable's optimized
    program), printed with :func:`print_options`."""
    return xc.XlaComputation(module_proto).get_hlo_module().to_string(print_options(metadata))


def compile_options_proto(*, replicas: int, partitions: int, options: dict[str, Any]) -> bytes:
    """A serialized ``CompileOptionsProto``: ``replicas`` x ``partitions`` with ``options``
    as XLA debug options (``env_option_overrides``), for a PJRT C-API compile."""
    compile_options = xc.CompileOptions()
    compile_options.num_replicas = replicas
    compile_options.num_partitions = partitions
    compile_options.env_option_overrides = list(options.items())
    return compile_options.SerializeAsString()


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


def _replica_options(replicas: int, device_ids: Sequence[int] | None) -> Any:
    """Compile options of ``replicas`` replicas of one partition on ``device_ids``
    (default: the first ``replicas`` ids)."""
    compile_options = xc.CompileOptions()
    compile_options.num_replicas = replicas
    compile_options.num_partitions = 1
    ids = np.arange(replicas) if device_ids is None else np.array(list(device_ids))
    compile_options.device_assignment = xc.DeviceAssignment.create(ids.reshape(replicas, 1))
    return compile_options


def compile_on_client(mlir_text: str, devices: Sequence[Any], *, replicas: int,
                      device_ids: Sequence[int] | None, options: dict[str, Any]) -> Any:
    """Compiles MLIR text on the devices' client as ``replicas`` replicas of one
    partition (``device_ids``: the assignment; default the first ``replicas`` ids),
    with ``options`` as XLA debug options. Returns the loaded executable."""
    compile_options = _replica_options(replicas, device_ids)
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


# ------------------------------------------------------------------ serialized executables


def _unloaded_executable(compiled: Any) -> Any:
    """The ``UnloadedMeshExecutable`` behind a ``jax.stages.Compiled`` (what
    ``jax.experimental.serialize_executable.serialize`` pickles).

    Raises:
        ValueError: a compiled program jax cannot serialize (not of ``jax.jit``).
    """
    unloaded = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
    if unloaded is None:
        raise ValueError(f"{type(compiled).__name__} holds no serializable jax executable")
    return unloaded


def _varint(data: bytes) -> tuple[int, int]:
    """``(value, its length in bytes)`` of the protobuf varint that starts ``data``.

    Raises:
        ValueError: ``data`` ends inside the varint.
    """
    value = 0
    for k, byte in enumerate(data[:10]):
        value |= (byte & 0x7F) << (7 * k)
        if not byte & 0x80:
            return value, k + 1
    raise ValueError("truncated varint")


def split_serialized(compiled: Any) -> tuple[bytes, bytes]:
    """jax's serialized executable of a ``jax.stages.Compiled``, cut in two.

    ``client.serialize_executable`` (what ``jax.experimental.serialize_executable``
    pickles) writes a varint-length-prefixed ``SerializedXlaExecutableMetadata`` proto
    (donations, output shapes, shardings, layouts) followed by the backend's own
    executable bytes (the same on every verified version).

    Args:
        compiled: a ``jax.stages.Compiled`` of ``jax.jit``.

    Returns:
        ``(prefix, backend_bytes)``: the metadata with its varint length, and the rest.

    Raises:
        ValueError: jax cannot serialize ``compiled``, or the length overruns the bytes.
    """
    executable = _unloaded_executable(compiled).xla_executable
    if isinstance(executable, xc.LoadedExecutable):
        data = executable.client.serialize_executable(executable)
    else:
        data = executable.serialize()
    length, width = _varint(data)
    if width + length > len(data):
        raise ValueError(f"metadata of {length} bytes overruns the {len(data)} serialized")
    return data[:width + length], data[width + length:]


def load_with_prefix(compiled: Any, backend_bytes: bytes) -> Any:
    """A ``jax.stages.Compiled`` with ``compiled``'s calling convention (in/out trees,
    shardings, layouts, donated arguments as jax sees them) running ``backend_bytes``.

    jax's metadata prefix of ``compiled`` (:func:`split_serialized`) goes in front of the
    bytes, the client deserializes the whole onto ``compiled``'s devices, and the result
    is loaded as ``jax.experimental.serialize_executable.deserialize_and_load`` does:
    jax's C++ dispatch calls it.

    Args:
        compiled: the template, a ``jax.stages.Compiled`` of ``jax.jit``.
        backend_bytes: a serialized executable of ``compiled``'s backend, without jax's
            prefix (e.g. a PJRT plugin's ``PJRT_Executable_Serialize``).

    Raises:
        ValueError: jax cannot serialize ``compiled``.
        Exception: the backend rejects the bytes (XLA's error type, which differs between
            versions).
    """
    import dataclasses

    unloaded = _unloaded_executable(compiled)
    prefix, _ = split_serialized(compiled)
    executable = unloaded.backend.deserialize_executable(
        prefix + bytes(backend_bytes), executable_devices=unloaded.device_list)
    loaded = dataclasses.replace(unloaded, xla_executable=executable).load()
    return jax.stages.Compiled(loaded, compiled._params.const_args, compiled.args_info,
                               compiled.out_tree, no_kwargs=compiled._no_kwargs)


def kept_arguments(compiled: Any) -> tuple[int, ...]:
    """The flat arguments of a ``jax.stages.Compiled`` that are entry parameters of its
    program, in parameter order (jax drops unused ones unless ``keep_unused=True``)."""
    return tuple(sorted(_unloaded_executable(compiled).kept_var_idx))


def lowered_compile_options_proto(lowered: Any, xla_options: dict[str, Any]) -> bytes:
    """The serialized ``CompileOptionsProto`` jax itself would compile ``lowered`` with.

    ``jax._src.compiler.get_compile_options`` with the lowering's device assignment (one
    replica, one partition per device; SPMD partitioning on), ``xla_options`` over the
    ``jax.jit(..., compiler_options=)`` ones as XLA debug options
    (``env_option_overrides``), tupled arguments and sharding propagation as jax sets
    them: the options of a side compile (e.g. through a PJRT plugin) whose executable
    goes under ``lowered``'s calling convention (:func:`load_with_prefix`).

    Raises:
        TypeError: a lowering of a kind without a device assignment (not of ``jax.jit``).
    """
    from jax._src import compiler as jax_compiler
    from jax._src.interpreters import pxla

    lowering = lowered._lowering
    device_list = getattr(lowering, "_device_list", None)
    args = getattr(lowering, "compile_args", None)
    if device_list is None or args is None:
        raise TypeError(f"unsupported lowering type {type(lowering).__name__}")
    ids = np.array([d.id for d in device_list]).reshape(1, len(device_list))
    options = {**dict(getattr(lowering, "_compiler_options_kvs", ())), **xla_options}
    compile_options = jax_compiler.get_compile_options(
        num_replicas=1, num_partitions=ids.size, device_assignment=ids,
        env_options_overrides=options, backend=args.get("backend"))
    compile_options.parameter_is_tupled_arguments = bool(args.get("tuple_args", False))
    to_inputs, to_outputs = pxla.get_prop_to_input_output(
        args["in_shardings"], args["out_shardings"], len(args.get("ordered_effects", ())))
    build = compile_options.executable_build_options
    build.use_spmd_partitioning = True
    build.allow_spmd_sharding_propagation_to_parameters = list(to_inputs)
    build.allow_spmd_sharding_propagation_to_output = list(to_outputs)
    return compile_options.SerializeAsString()


def parse_compile_options(proto: bytes) -> Any:
    """The ``xla_client.CompileOptions`` of a serialized ``CompileOptionsProto``."""
    return xc.CompileOptions.ParseFromString(proto)


# ------------------------------------------------------- executables shared in a job


def serialize_compiled(compiled: Any) -> bytes:
    """A ``jax.stages.Compiled`` of ``jax.jit`` as bytes that another process of the job
    loads (:func:`load_compiled`), through ``jax.experimental.serialize_executable``.

    Raises:
        ValueError, NotImplementedError: jax cannot serialize it (e.g. a program with
            hoisted constants).
    """
    from jax.experimental import serialize_executable

    return serialize_executable.serialize(compiled)[0]


def load_compiled(data: bytes, lowered: Any) -> Any:
    """The ``jax.stages.Compiled`` of :func:`serialize_compiled`'s ``data``, loaded on
    the devices of ``lowered`` (the same program lowered in this process, whose pytrees
    it takes)."""
    from jax.experimental import serialize_executable

    return serialize_executable.deserialize_and_load(
        data, lowered.in_tree, lowered.out_tree, backend=lowered_platform(lowered))


def serialize_loaded(executable: Any) -> bytes:
    """A loaded executable of :func:`compile_on_client` as bytes
    (:func:`load_on_client` loads them)."""
    return executable.client.serialize_executable(executable)


def load_on_client(data: bytes, devices: Sequence[Any], *, replicas: int,
                   device_ids: Sequence[int] | None) -> Any:
    """:func:`serialize_loaded`'s executable loaded on ``devices`` as
    :func:`compile_on_client` would have compiled it there (the same assignment)."""
    client = backend(devices[0].platform)
    return client.deserialize_executable(data, xc.DeviceList(tuple(devices)),
                                         _replica_options(replicas, device_ids))
