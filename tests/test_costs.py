"""Tests of the cost model (disco_estimator.costs.cost_model), plans to SimGraphs
(disco_estimator.costs.lower), the fallback fused-op rule (disco_estimator.interface),
disco_estimator.ops (keys, standalone timing, the op-time table) and
jax_bridge.compile_module for Standalone."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from pathlib import Path

import numpy as np
import pytest

import hlo_tools
from disco_estimator import ops
from disco_estimator.costs import cost_model as C
from disco_estimator.costs.lower import sim_graph, sim_graph_from_module
from disco_estimator.costs.simulator import check_graph, simulate
from disco_estimator.hardware import load_hardware, shipped_hardware_dir
from disco_estimator.interface import (
    BatchedFusedOpEstimator,
    FallbackFusedEstimator,
    FusedOpEstimator,
    NodeCosts,
    fallback_fused_time,
    memory_bound,
    split_times,
)
from disco_estimator.ops.cache import OpTimeCache, OpTiming
from disco_estimator.ops.keys import is_library_fusion, library_instructions, library_key, op_key
from disco_estimator.ops.standalone import PinnedTimer, pinned_timing, random_inputs, standalone_op
from disco_estimator.ops.table import OpEstimate, build_op_profile
from disco_estimator.ops.trace import profile_program
from hlo_tools import plan as P
from hlo_tools.graph import device_graph
from hlo_tools.rewrite import apply_plan

FIXTURES = Path(__file__).parent / "fixtures"
L, B = 1e-6, 1e-9  # launch seconds, seconds per byte used in the hand computations
EXACT = C.BackendConstants(overlap=1.0, kernel_launch_s=L, mem_s_per_byte=B, source="test")

# f32[256] is 1024 bytes.
CHAIN = """HloModule chain

ENTRY e {
  p0 = f32[256] parameter(0)
  p1 = f32[256] parameter(1)
  a = f32[256] add(p0, p1)
  b = f32[256] multiply(a, a)
  c = f32[256] exponential(b)
  ROOT d = f32[256] subtract(c, a)
}
"""

DUP = """HloModule dup

ENTRY e {
  p0 = f32[256] parameter(0)
  x = f32[256] exponential(p0)
  y = f32[256] add(x, p0)
  z = f32[256] multiply(x, x)
  ROOT t = (f32[256], f32[256]) tuple(y, z)
}
"""

SNIPPETS = pathlib.Path(__file__).parent / "fixtures" / "snippets"
GRADS = (SNIPPETS / "grads_two_allreduces.hlo").read_text()  # two gradient all-reduces


def _model(text: str, times: dict[str, float], constants: C.BackendConstants = EXACT
           ) -> tuple[C.CostModel, hlo_tools.HloModule]:
    """A cost model whose op times are ``times`` (instruction name -> seconds)."""
    module = hlo_tools.parse(text)
    view = ops.module_view(module)
    op_times = ops.OpTimes()
    for _, instr in module.instructions():
        if instr.name in times:
            assert op_times.add(op_key(view, instr).encode(), times[instr.name], "test")
    return C.CostModel("inproc4", op_times=op_times, constants=constants), module


def _node(graph, name: str) -> int:
    return graph.index[name]


# --------------------------------------------------------------------------- fallback rule


def test_fallback_rule_on_hand_numbers() -> None:
    costs, module = _model(CHAIN, {"a": 5e-6, "b": 4e-6, "c": 6e-6, "d": 3e-6})
    graph = device_graph(module)
    est = FallbackFusedEstimator(costs)
    a, b = _node(graph, "a"), _node(graph, "b")
    # add and multiply are memory-bound: a: l=1, m=4, c=0; b: l=1, m=3, c=0
    # io: reads p0, p1 (2048 B) + writes a and b (both read outside, 2048 B) = 4096 of 5120
    # traffic; the members' 7 us / 5120 B is above B: the kernel streams 4096 B at B
    want = L + 4096 * B
    assert est.predict(graph, [a, b], []) == pytest.approx(want, rel=1e-12)
    # with members that streamed faster than B, "sum - launches saved - traffic saved"
    fast, _ = _model(CHAIN, {"a": 3e-6, "b": 2e-6, "c": 6e-6, "d": 3e-6})
    want = 5e-6 - L - (2e-6 + 1e-6) * (1 - 4096 / 5120)
    assert FallbackFusedEstimator(fast).predict(graph, [a, b], []) == \
        pytest.approx(want, rel=1e-12)
    for node, t in ((a, 5e-6), (b, 4e-6)):  # a single op is predicted as its own time
        assert est.predict(graph, [node], []) == pytest.approx(t, rel=1e-12)


def test_fallback_rule_clamps_fast_ops() -> None:
    """An op faster than launch + b * traffic: its memory part is capped, nothing < 0."""
    costs, module = _model(CHAIN, {"a": 0.5e-6, "b": 2e-6, "c": 6e-6, "d": 3e-6})
    graph = device_graph(module)
    gc = costs.graph_costs(graph)
    a, b = _node(graph, "a"), _node(graph, "b")
    assert (gc.launch_s[a], gc.mem_s[a], gc.compute_s[a]) == (0.5e-6, 0.0, 0.0)
    assert gc.mem_s[b] == pytest.approx(1e-6) and gc.compute_s[b] == 0.0  # capped at t - L
    want = L + 1e-6 * 4096 / 5120
    assert costs.fused.predict(graph, [a, b], []) == pytest.approx(want, rel=1e-12)
    assert want >= max(gc.launch_s[[a, b]])


WRITTEN = """HloModule written

fused_bc {
  q0 = f32[256] parameter(0)
  b = f32[256] multiply(q0, q0)
  ROOT c = f32[256] exponential(b)
}

ENTRY e {
  p0 = f32[256] parameter(0)
  ROOT f = f32[256] fusion(p0), kind=kLoop, calls=fused_bc
}
"""


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0, 3.0])
def test_saving_share_prices_written_fusions_and_plans_alike(share: float) -> None:
    """A kernel of two ops costs its parts (S = 4 + 6 us) less ``share`` of the saving
    the estimator sees (S - R), whether XLA wrote the fusion or a plan fuses the two."""
    consts = dataclasses.replace(EXACT, saving_share=share)
    times = {"b": 4e-6, "c": 6e-6}
    costs, module = _model(CHAIN, times, consts)
    graph = device_graph(module)
    b, c = _node(graph, "b"), _node(graph, "c")
    rule = FallbackFusedEstimator(costs).predict(graph, [b, c], [])
    assert 2e-6 < rule < 10e-6  # the rule sees a saving
    want = {0.0: 10e-6,  # nothing saved: the parts
            0.5: (10e-6 + rule) / 2,
            1.0: rule,  # the estimator's price
            3.0: max(10e-6 - 3 * (10e-6 - rule), C.SAVING_FLOOR * rule)}[share]
    plan = P.fuse(P.FusionSpace(graph), P.initial_plan(graph), b, c)
    sim = sim_graph(graph, plan, costs)
    assert sim.duration_s[sim.names.index("fusion(c)")] == pytest.approx(want, rel=1e-12)
    costs, written = _model(WRITTEN, times, consts)
    sim = sim_graph_from_module(written, costs)
    assert sim.duration_s[sim.names.index("f")] == pytest.approx(want, rel=1e-12)


def test_saving_share_stops_at_the_floor() -> None:
    """However large the share, a fused kernel costs at least ``SAVING_FLOOR`` of the
    estimator's time: a share of 50 would price it below zero."""
    times, consts = {"b": 4e-6, "c": 6e-6}, dataclasses.replace(EXACT, saving_share=50.0)
    costs, chain = _model(CHAIN, times, consts)
    graph = device_graph(chain)
    rule = FallbackFusedEstimator(costs).predict(graph, [_node(graph, "b"),
                                                         _node(graph, "c")], [])
    costs, module = _model(WRITTEN, times, consts)
    sim = sim_graph_from_module(module, costs)
    assert sim.duration_s[sim.names.index("f")] == pytest.approx(C.SAVING_FLOOR * rule,
                                                                 rel=1e-12)


