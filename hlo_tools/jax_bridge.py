"""Bridge between jax and HLO text: extract a program, compile our text exactly as written.

This is the only module of the project that touches jax/jaxlib internals
(``jax._src...``, ``xla_client``, MLIR contexts, ``Lowered._lowering._hlo``). Everything
here was checked on jax/jaxlib 0.10.2; importing it under other versions warns.

Typical use::

    text = extract(step, params, batch)            # pre-optimization whole-program HLO
    new_text = rewrite(text)                        # our plan, e.g. hand-written fusions
    run = compile_hlo(step, (params, batch), new_text, exact=True)
    new_params, loss = run(params, batch)
    print(run.as_text())                            # what XLA actually compiled

A module given only as text (an HLO file, no Python function) compiles the same way with
:func:`compile_text`, which also makes inputs from its entry parameters::

    run, inputs = compile_text(text)                # on this process's first N devices
    outputs = run(*inputs)

With ``exact=True`` the XLA passes that create fusions or combine collectives (listed per
backend in ``hlo_tools/xla_passes.toml``) are disabled, so the compiled program keeps the
fusions and AllReduces of the text. On XLA:CPU every op left outside a fusion is still
wrapped in its own single-op ``wrapped_*`` fusion by ``fusion-wrapper``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jaxlib.version
import numpy as np
from jax._src import sharding_impls as jax_sharding_impls
from jax._src import xla_bridge as jax_xla_bridge
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

__all__ = [
    "PINNED_VERSION",
    "CompiledHlo",
    "CompiledText",
    "Coordinator",
    "DevicesUnavailableError",
    "HloCompileError",
    "StandaloneHlo",
    "check_versions",
    "backend_info",
    "PerDeviceHlo",
    "compile_hlo",
    "compile_per_device",
    "compile_standalone",
    "compile_text",
    "compiled_text",
    "count_all_reduces",
    "device_memory_bytes",
    "exact_compiler_options",
    "extract",
    "fresh_function",
    "hlo_text_to_mlir",
    "load_pass_config",
    "module_devices",
    "platform_family",
    "plan_library_options",
    "lowered_text",
    "verify_hlo",
    "xla_canonical_text",
    "xla_parse_ok",
]

PINNED_VERSION = "0.10.2"
#: The per-backend XLA pass lists (package data of hlo_tools).
DEFAULT_PASS_CONFIG = Path(__file__).with_name("xla_passes.toml")

# jax platform name -> platform family (a section of xla_passes.toml, of a hardware file).
_PLATFORM_FAMILIES = {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu"}
_DISABLE = "xla_disable_hlo_passes"


class HloCompileError(RuntimeError):
    """XLA rejected HLO text: parse, verification, MLIR conversion or compilation failed."""


class DevicesUnavailableError(HloCompileError):
    """This process's devices cannot run a module (:func:`compile_text`): it needs more
    devices than the process has locally, e.g. a module of a multi-process job or one
    extracted on more host devices than this process was started with."""


def check_versions(*, warn: bool = True) -> bool:
    """Checks that jax and jaxlib are the pinned version this bridge was verified on.

    Args:
        warn: Emit a ``RuntimeWarning`` on mismatch.

    Returns:
        True when both jax and jaxlib equal ``PINNED_VERSION``.
    """
    found = {"jax": jax.__version__, "jaxlib": jaxlib.version.__version__}
    ok = all(version == PINNED_VERSION for version in found.values())
    if not ok and warn:
        warnings.warn(
            f"hlo_tools.jax_bridge was verified on jax/jaxlib {PINNED_VERSION}, found {found}; "
            "the jax internals it uses may have changed.",
            RuntimeWarning,
            stacklevel=2,
        )
    return ok


check_versions()


# --------------------------------------------------------------------------- extraction


def _print_options(metadata: bool) -> xc.hlo.HloPrintOptions:
    """Print options giving re-parsable text with every constant printed in full."""
    opts = xc.hlo.HloPrintOptions.short_parsable()
    opts.print_large_constants = True  # already the default of short_parsable; be explicit
    opts.print_metadata = metadata
    return opts


def _jitted(fn: Callable[..., Any]) -> Any:
    """Returns ``fn`` if it is already jit-wrapped (has ``.lower``), else ``jax.jit(fn)``."""
    return fn if hasattr(fn, "lower") else jax.jit(fn)


def lowered_text(lowered: jax.stages.Lowered, *, metadata: bool = False) -> str:
    """Prints the pre-optimization HLO module of a ``Lowered`` as re-parsable text.

    Args:
        lowered: Result of ``jax.jit(fn).lower(...)``.
        metadata: Also print jax's ``metadata={op_name=...}``. Leave False to have XLA
            report each instruction's own name as its op_name after ``compile_hlo``.

    Returns:
        HLO text accepted by XLA's parser, large constants included (never ``{...}``).
    """
    module = lowered.compiler_ir("hlo").as_hlo_module()
    return module.to_string(_print_options(metadata))


def extract(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Whole-program pre-optimization HLO text of ``fn`` lowered on ``args``.

    Args:
        fn: A plain function or an already ``jax.jit``-wrapped one.
        *args: Positional arguments (pytrees of arrays or ``ShapeDtypeStruct``).
        **kwargs: Keyword arguments passed to ``lower``.

    Returns:
        HLO text equal to ``jax.jit(fn).lower(...).as_text(dialect="hlo")``.
    """
    return lowered_text(_jitted(fn).lower(*args, **kwargs))


