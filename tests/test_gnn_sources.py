"""The GNN estimator's XLA-fusion samples, vectorised batches, evaluation helpers and
``disco estimate --measure``: real jax/XLA on CPU, small modules."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_tools
from disco_estimator.costs.cost_model import CostModel
from disco_estimator.gnn import dataset as D
from disco_estimator.gnn import evaluate as E
from disco_estimator.gnn import features as F
from disco_estimator.gnn.estimator import GnnFusedEstimator
from disco_estimator.gnn.model import GnnConfig, init_params
from disco_estimator.gnn.train import make_batch
from disco_jax.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
SMALL = GnnConfig(opcode_embed=8, dtype_embed=2, hidden=16, heads=2, num_layers=1, mlp=(16,))


def _step(x: jax.Array, w: jax.Array) -> jax.Array:
    """A few elementwise ops and reductions: XLA fuses them into several loop fusions."""
    h = jnp.tanh(x @ w) * 2.0 + 1.0
    s = jnp.sum(jnp.exp(h - jnp.max(h, axis=-1, keepdims=True)), axis=-1)
    return jnp.log(s)[:, None] * h + jnp.sin(x).mean()


@pytest.fixture(scope="module")
def compiled_text() -> str:
    """XLA's post-optimization HLO of :func:`_step` (its own fusions)."""
    x = jnp.ones((64, 128), jnp.float32)
    w = jnp.ones((128, 128), jnp.float32)
    return jax.jit(_step).lower(x, w).compile().as_text()


def test_xla_groups_are_xla_fusions(compiled_text) -> None:
    module = hlo_tools.parse(compiled_text)
    graph = hlo_tools.device_graph(module)
    fusions = D.fusion_groups(module, graph)
    groups = D.xla_groups(module, graph)
    assert fusions and groups and len(groups) <= len(fusions)
    names = {i.name for i, _, _ in fusions}
    for name, body, members in groups:
        assert name in names and len(members) >= 2
        assert body.opcodes[body.root] != "tuple"
        text, specs = D.fused_module(body, members)
        assert text.count(" fusion(") == 1 and "bitcast(" not in text.split("ENTRY")[0]
        assert len(specs) >= 1


def test_generate_xla_samples_are_tagged_and_resume(tmp_path, monkeypatch,
                                                    compiled_text) -> None:
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    path, added = D.generate([("toy", compiled_text)], kind="xla", per_module=3, repeats=3,
                             warmup=1, directory=tmp_path)
    assert path.name.startswith(f"dataset-v{D.DATASET_VERSION}-")
    samples = D.load_samples(path)
    assert 1 <= added == len(samples) <= 3
    assert {s.kind for s in samples} == {"xla"} and {s.source for s in samples} == {"toy"}
    assert all(s.time_s > 0 and s.subgraph.num_nodes >= 2 for s in samples)
    # A sample written as JSON reads back equal, kind included.
    again = D.Sample.from_json(json.loads(json.dumps(samples[0].to_json())))
    assert again.kind == "xla" and again.to_json() == samples[0].to_json()
    _, more = D.generate([("toy", compiled_text)], kind="xla", per_module=3, repeats=3,
                         warmup=1, directory=tmp_path)
    assert len({(s.kind, s.key) for s in D.load_samples(path)}) == added + more
    with pytest.raises(ValueError, match="unknown sample kind"):
        D.generate([("toy", compiled_text)], kind="nope", directory=tmp_path)


def test_old_samples_without_a_kind_read_as_plan() -> None:
    sub = F.FusedSubgraph(("add", "multiply"), ("f32", "f32"), np.array([1e-6, 2e-6]),
                          np.array([8, 16]), np.array([8, 8]), np.array([False, True]),
                          np.array([False, False]), np.array([0], np.int32),
                          np.array([1], np.int32), 8, 8)
    d = D.Sample("k", "m", sub, 2e-6, 1e-6, 3e-6, 5).to_json()
    del d["kind"]
    assert D.Sample.from_json(d).kind == "plan"


