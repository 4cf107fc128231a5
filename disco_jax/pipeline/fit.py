"""The cost model of a step in the setup it runs in: op times from the in-context
profile first, then standalone timings, then the analytic model; the all-reduce latency,
compute scale, saving share and bucket-copy rate fitted to the profile's measured
iterations."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import hlo_tools
from disco_estimator.costs.cost_model import CostModel, cover
from disco_estimator.costs.lower import affine_simulation, simulated_s
from disco_estimator.hardware import HardwareConfig
from disco_estimator.interface import FallbackFusedEstimator
from disco_estimator.ops import OpProfile, bench_ops
from disco_estimator.probes import tuple_buffer_latency
from disco_jax.pipeline.profile import CompiledInContext, InContext
from hlo_tools.ir import HloInstruction, HloModule

__all__ = [
    "COPY_RATE_BOUNDS",
    "C_BOUNDS",
    "COMPUTE_SCALE_BOUNDS",
    "OVERLAP_STEPS",
    "SAVING_SHARE_BOUNDS",
    "SHARE_REBUILDS",
    "SHARE_TOLERANCE",
    "Calibration",
    "CompiledFit",
    "bucket_copies",
    "bucket_copy_rate",
    "flat_rate",
    "calibrate_in_context",
    "compiled_in_context_costs",
    "default_hardware",
    "fit_overlap_to_latency",
    "in_context_costs",
]


def default_hardware(num_processes: int, platform: str = "cpu") -> str:
    """The shipped hardware file for a setup on a backend (the in-context fit adapts its
    all-reduce latency and compute scale): on CPU ``inproc4`` for one process, else
    ``gloo2``; on GPU ``gpu_nvlink8`` for one process (its devices on one server), else
    ``gpu_400g``.

    Raises:
        ValueError: a platform with no shipped hardware file (not CPU or GPU).
    """
    from hlo_tools.jax_bridge import platform_family

    family = platform_family(platform)
    if family == "cpu":
        return "inproc4" if num_processes <= 1 else "gloo2"
    if family == "gpu":
        return "gpu_nvlink8" if num_processes <= 1 else "gpu_400g"
    raise ValueError(f"no shipped hardware file for platform {platform!r}; pass hardware= "
                     "(a file from disco calibrate)")


def in_context_costs(module: HloModule, hardware: HardwareConfig | str,
                     measured: InContext | None, *, bench: bool = True,
                     calibrate: bool = True, progress: bool | None = None,
                     op_profile: OpProfile | None = None, replicas: int = 1,
                     fused: Any = None, overlap: float | None = None
                     ) -> tuple[CostModel, Calibration | None]:
    """The cost model of ``module`` in the setup ``measured`` was taken in.

    Op times in priority order: ``op_profile`` (a stored profile, when given), the
    in-context profile (:func:`profile_in_context`), then standalone timings of the ops
    they lack (``bench``, each op on ``replicas`` devices at once), then the one-bucket
    program's profile for the ops only it runs (its bucket's copies), then the analytic
    model. With ``calibrate``, the hardware file's all-reduce model and compute scale are
    then fitted to the same measurement (:func:`calibrate_in_context`). ``fused``: a
    fused-op estimator to use instead of the fallback rule (one with a ``bind`` method,
    e.g. the GNN, is bound to the cost model first), and ``overlap``: the compute and
    communication overlap instead of the hardware file's, both set before the fit (None:
    the overlap is fitted with the rest, :func:`calibrate_in_context`).

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
            costs.op_times.add_timings(bench_ops(module, replicas=replicas,
                                                 progress=progress))
    if measured is not None and measured.one_bucket_profile is not None:
        costs.op_times.add_program_profile(measured.one_bucket_profile,
                                           original=measured.one_bucket)
    if overlap is not None:
        costs.set_overlap(overlap, "overlap given")
    if fused is not None:
        costs.set_fused_estimator(fused.bind(costs) if hasattr(fused, "bind") else fused)
    if not calibrate or measured is None:
        return costs, None
    return calibrate_in_context(costs, module, measured, bench=bench,
                                fit_overlap=overlap is None)


