"""Compiling HLO text: in place of a jax function's lowering, or from the text alone.

Four ways in, one pass configuration (:mod:`hlo_tools.jax_bridge.passes`):

* :func:`compile_hlo`: text with a jax function's entry signature, compiled in place of
  its lowering; the result takes the function's pytrees.
* :func:`compile_text`: a whole-program module given only as text, with inputs made from
  its entry parameters.
* :func:`compile_standalone`: a single-device module (one op, one fusion) for timing.
* :func:`compile_per_device`: a module without collectives run on several devices, each
  on its own inputs (a stage of a staged step).

With ``exact=True`` the XLA passes that create fusions or combine collectives are
disabled, so the compiled program keeps the fusions and AllReduces of the text. On
XLA:CPU every op left outside a fusion is still wrapped in its own single-op
``wrapped_*`` fusion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np

from hlo_tools.jax_bridge import internals
from hlo_tools.jax_bridge.devices import local_devices_for
from hlo_tools.jax_bridge.errors import HloCompileError
from hlo_tools.jax_bridge.extract import jitted
from hlo_tools.jax_bridge.passes import (
    compile_mode_options,
    exact_compiler_options,
    merged_options,
)
from hlo_tools.jax_bridge.text import computation, mlir_module, module_name, to_mlir

__all__ = [
    "CompiledHlo",
    "CompiledText",
    "PerDeviceHlo",
    "StandaloneHlo",
    "compile_hlo",
    "compile_per_device",
    "compile_standalone",
    "compile_text",
    "compiled_text",
]


@dataclass(frozen=True)
class CompiledHlo:
    """A compiled program: call it with the same pytrees as the original function.

    Attributes:
        compiled: The ``jax.stages.Compiled``; ``compiled.as_text()`` is the optimized HLO.
        hlo_text: The HLO text that was compiled (None: jax's own lowering).
        compiler_options: Options passed to XLA.
    """

    compiled: jax.stages.Compiled
    hlo_text: str | None
    compiler_options: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def as_text(self) -> str:
        """Post-optimization HLO text of what XLA compiled."""
        return self.compiled.as_text()


def _shape_strings(program_shape: Any) -> tuple[list[str], str]:
    """Parameter and result shapes (with layouts) as comparable strings."""
    return [str(s) for s in program_shape.parameter_shapes()], str(program_shape.result_shape())


def _install(lowered: jax.stages.Lowered, hlo_text: str) -> jax.stages.Lowered:
    """A copy of ``lowered`` whose module is ``hlo_text`` (signature checked, as MLIR)."""
    comp = computation(hlo_text)
    want = _shape_strings(internals.lowered_signature(lowered))
    got = _shape_strings(comp.program_shape())
    if got != want:
        raise HloCompileError(
            f"entry signature of the HLO text {got} differs from the lowered program {want}"
        )
    try:
        return internals.install_module(lowered, mlir_module(comp))
    except TypeError as err:
        raise HloCompileError(str(err)) from err


def _compile(lowered: jax.stages.Lowered, options: dict[str, Any],
             hlo_text: str | None) -> jax.stages.Compiled:
    """``lowered.compile`` with XLA errors turned into ``HloCompileError`` (and the
    version's options for the text's form of shardings,
    :func:`~hlo_tools.jax_bridge.internals.frontend_sharding_options`)."""
    options = {**options, **internals.frontend_sharding_options(hlo_text or "")}
    try:
        return lowered.compile(compiler_options=options or None)
    except Exception as err:
        raise HloCompileError(f"XLA failed to compile the HLO: {err}") from err


def compile_hlo(
    fn: Callable[..., Any],
    args: Sequence[Any],
    hlo_text: str | None,
    *,
    exact: bool = True,
    kwargs: Mapping[str, Any] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    library: bool = False,
) -> CompiledHlo:
    """Compiles ``hlo_text`` in place of ``fn``'s own lowering.

    Args:
        fn: Function (plain or jit-wrapped) whose calling convention the program keeps.
        args: Positional arguments to lower ``fn`` on (arrays or ``ShapeDtypeStruct``).
        hlo_text: HLO text with the same entry signature as ``fn``'s lowering; None compiles
            jax's own lowering (useful with ``exact=False`` for XLA's default plan).
        exact: Disable XLA's fusion and collective-combining passes for this backend
            (``xla_passes.toml``) so fusions and AllReduces stay as written.
        kwargs: Keyword arguments to lower ``fn`` on.
        compiler_options: Extra XLA options. Their ``xla_disable_hlo_passes`` is added to
            the exact-mode list; other keys override it.
        library: with ``exact``, run dots and convolutions on XLA's kernel library
            (YNNPACK on CPU) as its default pipeline does, each alone in a ``kind=kCustom``
            fusion (:func:`~hlo_tools.jax_bridge.passes.plan_library_options`); the
            text's fusions and all-reduces stay as written. Ignored without ``exact``.

    Returns:
        A ``CompiledHlo`` taking the same pytrees as ``fn`` and returning its output pytree.

    Raises:
        HloCompileError: XLA rejected the text, its signature differs from ``fn``'s, or
            compilation failed; the message includes XLA's.

    Warning:
        Limits of XLA:CPU (docs/xla_cpu_passes.md): a ``kind=kOutput`` fusion containing
        a dot aborts the whole process (C++ CHECK failure, not catchable; use
        ``kind=kLoop``), and a multi-operand (tuple) all-reduce inside a shard_map body is
        rejected (combine gradients through one flat concatenated buffer instead). jax
        drops unused arguments from the entry signature unless
        ``jax.jit(..., keep_unused=True)``. XLA:GPU compiles no hand-written ``fusion``
        (docs: the GPU route).
    """
    lowered = jitted(fn).lower(*args, **(kwargs or {}))
    if hlo_text is not None:
        lowered = _install(lowered, hlo_text)
    options = compile_mode_options(internals.lowered_platform(lowered), exact=exact,
                                   library=library, extra=compiler_options)
    return CompiledHlo(_compile(lowered, options, hlo_text), hlo_text, options)


def compiled_text(
    fn: Callable[..., Any],
    args: Sequence[Any],
    hlo_text: str | None = None,
    *,
    exact: bool = True,
    kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Post-optimization HLO of ``hlo_text`` (or of ``fn``'s own lowering when None)."""
    return compile_hlo(fn, args, hlo_text, exact=exact, kwargs=kwargs).as_text()


