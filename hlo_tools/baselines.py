"""The DisCo paper's four XLA baselines (section 6.1), and what XLA compiled for each.

Each baseline is jax's normal compilation with some XLA passes disabled (the lists are
``[cpu.baselines]`` / ``[gpu.baselines]`` of ``hlo_tools/jax_bridge/xla_passes.toml``):

* ``no_fusion``: fusion and AllReduce-combiner passes off; the same options as a plan's,
  ``jax_bridge.plan_library_options`` (XLA:CPU still wraps single ops in ``wrapped_*``
  fusions, and its kernel library takes single dots and convolutions, as in XLA's
  default and in every plan);
* ``op_fusion``: combiner passes off, XLA's op fusion on;
* ``allreduce_fusion``: fusion passes off, XLA's AllReduce combining on;
* ``xla_default``: nothing off;
* ``bucketed`` (hand bucketing: Horovod's tensor fusion, DDP's ``bucket_cap_mb``, one
  ``ravel_pytree`` and ``pmean`` in JAX): the gradients in flat buckets of at most T bytes
  in order of production (:func:`hlo_tools.plan.bucket_plan` written by ``apply_plan``),
  compiled with XLA's op fusion on and its combiner off. :data:`BUCKET_THRESHOLDS` are the
  candidates to sweep (:func:`bucketed_candidates`); the fastest measured is the baseline.

Typical use::

    step, args = zoo.get("vgg")(4, "tiny")
    for name in BASELINES:
        run = compile_baseline(step, args, name)
        outputs = run(*args)
        print(name, summary(module_from_compiled(run)))

AllReduce combine threshold. XLA:GPU's combiner takes its byte threshold from
``xla_gpu_all_reduce_combine_threshold_bytes`` (default 30 MiB, the paper's baseline).
XLA:CPU (jax/jaxlib 0.10.2) has **no** threshold option: its ``CpuAllReduceCombiner``
runs with ``INT64_MAX`` bytes and at most 256 operands per combined all-reduce, so
``threshold_bytes=None`` combines everything it can. On CPU, ``threshold_bytes=0``
disables the combiner and any other finite threshold is *emulated*: the
pre-optimization program is bucketed by XLA's own greedy rule (:func:`combiner_buckets`)
and each bucket is written as one all-reduce over a flat buffer (``apply_plan``, the form
DisCo's own plans take), then compiled with the combiner disabled. The flat buffer costs
a copy in and out that XLA's tuple all-reduce does not.

:func:`module_from_compiled` reads XLA's post-optimization HLO (``compiled.as_text()``)
as an :class:`~hlo_tools.ir.HloModule` whose per-device graph is the program as XLA runs
it: each fusion is one node and a combined (tuple) all-reduce is one collective node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from hlo_tools import jax_bridge as jb
from hlo_tools.compiled import is_library_fusion
from hlo_tools.graph import DeviceGraph, device_graph
from hlo_tools.ir import HloComputation, HloInstruction, HloModule
from hlo_tools.parser import parse
from hlo_tools.plan import (
    BUCKET_THRESHOLDS,
    FusionSpace,
    Plan,
    bucket_members,
    bucket_plan,
    bucketed_name,
    can_combine,
    combine,
    initial_plan,
)
from hlo_tools.printer import to_text
from hlo_tools.rewrite import apply_plan

__all__ = [
    "ALL_BASELINES",
    "BASELINES",
    "BUCKETED",
    "BUCKET_THRESHOLDS",
    "BucketedCandidate",
    "COMBINE_THRESHOLD_COUNT",
    "CPU_COMBINE_THRESHOLD_BYTES",
    "GPU_DEFAULT_THRESHOLD_BYTES",
    "apply_buckets",
    "baseline_options",
    "bucketed_candidates",
    "bucketed_name",
    "bucketed_plan",
    "combine_threshold_candidates",
    "combine_threshold_name",
    "combine_thresholds",
    "combined_plan_options",
    "combiner_buckets",
    "compile_baseline",
    "compile_bucketed",
    "module_from_compiled",
    "summary",
]

#: The baselines, in the paper's order.
BASELINES: tuple[str, ...] = ("no_fusion", "op_fusion", "allreduce_fusion", "xla_default")
#: Hand bucketing: flat gradient buckets of at most T bytes (:func:`compile_bucketed`).
BUCKETED = "bucketed"
#: The paper's baselines and hand bucketing.
ALL_BASELINES: tuple[str, ...] = (*BASELINES, BUCKETED)

#: Byte threshold of XLA:CPU's CpuAllReduceCombiner on 0.10.2 (``INT64_MAX``: unlimited).
CPU_COMBINE_THRESHOLD_BYTES = 2**63 - 1
#: Default of ``xla_gpu_all_reduce_combine_threshold_bytes`` (30 MiB).
GPU_DEFAULT_THRESHOLD_BYTES = 30 * 2**20
#: Most all-reduces XLA combines into one (both backends).
COMBINE_THRESHOLD_COUNT = 256

# baseline -> (XLA's op fusion on, XLA's AllReduce combining on)
_FLAGS = {
    "no_fusion": (False, False),
    "op_fusion": (True, False),
    "allreduce_fusion": (False, True),
    "xla_default": (True, True),
}
_DISABLE = "xla_disable_hlo_passes"
_NOT_OPS = frozenset({"parameter", "tuple", "get-tuple-element"})


# ------------------------------------------------------------------------------- options


def _flags(name: str) -> tuple[bool, bool]:
    """(op fusion, AllReduce combining) of a baseline; ValueError for unknown names."""
    try:
        return _FLAGS[name]
    except KeyError:
        raise ValueError(f"unknown baseline {name!r}; valid: {', '.join(ALL_BASELINES)}"
                         ) from None


def _bucketed_flags(platform: str, config: str | Path | None) -> tuple[bool, bool]:
    """(op fusion, AllReduce combining) of ``bucketed``, from the ``bucketed`` entry of the
    pass config's baselines table (the pass lists it switches off)."""
    off = set(_config(platform, config)["bucketed"])
    unknown = off - {"fusion", "combine"}
    if unknown:
        raise ValueError(f"bucketed: unknown pass lists {sorted(unknown)} (fusion, combine)")
    return "fusion" not in off, "combine" not in off