class Calibration(NamedTuple):
    """What :func:`calibrate_in_context` fitted.

    Attributes:
        d_s: all-reduce latency inside the program, seconds.
        compute_scale: the factor on every compute node.
        wall_s: ``(no fusion, one bucket)`` measured seconds per iteration.
        predicted_s: ``(no fusion, one bucket)`` predicted after the fit, seconds.
        saving_share: the share of their estimated saving that kernels of several ops
            get (:attr:`~disco_estimator.costs.cost_model.BackendConstants.saving_share`;
            1.0 when XLA's fused program was not measured).
        fused_wall_s: XLA's default program, measured seconds per iteration
            (None: not measured).
        fused_predicted_s: the same, predicted after the fit (None: not measured).
        d_tuple_extra_s: the extra latency of each buffer of a variadic all-reduce
            (:attr:`disco_estimator.allreduce.AllReduceModel.d_tuple_extra_s`; the hardware
            file's when the tuple probe was not measured).
        tuple_latency_s: the latency each buffer of a combined all-reduce paid in the
            tuple probe (:func:`disco_estimator.probes.tuple_buffer_latency`), seconds (None:
            not measured).
        copy_s_per_byte: the bucket copies' seconds per byte
            (:func:`bucket_copy_rate`; None: not measured, the hardware file's).
        c_s_per_byte: the all-reduce's seconds per byte the model uses (the flat
            probe's in a lean profile of a job, else the hardware file's).
        overlap: the simulator's phi fitted with ``D`` (:func:`fit_overlap_to_latency`;
            None: not fitted, the cost model's kept).

    A lean profile (no one-bucket program) has ``None`` in the second place of
    ``wall_s`` and ``predicted_s``.
    """

    d_s: float
    compute_scale: float
    wall_s: tuple[float, float | None]
    predicted_s: tuple[float, float | None]
    saving_share: float = 1.0
    fused_wall_s: float | None = None
    fused_predicted_s: float | None = None
    d_tuple_extra_s: float = 0.0
    tuple_latency_s: float | None = None
    copy_s_per_byte: float | None = None
    c_s_per_byte: float | None = None
    overlap: float | None = None


#: Range of the fitted saving share (below 0: fusion costs more than its parts).
SAVING_SHARE_BOUNDS = (-3.0, 5.0)

#: At most this many stand-ins of XLA's fused program are built for the saving share's
#: fit, each at the previous one's solution (:func:`calibrate_in_context`, 2.).
SHARE_REBUILDS = 4
#: The saving share's fit stops once the fused program is priced this close to its
#: measurement (a fraction of it).
SHARE_TOLERANCE = 0.01

#: Range of the measured seconds per byte of a bucket's copies (0.5-500 GB/s).
COPY_RATE_BOUNDS = (2e-12, 2e-9)


#: Range of the all-reduce's seconds per byte a lean profile takes from the flat probe,
#: as factors on the hardware file's.
C_BOUNDS = (0.1, 100.0)