# ----------------------------------------------------------------- standalone modules


def _replicated_sharding(devices: Sequence[Any]) -> Any:
    mesh = jax.sharding.Mesh(np.array(list(devices)), ("replica",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _leaf_shapes(shape: Any) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """``(dims, dtype)`` of the array leaves of an ``xla_client.Shape``."""
    if shape.is_tuple():
        return tuple(leaf for s in shape.tuple_shapes() for leaf in _leaf_shapes(s))
    return ((tuple(shape.dimensions()), np.dtype(shape.numpy_dtype())),)


def _load(hlo_text: str, devices: Sequence[Any], *, exact: bool, library: bool,
          extra: Mapping[str, Any] | None, device_ids: Sequence[int] | None
          ) -> tuple[Any, Any, dict[str, Any]]:
    """Compiles a module without a jax function, one replica per device: ``(loaded
    executable, program shape, options)``."""
    platform = devices[0].platform
    comp = computation(hlo_text)
    mlir_text = to_mlir(comp)
    options = merged_options(
        exact_compiler_options(platform, library=library) if exact else {}, extra)
    given = {**options, **internals.frontend_sharding_options(hlo_text)}
    try:
        executable = internals.compile_on_client(mlir_text, devices, replicas=len(devices),
                                                 device_ids=device_ids, options=given)
    except Exception as err:
        raise HloCompileError(f"XLA failed to compile the HLO: {err}") from err
    return executable, comp.program_shape(), options


@dataclass(frozen=True)
class StandaloneHlo:
    """A single-device HLO module compiled on its own, outside any jax function.

    Calling it runs the module once on replica 0's inputs and returns numpy arrays. For
    timing, :meth:`put` places inputs once and :meth:`run` executes without transfers.
    With ``replicas > 1`` the same program runs on that many local devices at once
    (every replica gets the same inputs), which reproduces the contention of a
    data-parallel program whose devices share the host's cores.

    Attributes:
        executable: the loaded XLA executable.
        devices: the devices of the replicas, in replica order.
        module_name: the HLO module name (the ``hlo_module`` of profiler events).
        param_shapes: ``(dims, numpy dtype)`` of each entry parameter, in order.
        result_shapes: ``(dims, numpy dtype)`` of each result leaf.
        result_is_tuple: whether the entry result is a tuple.
        hlo_text: the HLO text that was compiled.
        compiler_options: the XLA options used.
    """

    executable: Any
    devices: tuple[Any, ...]
    module_name: str
    param_shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]
    result_shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]
    result_is_tuple: bool
    hlo_text: str
    compiler_options: Mapping[str, Any] = field(default_factory=dict)

    def put(self, *arrays: Any) -> list[Any]:
        """Places host arrays on every replica device (one jax array per parameter).

        Raises:
            ValueError: wrong number of arrays, or a shape/dtype that differs from the
                module's parameter.
        """
        if len(arrays) != len(self.param_shapes):
            raise ValueError(f"{self.module_name} takes {len(self.param_shapes)} arguments, "
                             f"got {len(arrays)}")
        sharding = _replicated_sharding(self.devices)
        placed = []
        for k, (arr, (dims, dtype)) in enumerate(zip(arrays, self.param_shapes)):
            host = np.asarray(arr)
            if host.shape != dims or host.dtype != dtype:
                raise ValueError(f"argument {k} of {self.module_name}: expected {dtype}{list(dims)}"
                                 f", got {host.dtype}{list(host.shape)}")
            with jax.enable_x64(True):  # keep 64-bit inputs 64-bit (the module expects them)
                placed.append(jax.device_put(host, sharding))
        return placed

    def run(self, placed: Sequence[Any]) -> list[list[Any]]:
        """Executes once on placed inputs and waits; returns ``[leaf][replica]`` arrays."""
        results = self.executable.execute_sharded(list(placed))
        leaves = results.disassemble_into_single_device_arrays()
        jax.block_until_ready(leaves)
        return leaves

    def __call__(self, *arrays: Any) -> tuple[np.ndarray, ...]:
        """Runs the module on host arrays (parameter order); one numpy array per result
        leaf (a non-tuple result gives a 1-tuple), taken from replica 0."""
        leaves = self.run(self.put(*arrays))
        return tuple(np.asarray(per_replica[0]) for per_replica in leaves)

    def as_text(self) -> str:
        """Post-optimization HLO text of what XLA compiled."""
        return self.executable.hlo_modules()[0].to_string()