def test_encode_batch_equals_encode_batch_pad() -> None:
    graph = hlo_tools.device_graph(hlo_tools.parse((FIXTURES / "shard_map_mlp.pre.hlo")
                                                   .read_text()))
    nodes = CostModel("inproc4").node_costs(graph)
    groups = D.plan_groups(graph, 0, plans=16)
    subs = [F.subgraph_from_group(graph, nodes, m, c) for m, c in groups]
    single = F.subgraph_from_group(graph, nodes, [groups[0][0][0]])  # no edges
    rng = random.Random(0)
    for batch in (subs, [single], [single, *subs[:3]], rng.sample(subs, min(5, len(subs)))):
        for pad in (True, False):
            ref = F.batch([F.encode(s) for s in batch])
            ref = F.pad_to_bucket(ref) if pad else ref
            got = F.encode_batch(batch, pad=pad)
            for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
                a, b = np.asarray(a), np.asarray(b)
                assert a.shape == b.shape and a.dtype.kind == b.dtype.kind
                np.testing.assert_allclose(a, b, rtol=1e-6)
    with pytest.raises(ValueError):
        F.encode_batch([])


def test_cached_predictions_equal_fresh_ones() -> None:
    graph = hlo_tools.device_graph(hlo_tools.parse((FIXTURES / "shard_map_mlp.pre.hlo")
                                                   .read_text()))
    nodes = CostModel("inproc4").node_costs(graph)
    subs = [F.subgraph_from_group(graph, nodes, m, c)
            for m, c in D.plan_groups(graph, 0, plans=8)]
    params = init_params(SMALL, make_batch(subs[:4])[0], 1)
    est = GnnFusedEstimator(params, SMALL, chunk=3)
    first = est.predict_subgraphs(subs)
    assert len(est.cache) == len({F.canonical_key(s) for s in subs})
    np.testing.assert_array_equal(est.predict_subgraphs(subs[::-1]), first[::-1])
    np.testing.assert_allclose(GnnFusedEstimator(params, SMALL).predict_subgraphs(subs), first,
                               rtol=1e-5)


def test_evaluation_helpers() -> None:
    pred, meas = [1.05, 1.12, 2.0, 0.5], [1.0, 1.0, 1.0, 1.0]
    np.testing.assert_allclose(E.relative_errors(pred, meas), [0.05, 0.12, 1.0, 0.5])
    cdf = dict((x, y) for x, y in E.error_cdf(pred, meas))
    assert cdf[0.10] == 0.25 and cdf[0.14] == 0.5 and cdf[1.0] == 1.0
    out = E.breakdown({"a": pred, "b": meas}, meas,
                      {"first_two": lambda i: i < 2, "none": lambda i: False})
    assert out["all"]["a"]["n"] == 4 and out["all"]["b"]["within_10"] == 1.0
    assert out["first_two"]["a"]["within_14"] == 1.0 and out["first_two"]["a"]["n"] == 2
    assert out["none"]["a"]["n"] == 0 and math.isnan(out["none"]["a"]["within_10"])
    train, test = E.split_samples([D.Sample("k", m, None, 1.0, 1.0, 1.0, 1)  # type: ignore
                                   for m in ("a", "b", "a")], "a")
    assert [s.source for s in train] == ["b"] and len(test) == 2


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_estimate_measure_json(tmp_path, monkeypatch, compiled_text) -> None:
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "xla.hlo"
    path.write_text(compiled_text)
    code, out, err = _main("estimate", str(path), "--no-bench", "--measure", "--repeats", "3",
                           "--json")
    assert code == 0, err
    report = json.loads(out)
    rows = report["fusions"]
    assert rows and report["predictor"] == "fallback" and report["measured"]
    for r in rows:
        assert {"name", "predicted_s", "fallback_s", "measured_s"} <= set(r)
        assert r["predicted_s"] == r["fallback_s"] > 0
        assert (r["measured_s"] is None) == bool(r["measure_error"])
    single = {name for name, _, _ in D.xla_groups(hlo_tools.parse(compiled_text))}
    assert all(r["measured_s"] > 0 for r in rows if r["name"] in single)
    code, out, err = _main("estimate", str(path), "--no-bench", "--measure", "--repeats", "3")
    assert code == 0 and "measured" in out.splitlines()[1], err
    code, out, err = _main("estimate", str(path), "--no-bench", "--measure", "--repeats", "0")
    assert code == 2 and err.startswith("disco: error: --repeats must be >= 1"), err
    code, out, err = _main("estimate", str(path), "--no-bench", "--json")
    assert code == 0 and all(r["measured_s"] is None and "measure_error" not in r
                             for r in json.loads(out)["fusions"]), err