def test_duplicate_adds_the_copy_cost() -> None:
    costs, module = _model(DUP, {"x": 6e-6, "y": 4e-6, "z": 2e-6})
    graph = device_graph(module)
    space = P.FusionSpace(graph)
    x, y = _node(graph, "x"), _node(graph, "y")
    plan = P.duplicate(space, P.initial_plan(graph), x, y)
    sim = sim_graph(graph, plan, costs)
    check_graph(sim)
    # y's group holds a copy of x: x (l=1, m=2.048, c=2.952) + y (l=1, m=3, c=0);
    # io = p0 once (1024) + y (1024) of 5120 traffic
    want = L + (2.048e-6 + 3e-6) * 2048 / 5120 + 2.952e-6
    fused = sim.names.index("fusion(y)")
    assert sim.duration_s[fused] == pytest.approx(want, rel=1e-12)
    assert want - 4e-6 == pytest.approx(1.9712e-6)  # what the copy adds to y alone
    # x still runs for z, and y's group no longer waits for it
    assert sim.duration_s[sim.names.index("x")] == 6e-6
    preds = sim.pred_idx[sim.pred_ptr[fused]:sim.pred_ptr[fused + 1]]
    assert [sim.names[p] for p in preds] == ["p0"]
    base = sim_graph(graph, P.initial_plan(graph), costs)
    assert sim.duration_s.sum() - base.duration_s.sum() == pytest.approx(want - 4e-6)


def test_producer_left_without_readers_costs_nothing() -> None:
    """x is copied into y's group, then z (x's other reader) joins that group: nobody
    reads the original x any more, XLA deletes it, and the SimGraph does not charge it."""
    text = DUP.replace("z = f32[256] multiply(x, x)", "z = f32[256] multiply(y, x)").replace(
        "ROOT t = (f32[256], f32[256]) tuple(y, z)", "ROOT t = (f32[256]) tuple(z)")
    costs, module = _model(text, {"x": 6e-6, "y": 4e-6, "z": 2e-6})
    graph = device_graph(module)
    space = P.FusionSpace(graph)
    x, y, z = (_node(graph, n) for n in "xyz")
    plan = P.duplicate(space, P.initial_plan(graph), x, y)
    plan = P.fuse(space, plan, y, z)
    assert P.dead_groups(space, plan) == {x}
    sim = sim_graph(graph, plan, costs)
    check_graph(sim)
    k = sim.names.index("x")
    assert sim.duration_s[k] == 0.0 and sim.out_bytes[k] == 0
    assert k not in sim.pred_idx and sim.pred_ptr[k + 1] == sim.pred_ptr[k]
    busy = sorted(t for t in sim.duration_s if t > 0)
    rewritten = sim_graph_from_module(apply_plan(module, plan, graph), costs)
    assert busy == pytest.approx(sorted(t for t in rewritten.duration_s if t > 0))
    assert "x" not in rewritten.names


def test_a_memory_bound_op_computes_nothing() -> None:
    """Beyond its launch, a broadcast's (a transpose's, a multiply's...) time is all memory
    traffic, however slowly it streamed; a tanh's time beyond ``b * traffic`` is compute.
    So a fusion of the two keeps the tanh's compute, and streams its io no slower than
    ``b``, where the broadcast's slowness counted as compute, or averaged into the
    kernel's rate, would survive it."""
    bound = memory_bound(["broadcast", "multiply", "transpose", "tanh", "copy", "divide", "add"])
    assert bound.tolist() == [True, True, True, False, True, False, True]
    t = np.array([9e-6, 9e-6])  # 1 us launch; 1000 B at 1e-9 s/B = 1 us of memory
    launch, mem, compute = split_times(t, np.array([1000, 1000]), 1e-6, 1e-9,
                                       memory_bound(["broadcast", "tanh"]))
    assert launch.tolist() == [1e-6, 1e-6]
    assert mem == pytest.approx([8e-6, 1e-6]) and compute == pytest.approx([0.0, 7e-6])
    plain = split_times(t, np.array([1000, 1000]), 1e-6, 1e-9)
    assert plain[1] == pytest.approx([1e-6, 1e-6]) and plain[2] == pytest.approx([7e-6, 7e-6])
    # fused: broadcast 0 (of an outside scalar 2, 4 B) read by tanh 1 (with outside 3,
    # 500 B); io = 4 + 500 + 500 (output) of 2000 B traffic, 9 us of memory between them
    nodes = NodeCosts(launch, mem, compute, np.array([1000, 1000, 0, 0], dtype=np.int64),
                      np.array([500, 500, 4, 500], dtype=np.int64),
                      np.array([0, 1, 3, 3, 3], dtype=np.int64),
                      np.array([2, 0, 3], dtype=np.int32),
                      np.array([4, 500, 500], dtype=np.int64), mem_s_per_byte=1e-9)
    # the members' average 4.5 ns/B is above b: the kernel streams its 1004 B at b
    want = 1e-6 + 1e-9 * 1004 + 7e-6
    assert fallback_fused_time(nodes, [0, 1], [], [1]) == pytest.approx(want, rel=1e-12)
    # without b: at the members' average cost per byte
    assert fallback_fused_time(nodes._replace(mem_s_per_byte=None), [0, 1], [], [1]) == \
        pytest.approx(1e-6 + 9e-6 * 1004 / 2000 + 7e-6, rel=1e-12)
    # members that streamed faster than b keep their own rate
    fast = nodes._replace(mem_s_per_byte=1e-8)
    assert fallback_fused_time(fast, [0, 1], [], [1]) == pytest.approx(
        1e-6 + 9e-6 * 1004 / 2000 + 7e-6, rel=1e-12)


def test_fallback_rule_is_a_pure_function_of_node_arrays() -> None:
    """The rule needs no cost model: hand-made NodeCosts give the hand-computed time, and
    any object with ``node_costs(graph)`` is a source for the estimator."""
    # two nodes: 0 reads an outside value 5 (400 B), 1 reads 0 (1000 B) and 5 (300 B)
    nodes = NodeCosts(
        launch_s=np.array([1e-6, 1e-6, 0, 0, 0, 0]), mem_s=np.array([2e-6, 3e-6, 0, 0, 0, 0]),
        compute_s=np.array([4e-6, 5e-6, 0, 0, 0, 0]),
        traffic=np.array([1400, 2300, 0, 0, 0, 0], dtype=np.int64),
        write_bytes=np.array([1000, 1000, 0, 0, 0, 400], dtype=np.int64),
        op_ptr=np.array([0, 1, 3, 3, 3, 3, 3], dtype=np.int64),
        op_idx=np.array([5, 0, 5], dtype=np.int32),
        read_bytes=np.array([400, 1000, 300], dtype=np.int64))
    # io = 400 (5 once, its largest read) + 1000 (output 1) of 3700 B traffic
    want = 1e-6 + 5e-6 * 1400 / 3700 + 9e-6
    assert fallback_fused_time(nodes, [0, 1], [], [1]) == pytest.approx(want, rel=1e-12)
    assert fallback_fused_time(nodes, [1], [], [1]) == pytest.approx(9e-6, rel=1e-12)

    costs, module = _model(CHAIN, {"a": 5e-6, "b": 4e-6, "c": 6e-6, "d": 3e-6})
    graph = device_graph(module)

    class Source:  # duck-typed: not a CostModel
        def node_costs(self, g):
            assert g is graph
            return costs.graph_costs(g).nodes

    est = FallbackFusedEstimator(Source())
    assert isinstance(est, FusedOpEstimator) and isinstance(est, BatchedFusedOpEstimator)
    a, b = _node(graph, "a"), _node(graph, "b")
    assert est.predict(graph, [a, b], []) == costs.fused.predict(graph, [a, b], [])
    assert list(est.predict_batch(graph, [([a, b], []), ([a], [])])) == [
        costs.fused.predict(graph, [a, b], []), costs.fused.predict(graph, [a], [])]