def compile_standalone(
    hlo_text: str,
    *,
    exact: bool = True,
    replicas: int = 1,
    platform: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    library: bool = False,
) -> StandaloneHlo:
    """Compiles a single-device HLO module on its own (no jax function needed).

    The text goes HLO -> XLA's parser -> MLIR (as in
    :func:`~hlo_tools.jax_bridge.text.hlo_text_to_mlir`) and is compiled by the backend
    client directly, so any module can be built: one op with parameters for its operands
    (per-op timing), or a module holding one hand-written ``fusion`` (fused-op samples for
    the estimator).

    Args:
        hlo_text: HLO text of a module without cross-device collectives.
        exact: disable XLA's fusion passes (``xla_passes.toml``), so a hand-written
            fusion stays as written and single ops stay unfused.
        replicas: run the program on this many local devices at once (each replica
            gets the same inputs); 1 for a plain single-device run.
        platform: jax platform (default: ``jax.default_backend()``).
        compiler_options: extra XLA options (``xla_disable_hlo_passes`` is appended).
        library: with ``exact``, still let XLA hand single ops to its kernel library
            (``library_passes`` of the pass config), as its default pipeline does.

    Returns:
        A :class:`StandaloneHlo`: ``run(*numpy_arrays) -> tuple of numpy arrays``.

    Raises:
        HloCompileError: XLA rejects the text or fails to compile it, or the backend has
            fewer than ``replicas`` devices.
    """
    platform = platform or jax.default_backend()
    local = internals.backend(platform).local_devices()
    devices = tuple(local[:replicas])
    if replicas < 1 or len(devices) < replicas:
        raise HloCompileError(f"{replicas} replicas requested, {platform} has "
                              f"{len(local)} local devices")
    executable, program_shape, options = _load(hlo_text, devices, exact=exact,
                                               library=library, extra=compiler_options,
                                               device_ids=None)
    result = program_shape.result_shape()
    return StandaloneHlo(
        executable=executable,
        devices=devices,
        module_name=module_name(hlo_text),
        param_shapes=tuple(s for p in program_shape.parameter_shapes() for s in _leaf_shapes(p)),
        result_shapes=_leaf_shapes(result),
        result_is_tuple=bool(result.is_tuple()),
        hlo_text=hlo_text,
        compiler_options=options,
    )


