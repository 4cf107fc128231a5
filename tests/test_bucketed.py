"""The ``bucketed`` baseline (hand bucketing) on real XLA:CPU, 4 host devices.

Structure: :func:`hlo_tools.plan.bucket_plan` makes buckets of at most T bytes in order of
gradient production (a single larger gradient alone), for every threshold of the sweep.
Programs: on every zoo model the bucketed program compiles, matches ``jax.jit`` (rtol
1e-5), runs exactly the planned all-reduces and has XLA's own fusions.
"""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from disco_jax import zoo
from hlo_tools import baselines as bl
from hlo_tools import jax_bridge as jb
from hlo_tools.graph import device_graph
from hlo_tools.parser import parse
from hlo_tools.plan import (
    FusionSpace,
    bucket_members,
    bucket_plan,
    initial_plan,
    production_order,
    random_moves,
    ready_order,
)
from hlo_tools.printer import to_text

RTOL, ATOL = 1e-5, 1e-6
needs_devices = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 host devices")


def _space(model: str) -> FusionSpace:
    step, args = zoo.get(model)(4, "tiny")
    return FusionSpace(device_graph(parse(jb.extract(step, *args))))


def _check_buckets(space: FusionSpace, plan, threshold: int | None) -> list[list[int]]:
    """Asserts the bucketing rule; returns the buckets."""
    sizes = space.graph.out_bytes
    buckets = bucket_members(space, plan)
    shown = [[(space.graph.names[a], sizes[a]) for a in b] for b in buckets]
    # every combinable all-reduce in exactly one bucket, buckets in production order
    order = production_order(space, initial_plan(space.graph))
    assert [a for b in buckets for a in b] == order, shown
    limit = float("inf") if threshold is None else threshold
    for k, b in enumerate(buckets):
        total = sum(sizes[a] for a in b)
        assert len(b) == 1 or total <= limit, (k, shown)
        if k + 1 < len(buckets):  # closed only when the next gradient would not fit
            nxt = sizes[buckets[k + 1][0]]
            assert total + nxt > limit or space.ar_key[b[0]] != space.ar_key[buckets[k + 1][0]], (
                k, shown)
    if threshold is None:
        assert len({space.ar_key[a] for a in order}) == len(buckets), shown
    return buckets


