"""The staged cost model (disco_estimator.costs.staged_cost): hand-computed makespans of a
small staged step, the fit recovering the costs it was given, and the bucketings it proposes.

The staged step priced here, by hand (node: stage; ``-1`` is no stage)::

    0 param (-1)   1 h (0)   2 grad1 (0)   3 ar1 (-1, bucket 0)
    4 grad0 (1)    5 ar0 (-1, bucket 1)    6 update1 (2, reads ar1)   7 update0 (3, reads ar0)

Stage 0 and 1 are the pre stages (bucket 0 leaves stage 0, bucket 1 stage 1), stage 2
and 3 the post stages; the last stage waits for every bucket.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from disco_estimator.costs.simulator import simulate
from disco_estimator.costs.staged_cost import StagedCosts, fit_assignment, layouts, staged_graph
from hlo_tools.stages import CommBucket, StageAssignment

NODE_S = np.array([0.0, 1.0, 1.0, 0.0, 2.0, 0.0, 0.5, 0.5])
GRAPH = SimpleNamespace(users=[[1], [2, 4], [3], [6], [5], [7], [], []])
ASSIGN = StageAssignment(
    stage=(-1, 0, 0, -1, 1, -1, 2, 3), first_post=2, num_stages=4, nodes=((3,), (5,)),
    comm=(CommBucket(("ar1",), (250,), "f32", "sum", True, 0),  # 1000 bytes
          CommBucket(("ar0",), (1000,), "f32", "sum", True, 1)))  # 4000 bytes


def _makespan(costs: StagedCosts) -> float:
    return simulate(staged_graph(GRAPH, ASSIGN, costs), costs.overlap).iteration_s


def test_staged_graph_orders_stages_and_buckets():
    sim = staged_graph(GRAPH, ASSIGN, StagedCosts(NODE_S, d_s=3.0))
    assert sim.names == ("stage0", "bucket0", "stage1", "bucket1", "stage2", "stage3")
    assert sim.is_comm.tolist() == [False, True, False, True, False, False]
    preds = [sim.pred_idx[sim.pred_ptr[i]:sim.pred_ptr[i + 1]].tolist()
             for i in range(len(sim.names))]
    # a bucket after the stage that outputs it; a post stage after the buckets it reads;
    # the last stage after every bucket
    assert preds == [[], [0], [0], [2], [1, 2], [1, 3, 4]]
    assert sim.duration_s.tolist() == [2.0, 3.0, 2.0, 3.0, 0.5, 0.5]


def test_makespan_with_full_overlap_by_hand():
    # stage0 [0, 2]; bucket0 [2, 5]; stage1 [2, 4] beside it; bucket1 waits for the
    # channel [5, 8]; stage2 after bucket0 [5, 5.5]; stage3 after bucket1 [8, 8.5]
    assert _makespan(StagedCosts(NODE_S, d_s=3.0)) == pytest.approx(8.5)
    # 1 s per stage: stage0 [0, 3]; buckets 1 s + 1 ms per byte (2 s and 5 s): bucket0
    # [3, 5]; stage1 [3, 6]; bucket1 [6, 11]; stage2 [6, 7.5]; stage3 [11, 12.5]
    costs = StagedCosts(NODE_S, stage_s=1.0, c_s_per_byte=1e-3, d_s=1.0)
    assert _makespan(costs) == pytest.approx(12.5)


def test_makespan_with_shared_cpu_by_hand():
    # phi = 0.5: stage1 (2 s of work) runs at half speed under bucket0 [2, 5] (1.5 s
    # done), the last 0.5 s alone: [2, 5.5]; bucket1 [5.5, 8.5]; stage2 under bucket1
    # takes 1 s [5.5, 6.5]; stage3 [8.5, 9]
    assert _makespan(StagedCosts(NODE_S, d_s=3.0, overlap=0.5)) == pytest.approx(9.0)
    # phi = 0: compute waits while the channel is busy: stage1 [5, 7]; bucket1 [7, 10];
    # stage2 [10, 10.5]; stage3 [10.5, 11]
    assert _makespan(StagedCosts(NODE_S, d_s=3.0, overlap=0.0)) == pytest.approx(11.0)


def test_fit_recovers_the_costs_it_was_measured_with():
    # stage sums (2, 3, 0.5, 1): each group's stages differ, so that the per-stage cost
    # is told apart from the scales; the update fused far more than the passes: its
    # scale a fifth of theirs
    node_s = np.array([0.0, 1.0, 1.0, 0.0, 3.0, 0.0, 0.5, 1.0])
    true = StagedCosts(node_s, compute_scale=2.0, post_scale=0.4, stage_s=0.25,
                       c_s_per_byte=2e-3, d_s=0.5, overlap=0.4, step_s=0.3)
    sim = staged_graph(GRAPH, ASSIGN, true)
    stage_s = [d for d, c in zip(sim.duration_s, sim.is_comm) if not c]
    comm_s = [d for d, c in zip(sim.duration_s, sim.is_comm) if c]
    total_s = simulate(sim, true.overlap).iteration_s + true.step_s

    def fit(total_s, **overlap):
        return fit_assignment(GRAPH, ASSIGN, node_s, stage_s, comm_s, total_s, **overlap)

    got = fit(total_s, overlap=0.4)
    assert [got.compute_scale, got.post_scale, got.stage_s, got.c_s_per_byte, got.d_s,
            got.overlap, got.step_s] == pytest.approx([2.0, 0.4, 0.25, 2e-3, 0.5, 0.4, 0.3],
                                                      rel=1e-6)
    # by default the streams overlap fully and the step's cost takes what is left: the
    # makespan at phi 1 is the one at phi 0.4 less the time stage 1 and stage 2 lose
    full = simulate(sim, 1.0).iteration_s
    assert (got := fit(total_s)).overlap == 1.0
    assert got.step_s == pytest.approx(total_s - full) and got.step_s > true.step_s
    # a step faster than its simulation costs nothing more
    assert fit(0.1).step_s == 0.0


def test_restep_is_the_fit_again_with_the_reference_measured_again():
    from disco_estimator.costs.staged_cost import restep

    node_s = np.array([0.0, 1.0, 1.0, 0.0, 3.0, 0.0, 0.5, 1.0])
    true = StagedCosts(node_s, compute_scale=2.0, post_scale=0.4, stage_s=0.25,
                       c_s_per_byte=2e-3, d_s=0.5, overlap=0.4)
    sim = staged_graph(GRAPH, ASSIGN, true)
    stage_s = [d for d, c in zip(sim.duration_s, sim.is_comm) if not c]
    comm_s = [d for d, c in zip(sim.duration_s, sim.is_comm) if c]
    simulated = simulate(sim, true.overlap).iteration_s

    def fit(total_s):
        return fit_assignment(GRAPH, ASSIGN, node_s, stage_s, comm_s, total_s, overlap=0.4)

    # measured 0.3 s over its simulation, then 0.8 s over it (a slower machine), then
    # under it: the step cost goes 0.3 -> 0.8 -> 0 s, and every prediction with it
    first = fit(simulated + 0.3)
    assert first.step_s == pytest.approx(0.3)
    for again, step in ((simulated + 0.8, 0.8), (simulated - 0.5, 0.0)):
        shift = restep(_makespan(first) + first.step_s, first.step_s, again)
        assert shift == pytest.approx(step - 0.3)
        assert first.step_s + shift == pytest.approx(fit(again).step_s)


def test_fit_bounds_the_per_stage_cost_by_the_shortest_stage():
    # one stage holds all the modelled work: stage sums (0, 0, 4, 0), measured (1, 3, 5, 1)
    node_s = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 4.0, 0.0])
    got = fit_assignment(GRAPH, ASSIGN, node_s, [1.0, 3.0, 5.0, 1.0], [1.0, 1.0], 10.0)
    # the three empty stages alone: their mean, 5/3 s per stage, above the shortest
    # stage's 1 s; bounded at 1 s, stage 2 then gives the post stages' scale
    # (5 - 1) / 4 = 1, and the pre stages, with no modelled time, take it too
    assert (got.stage_s, got.post_scale, got.compute_scale) == pytest.approx((1.0, 1.0, 1.0))


def test_fit_prices_the_pre_stages_by_their_own_scale():
    # pre stages modelled (2, 2) measure (2, 2); post stages modelled (0.5, 0.5) measure
    # (0.1, 0.1): one scale (0.95, no intercept) would price the post stages nearly 5x
    # slow and, in relative error (0.23), the pre stages, nearly all of the step, 4x fast;
    # two scales price every stage as measured (each group's stages in one proportion:
    # no intercept)
    node_s = np.array([0.0, 1.0, 1.0, 0.0, 2.0, 0.0, 0.5, 0.5])
    got = fit_assignment(GRAPH, ASSIGN, node_s, [2.0, 2.0, 0.1, 0.1], [1.0, 1.0], 5.0)
    assert (got.compute_scale, got.post_scale, got.stage_s) == pytest.approx((1.0, 0.2, 0.0))
    sim = staged_graph(GRAPH, ASSIGN, got)
    assert [d for d, c in zip(sim.duration_s, sim.is_comm) if not c] == \
        pytest.approx([2.0, 2.0, 0.1, 0.1])


def test_layouts_split_the_gradients_in_order():
    order = [10, 11, 12, 13, 14, 15, 16, 17]
    graph = SimpleNamespace(out_bytes={a: 1000 for a in order})
    out = layouts(graph, order, counts=(2, 4, 9), ramps=(0.5, 1.0, 2.0))
    for name, buckets in out.items():
        assert [a for b in buckets for a in b] == order, name
        assert all(buckets), name
    assert out["staged_k2_r1"] == [order[:4], order[4:]]
    assert out["staged_k4_r1"] == [order[i:i + 2] for i in range(0, 8, 2)]
    # bytes growing x2 from the first bucket: 1/15, 2/15, 4/15, 8/15 of 8 gradients
    assert [len(b) for b in out["staged_k4_r2"]] == [1, 1, 2, 4]
    assert [len(b) for b in out["staged_k4_r0.5"]] == [4, 2, 1, 1]
    assert not any(name.startswith("staged_k9") for name in out)  # more than gradients
    assert len({tuple(map(tuple, b)) for b in out.values()}) == len(out)  # distinct


def _vgg_layouts():
    import hlo_tools
    from disco_jax import zoo
    from hlo_tools import plan as P
    from hlo_tools.jax_bridge import fresh_function

    step, args = zoo.get("vgg")(4, "tiny")
    module = hlo_tools.parse(hlo_tools.extract(fresh_function(step), *args))
    graph = hlo_tools.device_graph(module)
    return module, graph, layouts(graph, P.ready_order(P.FusionSpace(graph)), counts=(2, 4))


def test_predict_layouts_prices_each_layout_as_predict_staged_and_bounds_it():
    from disco_estimator.costs.staged_cost import predict_layouts, predict_staged

    module, graph, cands = _vgg_layouts()
    costs = StagedCosts(np.full(graph.num_nodes, 1e-4), c_s_per_byte=1e-8, d_s=1e-3,
                        overlap=0.3)
    got = predict_layouts(module, graph, cands, costs)
    assert set(got) == set(cands) and len(got) >= 2
    for name, (fitted, unshared, fo) in got.items():
        assert fitted == predict_staged(module, graph, cands[name], costs), name
        assert unshared == predict_staged(module, graph, cands[name],
                                          costs._replace(overlap=1.0)), name
        assert fo <= unshared * (1 + 1e-12) and unshared <= fitted, name  # (sums in
        # another order round differently)


def test_step_cost_prices_every_bucketing_alike():
    from disco_estimator.costs.staged_cost import predict_layouts, predict_staged

    module, graph, cands = _vgg_layouts()
    costs = StagedCosts(np.full(graph.num_nodes, 1e-4), c_s_per_byte=1e-8, d_s=1e-3)
    more = costs._replace(step_s=0.02)
    for name, buckets in cands.items():
        assert predict_staged(module, graph, buckets, more) == pytest.approx(
            predict_staged(module, graph, buckets, costs) + 0.02), name
    got, plain = predict_layouts(module, graph, cands, more), predict_layouts(
        module, graph, cands, costs)
    for name in cands:
        assert np.subtract(got[name], plain[name]) == pytest.approx([0.02] * 3), name
