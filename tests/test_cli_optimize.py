"""``disco optimize``: HLO in, optimized HLO out -- exact, numerically the same, atomic."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest

import hlo_tools
from disco_jax import zoo
from disco_jax.cli import main

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "shard_map_mlp.pre.hlo"
FAST_MODELS = ("vgg",)  # the others run under -m slow (transformer: 43 s, rnnlm: 22 s)
ALL_MODELS = tuple(n for n in zoo.names() if n != zoo.AUTO_SHARDED)


def _optimize_and_check(name: str, tmp_path, capsys, extra=()) -> dict:
    step, args = zoo.get(name)(4, "tiny")
    src = tmp_path / f"{name}.hlo"
    src.write_text(hlo_tools.extract(step, *args))
    out = tmp_path / f"{name}.opt.hlo"
    code = main(["optimize", str(src), "-o", str(out), "--time-budget", "3", "--json",
                 *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["predicted_s"] <= min(report["start_predicted_s"].values())
    assert report["fo_bound_s"] <= report["predicted_s"]
    assert report["search"]["evaluated"] >= 1
    text = out.read_text()
    assert text != src.read_text()  # the search changed something on a zoo model
    run = hlo_tools.compile_module(text, hlo_tools.InPlaceOf(step, args),
                                   hlo_tools.CompileOptions(exact=True))
    got, want = jax.tree.leaves(run(*args)), jax.tree.leaves(jax.jit(step)(*args))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    return report


@pytest.mark.parametrize("name", FAST_MODELS)
def test_optimized_output_compiles_exactly_and_matches_jit(name, tmp_path, capsys):
    """... and ``--enactment`` writes the same program as the one value the store keeps."""
    from disco_jax.enactment import SINGLE, Enactment

    ej = tmp_path / "enactment.json"
    _optimize_and_check(name, tmp_path, capsys, extra=("--no-bench", "--enactment", str(ej)))
    enactment = Enactment.from_json(json.loads(ej.read_text()))
    assert enactment.kind == SINGLE
    assert enactment.text == (tmp_path / f"{name}.opt.hlo").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_MODELS)
def test_every_zoo_model_with_measured_op_times(name, tmp_path, capsys):
    _optimize_and_check(name, tmp_path, capsys)


def test_text_report(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(FIXTURE.read_text())
    out = tmp_path / "out.hlo"
    assert main(["optimize", str(src), "-o", str(out), "--no-bench", "--time-budget", "2",
                 "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert "start no_fusion" in text and "optimized plan" in text
    assert "full-overlap bound" in text and "seed 1" in text
    assert hlo_tools.parse(out.read_text())


def _bad_inputs(tmp_path):
    empty = tmp_path / "empty.hlo"
    empty.write_text("")
    garbage = tmp_path / "garbage.hlo"
    garbage.write_text("HloModule m\n\nENTRY e {\n  this is not hlo\n}\n")
    binary = tmp_path / "binary.hlo"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    return {"empty": empty, "garbage": garbage, "binary": binary,
            "missing": tmp_path / "missing.hlo", "directory": tmp_path}


@pytest.mark.parametrize("kind", ["empty", "garbage", "binary", "missing", "directory"])
@pytest.mark.parametrize("existing", [False, True])
def test_bad_input_is_one_line_and_writes_nothing(kind, existing, tmp_path, capsys):
    src = _bad_inputs(tmp_path)[kind]
    out = tmp_path / "out" / "opt.hlo"
    out.parent.mkdir()
    if existing:
        out.write_text("previous")
    code = main(["optimize", str(src), "-o", str(out), "--no-bench", "--time-budget", "1"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disco: error: "), err
    assert "Traceback" not in err
    assert sorted(p.name for p in out.parent.iterdir()) == (["opt.hlo"] if existing else [])
    if existing:
        assert out.read_text() == "previous"


def test_bad_output_and_options(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(FIXTURE.read_text())
    for argv in (["-o", str(tmp_path / "nodir" / "x.hlo")], ["-o", str(tmp_path)],
                 ["-o", str(tmp_path / "x.hlo"), "--time-budget", "0"],
                 ["-o", str(tmp_path / "x.hlo"), "--hardware", "no-such-hardware"]):
        assert main(["optimize", str(src), "--no-bench", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("disco: error: "), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.hlo"]


@pytest.mark.slow  # the single program's file: test_optimized_output_compiles_exactly...
@pytest.mark.parametrize("staged", [None, "2", "plan"])
def test_enactment_file_builds_and_matches_jit(staged, tmp_path, capsys):
    """--enactment writes the one value the store keeps; it builds and computes the step."""
    from disco_jax.enactment import SINGLE, STAGED, Enactment, build

    step, args = zoo.get("vgg")(4, "tiny")
    src = tmp_path / "vgg.hlo"
    src.write_text(hlo_tools.extract(step, *args))
    out, ej = tmp_path / "vgg.opt.hlo", tmp_path / "vgg.enactment.json"
    extra = ["--staged", staged] if staged else []
    code = main(["optimize", str(src), "-o", str(out), "--no-bench", "--time-budget", "1",
                 "--enactment", str(ej), *extra])
    assert code == 0, capsys.readouterr().err
    enactment = Enactment.from_json(json.loads(ej.read_text()))
    assert enactment.kind == (STAGED if staged else SINGLE)
    if not staged:
        assert enactment.text == out.read_text()
    run = build(enactment, step, args, self_test=False)
    try:
        got, want = jax.tree.leaves(run(*args)), jax.tree.leaves(jax.jit(step)(*args))
    finally:
        getattr(run, "close", lambda: None)()
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_gpu_target_gets_an_exact_plan_with_fusions_written_for_xla_gpu(tmp_path, capsys):
    """For a GPU hardware file the route is exact (XLA:GPU compiles hand-written fusions
    through its PJRT plugin): the plan may hold fusions, written kCustom with copies at
    their edges (:func:`hlo_tools.gpu_legal.gpu_legal`), no "buckets only" note, and the
    enactment compiles it exactly. The text is XLA:GPU's, so it is not compiled here
    (``--no-gpu-compile``; ``tests/test_gpu_deviceless.py`` compiles such plans for an
    H100 without a GPU)."""
    from disco_jax.enactment import Enactment
    from hlo_tools.gpu_legal import gpu_legal

    step, args = zoo.get("vgg")(4, "tiny")
    src = tmp_path / "vgg.hlo"
    src.write_text(hlo_tools.extract(step, *args))
    out, ej = tmp_path / "vgg.opt.hlo", tmp_path / "vgg.enactment.json"
    code = main(["optimize", str(src), "-o", str(out), "--hardware", "gpu_nvlink8",
                 "--no-bench", "--no-in-context", "--time-budget", "1", "--json",
                 "--no-gpu-compile", "--enactment", str(ej)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "AllReduce buckets only" not in captured.err
    report = json.loads(captured.out)
    assert report["route"]["name"] == "exact" and report["gpu_compile"] is None
    written = hlo_tools.parse(out.read_text())
    fusions = [i for _, i in written.instructions() if i.opcode == "fusion"]
    assert bool(fusions) == (report["plan"]["fusions"] > 0)
    for fusion in fusions:
        assert fusion.attrs["kind"] == "kCustom" and "backend_config" not in fusion.attrs
    assert hlo_tools.to_text(gpu_legal(written)) == hlo_tools.to_text(written)  # legal as is
    enactment = Enactment.from_json(json.loads(ej.read_text()))
    assert enactment.exact and not enactment.compiler_options
    assert enactment.text == out.read_text()


def test_staged_without_enactment_is_a_user_error(tmp_path, capsys):
    src = tmp_path / "in.hlo"
    src.write_text(FIXTURE.read_text())
    code = main(["optimize", str(src), "-o", str(tmp_path / "o.hlo"), "--no-bench",
                 "--time-budget", "1", "--staged", "2"])
    assert code == 2 and "--enactment" in capsys.readouterr().err
    assert not (tmp_path / "o.hlo").exists()


def test_the_fused_estimator_is_chosen_once_and_recorded(tmp_path, capsys, monkeypatch):
    """--fused-estimator gnn (no local checkpoint here: the shipped one) prices the
    search and is named, with its checkpoint's sha256, in the report and OUT.plan.json;
    contradictory or malformed choices are one-line errors that write nothing."""
    import hashlib

    from disco_estimator.gnn.checkpoint import pretrained

    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DISCO_FUSED_ESTIMATOR", raising=False)
    src = tmp_path / "in.hlo"
    src.write_text(FIXTURE.read_text())
    out = tmp_path / "o.hlo"
    base = ["optimize", str(src), "-o", str(out), "--no-bench", "--no-in-context",
            "--time-budget", "1"]
    assert main([*base, "--json", "--fused-estimator", "gnn"]) == 0
    report = json.loads(capsys.readouterr().out)
    shipped = pretrained("cpu")
    want = {"name": "gnn", "checkpoint": str(shipped),
            "sha256": hashlib.sha256(shipped.read_bytes()).hexdigest()}
    assert report["fused_estimator"] == want
    assert report["cost_model"]["fused_estimator"] == "GnnFusedEstimator"
    plan = json.loads((tmp_path / "o.hlo.plan.json").read_text())
    assert plan["fused_estimator"] == want
    monkeypatch.setenv("DISCO_FUSED_ESTIMATOR", "gnn")  # the option wins over it
    assert main([*base, "--fused-estimator", "fallback"]) == 0
    assert "fused ops: the fallback rule (--fused-estimator: " in capsys.readouterr().out
    out.unlink()
    for argv, what in ((["--gnn", str(shipped), "--fused-estimator", "fallback"],
                        "does not go with --fused-estimator fallback"),
                       (["--gnn", str(tmp_path / "none.msgpack")], "no such file")):
        assert main([*base, *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and what in err, err
    monkeypatch.setenv("DISCO_FUSED_ESTIMATOR", "xgboost")
    assert main(base) == 2
    assert "DISCO_FUSED_ESTIMATOR='xgboost': use one of gnn, fallback" in \
        capsys.readouterr().err
    assert not out.exists()
