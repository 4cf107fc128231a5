"""The cost model of staged enactments: stages and buckets on the simulator's two streams.

A staged step (:mod:`disco_jax.enactment.staged`) is exactly the paper's two-resource program at a
coarser grain: its compute stages run in order on the compute stream, each bucket's
all-reduce on the communication channel once the stage that outputs it has run, and
each post stage after the buckets it reads. :func:`staged_graph` writes that as a
:class:`~disco_estimator.costs.simulator.SimGraph` and
:func:`disco_estimator.costs.simulator.simulate` prices it, with

* a stage's time: ``scale * (sum of its nodes' cost-model times) + stage_s``, the
  scale ``compute_scale`` for a pre stage and ``post_scale`` for a post stage (XLA fuses
  inside a stage, hence a scale; the update's elementwise chains fuse far more than the
  forward and backward passes' dots and convolutions, hence two; ``stage_s`` is the
  dispatch cost of one program);
* a bucket's time: ``c_s_per_byte * bytes + d_s`` (the communication programs' own fit);
* ``overlap`` (phi): how fast compute runs while an all-reduce is in flight (the CPU
  both streams share);
* ``step_s``: seconds per step outside every stage and bucket, the same for every
  bucketing (the staged call's own work: arguments split per device, the handoffs to
  the communication thread, the outputs assembled).

:func:`fit_staged_costs` measures those numbers on one staged step (its programs alone,
then the whole step) so that every other bucketing can be priced without
compiling it (:func:`predict_staged` needs only :func:`hlo_tools.stages.assign_stages`),
and :func:`layouts` proposes the bucketings the search weighs: how many stages, and
how the gradients are split between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from disco_estimator.costs.simulator import SimGraph, full_overlap_bound, simulate
from hlo_tools.graph import DeviceGraph
from hlo_tools.ir import ELEMENT_BYTES, HloModule
from hlo_tools.stages import StageAssignment, assign_stages

__all__ = [
    "StagedCosts",
    "fit_assignment",
    "fit_staged_costs",
    "layouts",
    "LayoutPrediction",
    "predict_layouts",
    "predict_staged",
    "restep",
    "staged_graph",
]


class StagedCosts(NamedTuple):
    """What prices a staged enactment.

    Attributes:
        node_s: ``[N]`` seconds of each node of the per-device graph run alone (the cost
            model's, e.g. ``CostModel.graph_costs(graph).time_s``; all-reduces ignored).
        compute_scale: pre-stage seconds per cost-model second (XLA's fusion inside
            stages).
        post_scale: the same for the post stages (the update).
        stage_s: seconds added per compute stage (dispatch, the flat buffers' copies).
        c_s_per_byte: all-reduce seconds per byte of a bucket.
        d_s: all-reduce seconds per bucket.
        overlap: phi in [0, 1]: compute rate while an all-reduce is in flight.
        step_s: seconds per step outside the stages and buckets, added to the simulated
            makespan.
    """

    node_s: np.ndarray
    compute_scale: float = 1.0
    post_scale: float = 1.0
    stage_s: float = 0.0
    c_s_per_byte: float = 0.0
    d_s: float = 0.0
    overlap: float = 1.0
    step_s: float = 0.0


def _reads(graph: DeviceGraph, assign: StageAssignment) -> list[set[int]]:
    """Per stage, the communication buckets whose reduced values it reads."""
    reads: list[set[int]] = [set() for _ in range(assign.num_stages)]
    for k, members in enumerate(assign.nodes):
        for a in members:
            for u in graph.users[a]:
                if assign.stage[u] >= 0:
                    reads[assign.stage[u]].add(k)
    reads[-1] |= set(range(len(assign.nodes)))  # the last stage waits for every bucket
    return reads


def staged_graph(graph: DeviceGraph, assign: StageAssignment, costs: StagedCosts
                 ) -> SimGraph:
    """The :class:`SimGraph` of a staged enactment: the pre stages, each followed by the
    all-reduces of its buckets, then the post stages (compute nodes in stage order, each
    post stage after the buckets it reads).

    Args:
        graph: the per-device graph the assignment is of.
        assign: :func:`hlo_tools.stages.assign_stages` of a bucketing.
        costs: the staged costs.

    Returns:
        ``S + B`` nodes (``S`` stages, ``B`` communication buckets), topologically ordered.
    """
    node_s = np.asarray(costs.node_s, dtype=np.float64)
    stage_sum = np.zeros(assign.num_stages)
    stage = np.asarray(assign.stage)
    mask = stage >= 0
    np.add.at(stage_sum, stage[mask], node_s[mask])
    reads = _reads(graph, assign)
    names, is_comm, dur, preds = [], [], [], []
    index: dict[tuple[str, int], int] = {}

    def add(kind: str, k: int, comm: bool, seconds: float, after: list[int]) -> None:
        index[(kind, k)] = len(names)
        names.append(f"{kind}{k}")
        is_comm.append(comm)
        dur.append(max(0.0, seconds))
        preds.append(sorted(set(after)))

    for s in range(assign.num_stages):
        after = [index[("stage", s - 1)]] if s else []
        after += [index[("bucket", k)] for k in sorted(reads[s])]
        scale = costs.compute_scale if s < assign.first_post else costs.post_scale
        add("stage", s, False, scale * stage_sum[s] + costs.stage_s, after)
        for k, bucket in enumerate(assign.comm):
            if bucket.after_stage == s:
                nbytes = bucket.length * _itemsize(bucket.element_type)
                add("bucket", k, True, costs.c_s_per_byte * nbytes + costs.d_s,
                    [index[("stage", s)]])
    ptr = np.zeros(len(names) + 1, np.int32)
    np.cumsum([len(p) for p in preds], out=ptr[1:])
    idx = np.asarray([i for p in preds for i in p], dtype=np.int32)
    return SimGraph(tuple(names), np.asarray(is_comm, np.bool_), np.asarray(dur),
                    np.zeros(len(names), np.int64), ptr, idx)


def _itemsize(element_type: str) -> int:
    return ELEMENT_BYTES.get(element_type, 4)


def predict_staged(module: HloModule, graph: DeviceGraph, buckets: Sequence[Sequence[int]],
                   costs: StagedCosts) -> float:
    """Predicted seconds per iteration of the staged enactment of ``buckets``."""
    assign = assign_stages(module, buckets, graph)
    return simulate(staged_graph(graph, assign, costs), costs.overlap).iteration_s + costs.step_s


class LayoutPrediction(NamedTuple):
    """What the staged cost model says of one bucketing (:func:`predict_layouts`).

    Attributes:
        fitted_s: predicted seconds per iteration (:func:`predict_staged`).
        unshared_s: the same with ``overlap`` 1: the two streams not sharing the CPU,
            what staging could reach with the first stage hiding nothing.
        fo_bound_s: the full-overlap bound of the staged program: the larger of its
            stages' and its buckets' summed seconds, with every dependency ignored
            (:func:`disco_estimator.costs.simulator.full_overlap_bound`), plus ``step_s``;
            at most ``unshared_s``.
    """

    fitted_s: float
    unshared_s: float
    fo_bound_s: float


def predict_layouts(module: HloModule, graph: DeviceGraph,
                    bucketings: dict[str, Sequence[Sequence[int]]], costs: StagedCosts
                    ) -> dict[str, LayoutPrediction]:
    """Per bucketing, its :class:`LayoutPrediction`; each bucketing is assigned to
    stages once."""
    out = {}
    for name, buckets in bucketings.items():
        sim = staged_graph(graph, assign_stages(module, buckets, graph), costs)
        out[name] = LayoutPrediction(simulate(sim, costs.overlap).iteration_s + costs.step_s,
                                     simulate(sim, 1.0).iteration_s + costs.step_s,
                                     full_overlap_bound(sim) + costs.step_s)
    return out


def fit_staged_costs(module: HloModule, graph: DeviceGraph, buckets: Sequence[Sequence[int]],
                     node_s: np.ndarray, stage_s: Sequence[float], comm_s: Sequence[float],
                     total_s: float, d_s: float | None = None, overlap: float = 1.0
                     ) -> StagedCosts:
    """Fits :class:`StagedCosts` to one staged step measured in context.

    Args:
        module, graph: the step's pre-optimization module and per-device graph.
        buckets: the bucketing that was measured.
        node_s: ``[N]`` the cost model's seconds of each node.
        stage_s: ``[S]`` measured seconds of each compute stage alone.
        comm_s: ``[B]`` measured seconds of each communication program alone.
        total_s: measured seconds per iteration of the whole staged step.
        d_s: all-reduce latency to keep (e.g. the in-context fit's); None fits it too
            when the buckets differ enough in size.
        overlap: phi, kept as given. One step's total cannot tell a slower compute stream
            under communication from a fixed cost per step; over 1 Gbit/s the fixed cost
            explains every bucketing and phi below 1 does not (see :func:`fit_assignment`).

    Returns:
        ``compute_scale``, ``post_scale`` and ``stage_s`` by least squares over the
        stages (``0 <= stage_s <=`` the shortest stage's seconds),
        ``c_s_per_byte`` and ``d_s`` over the buckets, ``overlap``, and ``step_s``: what
        ``total_s`` has beyond the simulated step (0 when the simulation is slower).
    """
    return fit_assignment(graph, assign_stages(module, buckets, graph), node_s, stage_s,
                          comm_s, total_s, d_s, overlap)


def fit_assignment(graph: DeviceGraph, assign: StageAssignment, node_s: np.ndarray,
                   stage_s: Sequence[float], comm_s: Sequence[float], total_s: float,
                   d_s: float | None = None, overlap: float = 1.0) -> StagedCosts:
    """:func:`fit_staged_costs` of a bucketing already assigned to stages
    (:func:`hlo_tools.stages.assign_stages`); the same arguments otherwise.

    The step's time beyond its simulation is charged once per step, not as a slower
    compute stream: what a staged step spends outside its programs is the same for
    every bucketing, while a phi fitted to absorb it would price each bucketing by how
    long its compute runs under communication, the bucketings that start reducing
    early the most (docs/findings.md, "A staged step's fixed cost").
    """
    stage = np.asarray(assign.stage)
    model = np.zeros(assign.num_stages)
    mask = stage >= 0
    np.add.at(model, stage[mask], np.asarray(node_s, np.float64)[mask])
    post = np.arange(assign.num_stages) >= assign.first_post
    scale, post_scale, per_stage = _fit_stages(model, post, np.asarray(stage_s, np.float64))
    nbytes = np.asarray([b.length * _itemsize(b.element_type) for b in assign.comm], float)
    times = np.asarray(comm_s, np.float64)
    if d_s is None and len(nbytes) > 1 and nbytes.max() > 2 * nbytes.min():
        c, d = np.polyfit(nbytes, times, 1)
        d = max(0.0, float(d))
    else:
        d = 0.0 if d_s is None else float(d_s)
    c = float(max(0.0, (times - d).sum()) / max(nbytes.sum(), 1.0))
    costs = StagedCosts(np.asarray(node_s, np.float64), scale, post_scale, per_stage, c, d,
                        float(overlap))
    simulated = simulate(staged_graph(graph, assign, costs), costs.overlap).iteration_s
    return costs._replace(step_s=max(0.0, float(total_s) - simulated))


def restep(reference_fitted_s: float, step_s: float, reference_s: float) -> float:
    """Seconds every prediction of a staged fit moves by when the reference bucketing is
    measured again (:func:`predict_layouts`' ``fitted_s`` and ``fo_bound_s`` alike).

    Of the fitted numbers only ``step_s`` depends on the whole step's measured time (the
    stages and buckets are fitted on their programs alone): it is what the reference's
    time has beyond its simulation, at least 0. Measured again -- beside the programs it
    is chosen among, on a machine that may have slowed since -- the reference gives a
    new ``step_s``; every prediction holds the old one once.

    Args:
        reference_fitted_s: the reference's predicted seconds per iteration (its
            simulation plus ``step_s``).
        step_s: the fit's ``step_s``, seconds.
        reference_s: the reference's new measurement, seconds per iteration.

    Returns:
        The new ``step_s`` less the old, seconds (negative: the predictions fall).
    """
    simulated = reference_fitted_s - step_s
    return max(0.0, reference_s - simulated) - step_s


def _fit_stages(model: np.ndarray, post: np.ndarray, measured: np.ndarray
                ) -> tuple[float, float, float]:
    """``compute_scale``, ``post_scale`` and ``stage_s`` such that ``scale * model +
    stage_s`` fits the measured stage seconds by least squares, the pre stages with one
    scale and the post stages (``post``) with the other, ``0 <= stage_s <=
    min(measured)``.

    Two scales, because XLA fuses the update's elementwise chains into a few kernels
    where the cost model counts each op, while the forward and backward passes' time
    is in dots and convolutions it prices near their fused cost (fitted at large size
    over 1 Gbit/s: 0.11 against 0.54 on bert). Absolute error, because a step's time is
    in its long stages: in relative error its near-empty stages (a fraction of a
    millisecond beside pre stages of 60-150 ms on rnnlm) set the scale and the long ones
    were priced several times fast. The intercept is bounded by the shortest stage (no
    stage costs less than its dispatch): unbounded, the long stages' spread set it at
    14-20 ms on rnnlm_unrolled, whose post stages measure 2-3 ms, and charged every
    layout with more stages that much per stage. It is 0 where the stages cannot tell it
    from the scales; a group with no modelled time takes the other's scale.
    """
    groups = [~post, post]
    cols = [np.where(g, model, 0.0) for g in groups if (model[g] > 0).any()]
    a = np.stack([*cols, np.ones_like(model)], axis=1)
    coef, _, rank, _ = np.linalg.lstsq(a, measured, rcond=None)
    per_stage = float(np.clip(coef[-1], 0.0, measured.min())) if rank == a.shape[1] else 0.0
    scales = []
    for g in groups:  # each group's best scale with the bounded intercept (0: none)
        mm = float((model[g] ** 2).sum())
        scales.append(float(model[g] @ (measured[g] - per_stage)) / mm if mm > 0 else 0.0)
    known = [s for s in scales if s > 0]
    if not known:
        return (float(measured.sum() / max(model.sum(), 1e-12)),) * 2 + (0.0,)
    pre, post_scale = (s if s > 0 else known[0] for s in scales)
    return pre, post_scale, per_stage


def layouts(graph: DeviceGraph, order: Sequence[int], counts: Sequence[int] = (2, 3, 4, 6, 8),
            ramps: Sequence[float] = (0.5, 1.0, 2.0)) -> dict[str, list[list[int]]]:
    """Bucketings to weigh: the gradient all-reduces, in the order they can be ready, split
    into ``k`` contiguous buckets whose bytes grow geometrically by ``ramp`` from the first.
    1.0 gives equal bytes; 2.0 a small first bucket (communication starts early: what a
    communication-bound step needs); 0.5 a small last bucket (little is left to reduce
    after the backward pass ends: what a compute-bound step needs).

    Args:
        graph: the per-device graph.
        order: its gradient all-reduces in the order they can be ready
            (:func:`hlo_tools.plan.buckets.ready_order`).
        counts: bucket counts ``k`` (those above ``len(order)`` are skipped).
        ramps: growth factors.

    Returns:
        ``{"staged_k{k}_r{ramp}": buckets}``, distinct bucketings only, each bucket a
        non-empty list of node indices, together covering ``order`` in order.
    """
    sizes = np.asarray([graph.out_bytes[a] for a in order], dtype=np.float64)
    ends = np.cumsum(sizes) - sizes / 2  # each gradient at its middle byte
    total = float(sizes.sum()) or 1.0
    out: dict[str, list[list[int]]] = {}
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for k in counts:
        if not 1 <= k <= len(order):
            continue
        for ramp in ramps:
            weights = np.asarray([ramp ** j for j in range(k)])
            bounds = np.cumsum(weights) / weights.sum() * total
            which = np.minimum(np.searchsorted(bounds, ends, side="right"), k - 1)
            buckets = [[a for a, w in zip(order, which) if w == j] for j in range(k)]
            buckets = [b for b in buckets if b]
            key = tuple(map(tuple, buckets))
            if key not in seen:
                seen.add(key)
                out[f"staged_k{len(buckets)}_r{ramp:g}"] = buckets
    return out