@pytest.mark.parametrize("model", ["vgg", "transformer", "rnnlm"])
def test_bucket_rule_for_every_threshold(model):
    space = _space(model)
    sizes = space.graph.out_bytes
    total = sum(sizes[a] for a in space.allreduces)
    largest = max(sizes[a] for a in space.allreduces)
    for threshold in (*bl.BUCKET_THRESHOLDS, total // 4, largest // 2, largest, 0):
        plan = bucket_plan(space, threshold)
        buckets = _check_buckets(space, plan, threshold)
        if threshold == 0:
            assert all(len(b) == 1 for b in buckets)
    # tiny models: every gradient fits in 1 MiB, so the whole sweep gives one bucket
    assert total <= 2**20
    assert len(bucket_members(space, bucket_plan(space, 2**20))) == 1


def test_bucket_plan_keeps_a_base_plan_and_refuses_bucketed_bases():
    space = _space("vgg")
    graph = space.graph
    base = random_moves(space, initial_plan(graph), random.Random(0), 100,
                        weights=(1.0, 0.0, 0.0))
    plan = bucket_plan(space, 4096, base)
    _check_buckets(space, plan, 4096)
    fused = {g: ms for g, ms in base.groups().items() if graph.opcodes[ms[0]] != "all-reduce"}
    assert fused and all(plan.group[m] == plan.group[ms[0]] for ms in fused.values() for m in ms)
    with pytest.raises(ValueError, match="already combines"):
        bucket_plan(space, 4096, plan)
    with pytest.raises(ValueError, match=">= 0"):
        bucket_plan(space, -1)


def test_bucketed_option_set():
    for platform in ("cpu", "gpu"):
        assert bl.baseline_options("bucketed", platform) == bl.baseline_options(
            "op_fusion", platform)
    assert bl.ALL_BASELINES[-1] == bl.BUCKETED and bl.BASELINES == bl.ALL_BASELINES[:-1]


@needs_devices
@pytest.mark.parametrize("model", [pytest.param(m, marks=[] if m in ("vgg", "rnnlm")
                                                else [pytest.mark.slow])
                                   for m in sorted(zoo.MODELS)])
def test_bucketed_program_runs_as_planned(model):
    step, args = zoo.get(model)(4, "tiny")
    reference = jax.tree.leaves(jax.jit(step)(*args))
    module = parse(jb.extract(step, *args))
    space, one = bl.bucketed_plan(module, None)
    total = sum(space.graph.out_bytes[a] for a in space.allreduces)
    threshold = total // 3  # several buckets on a tiny model
    cand = bl.compile_bucketed(step, args, threshold)
    text = cand.run.as_text()
    shown = list(zip(cand.buckets, cand.bucket_bytes))
    assert len(cand.buckets) >= 3, shown
    assert all(len(b) == 1 or n <= threshold for b, n in zip(cand.buckets, cand.bucket_bytes))
    names = [space.graph.names[a] for a in production_order(space, initial_plan(space.graph))]
    assert [n for b in cand.buckets for n in b] == names, shown
    merged = sum(len(b) - 1 for b in cand.buckets)
    assert cand.planned_all_reduces == jb.count_all_reduces(jb.extract(step, *args)) - merged
    assert jb.count_all_reduces(text) == cand.planned_all_reduces, shown
    summary = bl.summary(bl.module_from_compiled(text))
    assert summary["multi_op_fusions"] > 0, summary
    assert summary["combined_all_reduces"] == sum(len(b) > 1 for b in cand.buckets), summary
    got = jax.tree.leaves(cand.run(*args))
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_auto_sharded_has_nothing_to_bucket():
    step, args = zoo.get("auto_sharded")(4, "tiny")
    with pytest.raises(ValueError, match="no gradient all-reduce"):
        bl.compile_bucketed(step, args, None)


# A two-layer backward pass written the way jax lowers it: the weight gradients follow
# the parameters' order, so the first layer's (which needs the whole backward) is placed
# before the second layer's (which needs only the second layer's backward).
_TWO_LAYERS = """
HloModule two_layers

add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY step {
  x = f32[8] parameter(0)
  h1 = f32[8] tanh(x)
  h2 = f32[8] tanh(h1)
  d2 = f32[8] exponential(h2)
  d1 = f32[8] exponential(d2)
  g1 = f32[8] multiply(d1, x)
  g2 = f32[8] multiply(d2, h1)
  ar1 = f32[8] all-reduce(g1), replica_groups={}, to_apply=add
  ar2 = f32[8] all-reduce(g2), replica_groups={}, to_apply=add
  ROOT out = (f32[8], f32[8]) tuple(ar1, ar2)
}
"""


def test_ready_order_puts_the_gradient_that_needs_less_of_the_backward_first():
    module = parse(_TWO_LAYERS)
    space = FusionSpace(device_graph(module))
    names = space.graph.names
    by_position = [names[a] for a in production_order(space, initial_plan(space.graph))]
    assert by_position == ["ar1", "ar2"], to_text(module)
    assert [names[a] for a in ready_order(space)] == ["ar2", "ar1"], to_text(module)
    # with every node free the costs tie, and ties keep the schedule's order
    w = np.zeros(space.graph.num_nodes)
    assert [names[a] for a in ready_order(space, w)] == ["ar1", "ar2"]  # all free: ties
    with pytest.raises(ValueError, match="weights"):
        ready_order(space, [1.0])


@pytest.mark.parametrize("model", ["vgg", "bert"])
def test_ready_order_is_reverse_layer_order_on_zoo_steps(model):
    """Every gradient once, and the first needs fewer convolutions and dots than the
    schedule's first (the first layer's, which needs the whole backward pass)."""
    space = _space(model)
    g = space.graph
    order = ready_order(space)
    assert sorted(order) == sorted(space.allreduces)

    def heavy_ancestors(a: int) -> set[int]:
        seen, todo = set(), [space.grad_producer.get(a, a)]
        while todo:
            for o in g.operands[todo.pop()]:
                if o not in seen:
                    seen.add(o)
                    todo.append(o)
        return {x for x in seen if g.opcodes[x] in ("dot", "convolution")}

    first, scheduled_first = order[0], production_order(space, initial_plan(g))[0]
    assert len(heavy_ancestors(first)) < len(heavy_ancestors(scheduled_first)), (
        g.names[first], g.names[scheduled_first])