def test_fusible_nodes_follow_the_plan_package() -> None:
    """The cost model's fusible mask (which groups can die when every reader holds a copy)
    is the plan package's rule, reshapes in disguise included: a reduce over a size-1
    dimension is not fusible."""
    text = """HloModule r

sum {
  l = f32[] parameter(0)
  r = f32[] parameter(1)
  ROOT s = f32[] add(l, r)
}

ENTRY e {
  p0 = f32[256,1] parameter(0)
  zero = f32[] constant(0)
  d = f32[256] reduce(p0, zero), dimensions={1}, to_apply=sum
  x = f32[256] exponential(d)
  ROOT y = f32[256] add(x, x)
}
"""
    graph = device_graph(hlo_tools.parse(text))
    fusible = C.CostModel("inproc4").graph_costs(graph).fusible
    assert list(fusible) == list(P.fusible_nodes(graph)) == list(P.FusionSpace(graph).fusible)
    assert not fusible[_node(graph, "d")] and fusible[_node(graph, "x")]


def test_caches_never_serve_another_objects_entry() -> None:
    """Per-module caches hold their module: a module parsed after another one was dropped
    (which may get the dropped one's ``id``) gets its own costs."""
    import gc as garbage

    costs = C.CostModel("inproc4", constants=EXACT)
    times = []
    for text in (CHAIN, CHAIN.replace("f32[256]", "f32[4096]")):
        module = hlo_tools.parse(text)
        times.append(costs.computation_time(module, module.entry)[0])
        del module
        garbage.collect()
    assert times[1] > times[0]
    module = hlo_tools.parse(CHAIN)
    assert costs.computation_time(module, module.entry)[0] == times[0]


# --------------------------------------------------------------------------- sim graphs


def test_identity_plan_equals_module_as_written() -> None:
    module = hlo_tools.parse((FIXTURES / "shard_map_mlp.pre.hlo").read_text())
    costs = C.CostModel("inproc4")  # no measurements: every op from the analytic model
    graph = device_graph(module)
    from_plan = sim_graph(graph, P.initial_plan(graph), costs)
    as_written = sim_graph_from_module(module, costs)
    for field in from_plan._fields:
        a, b = getattr(from_plan, field), getattr(as_written, field)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, field
    assert simulate(from_plan, costs.overlap) .iteration_s > 0
    assert from_plan.is_comm.sum() == sum(op == "all-reduce" for op in graph.opcodes)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_plan_and_its_rewritten_module_cost_the_same(seed: int) -> None:
    """Op and duplicate fusion: a plan's SimGraph and that of the module apply_plan writes
    for it (fusions predicted from their fused computations) agree."""
    import random

    module = hlo_tools.parse((FIXTURES / "shard_map_mlp.pre.hlo").read_text())
    graph = device_graph(module)
    space = P.FusionSpace(graph)
    plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed), 60,
                          weights=(0.6, 0.4, 0.0))
    assert any(len(ms) > 1 for ms in plan.groups().values())
    costs = C.CostModel("inproc4")
    planned = sim_graph(graph, plan, costs)
    rewritten = apply_plan(module, plan, graph, ordered=False)
    written = sim_graph_from_module(rewritten, costs)
    busy = sorted(t for t in written.duration_s if t > 0)  # apply_plan adds free gtes
    assert busy == pytest.approx(sorted(t for t in planned.duration_s if t > 0), rel=1e-9)
    a, b = simulate(written, 1.0), simulate(planned, 1.0)
    assert a.iteration_s == pytest.approx(b.iteration_s, rel=1e-9)
    assert a.peak_bytes == b.peak_bytes


@pytest.mark.parametrize("fixture", ["shard_map_mlp.pre.hlo", "grad_mlp.pre.hlo"])
def test_lowering_uses_the_plan_packages_outputs_rule(fixture: str) -> None:
    """The lowering's all-nodes-at-once form of "which members leave their group" agrees
    with the one rule, hlo_tools.plan.group_outputs, on every group of plans with copies."""
    import random

    from disco_estimator.costs.lower import _leaving

    module = hlo_tools.parse((FIXTURES / fixture).read_text())
    graph = device_graph(module)
    space = P.FusionSpace(graph)
    costs = C.CostModel("inproc4")
    gc = costs.graph_costs(graph)
    checked = 0
    for seed in range(40):
        plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed), 80,
                              weights=(0.4, 0.6, 0.0))
        if not plan.dups:
            continue
        leaves = _leaving(gc, plan)
        for members in plan.groups().values():
            assert tuple(m for m in members if leaves[m]) == \
                P.group_outputs(graph, plan, members), (seed, members)
            checked += 1
    assert checked > 20


def test_bucket_is_one_comm_node_with_the_model_time() -> None:
    costs, module = _model(GRADS, {"g1": 3e-6, "g2": 2e-6, "u1": 3e-6, "u2": 2e-6})
    graph = device_graph(module)
    space = P.FusionSpace(graph)
    r1, r2 = _node(graph, "r1"), _node(graph, "r2")
    assert set(space.allreduces) == {r1, r2}
    before = sim_graph(graph, P.initial_plan(graph), costs)
    plan = P.combine(space, P.initial_plan(graph), r1, r2)
    sim = sim_graph(graph, plan, costs)
    check_graph(sim)
    assert before.is_comm.sum() == 2 and sim.is_comm.sum() == 1
    comm = int(np.flatnonzero(sim.is_comm)[0])
    assert sim.duration_s[comm] == costs.allreduce_time(1024 + 256)
    assert costs.allreduce_time(1280) == pytest.approx(
        costs.hardware.allreduce.c_s_per_byte * 1280 + costs.hardware.allreduce.d_s)
    buffer, slices = comm - 1, [sim.names.index("r1.slice"), sim.names.index("r2.slice")]
    assert sim.duration_s[buffer] == pytest.approx(L + 2 * B * 1280)
    assert list(sim.duration_s[slices]) == pytest.approx([L + 2 * B * 1024, L + 2 * B * 256])
    # users of each gradient wait for its slice, the slices for the one all-reduce
    u1 = sim.names.index("u1")
    assert slices[0] in sim.pred_idx[sim.pred_ptr[u1]:sim.pred_ptr[u1 + 1]]
    assert len(sim.names) == len(before.names) + 2  # 2 all-reduces -> buffer, bucket, 2 slices


def test_module_as_written_handles_combined_and_async_all_reduces() -> None:
    post = hlo_tools.parse((FIXTURES / "shard_map_mlp.post.hlo").read_text())
    costs = C.CostModel("inproc4")
    sim = sim_graph_from_module(post, costs)
    graph = device_graph(post)
    tuple_ar = graph.instruction(_node(graph, "all-reduce"))
    assert tuple_ar.shape.is_tuple
    k = sim.names.index("all-reduce")
    buffers = [leaf.byte_size() for leaf in tuple_ar.shape.tuple_shapes]
    assert len(buffers) > 1  # one latency per combined buffer
    assert sim.is_comm[k] and sim.duration_s[k] == pytest.approx(
        costs.allreduce_time(tuple_ar.shape.byte_size(), buffers))
    assert sim.duration_s[k] > costs.allreduce_time(tuple_ar.shape.byte_size())
    assert sim.is_comm.sum() == 4
    fusion = sim.names.index("add_tanh_fusion")
    assert 0 < sim.duration_s[fusion] and costs.graph_costs(graph).source[
        _node(graph, "add_tanh_fusion")] == "fusion"
    text = """HloModule a

sum {
  l = f32[] parameter(0)
  r = f32[] parameter(1)
  ROOT s = f32[] add(l, r)
}

ENTRY e {
  p = f32[64] parameter(0)
  g = f32[64] negate(p)
  st = f32[64] all-reduce-start(g), replica_groups={{0,1}}, to_apply=sum
  d = f32[64] all-reduce-done(st)
  ROOT o = f32[64] add(d, p)
}
"""
    sim = sim_graph_from_module(hlo_tools.parse(text), costs)
    assert list(sim.is_comm) == [False, False, True, False, False]
    assert sim.duration_s[2] == costs.allreduce_time(256) and sim.duration_s[3] == 0.0