def _config(platform: str, config: str | Path | None) -> dict[str, Any]:
    """The ``[<backend>.baselines]`` table of the pass config for a jax platform name."""
    section = jb.platform_family(platform)
    if section is None:
        raise ValueError(f"no baseline passes for platform {platform!r} (cpu, gpu)")
    return jb.load_pass_config(config)[section]["baselines"]


def _threshold_option(cfg: Mapping[str, Any], platform: str, threshold: int) -> dict[str, int]:
    """``{option: threshold}``, or ValueError where XLA has no threshold option."""
    option = cfg.get("threshold_option", "")
    if not option:
        raise ValueError(
            f"XLA on {platform!r} has no AllReduce combine-threshold option (its combiner "
            "combines without a byte limit); compile_baseline emulates a finite threshold"
        )
    return {option: int(threshold)}


def baseline_options(
    name: str,
    platform: str = "cpu",
    threshold_bytes: int | None = None,
    *,
    config: str | Path | None = None,
) -> dict[str, Any]:
    """XLA compiler options that make jax's compilation the baseline ``name``.

    Args:
        name: one of :data:`ALL_BASELINES`. ``bucketed`` gets the option set of the
            ``bucketed`` entry of the pass config (XLA's fusion on, its combiner off); its
            buckets are written into the module (:func:`compile_bucketed`), not asked of XLA.
        platform: jax platform name (``cpu``, ``cuda``, ``rocm`` or ``gpu``).
        threshold_bytes: AllReduce combine threshold of the combining baselines. None:
            XLA's default (unlimited on CPU, 30 MiB on GPU); 0: no combining. Ignored by
            the baselines that do not combine.
        config: pass config TOML (``hlo_tools/jax_bridge/xla_passes.toml`` when None).

    Returns:
        Options for ``Lowered.compile(compiler_options=...)`` /
        ``jax_bridge.CompileOptions(exact=False, extra=...)``.

    Raises:
        ValueError: unknown name or platform, a negative threshold, or a positive finite
            threshold on a backend without a threshold option (XLA:CPU);
            :func:`compile_baseline` emulates that case.
    """
    if name == BUCKETED:
        fuses, combines = _bucketed_flags(platform, config)
    else:
        fuses, combines = _flags(name)
    if threshold_bytes is not None and threshold_bytes < 0:
        raise ValueError(f"threshold_bytes must be >= 0, got {threshold_bytes}")
    cfg = _config(platform, config)
    disabled: list[str] = []
    options: dict[str, Any] = {}
    if not fuses:
        disabled += cfg["fusion_disable"]
        options.update(cfg.get("fusion_options", {}))
    if not combines or threshold_bytes == 0:
        disabled += cfg["combine_disable"]
        options.update(cfg.get("combine_options", {}))
    elif threshold_bytes is not None and not _unlimited(platform, threshold_bytes):
        options.update(_threshold_option(cfg, platform, threshold_bytes))
    if disabled:
        options[_DISABLE] = ",".join(disabled)
    return options


