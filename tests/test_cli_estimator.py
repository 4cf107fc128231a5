"""Tests of ``disco train-estimator`` and ``disco estimate``: real runs, small."""

from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest

import hlo_tools
from disco_estimator.costs.cost_model import CostModel
from disco_estimator.gnn import checkpoint as ckpt_io
from disco_estimator.gnn.dataset import load_samples, plan_groups
from disco_estimator.gnn.features import subgraph_from_group
from disco_estimator.interface import FallbackFusedEstimator
from disco_jax import zoo
from disco_jax.cli import main
from disco_jax.cli.train_estimator import accuracy, fallback_time


def _main(*argv: str) -> tuple[int, str, str]:
    """Runs ``disco`` in this process; returns ``(exit code, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _user_error(code: int, err: str) -> bool:
    """Exit 2 with one ``disco: error:`` line and no traceback."""
    return (code == 2 and err.startswith("disco: error: ") and err.count("\n") == 1
            and "Traceback" not in err)


@pytest.fixture(scope="module")
def vgg():
    """Tiny vgg: its pre-optimization text, the text of a random plan, that plan's fusion
    instructions (names, in program order)."""
    step, args = zoo.get("vgg")(4, "tiny")
    text = hlo_tools.extract(step, *args)
    module = hlo_tools.parse(text)
    planned = hlo_tools.to_text(hlo_tools.apply_plan(
        module, hlo_tools.random_plan(module, seed=0, moves=200)))
    graph = hlo_tools.device_graph(hlo_tools.parse(planned))
    return text, planned, [n for n, op in zip(graph.names, graph.opcodes) if op == "fusion"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``disco train-estimator --generate`` on a few samples of tiny vgg, 3 epochs."""
    root = tmp_path_factory.mktemp("gnn")
    cpus = os.sched_getaffinity(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISCO_CACHE_DIR", str(root / "cache"))
        code, out, err = _main("train-estimator", "--generate", "--models", "vgg",
                               "--size", "tiny", "--per-module", "2", "--repeats", "3",
                               "--epochs", "3", "--dataset", str(root / "data"),
                               "--out", str(root / "gnn.msgpack"))
    # timed in a pinned child: this process itself keeps all its CPUs
    assert os.sched_getaffinity(0) == cpus
    return root, code, out, err


def test_train_estimator_writes_a_checkpoint_that_loads(trained) -> None:
    root, code, out, err = trained
    assert code == 0, err
    (dataset,) = (root / "data").glob("dataset-*.jsonl")
    samples = load_samples(dataset)
    assert 1 <= len(samples) <= 4 and {s.source for s in samples} == {"vgg"}
    assert {s.kind for s in samples} <= {"plan", "xla"} and "xla" in err  # both kinds drawn
    ckpt = ckpt_io.load(root / "gnn.msgpack")
    assert ckpt.fingerprint["platform"] == "cpu"  # the dataset's own backend
    assert ckpt.notes["training"]["epochs"] == 3 and ckpt.notes["samples"] == len(samples)
    assert "loss" in err  # progress on stderr
    assert f"evaluation on the {len(samples)} training samples" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.split()[:1] in (["gnn"], ["fallback"])}
    assert set(rows) == {"gnn", "fallback"}
    assert all(int(r[1]) == len(samples) and r[-1].endswith("%") for r in rows.values())
    assert sorted(p.name for p in root.iterdir()) == ["cache", "data", "gnn.msgpack"]


def test_train_estimator_user_errors(trained, tmp_path) -> None:
    root = trained[0]
    (dataset,) = (root / "data").glob("dataset-*.jsonl")
    code, _, err = _main("train-estimator", "--dataset", str(dataset), "--held-out", "vgg")
    assert _user_error(code, err) and "no samples left to train on" in err, err
    code, _, err = _main("train-estimator", "--dataset", str(dataset), "--held-out", "bert")
    assert _user_error(code, err) and "no samples of that model" in err, err
    code, _, err = _main("train-estimator", "--dataset", str(tmp_path / "none.jsonl"))
    assert _user_error(code, err) and "no such dataset file" in err, err
    code, _, err = _main("train-estimator", "--generate", "--models", "nope",
                         "--dataset", str(tmp_path))
    assert _user_error(code, err) and "unknown model 'nope'" in err, err
    code, _, err = _main("train-estimator", "--generate", "--kinds", "plan,nope",
                         "--dataset", str(tmp_path))
    assert _user_error(code, err) and "valid kinds are plan, xla" in err, err
    code, _, err = _main("train-estimator", "--generate-only", "--dataset", str(dataset))
    assert _user_error(code, err) and "--generate-only needs --generate" in err, err


def test_fallback_time_of_a_subgraph_is_the_rule(vgg) -> None:
    graph = hlo_tools.device_graph(hlo_tools.parse(vgg[0]))
    costs = CostModel("inproc4")  # analytic single-op times: no measuring
    rule, nodes, c = FallbackFusedEstimator(costs), costs.node_costs(graph), costs.constants
    groups = plan_groups(graph, 0, plans=2)[:30]
    assert groups
    for ms, cs in groups:
        sub = subgraph_from_group(graph, nodes, ms, cs)
        assert fallback_time(sub, c.kernel_launch_s, c.mem_s_per_byte) == pytest.approx(
            rule.predict(graph, list(ms), list(cs)), rel=1e-9)
    acc = accuracy([1.05, 1.12, 2.0], [1.0, 1.0, 1.0])
    assert acc["n"] == 3 and acc["within_10"] == pytest.approx(1 / 3)
    assert acc["within_14"] == pytest.approx(2 / 3) and acc["median_rel_err"] == pytest.approx(0.12)