def test_async_fusion_of_a_gpu_module_costs_its_fusion() -> None:
    """XLA:GPU prints an asynchronous fusion as ``fusion-start``/``fusion-done``: the start
    is priced as the fusion it launches, the done is free, and the module simulates."""
    sync = """HloModule s

fused {
  p = f32[4096] parameter(0)
  e = f32[4096] exponential(p)
  ROOT m = f32[4096] multiply(e, p)
}

ENTRY e {
  a = f32[4096] parameter(0)
  ROOT f = f32[4096] fusion(a), kind=kLoop, calls=fused
}
"""
    asynchronous = sync.replace("HloModule s", "HloModule a").replace(
        "ROOT f = f32[4096] fusion(a), kind=kLoop, calls=fused",
        "fs = ((f32[4096]), f32[4096], s32[]) fusion-start(a), kind=kLoop, calls=fused\n"
        "  ROOT f = f32[4096] fusion-done(fs)")
    costs = C.CostModel("inproc4")
    want = sim_graph_from_module(hlo_tools.parse(sync), costs).duration_s[-1]
    sim = sim_graph_from_module(hlo_tools.parse(asynchronous), costs)
    assert want > 0
    assert list(sim.duration_s[-2:]) == [pytest.approx(want), 0.0]
    assert simulate(sim).iteration_s == pytest.approx(want)


def test_compute_scale_and_overlap_from_hardware() -> None:
    inproc = C.BackendConstants.from_hardware(load_hardware("inproc4"))
    assert inproc.compute_scale == 2.0 and inproc.overlap == 0.0  # 4 devices, 2 cores
    assert C.BackendConstants.from_hardware(load_hardware("gloo2")).compute_scale == 1.0
    gpu = C.BackendConstants.from_hardware(load_hardware("gpu_cluster_example"))
    assert gpu.overlap == 1.0 and gpu.compute_scale == 0.01  # the file's [costs]
    assert C.BackendConstants.for_backend("gpu").compute_scale == 1.0
    costs, module = _model(CHAIN, {"a": 5e-6, "b": 4e-6, "c": 6e-6, "d": 3e-6}, inproc)
    sim = sim_graph_from_module(module, costs)
    assert sim.duration_s[sim.names.index("a")] == pytest.approx(10e-6)


FUSIONS = """HloModule fusions

%two (x: f32[256], y: f32[256]) -> f32[256] {
  %x = f32[256] parameter(0)
  %y = f32[256] parameter(1)
  %s = f32[256] add(%x, %y)
  ROOT %m = f32[256] multiply(%s, %s)
}

%one (u: f32[256]) -> f32[256] {
  %u = f32[256] parameter(0)
  ROOT %n = f32[256] negate(%u)
}

ENTRY %e (p0: f32[256], p1: f32[256]) -> (f32[256], f32[256]) {
  %p0 = f32[256] parameter(0)
  %p1 = f32[256] parameter(1)
  %f2 = f32[256] fusion(%p0, %p1), kind=kLoop, calls=%two
  %f1 = f32[256] fusion(%p0), kind=kLoop, calls=%one
  ROOT %t = (f32[256], f32[256]) tuple(%f2, %f1)
}
"""


def test_saving_share_prices_kernels_of_several_ops_only() -> None:
    """``saving_share`` prices a fusion of two ops (as XLA wrote it, and as a plan's
    fusion group), not one op XLA wrapped in a fusion nor a single op of a plan."""
    times = {"s": 4e-6, "m": 3e-6, "n": 2e-6}

    def durations(constants):
        costs, module = _model(FUSIONS, times, constants)
        sg = sim_graph_from_module(module, costs)
        return dict(zip(sg.names, sg.duration_s))

    base = durations(EXACT)
    none = durations(dataclasses.replace(EXACT, saving_share=0.0))
    assert base["f2"] < 7e-6 and none["f2"] == pytest.approx(4e-6 + 3e-6)  # s + m
    assert none["f1"] == base["f1"] > 0

    def plan_durations(constants):
        costs, module = _model(CHAIN, {"a": 5e-6, "b": 4e-6, "c": 6e-6, "d": 3e-6},
                               constants)
        graph = device_graph(module)
        b, c = _node(graph, "b"), _node(graph, "c")
        plan = P.fuse(P.FusionSpace(graph), P.initial_plan(graph), b, c)
        sg = sim_graph(graph, plan, costs)
        return dict(zip(sg.names, sg.duration_s))

    base, half = plan_durations(EXACT), plan_durations(
        dataclasses.replace(EXACT, saving_share=0.5))
    fused = next(n for n in base if n.startswith("fusion("))
    assert half[fused] == pytest.approx((base[fused] + 4e-6 + 6e-6) / 2)  # b + c
    assert half["a"] == base["a"] and half["d"] == base["d"]


def test_saving_share_from_hardware_and_its_range(tmp_path) -> None:
    assert C.BackendConstants.from_hardware(load_hardware("gloo2")).saving_share == 1.0
    text = (shipped_hardware_dir() / "inproc4.toml").read_text()
    for value, ok in (("0.6", True), ("-0.5", True), ("nan", False), ("inf", False)):
        path = tmp_path / f"h{value}.toml"
        path.write_text(text + f"\n[costs]\nsaving_share = {value}\n")
        if ok:
            got = C.BackendConstants.from_hardware(load_hardware(path)).saving_share
            assert got == float(value)
        else:
            with pytest.raises(ValueError, match="invalid"):
                C.BackendConstants.from_hardware(load_hardware(path))


def test_bucket_copies_are_priced_at_the_rate_profiled_in_context(tmp_path) -> None:
    """The one-bucket program's concatenate and slices, at their profiled times, give
    the copies' seconds per byte (launch taken out; standalone times do not count); plans'
    buckets are then priced at it, and a hardware file may set it."""
    from disco_jax.pipeline import fit as enact

    module = hlo_tools.parse(GRADS)
    graph = device_graph(module)
    space = P.FusionSpace(graph)
    plan = P.combine(space, P.initial_plan(graph), _node(graph, "r1"), _node(graph, "r2"))
    one = apply_plan(module, plan, graph)
    copies = enact.bucket_copies(one)
    assert [c.opcode for c in copies] == ["concatenate", "slice", "slice"], one
    bucket = next(i for i in device_graph(one).computation.instructions
                  if i.opcode == "all-reduce")
    assert bucket.operands == [copies[0].name], one
    view = ops.module_view(one)
    times = ops.OpTimes()
    # 1280 + 1024 bytes, read and written once: 2 * 2304 bytes in 9.216e-8 s of copying
    for instr, extra in zip(copies[:2], (5.12e-8, 4.096e-8)):
        assert times.add(op_key(view, instr).encode(), L + extra, "profile")
    assert times.add(op_key(view, copies[2]).encode(), 1.0, "op_bench")  # not counted
    costs = C.CostModel("inproc4", op_times=times, constants=EXACT)
    rate = enact.bucket_copy_rate(costs, one)
    assert rate == pytest.approx(2e-11)
    assert enact.bucket_copy_rate(costs, module) is None  # no bucket, nothing measured
    assert costs.copy_time(1280) == pytest.approx(L + 2 * B * 1280)  # not set: B
    costs = C.CostModel("inproc4", op_times=times,
                        constants=dataclasses.replace(EXACT, copy_s_per_byte=rate))
    sim = sim_graph(graph, plan, costs)
    buffer = int(np.flatnonzero(sim.is_comm)[0]) - 1
    assert sim.duration_s[buffer] == pytest.approx(L + 2 * 2e-11 * 1280)
    text = (shipped_hardware_dir() / "inproc4.toml").read_text()
    for value, ok in (("3e-11", True), ("-1e-11", False)):
        path = tmp_path / f"h{value}.toml"
        path.write_text(text + f"\n[costs]\ncopy_s_per_byte = {value}\n")
        if ok:
            got = C.BackendConstants.from_hardware(load_hardware(path))
            assert got.copy_s_per_byte == 3e-11
        else:
            with pytest.raises(ValueError, match="invalid"):
                C.BackendConstants.from_hardware(load_hardware(path))
    assert C.BackendConstants.from_hardware(load_hardware("gloo2")).copy_s_per_byte is None