@dataclass(frozen=True)
class PerDeviceHlo:
    """A per-device HLO module (no collectives) compiled once for several local devices,
    each running it on its own inputs (:func:`compile_per_device`).

    The program is compiled with one replica per device, as ``pmap`` compiles; a call
    hands each replica its own device's buffers. Calls do not wait: the results are
    jax arrays whose values XLA computes asynchronously, like a jitted call's.

    Attributes:
        executable: the loaded XLA executable.
        devices: the devices of the replicas, in replica order (all local).
        param_shapes: ``(dims, numpy dtype)`` of each entry parameter, in order.
        result_shapes: ``(dims, numpy dtype)`` of each result leaf.
        hlo_text: the HLO text that was compiled.
        compiler_options: the XLA options used.
    """

    executable: Any
    devices: tuple[Any, ...]
    param_shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]
    result_shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]
    hlo_text: str
    compiler_options: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, inputs: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """Runs every replica on its own device's inputs, without waiting.

        Args:
            inputs: ``inputs[param][replica]``: one single-device jax array per entry
                parameter and device, on ``devices[replica]``.

        Returns:
            ``[leaf][replica]`` single-device jax arrays (one leaf for a non-tuple result).

        Raises:
            ValueError: wrong number of parameters or devices, or a shape/dtype that
                differs from the module's parameter.
        """
        if len(inputs) != len(self.param_shapes):
            raise ValueError(f"the module takes {len(self.param_shapes)} parameters, got "
                             f"{len(inputs)}")
        sharding = _replicated_sharding(self.devices) if len(self.devices) > 1 else None
        args = []
        for k, (per_device, (dims, dtype)) in enumerate(zip(inputs, self.param_shapes)):
            if len(per_device) != len(self.devices):
                raise ValueError(f"parameter {k}: {len(per_device)} arrays for "
                                 f"{len(self.devices)} devices")
            for arr in per_device:
                if tuple(arr.shape) != dims or np.dtype(arr.dtype) != dtype:
                    raise ValueError(f"parameter {k}: expected {dtype}{list(dims)}, got "
                                     f"{arr.dtype}{list(arr.shape)}")
            # One replica per device: the container's sharding only says which buffer
            # goes to which replica (each replica reads its own), as pmap's arrays did.
            args.append(per_device[0] if sharding is None else
                        jax.make_array_from_single_device_arrays(dims, sharding,
                                                                 list(per_device)))
        results = self.executable.execute_sharded(args)
        return results.disassemble_into_single_device_arrays()


def compile_per_device(
    hlo_text: str,
    devices: Sequence[Any],
    *,
    exact: bool = False,
    library: bool = False,
    compiler_options: Mapping[str, Any] | None = None,
) -> PerDeviceHlo:
    """Compiles a per-device module (a program without collectives, e.g. one stage of a
    staged train step) once, to run on each of ``devices`` with that device's inputs.

    Args:
        hlo_text: HLO text of a module without cross-device collectives.
        devices: local devices (of one platform), one replica each.
        exact: disable XLA's fusion passes (``xla_passes.toml``); False keeps XLA's
            default pipeline.
        library: with ``exact``, dots and convolutions still on XLA's kernel library.
        compiler_options: extra XLA options (``xla_disable_hlo_passes`` is appended).

    Returns:
        A :class:`PerDeviceHlo`.

    Raises:
        HloCompileError: no devices, XLA rejects the text or fails to compile it.
    """
    devices = tuple(devices)
    if not devices:
        raise HloCompileError("compile_per_device needs at least one device")
    executable, program_shape, options = _load(hlo_text, devices, exact=exact,
                                               library=library, extra=compiler_options,
                                               device_ids=[d.id for d in devices])
    return PerDeviceHlo(
        executable=executable,
        devices=devices,
        param_shapes=tuple(s for p in program_shape.parameter_shapes()
                           for s in _leaf_shapes(p)),
        result_shapes=_leaf_shapes(program_shape.result_shape()),
        hlo_text=hlo_text,
        compiler_options=options,
    )


