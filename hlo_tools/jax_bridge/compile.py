"""Compiling HLO text with XLA: one entry, :func:`compile_module`.

``compile_module(hlo_text, target, options)``; the target says what the program is
compiled for, and what comes back:

* :class:`InPlaceOf` ``(fn, args, kwargs)``: in place of a jax function's lowering; a
  :class:`CompiledHlo` taking the function's pytrees.
* :class:`FromText` ``(platform, inputs, seed)``: a whole-program module alone, with
  inputs made from its entry parameters; a :class:`CompiledText`.
* :class:`Standalone` ``(replicas, platform)``: a single-device module (one op, one
  fusion), the same inputs on each replica; a :class:`StandaloneHlo`.
* :class:`PerDevice` ``(devices)``: a module without collectives on several devices, each
  on its own inputs (a stage of a staged step); a :class:`PerDeviceHlo`.

:class:`~hlo_tools.jax_bridge.passes.CompileOptions` says how. With ``exact=True`` the XLA
passes that create fusions or combine collectives are disabled, so the compiled program
keeps the fusions and AllReduces of the text. On XLA:CPU every op left outside a fusion
is still wrapped in its own single-op ``wrapped_*`` fusion.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

import jax
import numpy as np

from hlo_tools.ir import HloModule
from hlo_tools.jax_bridge import internals, shared
from hlo_tools.jax_bridge.devices import local_devices_for
from hlo_tools.jax_bridge.errors import HloCompileError
from hlo_tools.jax_bridge.extract import jitted
from hlo_tools.jax_bridge.passes import CompileOptions, xla_options
from hlo_tools.jax_bridge.text import computation, mlir_module, module_name, to_mlir

__all__ = [
    "CompiledHlo",
    "CompiledText",
    "FromText",
    "InPlaceOf",
    "PerDevice",
    "PerDeviceHlo",
    "Standalone",
    "StandaloneHlo",
    "compile_module",
]


class InPlaceOf(NamedTuple):
    """Target: the text compiled in place of ``fn``'s own lowering on ``args`` (and
    ``kwargs``), keeping its calling convention (entry signature checked); no text
    compiles jax's own lowering (with ``exact=False``: XLA's default plan).

    Attributes:
        fn: function (plain or jit-wrapped).
        args: positional arguments to lower it on (arrays or ``ShapeDtypeStruct``).
        kwargs: keyword arguments to lower it on.
    """

    fn: Callable[..., Any]
    args: Sequence[Any]
    kwargs: Mapping[str, Any] | None = None


class FromText(NamedTuple):
    """Target: a pre-optimization whole-program module given only as text (what
    :func:`~hlo_tools.jax_bridge.extract.extract` prints, e.g. of a ``shard_map`` train
    step), run on this process's first :func:`~hlo_tools.devices.module_devices` local
    devices of ``platform`` in order (the assignment ``extract`` saw on one process).

    A stand-in function with the module's entry signature (one flat parameter per entry
    parameter, placed with its own ``sharding=``) is lowered by ``jax.jit`` and the text
    replaces its module as for :class:`InPlaceOf`, so the program equals
    ``InPlaceOf(step, args)``'s on the step's flattened arguments. Input/output aliasing
    is dropped from the header: the inputs are reused by every call.

    Attributes:
        platform: jax platform (default: ``jax.default_backend()``).
        inputs: make inputs: per parameter, standard normal floats, ints in ``0..7``,
            random booleans, the same for the same ``seed``.
        seed: seeds the inputs.
    """

    platform: str | None = None
    inputs: bool = True
    seed: int = 0


class Standalone(NamedTuple):
    """Target: a single-device module (one op with parameters for its operands, or one
    hand-written ``fusion``) compiled by the backend client directly, no jax function;
    with ``replicas > 1`` the same program runs on that many local devices at once (every
    replica the same inputs), as a data-parallel program's devices share the host.

    Attributes:
        replicas: local devices that run it; 1 for a plain single-device run.
        platform: jax platform (default: ``jax.default_backend()``).
    """

    replicas: int = 1
    platform: str | None = None


class PerDevice(NamedTuple):
    """Target: a per-device module (no collectives, e.g. one stage of a staged train
    step) compiled once with one replica per device, as ``pmap`` compiles, each running
    it on its own inputs.

    Attributes:
        devices: local devices of one platform, in replica order.
    """

    devices: Sequence[Any]


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


def _xla_compile(program: jax.stages.Lowered | str, options: dict[str, Any],
                 hlo_text: str | None, devices: Sequence[Any] = (),
                 device_ids: Sequence[int] | None = None, *, share: bool = True) -> Any:
    """Compiles with XLA: a ``Lowered`` (its ``compile``), or MLIR text on ``devices``'
    client as one replica per device (``device_ids``: the assignment; default the first
    ids). ``options`` get the version's options for the text's form of shardings
    (:func:`~hlo_tools.jax_bridge.internals.frontend_sharding_options`); XLA's errors
    become ``HloCompileError``. Within :func:`~hlo_tools.jax_bridge.shared.compiles_shared`
    process 0 compiles and the other processes of the job load its executable (unless
    not ``share``: a single-op module timed in one process alone)."""
    given = {**options, **internals.frontend_sharding_options(hlo_text or "")}

    def compile_it() -> Any:
        try:
            if isinstance(program, str):
                return internals.compile_on_client(program, devices, replicas=len(devices),
                                                   device_ids=device_ids, options=given)
            return program.compile(compiler_options=given or None)
        except Exception as err:
            raise HloCompileError(f"XLA failed to compile the HLO: {err}") from err

    if not share:
        return compile_it()
    options_text = repr(sorted((k, str(v)) for k, v in given.items()))
    if isinstance(program, str):  # a per-device module: loaded on this process's devices
        return shared.once(
            f"{len(devices)} replicas {options_text}\n{program}", compile_it,
            internals.serialize_loaded,
            lambda data: internals.load_on_client(data, devices, replicas=len(devices),
                                                  device_ids=device_ids))
    return shared.once(
        f"{program.in_tree} {program.out_tree} {options_text}\n"
        f"{hlo_text if hlo_text is not None else program.as_text()}", compile_it,
        internals.serialize_compiled, lambda data: internals.load_compiled(data, program))


def _in_place_of(hlo_text: str | None, target: InPlaceOf, options: CompileOptions
                 ) -> CompiledHlo:
    lowered = jitted(target.fn).lower(*target.args, **(target.kwargs or {}))
    platform = internals.lowered_platform(lowered)
    given = xla_options(platform, options)
    if hlo_text is not None and " fusion(" in hlo_text and internals.is_c_api_client(platform):
        return CompiledHlo(_through_plugin(lowered, hlo_text, given), hlo_text, given)
    if hlo_text is not None:
        lowered = _install(lowered, hlo_text)
    return CompiledHlo(_xla_compile(lowered, given, hlo_text), hlo_text, given)


def _through_plugin(lowered: jax.stages.Lowered, hlo_text: str, options: dict[str, Any]
                    ) -> jax.stages.Compiled:
    """Text with hand-written fusions on a PJRT plugin backend (XLA:GPU), whose jax client
    would hand XLA portable StableHLO, which has no fusion: the plugin compiles the text
    itself (program format ``"hlo"``, in a child process, so that an XLA abort is an
    ``HloCompileError``), and jax runs the executable with the step's calling convention,
    taken from jax's own compile of the step (:mod:`~hlo_tools.jax_bridge.transplant`)."""
    from hlo_tools.jax_bridge import pjrt
    from hlo_tools.jax_bridge.transplant import transplant

    _install(lowered, hlo_text)  # the entry signature must be the step's
    given = {**options, **internals.frontend_sharding_options(hlo_text)}
    executable = pjrt.compile_serialized(
        hlo_text, internals.lowered_compile_options_proto(lowered, given))
    return transplant(_xla_compile(lowered, {}, None), executable)