def test_recosting_a_plan_from_the_caches_gives_the_same_graph() -> None:
    """The second costing of a plan comes from the per-graph caches (no fused-op estimate
    is computed again) and gives the same SimGraph bit for bit; a fresh cost model gives
    it too. (How fast re-costing is belongs to benchmarks/.)"""
    import random

    module = hlo_tools.parse((FIXTURES / "shard_map_mlp.pre.hlo").read_text())
    graph = device_graph(module)
    costs = C.CostModel("inproc4")
    plan = P.random_moves(P.FusionSpace(graph), P.initial_plan(graph), random.Random(0), 30)
    first = sim_graph(graph, plan, costs)
    check_graph(first)
    cached = dict(costs.graph_costs(graph).fused_cache)
    assert cached  # the plan has fusion groups

    class Refuses:
        def predict(self, *args, **kwargs):
            raise AssertionError("a cached group was estimated again")

    costs.fused = Refuses()  # not set_fused_estimator: that would drop the caches
    again = sim_graph(graph, plan, costs)
    fresh = sim_graph(graph, plan, C.CostModel("inproc4"))
    for other in (again, fresh):
        for field in first._fields:
            a, b = getattr(first, field), getattr(other, field)
            assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, field
    assert costs.graph_costs(graph).fused_cache == cached


# --------------------------------------------------------------------------- op keys


def test_op_keys_ignore_names_layouts_and_metadata() -> None:
    a = hlo_tools.parse(CHAIN)
    b = hlo_tools.parse(CHAIN.replace("a = f32[256] add(p0, p1)",
                                      'q = f32[256]{0} add(p0, p1), metadata={op_name="x"}')
                        .replace("(a, a)", "(q, q)").replace("(c, a)", "(c, q)"))
    ka = op_key(ops.module_view(a), a.entry.instruction("a"))
    kb = op_key(ops.module_view(b), b.entry.instruction("q"))
    assert ka == kb and ka.encode() == "add|f32[256];f32[256]|f32[256]|f32|"
    assert ops.op_status(a.entry.instruction("p0"))[0] == "free"
    assert ops.op_status(a.entry.instruction("c"))[0] == "bench"
    grads = hlo_tools.parse(GRADS)
    assert ops.op_status(grads.entry.instruction("r1"))[0] == "skip"


def test_standalone_op_has_valid_index_operands() -> None:
    gather = ("rows = f32[6,8] gather(table, ids), offset_dims={1}, collapsed_slice_dims={0}, "
              "start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}")
    text = f"""HloModule g

ENTRY e {{
  table = f32[50,8] parameter(0)
  ids = s32[6,1] parameter(1)
  i = s32[] parameter(2)
  {gather}
  zero = s32[] constant(0)
  ROOT part = f32[4,8] dynamic-slice(table, i, zero), dynamic_slice_sizes={{4,8}}
}}
"""
    module = hlo_tools.parse(text)
    gather = standalone_op(module, module.entry.instruction("rows"))
    assert [s.index_high for s in gather.inputs] == [0, 50]
    (ids,) = [x for x in random_inputs(gather) if x.dtype == np.int32]
    assert ids.min() >= 0 and ids.max() < 50
    part = standalone_op(module, module.entry.instruction("part"))
    assert [s.index_high for s in part.inputs] == [0, 47, 1]  # the constant start stays a param
    assert part.key == op_key(ops.module_view(module), module.entry.instruction("part"))
    hlo_tools.parse(part.hlo_text)  # our own parser accepts it


# --------------------------------------------------------------------------- needs jax


def test_standalone_module_matches_numpy() -> None:
    from hlo_tools import jax_bridge

    text = """HloModule s

sum {
  l = f32[] parameter(0)
  r = f32[] parameter(1)
  ROOT s = f32[] add(l, r)
}

ENTRY e {
  x = f32[4,8] parameter(0)
  y = f32[4,8] parameter(1)
  t = f32[4,8] tanh(x)
  m = f32[4,8] multiply(t, y)
  zero = f32[] constant(0)
  ROOT r = f32[4] reduce(m, zero), dimensions={1}, to_apply=sum
}
"""
    run = jax_bridge.compile_module(text, jax_bridge.Standalone(),
                                    jax_bridge.CompileOptions(exact=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2, 4, 8)).astype(np.float32)
    (out,) = run(x, y)
    np.testing.assert_allclose(out, (np.tanh(x) * y).sum(axis=1), rtol=1e-5, atol=1e-6)
    assert run.module_name == "s" and "fusion" in run.as_text()  # wrapped single ops
    assert "tanh_multiply" not in run.as_text()  # exact: nothing fused
    with pytest.raises(ValueError, match="expected"):
        run(x.astype(np.float64), y)
    with pytest.raises(jax_bridge.HloCompileError):
        jax_bridge.compile_module("HloModule broken\n\nENTRY e {\n  ROOT x = f32[] foo()\n}\n",
                                  jax_bridge.Standalone(), jax_bridge.CompileOptions(exact=True))


def test_wrapped_key_matches_xla_fusion_wrapper() -> None:
    """A profiled ``wrapped_<op>`` fusion is found by the key of the op it wraps."""
    from hlo_tools import jax_bridge

    module = hlo_tools.parse(CHAIN)
    compiled = hlo_tools.parse(jax_bridge.compile_module(
        CHAIN, jax_bridge.Standalone(), jax_bridge.CompileOptions(exact=True)).as_text())
    view = ops.module_view(compiled)
    wrapped = {op_key(view, i).encode() for i in compiled.entry.instructions
               if i.opcode == "fusion"}
    mine = ops.module_view(module)
    for name in ("a", "b", "c", "d"):
        assert ops.table._wrapped_key(mine, module.entry.instruction(name)) in wrapped, name