#: Most thresholds of the swept combine threshold (:func:`combine_thresholds`).
MAX_SWEPT_THRESHOLDS = 6


def combine_thresholds(platform: str, gradient_bytes: int, *,
                       config: str | Path | None = None) -> tuple[int, ...]:
    """The combine thresholds a user of XLA sweeps, bytes: powers of two from 1 MiB up to
    the first at or above the step's gradient bytes, in 2x steps (NVIDIA's advice for
    JAX on GPUs), the largest :data:`MAX_SWEPT_THRESHOLDS` of them; none where XLA has no
    threshold option (XLA:CPU combines without a limit) or where every threshold
    combines what XLA's default threshold combines (the gradients fit under both).

    Args:
        platform: jax platform name (``cpu``, ``cuda``, ``rocm`` or ``gpu``).
        gradient_bytes: bytes of the step's gradient all-reduces together, per device.
        config: pass config TOML (``xla_passes.toml`` of the bridge when None).
    """
    if not _config(platform, config).get("threshold_option", ""):
        return ()
    out, t = [], 2**20
    while True:
        out.append(t)
        if t >= gradient_bytes:
            break
        t *= 2
    kept = [t for t in out if not (t >= gradient_bytes
                                   and GPU_DEFAULT_THRESHOLD_BYTES >= gradient_bytes)]
    return tuple(kept[-MAX_SWEPT_THRESHOLDS:])


def combine_threshold_name(threshold_bytes: int) -> str:
    """The name of XLA's default program with another combine threshold:
    ``xla_combine_16MiB``."""
    return f"xla_combine_{threshold_bytes >> 20}MiB"


def combine_threshold_candidates(platform: str, gradient_bytes: int, *,
                                 config: str | Path | None = None
                                 ) -> list[tuple[str, dict[str, Any]]]:
    """``(name, options)`` of XLA's default program at each swept combine threshold
    (:func:`combine_thresholds`): the hand-tuned baseline of a backend whose combiner
    takes a threshold."""
    return [(combine_threshold_name(t),
             baseline_options("xla_default", platform, t, config=config))
            for t in combine_thresholds(platform, gradient_bytes, config=config)]