# ------------------------------------------------------- whole programs from text alone


class CompiledText(NamedTuple):
    """A whole-program module compiled from its text alone (:func:`compile_text`).

    Attributes:
        run: the program: ``run(*inputs)`` executes it on this process's devices and
            returns its result (a tuple of jax arrays for a tuple-shaped result).
            ``run.compiled`` is a ``jax.stages.Compiled`` (``input_shardings``,
            ``as_text()``), so the profiler takes it as it takes :func:`compile_hlo`'s.
        inputs: one jax array per entry parameter, placed with the parameter's sharding
            (empty when :func:`compile_text` was asked for none).
    """

    run: CompiledHlo
    inputs: tuple[Any, ...]


def _random_array(rng: np.random.Generator, dims: tuple[int, ...], dtype: np.dtype
                  ) -> np.ndarray:
    """Realistic values of one parameter: standard normal floats, small ints (0..7)."""
    if jax.dtypes.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(dims) + 1j * rng.standard_normal(dims)).astype(dtype)
    if jax.dtypes.issubdtype(dtype, np.floating):
        return rng.standard_normal(dims, dtype=np.float32).astype(dtype)
    if dtype == np.bool_:
        return rng.random(dims) < 0.5
    if jax.dtypes.issubdtype(dtype, np.integer):
        return rng.integers(0, 8, dims).astype(dtype)
    return np.zeros(dims, dtype)


def _entry_parameters(hlo_text: str) -> tuple[Any, list[str | None]]:
    """Our IR of the text and the ``sharding=`` text of each entry parameter (in
    parameter order; None where it has none)."""
    from hlo_tools.parser import HloParseError, parse

    try:
        module = parse(hlo_text)
    except HloParseError as err:
        raise HloCompileError(f"could not parse the HLO text: {err}") from err
    params = sorted((int(i.payload), i) for i in module.entry.instructions
                    if i.opcode == "parameter")
    return module, [i.attrs.get("sharding") for _, i in params]


def _strip_aliasing(module: Any, hlo_text: str) -> str:
    """The text without input/output aliasing (buffer donation): the calls of
    :class:`CompiledText` keep their inputs, and aliasing changes no result."""
    from hlo_tools.printer import to_text

    dropped = [module.header_attrs.pop(k, None) for k in ("input_output_alias", "buffer_donor")]
    return to_text(module) if any(v is not None for v in dropped) else hlo_text


def _text_shardings(shardings: Sequence[str | None], devices: Sequence[Any]) -> list[Any]:
    """jax shardings over ``devices`` (the module's device assignment, in order) for the
    parameters' HLO shardings (replicated where a parameter has none)."""
    if len(devices) == 1:
        return [jax.sharding.SingleDeviceSharding(devices[0])] * len(shardings)
    out = []
    for k, text in enumerate(shardings):
        try:
            out.append(internals.gspmd_sharding(devices, text))
        except ValueError as err:
            raise HloCompileError(f"parameter {k}: unsupported sharding {text}: {err}") \
                from err
    return out