def test_standalone_times_and_caches(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path))
    module = hlo_tools.parse(GRADS)
    timings = ops.bench_ops(module, repeats=5, warmup=1, progress=False)
    view = ops.module_view(module)
    want = {op_key(view, view.instr[n]).encode() for n in ("g1", "g2", "u1", "u2")}
    assert set(timings) == want
    assert all(t.ok and t.time_s > 0 and t.samples == 5 for t in timings.values())
    files = list((tmp_path / "ops").glob("*.json"))
    assert len(files) == 1 and not list((tmp_path / "ops").glob("*.tmp"))
    data = json.loads(files[0].read_text())
    assert data["fingerprint"] == ops.backend_fingerprint(1) and set(data["ops"]) == want

    def boom(*args, **kwargs):
        raise AssertionError("cached ops must not be timed again")

    monkeypatch.setattr(ops.standalone, "_measure_chunk", boom)
    assert ops.bench_ops(module, progress=False) == timings
    cache = OpTimeCache.for_backend(1)
    assert {k: cache.get(k) for k in want} == timings
    other = OpTimeCache({**ops.backend_fingerprint(1), "cpu_count": -1})
    assert len(other) == 0 and other.path != cache.path  # another machine, another file
    files[0].write_text("{not json")
    assert len(OpTimeCache.for_backend(1)) == 0  # corrupt file reads as empty
    failed = OpTiming(math.nan, math.nan, math.nan, 0, "other", 4, 0.0, "boom")
    cache.update({"k": failed})
    cache.save()
    assert OpTimeCache.for_backend(1).get("k") == OpTiming.from_json(failed.to_json())


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity")
def test_pinned_timer_times_in_a_child_on_one_cpu() -> None:
    assert pinned_timing(replicas=4) is False  # devices sharing the cores: in place
    assert pinned_timing() is True
    module = hlo_tools.parse(GRADS)
    view = ops.module_view(module)
    op = standalone_op(module, view.instr["g1"], view)
    job = ops.TimingJob(op.module_name, op.hlo_text, op.inputs, seed=3)
    bad = ops.TimingJob("bad", "HloModule bad\nENTRY e { ROOT x = f32[] nonsense() }", ())
    with PinnedTimer(repeats=4, warmup=1) as clock:
        samples, errors = clock.run([job, bad])
        assert len(clock.child_cpus) == 1
        assert set(clock.child_cpus) <= os.sched_getaffinity(0)
        assert len(samples[op.module_name]) == 4 and min(samples[op.module_name]) > 0
        assert set(errors) == {"bad"} and errors["bad"].startswith("HloCompileError")
        clock.timeout_s = 0.0  # a batch that overruns: the child is killed, all fail
        samples, errors = clock.run([job])
        assert not samples and "exceeded" in errors[op.module_name]
        clock.timeout_s = 300.0  # the next batch starts a new child
        samples, errors = clock.run([job])
        assert not errors and len(samples[op.module_name]) == 4
        # a child that dies (here: on a request it cannot read) fails its batch with the
        # error it wrote on stderr; the next batch starts a new child
        broken = ops.TimingJob("broken", op.hlo_text, (ops.InputSpec("not a shape"),))
        samples, errors = clock.run([broken])
        assert not samples and errors["broken"].startswith("pinned timing process exited")
        assert "HloParseError" in errors["broken"], errors
        assert not clock.run([job])[1]


def test_pinned_and_in_place_timings_are_cached_apart(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path))
    module = hlo_tools.parse(GRADS)
    pinned = ops.bench_ops(module, repeats=3, warmup=1, progress=False, pinned=True)
    assert pinned and all(t.ok and t.time_s > 0 for t in pinned.values())
    assert set(OpTimeCache.for_backend(1, pinned=True).entries) == set(pinned)
    assert len(OpTimeCache.for_backend(1)) == 0  # the program's regime: not timed yet
    fingerprint = ops.backend_fingerprint(1, pinned=True)
    assert fingerprint.pop("pinned") is True and fingerprint == ops.backend_fingerprint(1)


def test_cost_model_for_module_uses_measured_times(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path))
    module = hlo_tools.parse(CHAIN)
    costs = C.CostModel.for_module(module, "inproc4", progress=False)
    gc = costs.graph_costs(device_graph(module))
    assert gc.summary()["sources"] == {"free": 2, "op_bench": 4}
    assert not gc.estimated.any() and (gc.time_s[2:] > 0).all()


def test_profiles_give_in_context_times() -> None:
    """A whole-program profile of the no-fusion program times the ops of its source;
    a stored OpProfile matches ops through XLA's single-op wrapper fusions."""
    import jax
    import jax.numpy as jnp

    from hlo_tools import jax_bridge

    def f(x, w, b):
        y = jnp.tanh(x @ w + b)
        return jnp.sum(y * y, axis=1)

    args = (np.ones((64, 32), np.float32), np.ones((32, 48), np.float32),
            np.ones((48,), np.float32))
    text = jax_bridge.extract(jax.jit(f), *args)
    module = hlo_tools.parse(text)
    compiled = jax_bridge.compile_module(text, jax_bridge.InPlaceOf(jax.jit(f), args),
                                         jax_bridge.CompileOptions(exact=True))
    prof = profile_program(compiled, *args, iterations=3, warmup=1)
    view = ops.module_view(module)
    benched = [i for i in module.entry.instructions if ops.op_status(i)[0] == "bench"]
    assert {i.opcode for i in benched} >= {"dot", "tanh", "multiply", "reduce", "add"}
    by_name = ops.OpTimes()
    assert by_name.add_program_profile(prof, original=module) > 0
    stored = ops.OpTimes()
    stored.add_op_profile(build_op_profile(prof))
    for instr in benched:
        est = by_name.estimate(view, instr)
        assert not est.estimated and est.source == "profile" and est.time_s > 0, instr
        # XLA:CPU runs this reduce as a reduce-window plus a reduce: no key can match it
        if instr.opcode != "reduce":
            est = stored.estimate(view, instr)
            assert not est.estimated and est.source == "profile" and est.time_s > 0, instr
    reduce = next(i for i in benched if i.opcode == "reduce")
    split = [n for n in prof.times_s if "reduce" in n]
    assert len(split) == 2  # both kernels of the split reduce count for it
    assert by_name.estimate(view, reduce).time_s == pytest.approx(
        sum(prof.times_s[n] / prof.counts.get(n, 1.0) for n in split))


def test_tuple_allreduce_pays_one_latency_per_buffer_and_tiny_ones_less():
    """C * total bytes + one latency per buffer; buffers of at most ``small_bytes``
    (gloo's short path) pay ``d_small_s`` instead of ``d_s``."""
    import dataclasses

    from disco_estimator.allreduce import AllReduceModel

    hw = dataclasses.replace(load_hardware("gloo2"),
                             allreduce=AllReduceModel(1e-9, 1e-3, 8, 1e-4))
    costs = C.CostModel(hw, constants=EXACT)
    assert costs.allreduce_time(4) == pytest.approx(4e-9 + 1e-4)
    assert costs.allreduce_time(12) == pytest.approx(12e-9 + 1e-3)
    assert costs.allreduce_time(1028, [1024, 4]) == pytest.approx(1028e-9 + 1e-3 + 1e-4)
    assert costs.allreduce_time(1028, [4, 1024]) == pytest.approx(1028e-9 + 1e-3 + 1e-4)
    assert costs.allreduce_time(2048, [1024, 1024]) == pytest.approx(2048e-9 + 2e-3)
    # the extra of a variadic all-reduce: every buffer, never below zero; one flat
    # buffer (our buckets) does not pay it
    extra = dataclasses.replace(hw, allreduce=AllReduceModel(1e-9, 1e-3, 8, 1e-4, 5e-4))
    costs = C.CostModel(extra, constants=EXACT)
    assert costs.allreduce_time(2048, [1024, 1024]) == pytest.approx(2048e-9 + 3e-3)
    assert costs.allreduce_time(1028, [1024, 4]) == pytest.approx(1028e-9 + 1.5e-3 + 6e-4)
    assert costs.allreduce_time(2048) == pytest.approx(2048e-9 + 1e-3)
    less = dataclasses.replace(hw, allreduce=AllReduceModel(1e-9, 1e-3, 8, 1e-4, -5e-4))
    costs = C.CostModel(less, constants=EXACT)
    assert costs.allreduce_time(1028, [1024, 4]) == pytest.approx(1028e-9 + 0.5e-3 + 0.0)


def test_tuple_extra_from_hardware(tmp_path) -> None:
    assert load_hardware("gloo2").allreduce.d_tuple_extra_s == 0.0
    text = (shipped_hardware_dir() / "gloo2.toml").read_text()
    path = tmp_path / "x.toml"
    for value, want in (("-2e-4", -2e-4), ('"a"', None)):
        path.write_text(text.replace("[allreduce]\n", f"[allreduce]\nd_tuple_extra_s = {value}\n",
                                     1))
        if want is not None:
            assert load_hardware(path).allreduce.d_tuple_extra_s == want
        else:
            with pytest.raises(ValueError, match="d_tuple_extra_s"):
                load_hardware(path)