def combined_plan_options(platform: str = "cpu", *, library: bool = True,
                          config: str | Path | None = None) -> dict[str, Any]:
    """Options that compile a module as a plan is compiled (exact, dots and convolutions
    on the kernel library: :func:`hlo_tools.jax_bridge.plan_library_options`) except
    that XLA's all-reduce combiner runs: the same kernels as the plan, every gradient in
    XLA's combined (variadic) all-reduce.

    Args:
        platform: jax platform name (``cpu``, ``cuda``, ``rocm`` or ``gpu``).
        library: dots and convolutions on the kernel library (False: XLA's own thunks,
            as ``CompileOptions(exact=True, library=False)``).
        config: pass config TOML (``hlo_tools/jax_bridge/xla_passes.toml`` when None).

    Returns:
        Options for ``jax_bridge.CompileOptions(exact=False, extra=...)``.
    """
    options = (jb.plan_library_options(platform, config) if library
               else jb.exact_compiler_options(platform, config))
    combiners = set(_config(platform, config)["combine_disable"])
    options[_DISABLE] = ",".join(name for name in options.get(_DISABLE, "").split(",")
                                 if name and name not in combiners)
    return options


def _unlimited(platform: str, threshold_bytes: int) -> bool:
    """Whether a threshold equals XLA:CPU's built-in one (no option needed)."""
    cpu = jb.platform_family(platform) == "cpu"
    return cpu and threshold_bytes >= CPU_COMBINE_THRESHOLD_BYTES


def _emulated(name: str, platform: str, threshold_bytes: int | None,
              config: str | Path | None) -> bool:
    """Whether the baseline needs a threshold the backend cannot be told."""
    if not _flags(name)[1] or threshold_bytes in (None, 0) or _unlimited(platform, threshold_bytes):
        return False
    return not _config(platform, config).get("threshold_option")


# ------------------------------------------------------------------------------ compiling


def compile_baseline(
    fn: Callable[..., Any],
    args: Sequence[Any],
    name: str,
    *,
    threshold_bytes: int | None = None,
    platform: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    config: str | Path | None = None,
) -> jb.CompiledHlo:
    """Compiles ``fn`` on ``args`` as the baseline ``name``.

    Args:
        fn: train step (plain or jit-wrapped), e.g. from :mod:`disco_jax.zoo`.
        args: positional arguments to lower it on.
        name: one of :data:`ALL_BASELINES`.
        threshold_bytes: AllReduce combine threshold (see :func:`baseline_options`). A
            positive finite value on XLA:CPU is emulated: the program is pre-bucketed with
            :func:`combiner_buckets` and compiled with XLA's combiner off; this needs the
            all-reduces explicit before partitioning (a ``shard_map`` step). For
            ``bucketed`` it is the bucket size T of :func:`compile_bucketed` (None: one
            bucket).
        platform: jax platform (default ``jax.default_backend()``).
        kwargs: keyword arguments to lower ``fn`` on.
        config: pass config TOML (``hlo_tools/jax_bridge/xla_passes.toml`` when None).

    Returns:
        The bridge's ``CompiledHlo``: call it like ``fn``; ``.as_text()`` is XLA's
        post-optimization HLO, ``.hlo_text`` the bucketed input text when emulated.

    Raises:
        ValueError: unknown name or platform, or an emulated threshold for a program
            without explicit all-reduces.
        jax_bridge.HloCompileError: XLA rejected the program.
    """
    if name == BUCKETED:
        return compile_bucketed(fn, args, threshold_bytes, platform=platform, kwargs=kwargs,
                                config=config).run
    platform = platform or jax.default_backend()
    step = jb.fresh_function(fn)
    if not _emulated(name, platform, threshold_bytes, config):
        options = baseline_options(name, platform, threshold_bytes, config=config)
        return jb.compile_module(None, jb.InPlaceOf(step, args, kwargs),
                                 jb.CompileOptions(exact=False, extra=options))
    module = parse(jb.extract(step, *args, **(kwargs or {})))
    if not any(i.opcode == "all-reduce" for i in device_graph(module).computation.instructions):
        raise ValueError(
            "cannot emulate a combine threshold: the program has no all-reduce before XLA's "
            "partitioner (not a shard_map step?)"
        )
    text = to_text(apply_buckets(module, combiner_buckets(module, threshold_bytes)))
    options = baseline_options(name, platform, 0, config=config)
    return jb.compile_module(text, jb.InPlaceOf(step, args, kwargs),
                             jb.CompileOptions(exact=False, extra=options))


