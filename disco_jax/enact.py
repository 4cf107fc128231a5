"""From a train step to the program that runs: in-context costs, candidates, and the
final choice by measurement (the product path shared by ``disco bench`` and, later,
``disco_jax.jit``).

1. :func:`profile_in_context` compiles the step's pre-optimization module with nothing
   fused (``exact=True``, dots and convolutions on XLA's kernel library as in every
   enacted plan) and profiles it where it will run: the same devices, processes and
   link. Every process of a multi-process job must call it (the program has
   collectives). :func:`profile_module_in_context` does the same for a module given
   alone (an HLO file: ``disco simulate``, ``disco optimize``), on this process's
   devices with inputs made from its parameters.
2. :func:`in_context_costs` turns that profile into the cost model: in-context single-op
   times first, standalone timings (:mod:`estimator.op_bench`, cached) only for the ops
   the profile lacks, the analytic model last. :func:`cover` adds standalone times for
   the ops of other modules (XLA's compiled plans) before they are priced.
3. :func:`measure` runs programs interleaved (rounds in a shared seeded order, every
   sample ``K`` calls, each waited for) and :func:`choose` decides: the search's best few
   plans, hand bucketing and XLA's default run side by side, and the choice climbs tiers
   (:func:`decide`, :func:`choice_tiers`): XLA's default, then hand bucketing, then
   DisCo's programs, each replacing the choice so far only when it wins most rounds
   against it, not when a lucky median says so.

Multi-process jobs synchronize through a :class:`Sync` (:func:`job_sync` wraps
``jax.distributed``'s coordination service): a barrier before every sample, ``K`` and the
round order from process 0, and per sample the minimum over processes (the last process
to arrive at the barrier times the iteration from the moment every participant is there).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import hlo_tools
from disco_jax.cost_model import CostModel
from estimator import op_bench
from estimator import profiler as pr
from estimator.hardware import HardwareConfig
from estimator.interface import FallbackFusedEstimator
from estimator.probes import tuple_allreduce_programs, tuple_buffer_latency
from hlo_tools.ir import HloInstruction, HloModule

__all__ = [
    "CHALLENGER_WIN_SHARE",
    "FUSED_SCALE_BOUNDS",
    "Calibration",
    "Choice",
    "InContext",
    "Sync",
    "choice_tiers",
    "choose",
    "cover",
    "decide",
    "calibrate_in_context",
    "in_context_costs",
    "inconsistent_walls",
    "job_sync",
    "measure",
    "pooled",
    "profile_in_context",
    "profile_module_in_context",
    "summarize_samples",
]


class Sync(Protocol):
    """What :func:`measure` needs from a multi-process job (None: one process).

    ``barrier(tag)`` waits for every process; ``share(key, value)`` returns process 0's
    JSON value everywhere; ``gather(key, value)`` returns every process's value.
    """

    def barrier(self, tag: str) -> None: ...

    def share(self, key: str, value: Any) -> Any: ...

    def gather(self, key: str, value: Any) -> list[Any]: ...


class _JobSync:
    def __init__(self, prefix: str, timeout_ms: int):
        import jax

        from hlo_tools.jax_bridge import Coordinator

        self._coord = Coordinator(prefix, timeout_ms)
        self._pid, self._n = jax.process_index(), jax.process_count()

    def barrier(self, tag: str) -> None:
        self._coord.barrier(tag)

    def share(self, key: str, value: Any) -> Any:
        return self._coord.share(key, value, self._pid)

    def gather(self, key: str, value: Any) -> list[Any]:
        return self._coord.all_values(key, value, self._pid, self._n)


def job_sync(prefix: str = "disco", timeout_ms: int = 900_000) -> Sync | None:
    """A :class:`Sync` over ``jax.distributed`` when the job has several processes,
    else None. ``prefix`` keeps the keys of separate uses apart."""
    import jax

    return _JobSync(prefix, timeout_ms) if jax.process_count() > 1 else None


# --------------------------------------------------------------------------- costs


class InContext(NamedTuple):
    """What :func:`profile_in_context` measured.

    Attributes:
        profile: the traced profile of the no-fusion program (per-op times).
        wall_s: untraced seconds per iteration of the no-fusion program.
        one_bucket: the no-fusion program with every gradient in one flat all-reduce
            bucket (the same computation, one collective), as a module.
        one_bucket_wall_s: its untraced seconds per iteration.
        fused: XLA's compilation of ``one_bucket`` with its op fusion on (the
            ``bucketed`` baseline with one bucket), as the module XLA runs (None: not
            measured).
        fused_wall_s: its untraced seconds per iteration (None: not measured).
        tuple_buffers: how many buffers the tuple probe's all-reduce has: the program's
            gradients, each its own buffer of one all-reduce, as XLA's combiner writes
            them (None: not measured).
        tuple_wall_s: seconds of that all-reduce alone in a program
            (:func:`estimator.probes.tuple_allreduce_programs`; None: not measured).
            Measured in multi-process jobs only: there each buffer of a combined
            collective is a network all-reduce of its own. In one process it is a
            rendezvous of the device threads (the extra fitted there, -0.02 to 0.15 ms
            per buffer on 4 held-out steps, was noise that made XLA's default up to 85%
            too slow in the held-out benchmark).
        flat_wall_s: seconds of one flat all-reduce of the same bytes alone in a program
            (None: not measured).
        runs: the measured programs by name (``no_fusion``, ``one_bucket``, ``fused``
            and, when measured, ``tuple`` and ``flat``), each called as ``run(*args)``
            with the step's arguments, to be measured again later (:func:`pooled`).
        samples_s: the samples behind the medians above, by the same names.
        one_bucket_profile: the traced profile of the one-bucket program (per-op times
            of its bucket's copies: the concatenate into the flat buffer and the
            slices out of it; None: not measured).

    The times are medians of interleaved samples (in a job, per sample the minimum over
    processes).
    """

    profile: pr.ProgramProfile
    wall_s: float
    one_bucket: HloModule
    one_bucket_wall_s: float
    fused: HloModule | None = None
    fused_wall_s: float | None = None
    tuple_buffers: int | None = None
    tuple_wall_s: float | None = None
    flat_wall_s: float | None = None
    runs: Mapping[str, Callable[..., Any]] | None = None
    samples_s: Mapping[str, Sequence[float]] | None = None
    one_bucket_profile: pr.ProgramProfile | None = None


def profile_in_context(step: Callable[..., Any], args: Sequence[Any], module: HloModule, *,
                       iterations: int = 5, warmup: int = 2, rounds: int = 5,
                       library: bool = True, sync: Sync | None = None) -> InContext:
    """Profiles ``module`` compiled with nothing fused, here, in the setup it will run in,
    and times it beside the same program with one gradient bucket, compiled once with
    nothing fused and once with XLA's op fusion, and in a multi-process job beside the
    tuple probe: the gradients' combined all-reduce alone, against one flat buffer of
    the same bytes (see :class:`InContext`).

    Args:
        step: the train step (its calling convention).
        args: its arguments (placed on the job's devices).
        module: its pre-optimization module.
        iterations: profiled iterations (per-op times are medians over them).
        warmup: untraced iterations first.
        rounds: untraced samples of each iteration time.
        library: run dots and convolutions on XLA's kernel library, as enacted plans do
            (:func:`hlo_tools.compile_hlo`'s ``library``), so their in-context times are
            the times a plan's dots will take.
        sync: the job's :class:`Sync` (None: one process).
    """
    graph = hlo_tools.device_graph(module)
    one = _one_bucket(module, graph)
    several = len(graph.gradient_allreduces) >= 2  # something to combine, buckets differ
    runs = {name: hlo_tools.compile_hlo(step, args, hlo_tools.to_text(m), exact=True,
                                        library=library)
            for name, m in (("no_fusion", module), ("one_bucket", one))}
    runs["fused"] = hlo_tools.compile_hlo(step, args, hlo_tools.to_text(one), exact=False,
                                          compiler_options=_fused_options())
    buffers = [int(graph.out_bytes[i]) for i in graph.gradient_allreduces]
    if sync is not None and several:
        probe = tuple_allreduce_programs(buffers)
        runs["tuple"] = lambda *_: probe.run_tuple()
        runs["flat"] = lambda *_: probe.run_flat()
    return _profile_runs(runs, args, one, iterations=iterations, warmup=warmup,
                         rounds=rounds, sync=sync, buckets_differ=several,
                         tuple_buffers=len(buffers) if "tuple" in runs else None)


def profile_module_in_context(module: HloModule | str, *, iterations: int = 5,
                              warmup: int = 2, rounds: int = 5, library: bool = True,
                              seed: int = 0) -> InContext:
    """:func:`profile_in_context` for a module given alone (HLO text or our IR), without
    its train step: e.g. a file for ``disco simulate`` / ``disco optimize``.

    Both programs (nothing fused; one gradient bucket) are compiled from their text by
    :func:`hlo_tools.jax_bridge.compile_text` on this process's devices, exactly as
    :func:`hlo_tools.compile_hlo` compiles them for the step (``exact=True``, dots and
    convolutions on the kernel library with ``library``), and run on the same inputs
    made from the entry parameters (normal floats, small ints; seeded). One process: the
    module runs on this process's devices alone.

    Args:
        module: the pre-optimization whole-program module (text, or parsed).
        iterations: profiled iterations (per-op times are medians over them).
        warmup: untraced iterations first.
        rounds: untraced samples of each iteration time.
        library: run dots and convolutions on XLA's kernel library, as enacted plans do.
        seed: seeds the inputs.

    Returns:
        The :class:`InContext` measurement, for :func:`in_context_costs` of the module.

    Raises:
        hlo_tools.jax_bridge.DevicesUnavailableError: the module needs more devices than
            this process has.
        hlo_tools.HloCompileError: the module cannot be compiled here (a compiled or
            multi-replica module, or XLA rejects it).
    """
    from hlo_tools.jax_bridge import compile_text

    text = module if isinstance(module, str) else hlo_tools.to_text(module)
    run, inputs = compile_text(text, exact=True, library=library, seed=seed)
    parsed = hlo_tools.parse(text) if isinstance(module, str) else module
    graph = hlo_tools.device_graph(parsed)
    one = _one_bucket(parsed, graph)
    one_text = hlo_tools.to_text(one)
    runs = {"no_fusion": run,
            "one_bucket": compile_text(one_text, exact=True, library=library,
                                       inputs=False).run,
            "fused": compile_text(one_text, exact=False, inputs=False,
                                  compiler_options=_fused_options()).run}
    return _profile_runs(runs, inputs, one, iterations=iterations, warmup=warmup,
                         rounds=rounds, sync=None,
                         buckets_differ=len(graph.gradient_allreduces) >= 2)


def _one_bucket(module: HloModule, graph: hlo_tools.DeviceGraph) -> HloModule:
    """``module`` (its device ``graph``) with every gradient in one flat all-reduce
    bucket."""
    from hlo_tools import plan as P

    return hlo_tools.apply_plan(module, P.bucket_plan(P.FusionSpace(graph), None), graph)


def _fused_options() -> dict[str, Any]:
    """XLA's options for the fused program of :class:`InContext`: the ``bucketed``
    baseline's (op fusion on, combiner off)."""
    import jax

    from hlo_tools import baselines as bl

    return bl.baseline_options(bl.BUCKETED, jax.default_backend())


#: At most this many more rounds of in-context timings while they are inconsistent
#: (:func:`inconsistent_walls`).
REMEASURE_INCONSISTENT = 2


def inconsistent_walls(walls: Mapping[str, Sequence[float]]) -> bool:
    """Whether in-context timings contradict what the programs are: the one-bucket
    program runs the no-fusion program's kernels with fewer collectives, so its median
    at or above the no-fusion program's can only be a slow phase of a shared host (seen
    once in five held-out runs on 4 host devices: 14.3 against 10.1 ms, which fitted an
    all-reduce latency of 0 and a compute scale of 3.1, and put every prediction of that
    job 15-47% off)."""
    return statistics.median(walls["one_bucket"]) >= statistics.median(walls["no_fusion"])


def _profile_runs(runs: Mapping[str, Callable[..., Any]], args: Sequence[Any],
                  one: HloModule, *, iterations: int, warmup: int, rounds: int,
                  sync: Sync | None, buckets_differ: bool,
                  tuple_buffers: int | None = None) -> InContext:
    """Profiles ``runs["no_fusion"]`` and times it beside ``runs["one_bucket"]`` (the
    program of ``one``), ``runs["fused"]`` (XLA's compilation of it) and, when given,
    the tuple probe ``runs["tuple"]`` and ``runs["flat"]`` (``tuple_buffers`` buffers),
    all called on ``args``. With ``buckets_differ`` (the program has two gradient
    all-reduces or more, so the bucket has copies), ``runs["one_bucket"]`` is profiled
    too, and timings that are :func:`inconsistent_walls` get up to
    :data:`REMEASURE_INCONSISTENT` more rounds of ``rounds`` samples, pooled (every
    process of a job sees the same samples, so all decide alike)."""
    from hlo_tools import baselines as bl

    profile = pr.profile_program(runs["no_fusion"], *args, iterations=iterations,
                                 warmup=warmup)
    one_profile = (pr.profile_program(runs["one_bucket"], *args, iterations=iterations,
                                      warmup=warmup) if buckets_differ else None)
    walls = measure(runs, args, rounds=rounds, sync=sync, tag="in_context")
    for again in range(REMEASURE_INCONSISTENT if buckets_differ else 0):
        if not inconsistent_walls(walls):
            break
        more = measure(runs, args, rounds=rounds, sync=sync, tag=f"in_context_{again}")
        walls = {name: [*walls[name], *more[name]] for name in walls}
    probed = "tuple" in runs and tuple_buffers is not None
    return InContext(profile, statistics.median(walls["no_fusion"]), one,
                     statistics.median(walls["one_bucket"]),
                     bl.module_from_compiled(runs["fused"]),
                     statistics.median(walls["fused"]),
                     tuple_buffers if probed else None,
                     statistics.median(walls["tuple"]) if probed else None,
                     statistics.median(walls["flat"]) if probed else None,
                     dict(runs), walls, one_profile)


def pooled(measured: InContext, more: Mapping[str, Sequence[float]]) -> InContext:
    """``measured`` with more samples of its programs (by the names of
    :attr:`InContext.runs`, e.g. taken again beside other programs later in the job)
    pooled into its medians: a fit to the result describes the job's later minutes as
    well as its first (on this shared VM a program measured a minute apart moved by
    5-17%, and every prediction of the step with it)."""
    samples = {name: [*got, *more.get(name, ())]
               for name, got in (measured.samples_s or {}).items()}

    def median(name: str, old: float | None) -> float | None:
        return statistics.median(samples[name]) if name in samples and old is not None \
            else old

    return measured._replace(
        wall_s=median("no_fusion", measured.wall_s),
        one_bucket_wall_s=median("one_bucket", measured.one_bucket_wall_s),
        fused_wall_s=median("fused", measured.fused_wall_s),
        tuple_wall_s=median("tuple", measured.tuple_wall_s),
        flat_wall_s=median("flat", measured.flat_wall_s), samples_s=samples)


def in_context_costs(module: HloModule, hardware: HardwareConfig | str,
                     measured: InContext | None, *, bench: bool = True,
                     calibrate: bool = True, progress: bool | None = None,
                     op_profile: pr.OpProfile | None = None, replicas: int = 1,
                     fused: Any = None) -> tuple[CostModel, Calibration | None]:
    """The cost model of ``module`` in the setup ``measured`` was taken in.

    Op times in priority order: ``op_profile`` (a stored profile, when given), the
    in-context profile (:func:`profile_in_context`), then standalone timings of the ops
    they lack (``bench``, each op on ``replicas`` devices at once), then the one-bucket
    program's profile for the ops only it runs (its bucket's copies), then the analytic
    model. With ``calibrate``, the hardware file's all-reduce model and compute scale are
    then fitted to the same measurement (:func:`calibrate_in_context`). ``fused``: a
    fused-op estimator to use instead of the fallback rule (one with a ``bind`` method,
    e.g. the GNN, is bound to the cost model first), set before the fit.

    Returns:
        The cost model and its :class:`Calibration` (None without ``calibrate`` or a
        measurement).
    """
    if op_profile is None:
        costs = CostModel.for_module(module, hardware,
                                     profile=measured.profile if measured else None,
                                     profiled_module=module, bench=bench,
                                     replicas=replicas, progress=progress)
    else:
        costs = CostModel.for_module(module, hardware, profile=op_profile, bench=False)
        if measured is not None:
            costs.op_times.add_program_profile(measured.profile, original=module)
        if bench:
            costs.op_times.add_timings(op_bench.bench_ops(module, replicas=replicas,
                                                          progress=progress))
    if measured is not None and measured.one_bucket_profile is not None:
        costs.op_times.add_program_profile(measured.one_bucket_profile,
                                           original=measured.one_bucket)
    if fused is not None:
        costs.set_fused_estimator(fused.bind(costs) if hasattr(fused, "bind") else fused)
    if not calibrate or measured is None:
        return costs, None
    return calibrate_in_context(costs, module, measured, bench=bench)


def cover(costs: CostModel, module: HloModule, progress: bool | None = False) -> int:
    """Times standalone (cached) the ops of ``module`` that ``costs`` has no time for --
    e.g. the ops of XLA's compiled plans, inside its library fusions timed as the library
    runs them; returns how many were added."""
    todo = [instr for key, (instr, _) in op_bench.benchable_ops(module).items()
            if key not in costs.op_times.times]
    if not todo:
        return 0
    return costs.op_times.add_timings(op_bench.bench_ops(module, todo, replicas=1,
                                                         progress=progress))


class Calibration(NamedTuple):
    """What :func:`calibrate_in_context` fitted.

    Attributes:
        d_s: all-reduce latency inside the program, seconds.
        compute_scale: the factor on every compute node.
        wall_s: ``(no fusion, one bucket)`` measured seconds per iteration.
        predicted_s: ``(no fusion, one bucket)`` predicted after the fit, seconds.
        fused_scale: the factor on fused-op estimates (1.0 when XLA's fused program was
            not measured).
        fused_wall_s: XLA's fused one-bucket program, measured seconds per iteration
            (None: not measured).
        fused_predicted_s: the same, predicted after the fit (None: not measured).
        d_tuple_extra_s: the extra latency of each buffer of a variadic all-reduce
            (:attr:`estimator.allreduce.AllReduceModel.d_tuple_extra_s`; the hardware
            file's when the tuple probe was not measured).
        tuple_latency_s: the latency each buffer of a combined all-reduce paid in the
            tuple probe (:func:`estimator.probes.tuple_buffer_latency`), seconds (None:
            not measured).
        copy_s_per_byte: the bucket copies' seconds per byte
            (:func:`bucket_copy_rate`; None: not measured, the hardware file's).
    """

    d_s: float
    compute_scale: float
    wall_s: tuple[float, float]
    predicted_s: tuple[float, float]
    fused_scale: float = 1.0
    fused_wall_s: float | None = None
    fused_predicted_s: float | None = None
    d_tuple_extra_s: float = 0.0
    tuple_latency_s: float | None = None
    copy_s_per_byte: float | None = None


#: Range of the fitted fused-op scale.
FUSED_SCALE_BOUNDS = (0.2, 5.0)

#: Range of the measured seconds per byte of a bucket's copies (0.5-500 GB/s).
COPY_RATE_BOUNDS = (2e-12, 2e-9)


def bucket_copies(module: HloModule) -> list[HloInstruction]:
    """The copies of ``module``'s AllReduce buckets as :func:`hlo_tools.apply_plan`
    writes them: the ``concatenate`` into each flat buffer and the ``slice`` ops out of
    it (in the per-device computation)."""
    comp = hlo_tools.device_graph(module).computation
    by_name = {i.name: i for i in comp.instructions}
    users: dict[str, list[HloInstruction]] = {}
    for instr in comp.instructions:
        for o in instr.operands:
            users.setdefault(o, []).append(instr)
    out = []
    for instr in comp.instructions:
        if instr.opcode != "all-reduce" or len(instr.operands) != 1:
            continue
        buffer = by_name.get(instr.operands[0])
        if buffer is None or buffer.opcode != "concatenate":
            continue
        out += [buffer, *(u for u in users.get(instr.name, ()) if u.opcode == "slice")]
    return out


def bucket_copy_rate(costs: CostModel, module: HloModule) -> float | None:
    """Seconds per byte of the bucket copies of ``module`` (:func:`bucket_copies`) as
    profiled in context: ``sum(t - L) / sum(2 * bytes)`` over those with a profiled time
    (each reads and writes its bytes once; ``L`` the per-kernel launch cost, as in
    :meth:`~disco_jax.cost_model.CostModel.copy_time`), clamped to
    :data:`COPY_RATE_BOUNDS`. None: no copy was profiled."""
    view = costs.view(module)
    launch = costs.constants.kernel_launch_s
    spent = moved = 0.0
    for instr in bucket_copies(module):
        est = costs.op_times.estimate(view, instr)
        if est.estimated or est.source != "profile":
            continue
        spent += max(est.time_s - launch, 0.0)
        moved += 2.0 * instr.shape.byte_size()
    if moved <= 0:
        return None
    return float(min(max(spent / moved, COPY_RATE_BOUNDS[0]), COPY_RATE_BOUNDS[1]))


def calibrate_in_context(costs: CostModel, module: HloModule, measured: InContext, *,
                         bench: bool = True) -> tuple[CostModel, Calibration]:
    """Fits the all-reduce latency ``D``, the compute scale and the fused-op scale to the
    programs measured in context (:func:`profile_in_context`).

    1. ``D`` and the compute scale, from two programs: no fusion with every gradient on
       its own all-reduce, and the same with one bucket. The two run the same kernels
       and differ in the number of collectives, so the pair separates what a collective
       costs inside a program -- gloo's latency, and the wait for the slower process,
       which no microbenchmark sees and which changes from run to run on a shared host --
       from how fast the kernels run beside the job's other devices (4 devices of one
       process share 2 cores). Both simulated times are close to affine in
       ``(scale, D)``: finite differences give the 2x2 system, solved once and refined
       once; the scale is clamped to ``[0.25, 8]`` times the hardware file's, ``D`` to
       ``[0, 1 s]``. ``C`` (seconds per byte) stays the file's.
    2. The fused-op scale (:attr:`~disco_jax.cost_model.BackendConstants.fused_scale`),
       from XLA's fused compilation of the one-bucket program, when it was measured: the
       same collective and the same computation as the second program, fused as XLA
       fuses, so what its time differs by is how fast fused kernels run here. Its
       simulated time is affine in the scale: solved once and refined once, clamped to
       :data:`FUSED_SCALE_BOUNDS`.
    3. The extra latency of each buffer of a variadic all-reduce
       (:attr:`~estimator.allreduce.AllReduceModel.d_tuple_extra_s`), from the tuple
       probe when it was measured: XLA:CPU reduces the buffers of a combined
       all-reduce one after the other, each paying gloo's bare latency
       (:func:`estimator.probes.tuple_buffer_latency`), where a gradient all-reduce
       between computations pays ``D``; the extra is the difference, so each buffer's
       latency stays >= 0. (Fitting it instead to the no-fusion program with XLA's
       combiner on, as before, gave every buffer about ``D``: 0.24 ms on mixer in
       gloo2 where the probe and XLA's default's traced all-reduce both show
       0.17 ms, and XLA's default came out 20-40% too slow.)
    4. The bucket copies' seconds per byte
       (:attr:`~disco_jax.cost_model.BackendConstants.copy_s_per_byte`), from the
       one-bucket program's profile (:func:`bucket_copy_rate`) when it was taken; set
       before 1-3, which price that program's copies. The default per-byte cost priced
       autoencoder's 2.5 MB flat buffer at 2.5 times its traced 0.2 ms, which the fit of
       the compute scale then took out of every kernel.

    With ``bench``, ops of XLA's programs that no measurement covers are timed
    standalone first (:func:`cover`, before any fit, so that every fit sees the same op
    times).

    Returns:
        The calibrated cost model (same op times) and the :class:`Calibration`.
    """
    import dataclasses

    import numpy as np

    from disco_jax.lower import sim_graph_from_module
    from disco_jax.simulator import simulate

    has_fused = measured.fused is not None and measured.fused_wall_s is not None
    if has_fused and bench:
        cover(costs, measured.fused)
    copy = bucket_copy_rate(costs, measured.one_bucket)
    modules = (module, measured.one_bucket)
    want = np.array([measured.wall_s, measured.one_bucket_wall_s])
    s0, d0 = costs.constants.compute_scale, costs.hardware.allreduce.d_s
    # another estimator (the GNN) carries over: its member times are the same op times
    estimator = None if isinstance(costs.fused, FallbackFusedEstimator) else costs.fused

    def model(scale: float, d: float, fused: float = costs.constants.fused_scale,
              extra: float = costs.hardware.allreduce.d_tuple_extra_s) -> CostModel:
        ar = dataclasses.replace(costs.hardware.allreduce, d_s=d, d_tuple_extra_s=extra)
        consts = dataclasses.replace(costs.constants, compute_scale=scale, fused_scale=fused,
                                     copy_s_per_byte=copy or costs.constants.copy_s_per_byte,
                                     source=f"{costs.constants.source} + in-context fit")
        return CostModel(dataclasses.replace(costs.hardware, allreduce=ar),
                         op_times=costs.op_times, constants=consts, fused=estimator)

    def time_of(m: HloModule, cm: CostModel) -> float:
        return simulate(sim_graph_from_module(m, cm), cm.overlap).iteration_s

    def times(scale: float, d: float) -> np.ndarray:
        cm = model(scale, d)
        return np.array([time_of(m, cm) for m in modules])

    x = np.array([s0, max(d0, 1e-5)])
    lo, hi = np.array([0.25 * s0, 0.0]), np.array([8.0 * s0, 1.0])
    for _ in range(2):
        base = times(*x)
        step = np.maximum(x * 0.5, [1e-3, 1e-5])
        jac = np.stack([(times(x[0] + step[0], x[1]) - base) / step[0],
                        (times(x[0], x[1] + step[1]) - base) / step[1]], axis=1)
        try:
            x = np.clip(x + np.linalg.solve(jac, want - base), lo, hi)
        except np.linalg.LinAlgError:
            break
    got = times(*x)
    fused, fused_got = costs.constants.fused_scale, None
    if has_fused:
        fused, fused_got = _fit_affine(
            lambda f: time_of(measured.fused, model(*x, f)), measured.fused_wall_s, fused,
            lambda f: 0.5 * f, *FUSED_SCALE_BOUNDS)
    extra, per_buffer = costs.hardware.allreduce.d_tuple_extra_s, None
    if (measured.tuple_buffers or 0) >= 2 and measured.tuple_wall_s is not None \
            and measured.flat_wall_s is not None:
        per_buffer = tuple_buffer_latency(measured.tuple_wall_s, measured.flat_wall_s,
                                          measured.tuple_buffers)
        extra = per_buffer - float(x[1])
    cm = model(*x, fused, extra)
    return cm, Calibration(float(x[1]), float(x[0]), (float(want[0]), float(want[1])),
                           (float(got[0]), float(got[1])), fused,
                           measured.fused_wall_s, fused_got, extra, per_buffer, copy)


def _fit_affine(time_at: Callable[[float], float], want: float, x: float,
                step: Callable[[float], float], lo: float, hi: float) -> tuple[float, float]:
    """Solves ``time_at(x) = want`` for a time close to affine in ``x``: a secant step
    of width ``step(x)``, refined once, clamped to ``[lo, hi]``; ``x`` stays where the
    time does not grow with it (nothing in the program depends on it).

    Returns:
        ``(x, time_at(x))``.
    """
    for _ in range(2):
        base = time_at(x)
        h = step(x)
        slope = (time_at(x + h) - base) / h
        if slope <= 0:
            break
        x = float(min(max(x + (want - base) / slope, lo), hi))
    return x, time_at(x)


# --------------------------------------------------------------------------- measuring


def _timed(run: Callable[..., Any], args: Sequence[Any], k: int) -> float:
    """Seconds per iteration of ``k`` calls, each waited for.

    Each call is waited for before the next is dispatched: XLA:CPU (jax 0.10.2) can
    deadlock when several calls of a program with in-process collectives are queued on
    the host devices of one process -- some devices' threads wait in a rendezvous for a
    device whose execution never starts, and after 40 s XLA aborts the process (seen
    with 4 host devices on 2 cores, programs of a few milliseconds called back to back).
    """
    import jax

    t0 = time.perf_counter()
    for _ in range(k):
        jax.block_until_ready(run(*args))
    return (time.perf_counter() - t0) / k


def measure(runs: Mapping[str, Callable[..., Any]], args: Sequence[Any], *,
            rounds: int = 10, min_sample_s: float = 0.1, warmup: int = 2, max_k: int = 50,
            seed: int = 0, sync: Sync | None = None, tag: str = "measure",
            progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Per-iteration seconds of each program, measured interleaved.

    Args:
        runs: the programs by name; each is called as ``run(*args)``.
        args: their arguments.
        rounds: samples per program; each round runs every program once, in an order
            shuffled per round (seeded, the same on every process).
        min_sample_s: a sample is ``K`` calls (each waited for) lasting about this long
            (``K`` per program from the warm-up, at most ``max_k``).
        warmup: untimed calls per program first.
        max_k: the most calls in one sample.
        seed: seeds the round order.
        sync: the job's :class:`Sync` (None: one process).
        tag: keeps the barriers and keys of separate measurements apart.
        progress: called with a line after the warm-up and every few rounds.

    Returns:
        ``{name: [seconds per iteration, one per round]}``; in a multi-process job the
        same on every process (per sample the minimum over processes).
    """
    names = sorted(runs)
    warm: dict[str, float] = {}
    for name in names:
        if sync is not None:
            sync.barrier(f"{tag}_warm")
        warm[name] = min(_timed(runs[name], args, 1) for _ in range(max(1, warmup)))
    ks = {n: max(1, min(max_k, round(min_sample_s / max(t, 1e-6)))) for n, t in warm.items()}
    if sync is not None:
        ks = sync.share(f"{tag}_k", ks)
    if progress is not None:
        progress("warm: " + ", ".join(f"{n} {warm[n] * 1e3:.1f} ms" for n in names))
    rng = random.Random(f"{seed}/{tag}")
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = list(names)
        rng.shuffle(order)
        for name in order:
            if sync is not None:
                sync.barrier(tag)
            samples[name].append(_timed(runs[name], args, ks[name]))
        if progress is not None and (r == 0 or (r + 1) % 5 == 0 or r + 1 == rounds):
            progress(f"round {r + 1}/{rounds}")
    if sync is not None:
        everyone = sync.gather(f"{tag}_samples", samples)
        samples = {n: [min(p[n][i] for p in everyone) for i in range(rounds)]
                   for n in names}
    return samples


def summarize_samples(samples: Sequence[float]) -> dict[str, float]:
    """``{"median_s", "p25_s", "p75_s"}`` of per-iteration samples."""
    if len(samples) == 1:
        return {"median_s": samples[0], "p25_s": samples[0], "p75_s": samples[0]}
    q = statistics.quantiles(samples, n=4)
    return {"median_s": statistics.median(samples), "p25_s": q[0], "p75_s": q[2]}


#: a challenger replaces the current choice (first XLA's default, then the hand bucketing
#: that beat it) only when it is faster in at least this share of the rounds, paired
#: within a round (3 of 3, 4 of 4, 4 of 5, 6 of 7): a one-sided sign test at about 6% for
#: 4 rounds. On the 2-core VM a bucketed program 1-2% faster by the median of 4 rounds was
#: 4% slower over 14 rounds (transformer-medium, inproc4; it won 4 of them), and with a
#: share of 0.75 bert-medium's 4 MiB buckets won 3 of 4 choice rounds and then lost the
#: fresh rounds by 16% (bimodal: p25 126 ms, median 139 ms against XLA's 120 ms). Lesser
#: wins are not worth a program the user did not have; real ones (hand bucketing on gloo,
#: 3x) win every round.
CHALLENGER_WIN_SHARE = 0.8


class Choice(NamedTuple):
    """The outcome of :func:`choose`.

    Attributes:
        name: the chosen program.
        medians_s: median seconds per iteration of every candidate.
        samples_s: the samples behind them.
        incumbent: the first tier's program, kept unless a challenger beats it (None:
            no tiers were named, the lowest median won).
        wins: per challenger, the rounds it was faster than the program it challenged in
            (empty without tiers).
        against: per challenger, the program it challenged: the choice of the tiers
            before its own (empty without tiers).
    """

    name: str
    medians_s: dict[str, float]
    samples_s: dict[str, list[float]]
    incumbent: str | None = None
    wins: dict[str, int] = {}
    against: dict[str, str] = {}


def decide(samples: Mapping[str, Sequence[float]],
           tiers: Sequence[Sequence[str]] | None = None, *,
           win_share: float = CHALLENGER_WIN_SHARE) -> Choice:
    """The choice from interleaved samples (:func:`measure`'s output).

    Without tiers the lowest median wins. With them, the choice climbs a ladder: the
    first tier's lowest median (``["xla_default"]``: what the user runs without DisCo) is
    the incumbent; each later tier (hand bucketing, then DisCo's own programs) challenges
    the choice so far, and a challenger is eligible when it was faster than that choice in
    at least ``win_share`` of the rounds (samples of one round compared) and has a lower
    median; the eligible one with the lowest median becomes the choice. A program of a
    later tier must so beat the best of the earlier ones, not merely XLA's default:
    a plan that ties with hand bucketing stays out. Programs in no tier form a last one.
    Ties go to the name first in sorted order, so every process of a job (which sees the
    same samples) chooses the same program.

    Args:
        samples: ``{name: [seconds per iteration, one per round]}``, rounds aligned.
        tiers: groups of program names, the incumbent's first, or None.
        win_share: the share of rounds a challenger must win, in ``(0, 1]``.

    Raises:
        ValueError: no samples, a tier naming a program that was not measured (or an
            empty first tier), or a bad share.
    """
    if not samples:
        raise ValueError("nothing to choose from")
    if not 0 < win_share <= 1:
        raise ValueError(f"win_share must be in (0, 1], got {win_share}")
    medians = {n: statistics.median(s) for n, s in samples.items()}
    copied = {n: list(s) for n, s in samples.items()}
    if tiers is None:
        return Choice(min(sorted(medians), key=medians.__getitem__), medians, copied)
    named = [n for tier in tiers for n in tier]
    missing = sorted(set(named) - set(samples))
    if missing or not tiers or not tiers[0]:
        raise ValueError(f"the tiers name programs that were not measured: {missing}"
                         if missing else "the first tier (the incumbent) is empty")
    rest = sorted(set(samples) - set(named))
    ladder = [sorted(t) for t in tiers] + ([rest] if rest else [])
    name = min(ladder[0], key=medians.__getitem__)
    incumbent, wins, against = name, {}, {}
    need = math.ceil(win_share * len(samples[name]) - 1e-9)
    for tier in ladder[1:]:
        base = samples[name]
        for n in tier:
            wins[n] = sum(a < b for a, b in zip(samples[n], base))
            against[n] = name
        eligible = [n for n in tier if wins[n] >= need and medians[n] < medians[name]]
        if eligible:
            name = min(eligible, key=medians.__getitem__)
    return Choice(name, medians, copied, incumbent, wins, against)


def choice_tiers(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """The product's tiers for :func:`decide` among the named programs: XLA's default
    (the incumbent), then what a user sets by hand: bucketing (``bucketed_*``,
    :func:`hlo_tools.plan.bucketed_name`), XLA's combiner at another threshold
    (``xla_combine_*``, :func:`hlo_tools.baselines.combine_threshold_name`) or XLA's
    fusion with no combining at all (``op_fusion``: each gradient's all-reduce on its
    own, which a program with spare pool threads can run beside the backward pass); every
    other program -- DisCo's plans and staged programs -- is in no tier, so forms the last
    one."""
    return ["xla_default"], sorted(n for n in names
                                   if n.startswith(("bucketed_", "xla_combine_"))
                                   or n == "op_fusion")


def choose(runs: Mapping[str, Callable[..., Any]], args: Sequence[Any], *, rounds: int = 5,
           tiers: Sequence[Sequence[str]] | None = None,
           win_share: float = CHALLENGER_WIN_SHARE, **kwargs: Any) -> Choice:
    """Measures the candidates side by side (:func:`measure`) and decides
    (:func:`decide`): the fastest, or with ``tiers`` the climb from the first tier's
    program, each later tier's best replacing the choice only when it beats it in
    ``win_share`` of the rounds."""
    return decide(measure(runs, args, rounds=rounds, **kwargs), tiers, win_share=win_share)