# --------------------------------------------------------------------------- library ops

# XLA:CPU's default pipeline hands this dot to YNNPACK inside a kCustom fusion; the
# same dot as a plain instruction and as a kLoop fusion runs XLA's own dot thunk.
LIBRARY = """HloModule library

%lib_body (a: f32[8,512], b: f32[128,512]) -> f32[8,128] {
  %a = f32[8,512] parameter(0)
  %b = f32[128,512] parameter(1)
  ROOT %d = f32[8,128] dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%loop_body (x: f32[8,512], y: f32[128,512]) -> f32[8,128] {
  %x = f32[8,512] parameter(0)
  %y = f32[128,512] parameter(1)
  ROOT %z = f32[8,128] dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %e (p0: f32[8,512], p1: f32[128,512]) -> (f32[8,128], f32[8,128]) {
  %p0 = f32[8,512] parameter(0)
  %p1 = f32[128,512] parameter(1)
  %ynn = f32[8,128] fusion(%p0, %p1), kind=kCustom, calls=%lib_body, backend_config=YNN
  %loop = f32[8,128] fusion(%p0, %p1), kind=kLoop, calls=%loop_body
  ROOT %t = (f32[8,128], f32[8,128]) tuple(%ynn, %loop)
}
""".replace("YNN", '{"fusion_config":{"kind":"__ynn_fusion"}}')


def test_ops_in_library_fusions_cost_their_library_time() -> None:
    module = hlo_tools.parse(LIBRARY)
    view = ops.module_view(module)
    dot = module.computation("lib_body").root
    plain = op_key(view, dot)
    assert ops.timing_key(view, dot, library=True) == library_key(plain).encode()
    assert library_key(plain).opcode == "dot@library"
    assert {i.name for _, i in module.instructions()
            if id(i) in library_instructions(module)} == {"a", "b", "d"}
    times = ops.OpTimes()
    times.add(plain.encode(), 200e-6, "profile")
    costs = C.CostModel("inproc4", op_times=times, constants=EXACT)
    sg = sim_graph_from_module(module, costs)
    dur = dict(zip(sg.names, sg.duration_s))
    assert dur["ynn"] == dur["loop"] == pytest.approx(200e-6)  # no library time: as unwrapped
    times.add(library_key(plain).encode(), 20e-6, "op_bench")
    costs = C.CostModel("inproc4", op_times=times, constants=EXACT)
    sg = sim_graph_from_module(module, costs)
    dur = dict(zip(sg.names, sg.duration_s))
    assert dur["ynn"] == pytest.approx(20e-6) and dur["loop"] == pytest.approx(200e-6)


def test_standalone_times_library_ops_as_the_library_runs_them(tmp_path, monkeypatch) -> None:
    from hlo_tools import jax_bridge

    assert "dot-library-rewriter" in jax_bridge.exact_compiler_options("cpu")[
        "xla_disable_hlo_passes"].split(",")
    assert "dot-library-rewriter" not in jax_bridge.exact_compiler_options(
        "cpu", library=True)["xla_disable_hlo_passes"].split(",")
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path))
    module = hlo_tools.parse(LIBRARY)
    view = ops.module_view(module)
    timings = ops.bench_ops(module, repeats=3, warmup=1, progress=False)
    plain = op_key(view, module.computation("lib_body").root)
    assert set(timings) == {plain.encode(), library_key(plain).encode()}
    assert all(t.ok and t.time_s > 0 for t in timings.values())
    lib = standalone_op(module, module.computation("lib_body").root, view, library=True)
    exe = jax_bridge.compile_module(lib.hlo_text, jax_bridge.Standalone(),
                                    jax_bridge.CompileOptions(exact=True, library="default"))
    plain_exe = jax_bridge.compile_module(lib.hlo_text, jax_bridge.Standalone(),
                                          jax_bridge.CompileOptions(exact=True))
    assert "kind=kCustom" in exe.as_text() and "kind=kCustom" not in plain_exe.as_text()
    a, b = random_inputs(lib, seed=1)
    np.testing.assert_allclose(exe(a, b)[0], a @ b.T, rtol=1e-4, atol=1e-4)


def test_profile_times_one_execution_per_call_site_and_folded_ops_at_their_producer():
    """A computation called from several sites is inlined once per site: each copy of its
    op is one execution (the op's time is their mean, not their sum); a transpose XLA
    folded into its dot (one dot kernel carrying the transpose's ``op_name``) gives that
    kernel's time to the dot and none to the transpose."""
    import jax
    import jax.numpy as jnp

    from hlo_tools import jax_bridge

    @jax.jit
    def norm(x):
        return jnp.sqrt(jnp.sum(x * x))

    def f(a, b, c, w):
        return norm(a) + norm(b) + norm(c), jnp.transpose(a @ w)

    args = (*(np.ones((64, 48), np.float32) for _ in range(3)),
            np.ones((48, 32), np.float32))
    text = jax_bridge.extract(jax.jit(f), *args)
    module = hlo_tools.parse(text)
    calls = [i for i in module.entry.instructions if i.opcode == "call"]
    assert len(calls) == 3 and len({i.called_computations[0] for i in calls}) == 1
    body = module.computation(calls[0].called_computations[0])
    mul = next(i for i in body.instructions if i.opcode == "multiply")
    compiled = jax_bridge.compile_module(text, jax_bridge.InPlaceOf(jax.jit(f), args),
                                         jax_bridge.CompileOptions(exact=True))
    prof = profile_program(compiled, *args, iterations=3, warmup=1)
    kernels = hlo_tools.parse(prof.hlo_text)
    sites = {}
    for instr in kernels.entry.instructions:
        if instr.name in prof.times_s and (instr.op_name or "").endswith("/" + mul.name):
            sites[instr.op_name] = prof.times_s[instr.name]
    assert len(sites) == 3, (sites, prof.hlo_text)
    times = ops.OpTimes()
    times.add_program_profile(prof, original=module)
    view = ops.module_view(module)
    est = times.estimate(view, mul)
    assert est.source == "profile" and est.time_s == pytest.approx(
        float(np.mean(list(sites.values())))), (est, sites)
    dot = next(i for i in module.entry.instructions if i.opcode == "dot")
    transpose = next(i for i in module.entry.instructions if i.opcode == "transpose")
    kernel = next(i for i in kernels.entry.instructions if i.opcode == "dot")
    assert kernel.op_name == transpose.name, prof.hlo_text  # XLA folded it
    assert times.estimate(view, dot).time_s == pytest.approx(prof.times_s[kernel.name])
    assert times.estimate(view, transpose) == OpEstimate(0.0, False, "profile")


