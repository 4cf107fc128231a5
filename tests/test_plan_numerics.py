"""Legality rules that keep a plan's numbers: a compare may not read a copy that XLA can
compute differently from its original (real XLA:CPU shows why)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import hlo_tools
from hlo_tools import plan as P
from hlo_tools.plan.merge import _with_copy
from hlo_tools.plan.value import _index

# jax's gradient of max(v, 0) tests ``v == max(v, 0)``; LayerNorm's variance
# v = E[x^2] - E[x]^2 is such a ``v`` (reformer, plan_check seed 63).
N = 1024
MODULE = (pathlib.Path(__file__).parent / "fixtures" / "snippets" / "compare_copy.hlo").read_text()


@pytest.fixture(scope="module")
def setup():
    module = hlo_tools.parse(MODULE)
    graph = hlo_tools.device_graph(module)
    return module, graph, P.FusionSpace(graph), graph.index


def _copy_plan(space, graph, idx, steps):
    """The plan with the copies ``(producer, consumer)`` made in order, without asking
    :func:`hlo_tools.plan.can_duplicate` (to run what the rule forbids)."""
    plan = P.initial_plan(graph)
    for producer, consumer in steps:
        plan = _with_copy(space, plan, _index(plan), idx[producer],
                            plan.group[idx[consumer]])
    return plan


def test_exact_copy_feeding_a_compare_is_legal(setup):
    _, graph, space, idx = setup
    plan = P.initial_plan(graph)
    # the copy of v reads y and sq from outside its fusion: the same subtract, bitwise
    assert P.can_duplicate(space, plan, idx["v"], idx["eq"])


def test_copy_reading_a_fused_value_may_not_feed_a_compare(setup):
    _, graph, space, idx = setup
    plan = P.duplicate(space, P.initial_plan(graph), idx["v"], idx["eq"])
    # copying sq too makes the copy of v one FMA: another v than the original's
    decision = P.can_duplicate(space, plan, idx["sq"], idx["eq"])
    assert not decision
    assert "compare" in decision.reason and "copy" in decision.reason
    # an unrelated copy in a group without compares stays legal
    assert P.can_duplicate(space, P.initial_plan(graph), idx["z"], idx["m"])


def test_fusing_a_compare_with_an_inexact_copy_is_refused(setup):
    _, graph, space, idx = setup
    # a's group holds copies of v and sq: its copy of v is one FMA, and a is computed from
    # it; no compare there yet, so both copies are legal
    plan = P.duplicate(space, P.initial_plan(graph), idx["v"], idx["a"])
    plan = P.duplicate(space, plan, idx["sq"], idx["a"])
    # fusing that group into ge would compare it with the original's max
    decision = P.can_fuse(space, plan, idx["a"], idx["ge"])
    assert not decision and "compare" in decision.reason, decision
    # without the copy of sq the copy of v is exact and the fusion is legal
    plan = P.duplicate(space, P.initial_plan(graph), idx["v"], idx["a"])
    assert P.can_fuse(space, plan, idx["a"], idx["ge"])


def _run(text):
    import jax.numpy as jnp

    def fn(x, y):  # the same signature and outputs as MODULE; its text is replaced
        v = y - x * x
        m = jnp.maximum(v, 0.0)
        return m, jnp.where(v == m, 1.0, 0.0), jnp.where(v + 0.0 >= m, 1.0, 0.0)

    x = np.random.RandomState(0).uniform(0.5, 2.0, N).astype(np.float32)
    y = x * x  # so that the unfused v is exactly 0: a tie of max(v, 0)
    run = hlo_tools.compile_module(text, hlo_tools.InPlaceOf(fn, (x, y)),
                                   hlo_tools.CompileOptions(exact=True))
    return [np.asarray(a) for a in run(x, y)]


def test_xla_computes_the_forbidden_copy_differently(setup):
    """Why the rule exists: on XLA:CPU the refused plan changes the compare's answer,
    the legal one computes the original numbers bitwise."""
    module, graph, space, idx = setup
    want = _run(MODULE)
    assert want[1].min() == 1.0  # every v is exactly 0 unfused: the tie holds
    legal = _copy_plan(space, graph, idx, [("v", "eq")])
    got = _run(hlo_tools.to_text(hlo_tools.apply_plan(module, legal, graph)))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    forbidden = _copy_plan(space, graph, idx, [("v", "eq"), ("sq", "eq")])
    text = hlo_tools.to_text(hlo_tools.apply_plan(module, forbidden, graph))
    got = _run(text)
    assert np.array_equal(got[0], want[0])  # m still comes from the original v
    assert not np.array_equal(got[1], want[1]), text  # the copy of v is not 0 everywhere