# ---------------------------------------------------------------- threshold emulation


class _CombinerSpace(FusionSpace):
    """A :class:`FusionSpace` in which every single-operand array all-reduce may be
    combined (XLA's rule), not only the gradient all-reduces."""

    def __init__(self, graph: DeviceGraph):
        super().__init__(graph)
        self.allreduces = tuple(
            i for i, op in enumerate(graph.opcodes)
            if op == "all-reduce" and len(graph.operands[i]) == 1
            and graph.instruction(i).shape.is_array
        )
        self.ar_key = {i: _combine_key(graph, i) for i in self.allreduces}
        self.grad_producer = {i: graph.operands[i][0] for i in self.allreduces}


def _combine_key(graph: DeviceGraph, node: int) -> tuple[Any, ...]:
    """What two all-reduces must share to be combined (groups, reduction, type)."""
    instr = graph.instruction(node)
    attrs = instr.attrs
    reducer = graph.module.computation(instr.called_computations[0])
    return (attrs.get("replica_groups", ""), attrs.get("use_global_device_ids", ""),
            "channel_id" in attrs, reducer.root.opcode, instr.shape.element_type)


def _bucket_plan(space: _CombinerSpace, threshold: int, count: int) -> tuple[Plan, list[list[int]]]:
    """XLA's ``CombineInstructionsByKey`` on the graph, in print order, as a plan.

    Repeatedly: the first remaining all-reduce opens a bucket of its key; the following
    ones of that key join it in order until one would exceed ``threshold`` bytes or
    depends on the bucket (it then waits for a later round), or ``count`` is reached.
    An all-reduce larger than ``threshold`` alone is never combined.
    """
    graph = space.graph
    plan = initial_plan(graph)
    remaining = [a for a in space.allreduces if graph.out_bytes[a] <= threshold]
    buckets: list[list[int]] = []
    while remaining:
        bucket, size = [remaining[0]], graph.out_bytes[remaining[0]]
        for ar in remaining[1:]:
            if len(bucket) >= count:
                break
            if space.ar_key[ar] != space.ar_key[bucket[0]]:
                continue
            too_big = size + graph.out_bytes[ar] > threshold
            if too_big or not can_combine(space, plan, bucket[0], ar):
                break
            plan = combine(space, plan, bucket[0], ar)
            bucket.append(ar)
            size += graph.out_bytes[ar]
        remaining = [a for a in remaining if a not in bucket]
        buckets.append(bucket)
    return plan, [b for b in buckets if len(b) > 1]


def combiner_buckets(
    module: HloModule, threshold_bytes: int, count: int = COMBINE_THRESHOLD_COUNT
) -> list[list[str]]:
    """The all-reduces XLA's AllReduceCombiner would combine, by its greedy rule.

    Emulates ``CombineInstructionsByKey`` on the per-device program of a
    pre-optimization module. XLA walks its own post order of the partitioned module; this
    walks print order (both topological), so buckets can differ where the orders do.

    Args:
        module: pre-optimization module (e.g. ``parse(jax_bridge.extract(...))``).
        threshold_bytes: most bytes of one combined all-reduce.
        count: most all-reduces in one combined all-reduce.

    Returns:
        Buckets of two or more all-reduce names, in program order.
    """
    space = _CombinerSpace(device_graph(module))
    _, buckets = _bucket_plan(space, threshold_bytes, count)
    return [[space.graph.names[a] for a in bucket] for bucket in buckets]