# ------------------------------------------------------------------------ text -> XLA


def _parse(hlo_text: str) -> Any:
    """Parses HLO text with XLA's own parser, wrapping its errors.

    The parser checks syntax, names and attributes but not operand shapes.
    """
    try:
        return xc.hlo.hlo_module_from_text(hlo_text)
    except Exception as err:  # jax.errors.JaxRuntimeError carries XLA's message
        raise HloCompileError(f"XLA could not parse the HLO text: {err}") from err


def xla_parse_ok(hlo_text: str) -> None:
    """Raises ``HloCompileError`` with XLA's message unless XLA's parser accepts the text.

    Shape errors (e.g. ``add`` of f32[8] and f32[4]) pass this check; ``verify_hlo``
    catches them.
    """
    _parse(hlo_text)


def xla_canonical_text(hlo_text: str) -> str:
    """The text XLA's own parser and printer make of ``hlo_text`` (XLA's canonical print).

    Raises:
        HloCompileError: XLA's parser rejects the text.
    """
    return _parse(hlo_text).to_string()


def _computation(hlo_text: str) -> Any:
    """HLO text -> ``XlaComputation``."""
    return xc.XlaComputation(_parse(hlo_text).as_serialized_hlo_module_proto())


def _to_mlir(computation: Any) -> str:
    """``XlaComputation`` -> MLIR (StableHLO) text, wrapping conversion errors."""
    try:
        return xc._xla.mlir.xla_computation_to_mlir_module(computation)
    except Exception as err:
        raise HloCompileError(f"HLO -> MLIR conversion failed: {err}") from err


def hlo_text_to_mlir(hlo_text: str) -> str:
    """Converts HLO text to MLIR (StableHLO) text that jax can compile.

    A ``fusion`` instruction survives the conversion (as ``mhlo.fusion``); each original
    instruction name is kept as its MLIR location, which XLA reports back as
    ``metadata={op_name="<name>"}`` in the compiled HLO and in profiles (when the text was
    printed without metadata, the default of ``extract``).

    Raises:
        HloCompileError: XLA rejects the text or its conversion.
    """
    return _to_mlir(_computation(hlo_text))


def _mlir_module(computation: Any) -> ir.Module:
    """``XlaComputation`` -> verified MLIR module in a jax MLIR context."""
    mlir_text = _to_mlir(computation)
    try:
        with jax_mlir.make_ir_context():
            return ir.Module.parse(mlir_text)  # runs the StableHLO verifier
    except Exception as err:  # ir.MLIRError
        raise HloCompileError(f"jax could not parse the converted MLIR: {err}") from err