def test_estimate_prints_every_fusion(vgg, trained, tmp_path) -> None:
    text, planned, fusions = vgg
    assert fusions
    pre, post = tmp_path / "pre.hlo", tmp_path / "post.hlo"
    pre.write_text(text)
    post.write_text(planned)
    code, out, err = _main("estimate", str(post), "--no-bench")
    assert code == 0, err
    lines = out.splitlines()  # summary, column header, one line per fusion, total
    assert lines[1].split()[:3] == ["fusion", "kind", "ops"] and lines[-1].split()[0] == "total"
    assert [ln.split()[0] for ln in lines[2:-1]] == fusions
    assert "fallback rule only" in out
    ckpt = str(trained[0] / "gnn.msgpack")
    code, out, err = _main("estimate", str(post), "--no-bench", "--checkpoint", ckpt, "--json")
    assert code == 0, err
    rows = json.loads(out)["fusions"]
    assert [r["name"] for r in rows] == fusions
    assert all(r["gnn_s"] > 0 and r["fallback_s"] > 0 and r["ops"] >= 1 for r in rows)
    assert np.isfinite([r["gnn_s"] for r in rows]).all()
    code, out, err = _main("estimate", str(post), "--no-bench", "--checkpoint", ckpt)
    assert code == 0, err
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines[2:-1]] == fusions and "GNN" in lines[0]
    assert lines[-1].endswith(" us")  # the GNN's total (without a checkpoint: "-")
    code, out, err = _main("estimate", str(pre), "--no-bench")
    assert code == 0 and "0 fusions" in out and "no fusion instructions" in out, err


@pytest.mark.parametrize(("content", "what"), [
    (b"", "empty file"),
    (b"this is not HLO at all\n\x00\x01", ":1:"),
    (b"HloModule m\n\nENTRY e {\n  a = f32[4] parameter(0)\n  ROOT b = f32[4] frob(a)\n}\n",
     ":5:"),
])
def test_estimate_bad_input_exits_2(tmp_path, content, what) -> None:
    path = tmp_path / "bad.hlo"
    path.write_bytes(content)
    code, out, err = _main("estimate", str(path), "--no-bench")
    assert _user_error(code, err) and str(path) in err and what in err, err
    assert out == ""


def test_estimate_bad_checkpoint_exits_2(vgg, tmp_path) -> None:
    post = tmp_path / "post.hlo"
    post.write_text(vgg[1])
    junk = tmp_path / "junk.msgpack"
    junk.write_bytes(b"not a checkpoint")
    for ckpt, what in ((junk, "not a GNN estimator checkpoint"),
                       (tmp_path / "missing.msgpack", "no such file")):
        code, _, err = _main("estimate", str(post), "--no-bench", "--checkpoint", str(ckpt))
        assert _user_error(code, err) and what in err, err


def test_simulate_and_optimize_price_fusions_with_the_gnn(vgg, trained, tmp_path) -> None:
    """``--gnn CHECKPOINT`` swaps the GNN into the simulator's cost model: ``disco
    simulate`` of a planned module (fusions priced by the estimator) reports it and
    predicts another time than with the fallback rule; ``disco optimize`` searches with
    it; a missing checkpoint is one clean error."""
    _, planned, _ = vgg
    post = tmp_path / "post.hlo"
    post.write_text(planned)
    ckpt = str(trained[0] / "gnn.msgpack")
    base = ("simulate", str(post), "--no-bench", "--no-in-context", "--json")
    code, out, err = _main(*base)
    assert code == 0, err
    fallback = json.loads(out)
    code, out, err = _main(*base, "--gnn", ckpt)
    assert code == 0, err
    gnn = json.loads(out)
    assert fallback["cost_model"]["fused_estimator"] == "FallbackFusedEstimator"
    assert gnn["cost_model"]["fused_estimator"] == "GnnFusedEstimator"
    assert gnn["iteration_s"] > 0 and gnn["iteration_s"] != fallback["iteration_s"]
    pre = tmp_path / "pre.hlo"
    pre.write_text(vgg[0])
    code, out, err = _main("optimize", str(pre), "-o", str(tmp_path / "o.hlo"), "--no-bench",
                           "--no-in-context", "--time-budget", "1", "--json", "--gnn", ckpt)
    assert code == 0, err
    assert json.loads(out)["cost_model"]["fused_estimator"] == "GnnFusedEstimator"
    code, out, err = _main(*base, "--gnn", str(tmp_path / "missing.msgpack"))
    assert _user_error(code, err) and "--gnn" in err and "no such file" in err


def test_the_shipped_checkpoint_loads_and_prices_fusions(vgg, tmp_path) -> None:
    """The package ships a trained CPU estimator (package data): it loads, was trained
    on this backend family, and ``--gnn pretrained`` prices a planned module's fusions
    with it."""
    from disco_estimator.gnn import checkpoint as ckpt_io

    path = ckpt_io.pretrained("cpu")
    assert path is not None and path.stat().st_size < 512 * 1024
    ck = ckpt_io.load(path)
    assert ck.fingerprint.get("platform") == "cpu" and ck.notes
    assert ckpt_io.pretrained("gpu") is None
    post = tmp_path / "post.hlo"
    post.write_text(vgg[1])
    base = ("simulate", str(post), "--no-bench", "--no-in-context", "--json")
    code, out, err = _main(*base, "--gnn", "pretrained")
    assert code == 0, err
    report = json.loads(out)
    assert report["cost_model"]["fused_estimator"] == "GnnFusedEstimator"
    assert report["iteration_s"] > 0