def apply_buckets(module: HloModule, buckets: Sequence[Sequence[str]]) -> HloModule:
    """A copy of ``module`` with each bucket written as one flat-buffer all-reduce.

    Args:
        module: pre-optimization module.
        buckets: all-reduce names to combine (e.g. from :func:`combiner_buckets`).

    Raises:
        ValueError: a bucket is not legal (different keys, or one member depends on
            another).
    """
    graph = device_graph(module)
    space = _CombinerSpace(graph)
    plan = initial_plan(graph)
    for bucket in buckets:
        first = graph.index[bucket[0]]
        for other in bucket[1:]:
            plan = combine(space, plan, first, graph.index[other])
    return apply_plan(module, plan, graph)


# ---------------------------------------------------------------------- hand bucketing


@dataclass(frozen=True)
class BucketedCandidate:
    """One candidate of the ``bucketed`` baseline, compiled.

    Attributes:
        threshold_bytes: the bucket size T (None: one bucket).
        buckets: the gradient all-reduces of each bucket, by name, in order of
            production (a bucket of one is a gradient left alone).
        bucket_bytes: bytes of each bucket.
        planned_all_reduces: all-reduces of the bucketed module (buckets, gradients left
            alone and the other all-reduces, the loss's say): what XLA must run.
        run: the compiled program; call it like the train step.
    """

    threshold_bytes: int | None
    buckets: tuple[tuple[str, ...], ...]
    bucket_bytes: tuple[int, ...]
    planned_all_reduces: int
    run: jb.CompiledHlo


def bucketed_plan(module: HloModule, threshold_bytes: int | None
                  ) -> tuple[FusionSpace, Plan]:
    """The ``bucketed`` plan of a pre-optimization module: only AllReduce buckets
    (:func:`hlo_tools.plan.bucket_plan`), no fusion.

    Raises:
        ValueError: the program has no combinable all-reduce before XLA's partitioner
            (not a ``shard_map`` step), or a negative threshold.
    """
    space = FusionSpace(device_graph(module))
    if not space.allreduces:
        raise ValueError("cannot bucket: the program has no gradient all-reduce before XLA's "
                         "partitioner (not a shard_map step?)")
    return space, bucket_plan(space, threshold_bytes)


def _compile_bucketed(step: Callable[..., Any], args: Sequence[Any], module: HloModule,
                      thresholds: Sequence[int | None], platform: str,
                      kwargs: Mapping[str, Any] | None, config: str | Path | None,
                      afford: Callable[[], bool] | None = None) -> list[BucketedCandidate]:
    """One candidate per threshold; thresholds giving the same buckets share one compile;
    the sweep ends where ``afford()`` says False."""
    options = baseline_options(BUCKETED, platform, config=config)
    compiled: dict[tuple, tuple[int, jb.CompiledHlo]] = {}
    out = []
    for threshold in thresholds:
        space, plan = bucketed_plan(module, threshold)
        graph = space.graph
        members = bucket_members(space, plan)
        key = tuple(map(tuple, members))
        if key not in compiled:
            if afford is not None and not afford():
                break
            text = to_text(apply_plan(module, plan, graph))
            run = jb.compile_module(text, jb.InPlaceOf(step, args, kwargs),
                                    jb.CompileOptions(exact=False, extra=options))
            compiled[key] = (jb.count_all_reduces(text), run)
        planned, run = compiled[key]
        out.append(BucketedCandidate(
            threshold, tuple(tuple(graph.names[a] for a in b) for b in members),
            tuple(sum(graph.out_bytes[a] for a in b) for b in members), planned, run))
    return out