# ----------------------------------------------------------------- standalone modules


def _replicated_sharding(devices: Sequence[Any]) -> Any:
    mesh = jax.sharding.Mesh(np.array(list(devices)), ("replica",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _leaf_shapes(shape: Any) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """``(dims, dtype)`` of the array leaves of an ``xla_client.Shape``."""
    if shape.is_tuple():
        return tuple(leaf for s in shape.tuple_shapes() for leaf in _leaf_shapes(s))
    return ((tuple(shape.dimensions()), np.dtype(shape.numpy_dtype())),)


def _load(hlo_text: str, devices: Sequence[Any], options: CompileOptions,
          device_ids: Sequence[int] | None, *, share: bool) -> tuple[Any, Any, dict[str, Any]]:
    """Compiles a module without a jax function, one replica per device: ``(loaded
    executable, program shape, XLA options)``; ``share``: as :func:`_xla_compile`."""
    comp = computation(hlo_text)
    mlir_text = to_mlir(comp)
    given = xla_options(devices[0].platform, options)
    return (_xla_compile(mlir_text, given, hlo_text, devices, device_ids, share=share),
            comp.program_shape(), given)


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

    def put_random(self, seed: int = 0) -> list[Any]:
        """Places inputs made from the parameters' shapes on every replica (standard
        normal floats, ints in ``0..7``, random booleans; the same for the same
        ``seed``), as :class:`FromText` makes them."""
        rng = np.random.default_rng(seed)
        return self.put(*(_random_array(rng, dims, dtype) for dims, dtype in self.param_shapes))

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


def _standalone(hlo_text: str, target: Standalone, options: CompileOptions
                ) -> StandaloneHlo:
    platform = target.platform or jax.default_backend()
    local = internals.backend(platform).local_devices()
    devices = tuple(local[:target.replicas])
    if target.replicas < 1 or len(devices) < target.replicas:
        raise HloCompileError(f"{target.replicas} replicas requested, {platform} has "
                              f"{len(local)} local devices")
    # assigned to this process's own devices: the first global ids belong to process 0
    executable, program_shape, given = _load(hlo_text, devices, options,
                                             device_ids=[d.id for d in devices], share=False)
    result = program_shape.result_shape()
    return StandaloneHlo(
        executable=executable,
        devices=devices,
        module_name=module_name(hlo_text),
        param_shapes=tuple(s for p in program_shape.parameter_shapes() for s in _leaf_shapes(p)),
        result_shapes=_leaf_shapes(result),
        result_is_tuple=bool(result.is_tuple()),
        hlo_text=hlo_text,
        compiler_options=given,
    )


@dataclass(frozen=True)
class PerDeviceHlo:
    """A per-device HLO module (no collectives) compiled once for several local devices,
    each running it on its own inputs (:class:`PerDevice`).

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


def _per_device(hlo_text: str, target: PerDevice, options: CompileOptions) -> PerDeviceHlo:
    devices = tuple(target.devices)
    if not devices:
        raise HloCompileError("PerDevice needs at least one device")
    executable, program_shape, given = _load(hlo_text, devices, options,
                                             device_ids=[d.id for d in devices], share=True)
    return PerDeviceHlo(
        executable=executable,
        devices=devices,
        param_shapes=tuple(s for p in program_shape.parameter_shapes()
                           for s in _leaf_shapes(p)),
        result_shapes=_leaf_shapes(program_shape.result_shape()),
        hlo_text=hlo_text,
        compiler_options=given,
    )


# ------------------------------------------------------- whole programs from text alone


class CompiledText(NamedTuple):
    """A whole-program module compiled from its text alone (:class:`FromText`).

    Attributes:
        run: the program: ``run(*inputs)`` executes it on this process's devices and
            returns its result (a tuple of jax arrays for a tuple-shaped result).
            ``run.compiled`` is a ``jax.stages.Compiled`` (``input_shardings``,
            ``as_text()``), so the profiler takes it as it takes :class:`InPlaceOf`'s.
        inputs: one jax array per entry parameter, placed with the parameter's sharding
            (empty when :class:`FromText` asked for none).
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


def _entry_parameters(hlo_text: str) -> tuple[HloModule, list[str | None]]:
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


def _strip_aliasing(module: HloModule, hlo_text: str) -> str:
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


def _from_text(hlo_text: str, target: FromText, options: CompileOptions) -> CompiledText:
    platform = target.platform or jax.default_backend()
    module, shardings = _entry_parameters(hlo_text)
    if module.header_attrs.get("is_scheduled") == "true":
        raise HloCompileError("the module is compiled (is_scheduled=true: post-optimization);"
                              " a pre-optimization module is needed")
    if int(module.header_attrs.get("replica_count", "1")) > 1:
        raise HloCompileError(f"replica_count={module.header_attrs['replica_count']}: "
                              "modules of several replicas (pmap) are not supported, only "
                              "partitioned ones (jax.jit)")
    devices = local_devices_for(module, platform)
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
        given = xla_options(platform, options)
        run = CompiledHlo(_xla_compile(lowered, given, hlo_text), hlo_text, given)
        placed: tuple[Any, ...] = ()
        if target.inputs:
            rng = np.random.default_rng(target.seed)
            placed = tuple(jax.device_put(_random_array(rng, d, t), s)
                           for (d, t), s in zip(params_flat, run.compiled.input_shardings[0],
                                                strict=True))
    return CompiledText(run, placed)


# ------------------------------------------------------------------- the one entry


@overload
def compile_module(hlo_text: str | None, target: InPlaceOf,
                   options: CompileOptions = ...) -> CompiledHlo: ...
@overload
def compile_module(hlo_text: str, target: FromText,
                   options: CompileOptions = ...) -> CompiledText: ...
@overload
def compile_module(hlo_text: str, target: Standalone,
                   options: CompileOptions = ...) -> StandaloneHlo: ...
@overload
def compile_module(hlo_text: str, target: PerDevice,
                   options: CompileOptions = ...) -> PerDeviceHlo: ...


def compile_module(hlo_text: str | None,
                   target: InPlaceOf | FromText | Standalone | PerDevice,
                   options: CompileOptions = CompileOptions(),  # noqa: B008 - immutable
                   ) -> CompiledHlo | CompiledText | StandaloneHlo | PerDeviceHlo:
    """Compiles HLO text for ``target`` with ``options``.

    Args:
        hlo_text: the module's HLO text (None: with :class:`InPlaceOf` only, jax's own
            lowering).
        target: what it is compiled for: :class:`InPlaceOf`, :class:`FromText`,
            :class:`Standalone` or :class:`PerDevice`.
        options: exact mode, kernel library, extra XLA options.

    Returns:
        :class:`CompiledHlo` (:class:`InPlaceOf`), :class:`CompiledText`
        (:class:`FromText`), :class:`StandaloneHlo` (:class:`Standalone`) or
        :class:`PerDeviceHlo` (:class:`PerDevice`).

    Raises:
        HloCompileError: XLA rejected the text or failed to compile it (the message
            includes XLA's), its signature differs from the function's, the target's
            devices are missing, or (:class:`FromText`) the module is compiled
            (scheduled) or of several replicas.
        DevicesUnavailableError: (:class:`FromText`) the module needs more devices than
            this process has.

    Warning:
        Limits of XLA:CPU (docs/xla_cpu_passes.md): a ``kind=kOutput`` fusion containing
        a dot aborts the whole process (C++ CHECK failure, not catchable; use
        ``kind=kLoop``), and a multi-operand (tuple) all-reduce inside a shard_map body is
        rejected (combine gradients through one flat concatenated buffer instead). jax
        drops unused arguments from the entry signature unless
        ``jax.jit(..., keep_unused=True)``. On XLA:GPU, text with hand-written fusions
        compiles through the plugin's own compile (:class:`InPlaceOf` only; docs: the GPU
        route) and must be legal for it (:func:`hlo_tools.gpu_legal.gpu_legal`).
    """
    if isinstance(target, InPlaceOf):
        return _in_place_of(hlo_text, target, options)
    if hlo_text is None:
        raise HloCompileError(f"{type(target).__name__} needs HLO text")
    if isinstance(target, FromText):
        return _from_text(hlo_text, target, options)
    if isinstance(target, Standalone):
        return _standalone(hlo_text, target, options)
    if isinstance(target, PerDevice):
        return _per_device(hlo_text, target, options)
    raise TypeError(f"not a compile target: {target!r}")