def compile_text(
    hlo_text: str,
    *,
    exact: bool = True,
    library: bool = True,
    platform: str | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    inputs: bool = True,
    seed: int = 0,
) -> CompiledText:
    """Compiles a pre-optimization whole-program module given only as HLO text, to run
    on this process's devices, with inputs made from its entry parameters.

    The text is what :func:`~hlo_tools.jax_bridge.extract.extract`
    (``lowered.as_text(dialect="hlo")``) prints, e.g. of a ``shard_map`` + ``pmean``
    train step; no Python function is needed. How:

    1. The module's device count (:func:`~hlo_tools.jax_bridge.devices.module_devices`:
       its header, shardy meshes, shardings and collectives) picks the first that many
       local devices of ``platform``, in order (the device assignment ``extract`` saw on
       one process).
    2. A stand-in function with the module's entry signature -- one flat parameter per
       entry parameter, placed with the parameter's own ``sharding=`` (an XLA
       ``HloSharding`` over those devices), outputs of the module's result shapes -- is
       lowered by ``jax.jit`` (``keep_unused=True``), and the text replaces its module as
       in :func:`compile_hlo` (signature checked); ``jax`` then compiles it as it
       compiles a jitted step, taking the result shardings from the executable.
    3. The exact-mode options are those of :func:`compile_hlo` (``exact``, ``library``),
       so the program equals ``compile_hlo(step, args, hlo_text, exact=exact,
       library=library)`` called on the step's flattened arguments.

    Input/output aliasing (``input_output_alias``, ``buffer_donor``) is dropped from the
    header: the inputs are reused by every call.

    Args:
        hlo_text: the module's text (pre-optimization; one process's program).
        exact: disable XLA's fusion and collective-combining passes
            (``xla_passes.toml``), as :func:`compile_hlo` does.
        library: with ``exact``, dots and convolutions on XLA's kernel library
            (:func:`~hlo_tools.jax_bridge.passes.plan_library_options`), as every enacted
            plan runs them.
        platform: jax platform (default: ``jax.default_backend()``).
        compiler_options: extra XLA options, as in :func:`compile_hlo`.
        inputs: make inputs: per parameter, standard normal floats, ints in ``0..7``,
            random booleans (random values, not zeros), the same for the same ``seed``.
        seed: seeds the inputs.

    Returns:
        A :class:`CompiledText` ``(run, inputs)``: ``run(*inputs)`` runs the program.

    Raises:
        DevicesUnavailableError: the module needs more devices than this process has.
        HloCompileError: the text is a compiled (scheduled) or multi-replica module,
            XLA rejects it, or compilation fails; the message includes XLA's.
    """
    platform = platform or jax.default_backend()
    module, shardings = _entry_parameters(hlo_text)
    if module.header_attrs.get("is_scheduled") == "true":
        raise HloCompileError("the module is compiled (is_scheduled=true: post-optimization);"
                              " a pre-optimization module is needed")
    if int(module.header_attrs.get("replica_count", "1")) > 1:
        raise HloCompileError(f"replica_count={module.header_attrs['replica_count']}: "
                              "modules of several replicas (pmap) are not supported, only "
                              "partitioned ones (jax.jit)")
    devices = local_devices_for(hlo_text, platform)
    hlo_text = _strip_aliasing(module, hlo_text)
    program_shape = computation(hlo_text).program_shape()
    params = [_leaf_shapes(p) for p in program_shape.parameter_shapes()]
    if any(len(leaves) != 1 for leaves in params):
        raise HloCompileError("tuple-shaped entry parameters are not supported")
    params_flat = [leaves[0] for leaves in params]
    result = program_shape.result_shape()
    outs, tupled = _leaf_shapes(result), bool(result.is_tuple())
    wide = any(np.dtype(t).itemsize == 8 and np.dtype(t).kind in "iuf"
               for _, t in params_flat + list(outs))

    def stand_in(*_: Any) -> Any:
        zeros = tuple(jax.numpy.zeros(dims, dtype) for dims, dtype in outs)
        return zeros if tupled else zeros[0]

    in_shardings = _text_shardings(shardings, devices)
    with jax.enable_x64(True) if wide else contextlib.nullcontext():
        try:
            lowered = jax.jit(stand_in, in_shardings=tuple(in_shardings), keep_unused=True
                              ).lower(*(jax.ShapeDtypeStruct(d, t) for d, t in params_flat))
        except Exception as err:
            raise HloCompileError(f"could not build the module's calling convention "
                                  f"(parameter shardings {sorted(set(map(str, shardings)))}): "
                                  f"{err}") from err
        lowered = _install(lowered, hlo_text)
        options = compile_mode_options(platform, exact=exact, library=library,
                                       extra=compiler_options)
        run = CompiledHlo(_compile(lowered, options, hlo_text), hlo_text, options)
        placed: tuple[Any, ...] = ()
        if inputs:
            rng = np.random.default_rng(seed)
            placed = tuple(jax.device_put(_random_array(rng, d, t), s)
                           for (d, t), s in zip(params_flat, run.compiled.input_shardings[0],
                                                strict=True))
    return CompiledText(run, placed)