def compile_bucketed(
    fn: Callable[..., Any],
    args: Sequence[Any],
    threshold_bytes: int | None = None,
    *,
    platform: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    config: str | Path | None = None,
) -> BucketedCandidate:
    """Compiles ``fn`` on ``args`` as the ``bucketed`` baseline with bucket size T.

    The pre-optimization program gets flat gradient buckets of at most ``threshold_bytes``
    in order of production (:func:`bucketed_plan`, written by ``apply_plan``) and nothing
    else; XLA then compiles it with its op fusion on and its AllReduce combiner off
    (:func:`baseline_options` of ``bucketed``), so the buckets are the all-reduces that run.

    Args:
        fn: a ``shard_map`` train step (plain or jit-wrapped).
        args: positional arguments to lower it on.
        threshold_bytes: T, the most bytes of a bucket (None: one bucket).
        platform: jax platform (default ``jax.default_backend()``).
        kwargs: keyword arguments to lower ``fn`` on.
        config: pass config TOML (``hlo_tools/jax_bridge/xla_passes.toml`` when None).

    Raises:
        ValueError: no gradient all-reduce to bucket, or a negative threshold.
        jax_bridge.HloCompileError: XLA rejected the program.
    """
    return bucketed_candidates(fn, args, (threshold_bytes,), platform=platform, kwargs=kwargs,
                               config=config)[0]


def bucketed_candidates(
    fn: Callable[..., Any],
    args: Sequence[Any],
    thresholds: Sequence[int | None] = BUCKET_THRESHOLDS,
    *,
    platform: str | None = None,
    kwargs: Mapping[str, Any] | None = None,
    config: str | Path | None = None,
    module: HloModule | None = None,
    afford: Callable[[], bool] | None = None,
) -> list[BucketedCandidate]:
    """The ``bucketed`` sweep: one compiled candidate per threshold, in the given order.

    The program is extracted once (not at all when ``module`` is given); thresholds that
    give the same buckets (all of them on a model whose gradients fit in the smallest)
    share one compiled program. Measuring the candidates and keeping the fastest is the
    caller's business.

    Args:
        fn, args, platform, kwargs, config: as for :func:`compile_bucketed`.
        thresholds: the bucket sizes T (None: one bucket).
        module: ``fn``'s pre-optimization module on ``args``, already parsed.
        afford: asked before each compile; the sweep ends at the first False (the
            candidates so far are returned).
    """
    platform = platform or jax.default_backend()
    step = jb.fresh_function(fn)
    if module is None:
        module = parse(jb.extract(step, *args, **(kwargs or {})))
    return _compile_bucketed(step, args, module, thresholds, platform, kwargs, config,
                             afford)


# ----------------------------------------------------------------- reading the result


