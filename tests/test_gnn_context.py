"""Labels from whole-program traces (disco_estimator.gnn.context, disco_jax.pipeline.labels):
a real traced run of an inline module maps each fused kernel to its fused op; weighted
training; the product's runs add their labels to the local dataset."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import numpy as np
import pytest

from disco_estimator.gnn import context as C
from disco_estimator.gnn.dataset import Sample, load_samples, node_arrays
from disco_estimator.ops.keys import op_status

#: Real labels of zoo steps' programs (``benchmarks/estimator_context.py --fixture``).
_FIXTURE = Path(__file__).parent / "fixtures" / "context_samples.jsonl"

#: One hand-written loop fusion of three elementwise ops, and a negate outside it.
FUSED_HLO = """HloModule labels_probe

fused_body {
  p0 = f32[256,256]{1,0} parameter(0)
  p1 = f32[256,256]{1,0} parameter(1)
  add.1 = f32[256,256]{1,0} add(p0, p1)
  mul.1 = f32[256,256]{1,0} multiply(add.1, p1)
  ROOT exp.1 = f32[256,256]{1,0} exponential(mul.1)
}

ENTRY main {
  a = f32[256,256]{1,0} parameter(0)
  b = f32[256,256]{1,0} parameter(1)
  f = f32[256,256]{1,0} fusion(a, b), kind=kLoop, calls=fused_body
  ROOT n = f32[256,256]{1,0} negate(f)
}
"""


class _Times:
    """Member times of a graph: 2 us per op that runs a kernel (a NodeCostSource)."""

    def node_costs(self, graph):
        instrs = graph.computation.instructions
        free = np.array([op_status(i)[0] != "bench" for i in instrs])
        return node_arrays(graph, np.where(free, 0.0, 2e-6), free)


@pytest.fixture(scope="module")
def traced():
    """The module compiled exactly (XLA's fusion passes off) and traced for 6 iterations."""
    from disco_estimator.ops import trace
    from hlo_tools.jax_bridge import CompileOptions, FromText, compile_module

    run, inputs = compile_module(FUSED_HLO, FromText(seed=0), CompileOptions(exact=True))
    return trace.profile_program(run, *inputs, iterations=6, warmup=1)


def test_each_fused_kernel_maps_to_its_fused_op(traced) -> None:
    fusions = C.traced_fusions(traced)
    assert len(fusions) == 1
    (f,) = fusions
    body = f.body.computation.instructions
    assert sorted(body[m].opcode for m in f.members) == ["add", "exponential", "multiply"]
    assert [body[o].opcode for o in f.outputs] == ["exponential"]
    # one execution per iteration on the one device: the trace's own samples
    assert sorted(f.runs_s) == sorted(traced.samples_s[0][f.name])
    assert len(f.runs_s) == 6
    assert f.time_s == pytest.approx(statistics.median(traced.samples_s[0][f.name]))


def test_context_samples_carry_member_times_and_the_traced_label(traced) -> None:
    fusions = C.traced_fusions(traced)
    again = {f.name: f._replace(runs_s=tuple(2 * t for t in f.runs_s)) for f in fusions}
    (s,) = C.context_samples(fusions, _Times(), "probe", retest=again)
    assert s.kind == C.CONTEXT and s.source == "probe"
    assert s.subgraph.opcodes == ("add", "multiply", "exponential")
    assert list(s.subgraph.time_s) == [2e-6] * 3
    assert s.time_s == pytest.approx(fusions[0].time_s)
    assert s.retest_s == pytest.approx(2 * s.time_s)
    assert Sample.from_json(s.to_json()).to_json() == s.to_json()
    # a label that doubled on retest agrees with nothing and weighs 0.1 / 1.0
    assert C.repeat_agreement([s]) == {"n": 1, "within": 0.0, "median_rel_diff": 1.0}
    assert C.repeat_weight(s) == pytest.approx(0.1)
    assert C.repeat_weight(dataclasses.replace(s, retest_s=None)) == 1.0


def test_a_member_without_a_time_gives_no_sample(traced) -> None:
    class NoTimes(_Times):
        def node_costs(self, graph):
            n = graph.num_nodes
            return node_arrays(graph, np.zeros(n), np.zeros(n, bool))

    assert C.context_samples(C.traced_fusions(traced), NoTimes(), "probe") == []


def test_weighted_training_ignores_zero_weight_samples() -> None:
    """A sample of weight 0 does not move the model: training on (a, b) with b at
    weight 0 gives the same parameters as training on (a, b') with b' another label."""
    import jax

    from disco_estimator.gnn.model import GnnConfig
    from disco_estimator.gnn.train import train

    fixture = load_samples(_FIXTURE)[:2]
    subs = [s.subgraph for s in fixture]
    small = GnnConfig(hidden=8, heads=2, num_layers=1)
    a = train(subs, [1e-5, 2e-5], steps=5, config=small, weights=[1.0, 0.0], log_every=5)
    b = train(subs, [1e-5, 9e-3], steps=5, config=small, weights=[1.0, 0.0], log_every=5)
    c = train(subs, [1e-5, 9e-3], steps=5, config=small, log_every=5)
    same = jax.tree.map(lambda x, y: bool(np.allclose(x, y)), a.params, b.params)
    assert all(jax.tree.leaves(same))
    moved = jax.tree.map(lambda x, y: bool(np.allclose(x, y)), a.params, c.params)
    assert not all(jax.tree.leaves(moved))
    with pytest.raises(ValueError, match="weights"):
        train(subs, [1e-5, 2e-5], steps=1, config=small, weights=[0.0, 0.0])


def test_fixture_holds_real_context_labels() -> None:
    samples = load_samples(_FIXTURE)
    assert len(samples) >= 40
    assert {s.kind for s in samples} == {C.CONTEXT}
    assert all(s.time_s > 0 and s.retest_s and s.subgraph.num_nodes >= 2 for s in samples)


def test_product_run_adds_its_labels_to_the_local_dataset(tmp_path, monkeypatch) -> None:
    """optimize_step traces its exact plans and XLA's default after the final choice and
    keeps their fused ops in the local dataset of this backend."""
    import jax
    from step_helpers import mlp_step

    from disco_estimator.gnn.local import load_local_samples
    from disco_estimator.ops import backend_fingerprint
    from disco_jax.pipeline.optimize import optimize_step

    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DISCO_LOCAL_LABELS", "1")
    step, params, batch = mlp_step()
    lines = []
    out = optimize_step(jax.jit(step), (params(), batch, 0.1), top_k=1, choice_rounds=2,
                        search_s=2.0, predict_baselines=False, progress=lines.append)
    assert "labels" in out.report.seconds
    kept = load_local_samples(backend_fingerprint(1))
    assert kept and {s.kind for s in kept} == {C.CONTEXT}
    assert any(line.startswith("kept ") for line in lines)
