"""Random plans on every zoo model compile exactly as planned and compute the same numbers.

Each model gets 2 seeded random plans of 200 moves (op fusion, duplicate fusion,
AllReduce combination; 8 more under the ``slow`` mark). In the default run: vgg
(convolutions) and rnnlm (a loop); the other models (transformer's attention and
layernorm among them) under ``slow``. Every plan must pass
``verify``, compile with ``exact=True`` (in a subprocess: XLA:CPU aborts the whole
process on fusions it cannot emit, and such a crash must fail the test rather than kill
pytest), contain exactly the planned multi-op fusions and all-reduces, and produce
outputs equal to ``jax.jit`` of the original step within rtol 1e-5 / atol 1e-6.
``python benchmarks/random_plans.py --plans 200`` is the slow version of this test.

ResNet may match either ``jax.jit`` or XLA's no-fusion compile of the unchanged
program: with fusion and the dot library rewriter disabled, XLA:CPU itself computes its
multi-device convolution gradients about 3e-4 (relative) off the float64 result, for the
unchanged program too (see tests/test_roundtrip.py), and which of the two answers a plan
gets depends on its fusions; comparing with ``jax.jit`` alone would test XLA.
"""

from __future__ import annotations

import pytest

from disco_jax.enactment.plan_check import run_isolated
from disco_jax.zoo import MODELS

FAST_SEEDS, SLOW_SEEDS, MOVES = range(2), range(2, 10), 200


def _check(model, seeds):
    rows = run_isolated(model, list(seeds), MOVES)
    bad = [r for r in rows if r["status"] != "ok"]
    assert not bad, "\n".join(f"seed {r['seed']}: {r['status']}: {r.get('error', '')[:400]}"
                              for r in bad)
    for r in rows:
        # Exactly the planned fusions, except that XLA may fold a fusion whose inputs
        # are all constants (a causal mask, say) into a constant.
        low = r["planned_fusions"] - r["foldable_fusions"]
        assert low <= r["compiled_fusions"] <= r["planned_fusions"], r
        assert r["compiled_allreduces"] == r["planned_allreduces"], r
    assert sum(r["planned_fusions"] for r in rows) > 0


FAST_MODELS = ("vgg", "rnnlm")


@pytest.mark.parametrize("model", [pytest.param(m, marks=[] if m in FAST_MODELS else
                                                [pytest.mark.slow]) for m in sorted(MODELS)])
def test_random_plans_compile_exactly_and_match(model):
    _check(model, FAST_SEEDS)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_more_random_plans_compile_exactly_and_match(model):
    _check(model, SLOW_SEEDS)


def test_a_plan_past_its_time_is_reported_as_timed_out_and_the_rest_go_on():
    logged = []
    rows = run_isolated("vgg", [0, 1], MOVES, timeout_s=0.5, on_row=logged.append)
    assert [(r["seed"], r["status"]) for r in rows] == [(0, "timeout"), (1, "timeout")]
    assert logged == rows