def module_from_compiled(compiled: jb.CompiledHlo | Any | str) -> HloModule:
    """XLA's post-optimization HLO as a module, to simulate the program XLA runs.

    Its per-device program is ENTRY (``device_graph`` picks it): every fusion XLA made
    is one ``fusion`` node (NodeKind.FUSION), a combined all-reduce is one tuple-shaped
    ``all-reduce`` node (NodeKind.COLLECTIVE) read through ``get-tuple-element``, and
    instructions are in XLA's schedule order. Large constants are elided (``{...}``) in
    this text, so the module is for analysis and simulation, not for recompiling.

    Args:
        compiled: a ``CompiledHlo``, a ``jax.stages.Compiled`` or its ``as_text()``.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    return parse(text, source="<compiled>")


def _fused_ops(comps: Mapping[str, HloComputation], fusion: HloInstruction) -> int:
    """Operations inside a fusion (nested fusions expanded), plumbing not counted."""
    total = 0
    for callee in fusion.called_computations:
        for instr in comps[callee].instructions:
            if instr.opcode == "fusion":
                total += _fused_ops(comps, instr)
            elif instr.opcode not in _NOT_OPS:
                total += 1
    return total


def _fusion_bodies(module: HloModule) -> set[str]:
    """Names of the computations that fusions call."""
    return {c for _, i in module.instructions() if i.opcode == "fusion"
            for c in i.called_computations}


def _top_level_fusions(module: HloModule) -> list[HloInstruction]:
    """Fusion instructions outside fused computations (in ENTRY, loop bodies, ...)."""
    bodies = _fusion_bodies(module)
    return [i for comp in module.computations if comp.name not in bodies
            for i in comp.instructions if i.opcode == "fusion"]


def _fusion_counts(module: HloModule) -> dict[str, int]:
    """Counts of multi-op, single-op, ``wrapped_*`` and library (kCustom) fusions."""
    comps = module.computations_by_name()
    fusions = _top_level_fusions(module)
    multi = [f for f in fusions if _fused_ops(comps, f) > 1]
    return {
        "fusions": len(fusions),
        "multi_op_fusions": len(multi),
        "single_op_fusions": len(fusions) - len(multi),
        "wrapped_fusions": sum(f.name.startswith("wrapped_") for f in fusions),
        "library_fusions": sum(is_library_fusion(f) for f in fusions),
        "ops_in_multi_op_fusions": sum(_fused_ops(comps, f) for f in multi),
    }


def _pieces(comps: Mapping[str, HloComputation], producer: HloInstruction | None) -> int:
    """Tensors in one all-reduce operand: the pieces of a flat buffer, else 1.

    A bucket written by ``apply_plan`` (and :func:`apply_buckets`) reaches XLA as one
    all-reduce of a ``concatenate``; after XLA's fusion the concatenate may be the root
    of the fusion that produces the operand. A bucket written after another all-reduce
    counts one piece more: the element that orders it (:mod:`hlo_tools.rewrite`).
    """
    if producer is None:
        return 1
    if producer.opcode == "fusion":
        producer = comps[producer.called_computations[0]].root
    return len(producer.operands) if producer.opcode == "concatenate" else 1


def _all_reduce_counts(module: HloModule) -> dict[str, Any]:
    """All-reduce count, and operands, tensors and bytes of each, in print order."""
    comps = module.computations_by_name()
    ars, tensors = [], []
    for comp in module.computations:
        defs = comp.by_name()
        for instr in comp.instructions:
            if instr.opcode in ("all-reduce", "all-reduce-start"):
                ars.append(instr)
                tensors.append(sum(_pieces(comps, defs.get(o)) for o in instr.operands))
    return {
        "all_reduces": len(ars),
        "all_reduce_operands": [len(i.operands) for i in ars],
        "all_reduce_tensors": tensors,
        "all_reduce_bytes": [i.shape.byte_size() for i in ars],
        "combined_all_reduces": sum(n > 1 for n in tensors),
        "all_reduced_tensors": sum(tensors),
    }


def summary(module: HloModule) -> dict[str, Any]:
    """What a compiled program fused and combined.

    Args:
        module: usually :func:`module_from_compiled` of a compiled baseline; a
            pre-optimization module works too (no fusions, one all-reduce per tensor).

    Returns:
        ``fusions`` (fusion instructions outside fused computations),
        ``multi_op_fusions`` (holding two or more operations), ``single_op_fusions``,
        ``wrapped_fusions`` (XLA:CPU's single-op ``wrapped_*``), ``library_fusions``
        (``kind=kCustom``, e.g. YNNPACK's ``__ynn_fusion``), ``ops_in_multi_op_fusions``,
        ``all_reduces`` (a combined tuple all-reduce counts once), per all-reduce in print
        order ``all_reduce_operands``, ``all_reduce_tensors`` (operands, a flat-buffer
        ``concatenate`` operand counting its pieces: how DisCo's buckets and the emulated
        thresholds are written) and ``all_reduce_bytes``; ``combined_all_reduces``
        (carrying two or more tensors), ``all_reduced_tensors`` (sum of tensors) and
        ``nodes`` (instructions of the per-device program: what a simulator schedules).
    """
    counts: dict[str, Any] = _fusion_counts(module)
    counts.update(_all_reduce_counts(module))
    counts["nodes"] = device_graph(module).num_nodes
    return counts