def flat_rate(flat_s: float, d_s: float, nbytes: int, c_file: float) -> float:
    """Seconds per byte of an all-reduce, from one flat all-reduce of ``nbytes`` alone in
    a program that took ``flat_s`` with a latency of ``d_s``: ``(flat_s - d_s) / nbytes``,
    clamped to :data:`C_BOUNDS` times the hardware file's ``c_file``."""
    rate = max(flat_s - d_s, 0.0) / max(nbytes, 1)
    return float(min(max(rate, C_BOUNDS[0] * c_file), C_BOUNDS[1] * c_file))


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
    :meth:`~disco_estimator.costs.cost_model.CostModel.copy_time`), clamped to
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
                         bench: bool = True, fit_overlap: bool = True
                         ) -> tuple[CostModel, Calibration]:
    """Fits the all-reduce latency ``D``, the compute scale and the saving share to the
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
       ``[0, 1 s]``. ``C`` (seconds per byte) is set first: the flat probe's seconds
       per byte beyond the tuple probe's latency per buffer (:func:`flat_rate`, within
       :data:`C_BOUNDS` of the hardware file's); the file's where the probe was not
       measured. A ``C`` that misses what the job's link does would leave its error to
       the scales fitted after it (docs/findings.md, "The fused-op scale held the
       all-reduce's error", the saving share's predecessor).
    2. The saving share (:attr:`~disco_estimator.costs.cost_model.BackendConstants.saving_share`),
       from XLA's default compilation of the step, when it was measured: the same
       computation, fused as XLA fuses, its all-reduces combined as XLA combines them
       (priced with 3.'s latency per buffer). Its simulated time falls affinely as the
       share grows until kernels reach the cost model's floor, which bends it: solved
       on an affine stand-in built at share 1 (no kernel on the floor), then on one
       built again at each solution, until the fused program is priced within
       :data:`SHARE_TOLERANCE` of its measurement (at most :data:`SHARE_REBUILDS`
       stand-ins), clamped to :data:`SAVING_SHARE_BOUNDS`: a stand-in built where
       kernels sit on the floor sees them as fixed. XLA's fusion of the one-bucket
       program would add its flat bucket's copies and all-reduce, which XLA's fusion
       slows down beyond their unfused price, to what the scale measures.
    3. The extra latency of each buffer of a variadic all-reduce
       (:attr:`~disco_estimator.allreduce.AllReduceModel.d_tuple_extra_s`), from the tuple
       probe when it was measured: XLA:CPU reduces the buffers of a combined
       all-reduce one after the other, each paying the backend's bare latency (gloo's
       in a job, a rendezvous of threads that have already met in one process;
       :func:`disco_estimator.probes.tuple_buffer_latency`), where a gradient all-reduce
       between computations pays ``D``; the extra is the difference, so each buffer's
       latency stays >= 0. (Fitting it instead to the no-fusion program with XLA's
       combiner on, as before, gave every buffer about ``D``: 0.24 ms on mixer in
       gloo2 where the probe and XLA's default's traced all-reduce both show
       0.17 ms, and XLA's default came out 20-40% too slow.)
    4. The bucket copies' seconds per byte
       (:attr:`~disco_estimator.costs.cost_model.BackendConstants.copy_s_per_byte`), from the
       one-bucket program's profile (:func:`bucket_copy_rate`) when it was taken; set
       before 1-3, which price that program's copies. The default per-byte cost priced
       autoencoder's 2.5 MB flat buffer at 2.5 times its traced 0.2 ms, which the fit of
       the compute scale then took out of every kernel.

    5. With ``fit_overlap`` and the tuple probe measured, the simulator's overlap phi,
       with 1.: the phi up to the hardware file's at which the fitted ``D`` equals the
       probe's latency per buffer (:func:`fit_overlap_to_latency`). A phi held at the
       hardware file's (fitted on small steps) turns overlap a program does not have into
       latency each all-reduce pays, and prices programs with many separate all-reduces
       too slow (docs/findings.md, "Latency or overlap"). Without ``fit_overlap`` (an
       overlap the user set) the cost model's phi is kept.

    A lean profile (:attr:`~disco_jax.pipeline.profile.InContext.lean`: no one-bucket
    program) has one program to fit the compute scale to and none to tell ``D`` apart
    from it: ``D`` is then the tuple probe's latency per buffer (the hardware file's
    where it was not measured), the compute scale is fitted to the no-fusion program
    alone, and ``C`` and the saving share are as in 1. and 2.

    With ``bench``, ops of XLA's programs that no measurement covers are timed
    standalone first (:func:`~disco_estimator.costs.cost_model.cover`, before any fit, so
    that every fit sees the same op times).

    Returns:
        The calibrated cost model (same op times) and the :class:`Calibration`.
    """

    import numpy as np


    has_fused = measured.fused is not None and measured.fused_wall_s is not None
    if has_fused and bench:
        cover(costs, measured.fused)
    per_buffer = None
    if (measured.tuple_buffers or 0) >= 2 and measured.tuple_wall_s is not None \
            and measured.flat_wall_s is not None:
        per_buffer = tuple_buffer_latency(measured.tuple_wall_s, measured.flat_wall_s,
                                          measured.tuple_buffers)
    copy = bucket_copy_rate(costs, measured.one_bucket) if not measured.lean else None
    s0, d0 = costs.constants.compute_scale, costs.hardware.allreduce.d_s
    c = costs.hardware.allreduce.c_s_per_byte
    if per_buffer is not None and measured.flat_bytes:
        c = flat_rate(measured.flat_wall_s, per_buffer, measured.flat_bytes, c)
    # another estimator (the GNN) carries over: its member times are the same op times
    estimator = None if isinstance(costs.fused, FallbackFusedEstimator) else costs.fused

    def model(scale: float, d: float, share: float = costs.constants.saving_share,
              extra: float = costs.hardware.allreduce.d_tuple_extra_s,
              phi: float = costs.overlap) -> CostModel:
        ar = dataclasses.replace(costs.hardware.allreduce, d_s=d, d_tuple_extra_s=extra,
                                 c_s_per_byte=c)
        consts = dataclasses.replace(costs.constants, compute_scale=scale, saving_share=share,
                                     copy_s_per_byte=copy or costs.constants.copy_s_per_byte,
                                     overlap=phi,
                                     source=f"{costs.constants.source} + in-context fit")
        return CostModel(dataclasses.replace(costs.hardware, allreduce=ar),
                         op_times=costs.op_times, constants=consts, fused=estimator)

    def fit_fused(scale: float, d: float, extra: float, phi: float = costs.overlap
                  ) -> tuple[float, float | None]:
        """The saving share that prices XLA's fused program at its measured time."""
        share = costs.constants.saving_share
        if not has_fused:
            return share, None
        lo, hi = SAVING_SHARE_BOUNDS
        want = measured.fused_wall_s

        def stand_in(u: float) -> Callable[..., float]:
            return affine_simulation(measured.fused,
                                     lambda v: model(scale, d, 1.0 - v, extra, phi),
                                     (u,), (0.5,))

        # solved for the share not granted, u = 1 - share, in which the time grows; from
        # share 1, where no kernel is on the floor
        u = 0.0
        at = stand_in(u)
        for _ in range(SHARE_REBUILDS):
            new, _ = _fit_affine(at, want, u, lambda v: 0.5, 1.0 - hi, 1.0 - lo)
            if new == u:  # the stand-in's own point: a bound, or a time that does not grow
                break
            at, u = stand_in(new), new
            if abs(at(u) - want) <= SHARE_TOLERANCE * want:
                break
        return 1.0 - u, at(u)  # a stand-in is exact where it was built

    if measured.lean:
        d = d0 if per_buffer is None else per_buffer
        at = affine_simulation(module, lambda k: model(k, d), (s0,), (0.5 * s0,))
        scale, got_nf = _fit_affine(at, measured.wall_s, s0, lambda k: 0.5 * k,
                                    0.25 * s0, 8.0 * s0)
        extra = costs.hardware.allreduce.d_tuple_extra_s if per_buffer is None else 0.0
        share, fused_got = fit_fused(scale, d, extra)
        return model(scale, d, share, extra), Calibration(
            d, scale, (measured.wall_s, None), (got_nf, None), share, measured.fused_wall_s,
            fused_got, extra, per_buffer, None, c)

    modules = (module, measured.one_bucket)
    want = np.array([measured.wall_s, measured.one_bucket_wall_s])
    x0 = np.array([s0, max(d0, 1e-5)])
    # both programs' node durations are affine in (scale, D) jointly; phi sets none
    sims = [affine_simulation(m, model, tuple(x0), (0.5 * x0[0], 0.5 * x0[1]))
            for m in modules]
    lo, hi = np.array([0.25 * s0, 0.0]), np.array([8.0 * s0, 1.0])

    def fit_pair(phi: float) -> tuple[np.ndarray, np.ndarray]:
        """(scale, D) that price both programs at their measured times with overlap phi,
        and the two predicted times."""
        def times(scale: float, d: float) -> np.ndarray:
            return np.array([sim(scale, d, overlap=phi) for sim in sims])

        x = x0.copy()
        for _ in range(2):
            base = times(*x)
            step = np.maximum(x * 0.5, [1e-3, 1e-5])
            jac = np.stack([(times(x[0] + step[0], x[1]) - base) / step[0],
                            (times(x[0], x[1] + step[1]) - base) / step[1]], axis=1)
            try:
                x = np.clip(x + np.linalg.solve(jac, want - base), lo, hi)
            except np.linalg.LinAlgError:
                break
        return x, times(*x)

    phi = costs.overlap
    if fit_overlap and per_buffer is not None:
        phi = fit_overlap_to_latency(lambda p: float(fit_pair(p)[0][1]), per_buffer, phi)
    x, got = fit_pair(phi)
    extra = costs.hardware.allreduce.d_tuple_extra_s
    if per_buffer is not None:
        extra = per_buffer - float(x[1])
    # XLA's default combines its all-reduces
    share, fused_got = fit_fused(*x, extra, phi)
    cm = model(*x, share, extra, phi)
    return cm, Calibration(float(x[1]), float(x[0]), (float(want[0]), float(want[1])),
                           (float(got[0]), float(got[1])), share,
                           measured.fused_wall_s, fused_got, extra, per_buffer, copy, c,
                           phi if fit_overlap and per_buffer is not None else None)