def verify_hlo(hlo_text: str) -> None:
    """Parses the text and verifies every op's shapes (as MLIR), without compiling.

    Raises:
        HloCompileError: with XLA's or MLIR's message, naming the offending instruction.
    """
    _mlir_module(_computation(hlo_text))


# ------------------------------------------------------------------- pass configuration


@functools.lru_cache(maxsize=8)
def load_pass_config(path: str | Path | None = None) -> dict[str, Any]:
    """Reads the per-backend XLA pass lists (``hlo_tools/xla_passes.toml`` by default)."""
    with open(path or DEFAULT_PASS_CONFIG, "rb") as fh:
        return tomllib.load(fh)


def platform_family(platform: str) -> str | None:
    """``"cpu"`` or ``"gpu"`` for a jax platform name (cpu, cuda, rocm, gpu); None for
    another. The one map from platforms to config sections (pass lists, hardware files,
    backend constants)."""
    return _PLATFORM_FAMILIES.get(platform.lower())


def _section(platform: str) -> str:
    """Maps a jax platform name (cpu, cuda, rocm) to a config section."""
    family = platform_family(platform)
    if family is None:
        raise HloCompileError(
            f"exact=True has no pass list for backend {platform!r} (known: cpu, gpu)"
        )
    return family


def exact_compiler_options(platform: str, config: str | Path | None = None,
                           library: bool = False) -> dict[str, Any]:
    """Compiler options that make XLA compile fusions and collectives as written.

    Args:
        platform: jax platform name: ``cpu``, ``cuda``, ``rocm`` or ``gpu``.
        config: Pass config TOML; ``hlo_tools/xla_passes.toml`` when None.
        library: keep the section's ``library_passes`` running (they hand a single op
            to a kernel library, e.g. XLA:CPU's YNNPACK ``__ynn_fusion`` around a
            ``dot``): used to time an op the way XLA's default pipeline runs it.

    Returns:
        ``{"xla_disable_hlo_passes": "a,b,..."}`` plus the section's ``exact_options``.
    """
    section = load_pass_config(config)[_section(platform)]
    kept = set(section.get("library_passes", ())) if library else set()
    disabled = [name for name in section["exact_disable"] if name not in kept]
    options: dict[str, Any] = {_DISABLE: ",".join(disabled)}
    options.update(section.get("exact_options", {}))
    return options


def plan_library_options(platform: str, config: str | Path | None = None) -> dict[str, Any]:
    """Exact-mode options under which dots and convolutions run on XLA's kernel library.

    The section's ``library_passes`` keep running (as in
    ``exact_compiler_options(platform, library=True)``) and its ``library_options`` are
    added: on XLA:CPU these restrict YNNPACK's rewriter to single dots and convolutions,
    each wrapped alone in a ``kind=kCustom`` ``__ynn_fusion`` as XLA's default pipeline
    wraps them, so a plan's own fusions and all-reduces stay exactly as written.

    Args:
        platform: jax platform name: ``cpu``, ``cuda``, ``rocm`` or ``gpu``.
        config: Pass config TOML; ``hlo_tools/xla_passes.toml`` when None.

    Returns:
        Options for ``Lowered.compile(compiler_options=...)``.
    """
    options = exact_compiler_options(platform, config, library=True)
    options.update(load_pass_config(config)[_section(platform)].get("library_options", {}))
    return options


# --------------------------------------------------------------------------- compiling


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


def _platform(lowered: jax.stages.Lowered) -> str:
    """The jax platform a ``Lowered`` targets (``cpu``, ``cuda``, ...)."""
    platforms = getattr(lowered._lowering, "_platforms", None) or (jax.default_backend(),)
    return platforms[0]


def _shape_strings(program_shape: Any) -> tuple[list[str], str]:
    """Parameter and result shapes (with layouts) as comparable strings."""
    return [str(s) for s in program_shape.parameter_shapes()], str(program_shape.result_shape())


def _check_signature(lowered: jax.stages.Lowered, computation: Any) -> None:
    """Raises unless ``computation`` has the entry signature of the lowered program."""
    want = _shape_strings(lowered.compiler_ir("hlo").program_shape())
    got = _shape_strings(computation.program_shape())
    if got != want:
        raise HloCompileError(
            f"entry signature of the HLO text {got} differs from the lowered program {want}"
        )