def test_every_kernel_of_an_expanded_op_is_priced_on_that_op():
    """XLA:CPU expands the max-pool gradient's ``select-and-scatter`` into kernels without
    ``op_name`` (iotas, a variadic ``reduce-window``) that reach the op's ``scatter``
    through several users: their time is the op's (dropped, the fitted compute scale
    would spread it over every op)."""
    import jax
    import jax.numpy as jnp

    from hlo_tools import jax_bridge

    def pool(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                     "VALID")

    def f(x):
        return jax.grad(lambda x: jnp.sum(pool(jnp.tanh(x)) ** 2))(x)

    args = (np.random.default_rng(0).normal(size=(8, 32, 32, 16)).astype(np.float32),)
    text = jax_bridge.extract(jax.jit(f), *args)
    module = hlo_tools.parse(text)
    sas = [i for i in module.entry.instructions if i.opcode == "select-and-scatter"]
    assert len(sas) == 1, text
    compiled = jax_bridge.compile_module(text, jax_bridge.InPlaceOf(jax.jit(f), args),
                                         jax_bridge.CompileOptions(exact=True))
    prof = profile_program(compiled, *args, iterations=3, warmup=1)
    kernels = hlo_tools.parse(prof.hlo_text)
    by_name = {i.name: i for _, i in kernels.instructions()}

    def runs(name):  # the op a kernel runs: itself, or the only op of its wrapper
        body = [i for c in by_name[name].called_computations
                for i in kernels.computation(c).instructions if i.opcode != "parameter"]
        return body[0] if len(body) == 1 else by_name[name]

    unnamed = [n for n in prof.times_s if not runs(n).op_name]
    assert unnamed, prof.hlo_text  # the expansion: kernels XLA gave no op_name
    per_run = {n: t / max(prof.counts.get(n, 1.0), 1.0) for n, t in prof.times_s.items()}
    times = ops.OpTimes()
    times.add_program_profile(prof, original=module)
    view = ops.module_view(module)
    scatter = next(n for n in per_run if runs(n).opcode == "scatter")
    assert times.estimate(view, sas[0]).time_s == pytest.approx(
        per_run[scatter] + sum(per_run[n] for n in unnamed), rel=1e-6), prof.hlo_text


def test_an_op_run_on_the_kernel_library_is_priced_at_that_time():
    """A plan compiled like the profiled program (library dots) runs the op on the
    library as well: the op's own key gets the library time, not a standalone time of
    XLA's emitter."""
    import jax
    import jax.numpy as jnp

    from hlo_tools import jax_bridge

    def f(x, w):
        return jnp.tanh(x @ w)

    args = (np.ones((128, 256), np.float32), np.ones((256, 128), np.float32))
    text = jax_bridge.extract(jax.jit(f), *args)
    module = hlo_tools.parse(text)
    compiled = jax_bridge.compile_module(text, jax_bridge.InPlaceOf(jax.jit(f), args),
                                         jax_bridge.CompileOptions(exact=True, library=True))
    prof = profile_program(compiled, *args, iterations=3, warmup=1)
    kernels = hlo_tools.parse(prof.hlo_text)
    on_library = [i for i in kernels.entry.instructions if is_library_fusion(i)]
    assert len(on_library) == 1, prof.hlo_text
    times = ops.OpTimes()
    times.add_program_profile(prof, original=module)
    view = ops.module_view(module)
    dot = next(i for i in module.entry.instructions if i.opcode == "dot")
    want = prof.times_s[on_library[0].name]
    for library in (False, True):
        est = times.estimate(view, dot, library=library)
        assert est.source == "profile" and est.time_s == pytest.approx(want), est


def test_an_affine_simulation_is_the_simulation_at_every_point():
    """Two constants on disjoint nodes (compute scale, D) from three graphs, and the
    saving share alone from two: the same seconds as a cost model built at the point
    (for the share, where no kernel is at the floor: shares up to 1 keep every kernel
    between its estimate and its parts)."""

    import jax

    from disco_estimator.costs.cost_model import CostModel
    from disco_estimator.costs.lower import affine_simulation, simulated_s
    from disco_jax import zoo

    step, args = zoo.get("vgg")(jax.device_count(), "tiny")
    module = hlo_tools.parse(jax.jit(step).lower(*args).compile().as_text())
    base = CostModel.for_module(module, "inproc4", bench=False, progress=False)

    def model(scale: float, d: float, fused: float = 1.0) -> CostModel:
        ar = dataclasses.replace(base.hardware.allreduce, d_s=d)
        consts = dataclasses.replace(base.constants, compute_scale=scale, saving_share=fused)
        return CostModel(dataclasses.replace(base.hardware, allreduce=ar),
                         op_times=base.op_times, constants=consts)

    at = affine_simulation(module, model, (1.0, 1e-4), (0.5, 5e-5))
    for x in ((1.0, 1e-4), (2.7, 3e-4), (0.4, 0.0)):
        assert at(*x) == pytest.approx(simulated_s(module, model(*x)), rel=1e-9)
    fused = affine_simulation(module, lambda f: model(1.5, 2e-4, f), (1.0,), (-0.5,))
    for f in (-0.5, 0.2, 1.0):
        assert fused(f) == pytest.approx(simulated_s(module, model(1.5, 2e-4, f)), rel=1e-9)


def test_fused_programs_pay_no_wait_beyond_the_probes_latency():
    """A gradient all-reduce of one buffer pays ``D`` less ``fused_wait_s`` (``D`` above
    the tuple probe's latency per buffer) times the share of the step's ops that run in
    kernels of several ops: all of ``D`` with nothing fused, XLA's fusions counted by
    their bodies' ops; nothing changes where ``D`` is not above the probe's latency, or
    in one process."""
    import random

    import jax

    from disco_estimator.allreduce import AllReduceModel
    from disco_jax import zoo
    from hlo_tools import baselines as bl

    step, args = zoo.get("vgg")(jax.device_count(), "tiny")
    module = hlo_tools.parse(hlo_tools.extract(step, *args))
    fused = bl.module_from_compiled(bl.compile_baseline(step, args, "op_fusion"))
    hw = load_hardware("gloo2")

    def priced(extra: float, m: hlo_tools.ir.HloModule) -> tuple[C.CostModel, dict, float]:
        model = AllReduceModel(1e-9, 1e-3, 0, 0.0, extra)
        costs = C.CostModel(dataclasses.replace(hw, allreduce=model), constants=EXACT)
        graph = device_graph(m)
        sim = sim_graph(graph, P.initial_plan(graph), costs)
        gc = costs.graph_costs(graph)
        waits = {sim.names[k]: float(sim.duration_s[k]) for k in range(len(sim.names))
                 if gc.pays_d[graph.names.index(sim.names[k])]}
        return costs, waits, simulate(sim, 0.0).iteration_s

    for m in (module, fused):
        costs, plain, _ = priced(0.0, m)
        assert costs.fused_wait_s == 0.0 and len(plain) >= 2
        graph = device_graph(m)
        for name, seconds in plain.items():
            nbytes = graph.computation.instructions[graph.names.index(name)].shape.byte_size()
            assert seconds == pytest.approx(costs.allreduce_time(nbytes))
    costs, unfused, _ = priced(-8e-4, module)
    assert costs.fused_wait_s == pytest.approx(8e-4)
    one_process = load_hardware("inproc4")
    assert C.CostModel(dataclasses.replace(one_process, allreduce=AllReduceModel(
        1e-9, 1e-3, 0, 0.0, -8e-4)), constants=EXACT).fused_wait_s == 0.0
    assert unfused == priced(0.0, module)[1]  # nothing fused: all of D
    gc = costs.graph_costs(device_graph(fused))
    share = gc.ops[gc.ops > 1].sum() / gc.ops.sum()
    assert 0.5 < share < 1.0  # XLA fuses most of vgg's ops
    costs, less, fast = priced(-8e-4, fused)
    _, full, slow = priced(0.0, fused)
    for name, seconds in less.items():
        assert seconds == pytest.approx(full[name] - share * 8e-4)
    assert fast < slow
    # a plan's fusion groups count by their members
    graph = device_graph(module)
    plan = P.random_moves(P.FusionSpace(graph), P.initial_plan(graph), random.Random(0), 200)
    plain_sim = sim_graph(graph, plan, priced(0.0, module)[0])
    costs = priced(-8e-4, module)[0]
    sim = sim_graph(graph, plan, costs)
    gc = costs.graph_costs(graph)
    copied = {g for _, g in plan.dups}
    grouped = sum(gc.ops[members].sum() for gid, members in plan.groups().items()
                  if len(members) > 1 or gid in copied)
    assert grouped > 0
    comm = sim.is_comm & (plain_sim.duration_s > 0)
    cut = plain_sim.duration_s[comm] - sim.duration_s[comm]
    assert cut.max() == pytest.approx(grouped / gc.ops.sum() * 8e-4)