#: Bisection steps of :func:`fit_overlap_to_latency` (phi within 1/128 of its range).
OVERLAP_STEPS = 6


def fit_overlap_to_latency(d_at: Callable[[float], float], latency_s: float,
                           upper: float) -> float:
    """The overlap phi in ``[0, upper]`` at which the all-reduce latency fitted in
    context, ``d_at(phi)``, equals the tuple probe's latency per buffer ``latency_s``.

    The more computation the simulator lets run beside an all-reduce, the cheaper the
    no-fusion program's separate all-reduces look against the one bucket's, and the more
    latency each must carry to price it at its measured time: ``d_at`` grows with phi.
    The probe measures that latency alone, so a fitted latency above it is overlap the
    program did not have. Where even no overlap leaves more than the probe's latency per
    all-reduce (each waits for the slower process, or its collective serializes beside
    the computation), phi is 0 and the fitted latency keeps the rest; where ``upper``
    (the hardware file's phi) leaves less, phi stays ``upper``: the fit takes out overlap
    the programs did not show, and adds none the file's measurement did not (past it,
    ``D`` reaches its floor of 0 and the two programs can no longer both be matched).
    Bisection between, :data:`OVERLAP_STEPS` steps.
    """
    if upper <= 0.0 or d_at(0.0) >= latency_s:
        return 0.0
    if d_at(upper) <= latency_s:
        return upper
    lo, hi = 0.0, upper
    for _ in range(OVERLAP_STEPS):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if d_at(mid) < latency_s else (lo, mid)
    return 0.5 * (lo + hi)