def _install(lowered: jax.stages.Lowered, hlo_text: str) -> jax.stages.Lowered:
    """A copy of ``lowered`` whose module is ``hlo_text`` (checked, as MLIR).

    jax caches lowerings per function and signature, so the text goes into shallow
    copies of the ``Lowered`` and its lowering: writing into the cached object would make
    later ``jax.jit(fn)`` calls run our text.
    """
    if not hasattr(lowered._lowering, "_hlo"):
        raise HloCompileError(f"unsupported lowering type {type(lowered._lowering).__name__}")
    computation = _computation(hlo_text)
    _check_signature(lowered, computation)
    installed = copy.copy(lowered)
    installed._lowering = copy.copy(lowered._lowering)
    installed._lowering._hlo = _mlir_module(computation)
    if hasattr(installed._lowering, "_executable"):
        installed._lowering._executable = None
    return installed


def _options(
    lowered: jax.stages.Lowered, exact: bool, extra: Mapping[str, Any] | None,
    library: bool = False,
) -> dict[str, Any]:
    """Compiler options: the exact-mode ones (if asked; with library kernels if
    ``library``) updated with ``extra``.

    ``xla_disable_hlo_passes`` lists are concatenated, other keys of ``extra`` win.
    """
    if exact:
        platform = _platform(lowered)
        options = plan_library_options(platform) if library else exact_compiler_options(platform)
    else:
        options = {}
    extra = dict(extra or {})
    disabled = [options.get(_DISABLE, ""), extra.pop(_DISABLE, "")]
    options.update(extra)
    if any(disabled):
        options[_DISABLE] = ",".join(name for name in disabled if name)
    return options


