"""The GNN fused-op estimator: features, model, training, checkpoints, the protocol."""

from __future__ import annotations

import random
from pathlib import Path

import jax
import numpy as np
import pytest

import hlo_tools
from disco_estimator.costs.cost_model import CostModel
from disco_estimator.costs.lower import simulate_plan
from disco_estimator.gnn import checkpoint as ckpt_io
from disco_estimator.gnn import features as F
from disco_estimator.gnn.estimator import GnnFusedEstimator
from disco_estimator.gnn.model import FusedOpGnn, GnnConfig
from disco_estimator.gnn.train import make_batch, train
from disco_estimator.interface import (
    BatchedFusedOpEstimator,
    FallbackFusedEstimator,
    FusedOpEstimator,
)
from hlo_tools import plan as P
from hlo_tools.graph import device_graph

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = GnnConfig(opcode_embed=8, dtype_embed=2, hidden=16, heads=2, num_layers=2, mlp=(16,))


def _fused_groups(graph, seeds=range(6)):
    """Distinct multi-op compute groups (with their copies) of random plans."""
    space = P.FusionSpace(graph)
    out = set()
    for seed in seeds:
        plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed), 60,
                              weights=(0.6, 0.4, 0.0))
        copies: dict[int, list[int]] = {}
        for p, g in plan.dups:
            copies.setdefault(g, []).append(p)
        for gid, ms in plan.groups().items():
            if len(ms) > 1 and graph.opcodes[ms[0]] != "all-reduce":
                out.add((tuple(ms), tuple(sorted(copies.get(gid, [])))))
    return sorted(out)


@pytest.fixture(scope="module")
def setup():
    module = hlo_tools.parse((FIXTURES / "shard_map_mlp.pre.hlo").read_text())
    graph = device_graph(module)
    costs = CostModel("inproc4")  # analytic single-op times: no measuring in tests
    groups = _fused_groups(graph)
    nodes = costs.node_costs(graph)
    subs = [F.subgraph_from_group(graph, nodes, m, c) for m, c in groups]
    fallback = FallbackFusedEstimator(costs)
    # Targets: the fallback rule's times scaled by a per-opcode-mix factor, so the model
    # must learn something beyond the sum of member times.
    times = [fallback.predict(graph, list(m), list(c)) * (1.5 if "reduce" in s.opcodes else 0.7)
             for (m, c), s in zip(groups, subs)]
    return graph, costs, groups, subs, np.array(times)


@pytest.fixture(scope="module")
def trained(setup):
    _, _, _, subs, times = setup
    return train(subs, times, steps=500, learning_rate=3e-3, seed=0, config=SMALL,
                 log_every=25)


def test_subgraphs_cover_duplicates_and_outputs(setup) -> None:
    graph, _, groups, subs, _ = setup
    assert len(subs) >= 10
    assert any(s.is_copy.any() for s in subs)
    for (ms, cs), s in zip(groups, subs):
        assert s.num_nodes == len(set(ms) | set(cs))
        assert s.is_output.any() and not (s.is_output & s.is_copy).any()
        assert (s.senders < s.receivers).all()  # topological order
        assert F.FusedSubgraph.from_json(s.to_json()).to_json() == s.to_json()


def test_pad_unpad_round_trip_and_static_buckets(setup) -> None:
    subs = setup[3]
    raw = F.batch([F.encode(s) for s in subs[:7]])
    padded = F.pad_to_bucket(raw)
    assert (padded.nodes["x"].shape[0], padded.senders.shape[0], padded.n_node.shape[0]) \
        == F.bucket_sizes(int(raw.n_node.sum()), int(raw.n_edge.sum()), 7)
    back = F.unpad(padded)
    for a, b in zip(jax.tree_util.tree_leaves(raw), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Different batches of similar size share one padded shape (one compilation).
    other = F.pad_to_bucket(F.batch([F.encode(s) for s in subs[1:8]]))
    assert jax.tree_util.tree_map(np.shape, other) == jax.tree_util.tree_map(np.shape, padded)


def test_canonical_key_ignores_position_not_content(setup) -> None:
    sub = setup[3][0]
    same = F.FusedSubgraph.from_json(sub.to_json())
    assert F.canonical_key(same) == F.canonical_key(sub)
    slower = sub._replace(time_s=sub.time_s * 1.5)
    assert F.canonical_key(slower) != F.canonical_key(sub)


def test_jit_and_eager_inference_agree(setup, trained) -> None:
    subs = setup[3]
    jitted = GnnFusedEstimator(trained.params, trained.config).predict_subgraphs(subs)
    eager = GnnFusedEstimator(trained.params, trained.config, jit=False).predict_subgraphs(subs)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)
    # Batched and one at a time (other padding) agree too.
    one = GnnFusedEstimator(trained.params, trained.config, chunk=1).predict_subgraphs(subs)
    np.testing.assert_allclose(one, jitted, rtol=1e-5)


def test_training_overfits_a_tiny_fixture(setup, trained) -> None:
    subs, times = setup[3], setup[4]
    losses = [h["loss"] for h in trained.history]
    assert losses[0] > 0.02            # the targets are not the sum of member times
    assert losses[-1] < 2e-3           # ~4.5% rms error in log time
    pred = GnnFusedEstimator(trained.params, trained.config).predict_subgraphs(subs)
    assert np.max(np.abs(pred / times - 1)) < 0.15


