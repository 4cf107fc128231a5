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

With ``exact=True`` the XLA passes that create fusions or combine collectives (listed per
backend in ``hlo_tools/xla_passes.toml``) are disabled, so the compiled program keeps the
fusions and AllReduces of the text. On XLA:CPU every op left outside a fusion is still
wrapped in its own single-op ``wrapped_*`` fusion by ``fusion-wrapper``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jaxlib.version
import numpy as np
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
    "Coordinator",
    "HloCompileError",
    "StandaloneHlo",
    "check_versions",
    "backend_info",
    "compile_hlo",
    "compile_standalone",
    "compiled_text",
    "count_all_reduces",
    "exact_compiler_options",
    "extract",
    "fresh_function",
    "hlo_text_to_mlir",
    "load_pass_config",
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


def _module_name(hlo_text: str) -> str:
    match = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    return match.group(1) if match else ""


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