def _compile(lowered: jax.stages.Lowered, options: dict[str, Any]) -> jax.stages.Compiled:
    """``lowered.compile`` with XLA errors turned into ``HloCompileError``."""
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
            (``hlo_tools/xla_passes.toml``) so fusions and AllReduces stay as written.
        kwargs: Keyword arguments to lower ``fn`` on.
        compiler_options: Extra XLA options. Their ``xla_disable_hlo_passes`` is added to
            the exact-mode list; other keys override it.
        library: with ``exact``, run dots and convolutions on XLA's kernel library
            (YNNPACK on CPU) as its default pipeline does, each alone in a ``kind=kCustom``
            fusion (:func:`plan_library_options`); the text's fusions and all-reduces
            stay as written. Ignored without ``exact`` (XLA's default uses the library).

    Returns:
        A ``CompiledHlo`` taking the same pytrees as ``fn`` and returning its output pytree.

    Raises:
        HloCompileError: XLA rejected the text, its signature differs from ``fn``'s, or
            compilation failed; the message includes XLA's.

    Warning:
        Limits of XLA:CPU 0.10.2 (docs/xla_cpu_passes.md): a ``kind=kOutput`` fusion
        containing a dot aborts the whole process (C++ CHECK failure, not catchable; use
        ``kind=kLoop``), and a multi-operand (tuple) all-reduce inside a shard_map body is
        rejected (combine gradients through one flat concatenated buffer instead). jax drops
        unused arguments from the entry signature unless ``jax.jit(..., keep_unused=True)``.
    """
    lowered = _jitted(fn).lower(*args, **(kwargs or {}))
    if hlo_text is not None:
        lowered = _install(lowered, hlo_text)
    options = _options(lowered, exact, compiler_options, library)
    return CompiledHlo(_compile(lowered, options), hlo_text, options)


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


# An opcode is followed by "(", an instruction name never is.
_ALL_REDUCE_RE = re.compile(r"\sall-reduce(?:-start)?\(")


def count_all_reduces(hlo_text: str) -> int:
    """Number of all-reduce instructions in HLO text (a combined tuple one counts once)."""
    return len(_ALL_REDUCE_RE.findall(hlo_text))


# ----------------------------------------------------------------- standalone modules


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


def _replicated_sharding(devices: Sequence[Any]) -> Any:
    mesh = jax.sharding.Mesh(np.array(list(devices)), ("replica",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _leaf_shapes(shape: Any) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """``(dims, dtype)`` of the array leaves of an ``xla_client.Shape``."""
    if shape.is_tuple():
        return tuple(leaf for s in shape.tuple_shapes() for leaf in _leaf_shapes(s))
    return ((tuple(shape.dimensions()), np.dtype(shape.numpy_dtype())),)


def _standalone_options(platform: str, exact: bool, replicas: int,
                        extra: Mapping[str, Any] | None,
                        library: bool = False) -> tuple[Any, dict[str, Any]]:
    """``CompileOptions`` for ``replicas`` replicas with the exact-mode pass list."""
    options = exact_compiler_options(platform, library=library) if exact else {}
    extra = dict(extra or {})
    disabled = [options.get(_DISABLE, ""), extra.pop(_DISABLE, "")]
    options.update(extra)
    if any(disabled):
        options[_DISABLE] = ",".join(name for name in disabled if name)
    compile_options = xc.CompileOptions()
    compile_options.num_replicas = replicas
    compile_options.num_partitions = 1
    compile_options.device_assignment = xc.DeviceAssignment.create(
        np.arange(replicas).reshape(replicas, 1))
    compile_options.env_option_overrides = list(options.items())
    return compile_options, options


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

    The text goes HLO -> XLA's parser -> MLIR (as in :func:`hlo_text_to_mlir`) and is
    compiled by the backend client directly (``Client.compile_and_load``), so any
    module can be built: one op with parameters for its operands (per-op timing), or a
    module holding one hand-written ``fusion`` (fused-op samples for the estimator).

    Args:
        hlo_text: HLO text of a module without cross-device collectives.
        exact: disable XLA's fusion passes (``hlo_tools/xla_passes.toml``), so a
            hand-written fusion stays as written and single ops stay unfused.
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
    client = jax_xla_bridge.get_backend(platform)
    devices = tuple(client.local_devices()[:replicas])
    if replicas < 1 or len(devices) < replicas:
        raise HloCompileError(f"{replicas} replicas requested, {platform} has "
                              f"{len(client.local_devices())} local devices")
    computation = _computation(hlo_text)
    program_shape = computation.program_shape()
    mlir_text = _to_mlir(computation)
    compile_options, options = _standalone_options(platform, exact, replicas, compiler_options,
                                                   library)
    try:
        executable = client.compile_and_load(mlir_text, xc.DeviceList(devices), compile_options)
    except Exception as err:
        raise HloCompileError(f"XLA failed to compile the HLO: {err}") from err
    result = program_shape.result_shape()
    return StandaloneHlo(
        executable=executable,
        devices=devices,
        module_name=_module_name(hlo_text),
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
        exact: disable XLA's fusion passes (``hlo_tools/xla_passes.toml``); False keeps
            XLA's default pipeline.
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
    platform = devices[0].platform
    client = jax_xla_bridge.get_backend(platform)
    computation = _computation(hlo_text)
    program_shape = computation.program_shape()
    mlir_text = _to_mlir(computation)
    compile_options, options = _standalone_options(platform, exact, len(devices),
                                                   compiler_options, library)
    compile_options.device_assignment = xc.DeviceAssignment.create(
        np.array([d.id for d in devices]).reshape(len(devices), 1))
    try:
        executable = client.compile_and_load(mlir_text, xc.DeviceList(devices),
                                             compile_options)
    except Exception as err:
        raise HloCompileError(f"XLA failed to compile the HLO: {err}") from err
    return PerDeviceHlo(
        executable=executable,
        devices=devices,
        param_shapes=tuple(s for p in program_shape.parameter_shapes()
                           for s in _leaf_shapes(p)),
        result_shapes=_leaf_shapes(program_shape.result_shape()),
        hlo_text=hlo_text,
        compiler_options=options,
    )


def _module_name(hlo_text: str) -> str:
    match = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    return match.group(1) if match else ""


# ------------------------------------------------------- whole programs from text alone

#: ``devices=[4,1]...`` of a tiled sharding: the tile assignment's dimensions.
_TILE_DIMS_RE = re.compile(r"devices=\[([\d,\s]+)\]")
#: ``maximal device=3``.
_MAXIMAL_RE = re.compile(r"maximal\s+device=(\d+)")
#: ``replica_groups=[2,2]<=[4]`` (iota form): its dimensions.
_IOTA_GROUPS_RE = re.compile(r"replica_groups=\[([\d,\s]+)\]<=")
#: ``replica_groups={{0,1},{2,3}}`` / ``source_target_pairs={{0,1},{1,0}}``.
_LIST_GROUPS_RE = re.compile(r"(?:replica_groups|source_target_pairs)=\{([\d,{}\s]*)\}")
#: ``#sdy.mesh<["data"=4, "model"=2]>`` (quotes possibly escaped): its axes.
_SDY_MESH_RE = re.compile(r"#sdy\.mesh<\[([^\]]*)\]")
_SIZE_RE = re.compile(r"=\s*(\d+)")


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


def module_devices(hlo_text: str) -> int:
    """How many devices a pre-optimization whole-program module runs on.

    The largest of what the text says: the header's ``num_partitions`` times its
    ``replica_count``, the size of every shardy mesh (``#sdy.mesh<["data"=4]>``, as jax
    lowers ``shard_map``), the tile assignment of every sharding (``devices=[4,1]<=[4]``,
    ``maximal device=3``) and the device ids of every collective (``replica_groups``,
    ``source_target_pairs``); 1 when it says nothing.
    """
    found = [1]
    header = hlo_text.lstrip().split("\n", 1)[0]
    partitions = re.search(r"\bnum_partitions=(\d+)", header)
    replicas = re.search(r"\breplica_count=(\d+)", header)
    found.append((int(partitions.group(1)) if partitions else 1)
                 * (int(replicas.group(1)) if replicas else 1))
    for axes in _SDY_MESH_RE.findall(hlo_text):
        found.append(math.prod(int(v) for v in _SIZE_RE.findall(axes)))
    for dims in _TILE_DIMS_RE.findall(hlo_text) + _IOTA_GROUPS_RE.findall(hlo_text):
        found.append(math.prod(_ints(dims)))
    found.extend(int(d) + 1 for d in _MAXIMAL_RE.findall(hlo_text))
    for groups in _LIST_GROUPS_RE.findall(hlo_text):
        found.append(max(_ints(groups), default=-1) + 1)
    return max(found)


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
            hlo = xc.HloSharding.from_string(text) if text else xc.HloSharding.replicate()
        except Exception as err:
            raise HloCompileError(f"parameter {k}: unsupported sharding {text}: {err}") \
                from err
        if hlo.tuple_elements():
            raise HloCompileError(f"parameter {k}: tuple-shaped parameters are not supported")
        out.append(jax_sharding_impls.GSPMDSharding(tuple(devices), hlo))
    return out


def _local_devices_for(hlo_text: str, platform: str) -> tuple[Any, ...]:
    """The first :func:`module_devices` local devices of ``platform``.

    Raises:
        DevicesUnavailableError: the process has fewer.
    """
    needed = module_devices(hlo_text)
    local = jax.local_devices(backend=platform)
    if needed <= len(local):
        return tuple(local[:needed])
    hint = ""
    if jax.process_count() > 1:
        hint = (f" (process {jax.process_index()} of {jax.process_count()}: a module "
                "runs here on this process's devices alone)")
    elif platform == "cpu":
        hint = (f" (XLA_FLAGS=--xla_force_host_platform_device_count={needed} gives a "
                f"process {needed} host devices)")
    raise DevicesUnavailableError(
        f"the module runs on {needed} devices, this process has {len(local)} local "
        f"{platform} device{'s' if len(local) != 1 else ''}{hint}")


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

    The text is what :func:`extract` (``lowered.as_text(dialect="hlo")``) prints, e.g.
    of a ``shard_map`` + ``pmean`` train step; no Python function is needed. How:

    1. The module's device count (:func:`module_devices`: its header, shardy meshes,
       shardings and collectives) picks the first that many local devices of
       ``platform``, in order (the device assignment ``extract`` saw on one process).
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
            (``hlo_tools/xla_passes.toml``), as :func:`compile_hlo` does.
        library: with ``exact``, dots and convolutions on XLA's kernel library
            (:func:`plan_library_options`), as every enacted plan runs them.
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
    devices = _local_devices_for(hlo_text, platform)
    hlo_text = _strip_aliasing(module, hlo_text)
    program_shape = _computation(hlo_text).program_shape()
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
        options = _options(lowered, exact, compiler_options, library)
        run = CompiledHlo(_compile(lowered, options), hlo_text, options)
        placed: tuple[Any, ...] = ()
        if inputs:
            rng = np.random.default_rng(seed)
            placed = tuple(jax.device_put(_random_array(rng, d, t), s)
                           for (d, t), s in zip(params_flat, run.compiled.input_shardings[0],
                                                strict=True))
    return CompiledText(run, placed)


def backend_info(platform: str | None = None) -> dict[str, Any]:
    """What per-op times depend on: versions, platform, device kind and host CPUs.

    Returns:
        ``{"jax", "jaxlib", "platform", "device_kind", "num_devices", "cpu_count"}``.
    """
    platform = platform or jax.default_backend()
    devices = jax.devices(platform)
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.version.__version__,
        "platform": platform,
        "device_kind": devices[0].device_kind if devices else "",
        "num_devices": len(devices),
        "cpu_count": os.cpu_count() or 0,
    }


def device_memory_bytes(platform: str | None = None) -> int:
    """Memory one device of this process may use, bytes.

    A device that reports its memory (``memory_stats()["bytes_limit"]``: GPU) gives that;
    host devices (CPU), which report nothing, share the machine's physical memory, so each
    gets ``physical memory / local device count``.
    """
    platform = platform or jax.default_backend()
    devices = jax.local_devices(backend=platform)
    try:
        stats = devices[0].memory_stats() if devices else None
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(physical // max(1, len(devices)))


def fresh_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object that calls ``fn`` (a jit-wrapped ``fn`` is returned as is).

    jax caches the lowering of a function per argument signature, and
    :func:`compile_hlo` with a text writes that text into the cached lowering (on
    jax 0.10.2): afterwards ``jax.jit(fn)``, ``extract(fn, ...)`` and ``compile_hlo(fn,
    ..., None)`` all see the text instead of ``fn``'s own program. Lowering a fresh
    wrapper keeps the baselines from reading, or leaving behind, such a text.
    """
    if hasattr(fn, "lower"):
        return fn

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return step


class Coordinator:
    """Barriers and small key-value exchanges between the processes of a
    ``jax.distributed`` job, through jax's coordination service (its client is a jax
    internal, which is why this lives here).

    Args:
        prefix: the keys' prefix (distinct per use, e.g. ``"acc"``).
        timeout_ms: how long a barrier or a read waits for the other processes.
    """

    def __init__(self, prefix: str, timeout_ms: int = 600_000) -> None:
        from jax._src import distributed  # jax internal: the coordination client

        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("jax.distributed.initialize() has not been called")
        self.prefix, self.timeout_ms = prefix, timeout_ms
        self.count = 0

    def barrier(self, tag: str) -> None:
        """Waits until every process has reached the barrier ``tag``."""
        self.count += 1
        self.client.wait_at_barrier(f"{self.prefix}_{tag}_{self.count}", self.timeout_ms)

    def share(self, key: str, value: Any, pid: int) -> Any:
        """Process 0's ``value`` (JSON-serializable) on every process."""
        if pid == 0:
            self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value))
        return json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{key}",
                                                             self.timeout_ms))

    def all_values(self, key: str, value: Any, pid: int, n: int) -> list[Any]:
        """Every process's ``value`` (index = process id)."""
        self.client.key_value_set(f"{self.prefix}/{key}/{pid}", json.dumps(value))
        return [json.loads(self.client.blocking_key_value_get(f"{self.prefix}/{key}/{i}",
                                                              self.timeout_ms))
                for i in range(n)]