def test_checkpoint_round_trip_predicts_identically(tmp_path, setup, trained) -> None:
    subs = setup[3]
    path = ckpt_io.save(tmp_path / "gnn.msgpack",
                        ckpt_io.Checkpoint(trained.params, trained.config, {"platform": "cpu"},
                                           {"steps": 250}))
    loaded = ckpt_io.load(path)
    assert loaded.config == trained.config and loaded.fingerprint == {"platform": "cpu"}
    a = GnnFusedEstimator(trained.params, trained.config).predict_subgraphs(subs)
    b = GnnFusedEstimator.from_checkpoint(str(path)).predict_subgraphs(subs)
    np.testing.assert_array_equal(a, b)
    from flax import serialization

    header = serialization.msgpack_restore(path.read_bytes())["header"]  # plain msgpack
    assert '"feature_version": 1' in header
    (tmp_path / "junk").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError):
        ckpt_io.load(tmp_path / "junk")


def test_unknown_opcodes_and_dtypes_use_bucket_zero(setup, trained) -> None:
    sub = setup[3][0]
    odd = sub._replace(opcodes=("some-future-op", *sub.opcodes[1:]),
                       dtypes=("f4e2m1", *sub.dtypes[1:]))
    g = F.encode(odd)
    assert g.nodes["opcode"][0] == 0 and g.nodes["dtype"][0] == 0
    assert F.opcode_id("add") == F.OPCODE_VOCAB.index("add") > 0
    t = GnnFusedEstimator(trained.params, trained.config).predict_subgraphs([odd])
    assert np.isfinite(t).all() and t[0] > 0


def test_estimator_plugs_into_the_cost_model(setup, trained) -> None:
    graph, _, groups, _, _ = setup
    costs = CostModel("inproc4")
    est = GnnFusedEstimator(trained.params, trained.config, costs)
    assert isinstance(est, FusedOpEstimator) and isinstance(est, BatchedFusedOpEstimator)
    costs.set_fused_estimator(est)
    batch_t = est.predict_batch(graph, groups)
    single = [est.predict(graph, list(m), list(c)) for m, c in groups[:5]]
    np.testing.assert_allclose(single, batch_t[:5], rtol=1e-6)
    # A single op is its own measured time, as with the fallback rule.
    node = groups[0][0][0]
    assert est.predict(graph, [node], []) == pytest.approx(
        FallbackFusedEstimator(costs).predict(graph, [node], []), rel=1e-12)
    plan = P.random_moves(P.FusionSpace(graph), P.initial_plan(graph), random.Random(3), 60,
                          weights=(0.6, 0.4, 0.0))
    gnn_run = simulate_plan(graph, plan, costs)
    fallback_run = simulate_plan(graph, plan, CostModel("inproc4"))
    assert gnn_run.iteration_s > 0
    assert gnn_run.iteration_s != fallback_run.iteration_s  # the GNN's times were used
    assert len(est.cache) > 0


def test_model_output_is_the_base_plus_a_correction(setup) -> None:
    """A fresh model (zero-initialised output layer) predicts the sum of member times."""
    subs = setup[3][:5]
    padded, _, _ = make_batch(subs)
    model = FusedOpGnn(SMALL)
    params = model.init(jax.random.PRNGKey(0), padded)
    out = np.exp(np.asarray(model.apply(params, padded))[:5])
    np.testing.assert_allclose(out, [s.time_s.sum() for s in subs], rtol=1e-5)


# --------------------------------------------------------------------------- dataset


def test_dataset_node_arrays_match_the_cost_model(setup) -> None:
    from disco_estimator.gnn import dataset as D
    from disco_estimator.ops import op_status

    graph, costs, groups, subs, _ = setup
    ref = costs.node_costs(graph)
    instrs = graph.computation.instructions
    free = np.array([op_status(i)[0] == "free" for i in instrs])
    time_s = ref.launch_s + ref.mem_s + ref.compute_s
    mine = D.node_arrays(graph, time_s, free)
    for field in ("traffic", "write_bytes", "op_ptr", "op_idx", "read_bytes"):
        np.testing.assert_array_equal(getattr(mine, field), getattr(ref, field), field)
    for (m, c), s in zip(groups, subs):  # so training features equal inference features
        assert F.canonical_key(F.subgraph_from_group(graph, mine, m, c)) == F.canonical_key(s)


def test_dataset_generation_times_fused_modules_and_resumes(tmp_path, monkeypatch) -> None:
    from disco_estimator.gnn import dataset as D
    from hlo_tools import jax_bridge

    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    text = (FIXTURES / "shard_map_mlp.pre.hlo").read_text()
    graph = device_graph(hlo_tools.parse(text))
    ms, cs = next((m, c) for m, c in D.plan_groups(graph, 0)
                  if len(P.group_outputs(graph, None, m)) == 1)
    hlo, specs = D.fused_module(graph, ms, cs)
    assert hlo.count(" fusion(") == 1
    exe = jax_bridge.compile_module(hlo, jax_bridge.Standalone(),
                                    jax_bridge.CompileOptions(exact=True))
    assert all(np.isfinite(o).all() for o in exe.run(exe.put(*ob_inputs(specs))))
    path, added = D.generate([("mlp", text)], per_module=3, repeats=3, warmup=1,
                             directory=tmp_path)
    assert 1 <= added <= 3
    samples = D.load_samples(path)
    assert len(samples) == added and all(s.time_s > 0 and s.samples >= 3 for s in samples)
    assert all(s.subgraph.num_nodes > 1 for s in samples)
    _, again = D.generate([("mlp", text)], per_module=3, repeats=3, warmup=1,
                          directory=tmp_path)
    assert len(D.load_samples(path)) == added + again  # known keys are never re-timed
    assert len({s.key for s in D.load_samples(path)}) == added + again


def ob_inputs(specs):
    from disco_estimator.ops.standalone import random_inputs

    return random_inputs(specs, seed=0)