#: The compute scale fitted to a compiled module run as written stays in this range.
COMPUTE_SCALE_BOUNDS = (0.25, 8.0)


class CompiledFit(NamedTuple):
    """The fit of :func:`compiled_in_context_costs`.

    Attributes:
        compute_scale: the factor on every compute kernel's traced time.
        wall_s: the measured (untraced) seconds per iteration.
        predicted_s: the simulated seconds per iteration after the fit.
        traced_s: the simulated seconds per iteration at the traced times (scale 1).
    """

    compute_scale: float
    wall_s: float
    predicted_s: float
    traced_s: float


def compiled_in_context_costs(module: HloModule, hardware: HardwareConfig | str,
                              measured: CompiledInContext, *, overlap: float | None = None
                              ) -> tuple[CostModel, CompiledFit]:
    """The cost model of XLA's compiled ``module`` run as written here
    (:func:`~disco_jax.pipeline.profile.profile_compiled_in_context`).

    Each instruction is priced at its traced time, collectives included (in one process
    an all-reduce's time holds the wait for the slowest device); instructions no kernel
    maps to keep the model's rule. The compute scale is then fitted so that the simulated
    iteration equals the measured untraced one: the trace's own cost on every kernel is
    what the scale takes out, as the fit of a pre-optimization module takes it out
    (:func:`calibrate_in_context`). ``overlap``: the compute and communication overlap
    instead of the hardware file's.
    """

    base = CostModel.for_module(module, hardware, bench=False)
    if overlap is not None:
        base.set_overlap(overlap, "overlap given")

    def model(scale: float) -> CostModel:
        consts = dataclasses.replace(base.constants, compute_scale=scale,
                                     source=f"{base.constants.source} + in-context fit")
        cm = CostModel(base.hardware, op_times=base.op_times, constants=consts)
        cm.set_node_times(module, measured.node_s)
        return cm

    def time_at(scale: float) -> float:
        return simulated_s(module, model(scale))

    traced = time_at(1.0)
    scale, got = _fit_affine(time_at, measured.wall_s, 1.0, lambda x: 0.5 * x,
                             *COMPUTE_SCALE_BOUNDS)
    return model(scale), CompiledFit(scale, measured.wall_s, got, traced)


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
