"""Tests of ``disco simulate``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from disco_estimator.hardware import shipped_hardware_dir
from disco_jax.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "shard_map_mlp.post.hlo"
KEYS = {"iteration_s", "compute_s", "comm_s", "overlap_s", "peak_bytes"}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report_on_the_fixture_without_running_it(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = _run(capsys, str(FIXTURE), "--json", "--no-in-context")
    assert code == 0, err
    report = json.loads(out)
    assert KEYS <= set(report)
    assert report["iteration_s"] > 0 and report["peak_bytes"] > 0
    assert report["comm_nodes"] == 4  # 3 tuple all-reduces from XLA's combiner + 1 single
    assert report["time_sources"].get("op_bench", 0) > 0 and report["estimated_nodes"] == 0
    assert report["time_sources"]["fusion"] == 12  # predicted, never measured as fusions
    assert report["iteration_s"] >= report["fo_bound_s"] - 1e-15
    assert list((tmp_path / "cache" / "ops").glob("*.json"))  # single ops were cached


def test_text_report_and_trace(tmp_path, capsys) -> None:
    trace = tmp_path / "sim.json"
    code, out, err = _run(capsys, str(FIXTURE), "--no-bench", "--hardware", "gloo2",
                          "--trace", str(trace))
    assert code == 0, err
    assert "iteration" in out and "peak memory" in out and "hardware gloo2" in out
    data = json.loads(trace.read_text())
    assert data["otherData"]["iteration_us"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sim.json"]  # no temp file left


def test_hardware_by_path_and_overlap(tmp_path, capsys) -> None:
    toml = tmp_path / "mine.toml"  # a file outside the package, found by its path
    toml.write_text((shipped_hardware_dir() / "gloo2-1gbit.toml").read_text())
    runs = {}
    for phi in ("0", "1"):
        code, out, err = _run(capsys, str(FIXTURE), "--no-bench", "--json", "--hardware",
                              str(toml), "--overlap", phi)
        assert code == 0, err
        runs[phi] = json.loads(out)
    assert runs["0"]["cost_model"]["hardware"] == "gloo2-1gbit"
    assert runs["1"]["iteration_s"] <= runs["0"]["iteration_s"]


@pytest.mark.parametrize(("content", "where", "what"), [
    (b"HloModule m\n\nENTRY e {\n  a = f32[4] parameter(0)\n  ROOT b = f32[4] frob(a)\n}\n",
     ":5:", "unknown opcode"),
    (b"HloModule m\n\nENTRY e {\n  a = f32[4] parameter(0)\n  ROOT b = f32[4] add(a, c)\n}\n",
     ":5:", "not defined"),
    (b"HloModule m\n\nENTRY e {\n  a = f32[4] parameter(0)\n  b = f32[8] parameter(1)\n"
     b"  ROOT c = f32[4] add(a, b)\n}\n", ":6:", "invalid module"),
    (b"HloModule m\n\nENTRY e {\n  a = f32[4] parameter(0)\n", ":", "end of input"),
    (b"", ":1:", "empty file"),
    (b"HloModule m\n\xff\xfe\n", ":2:", "not UTF-8"),
])
def test_bad_input_exits_2_with_file_and_line(tmp_path, capsys, content, where, what) -> None:
    path = tmp_path / "bad.hlo"
    path.write_bytes(content)
    trace = tmp_path / "out.json"
    code, out, err = _run(capsys, str(path), "--no-bench", "--trace", str(trace))
    assert code == 2
    assert err.startswith(f"disco: error: {path}{where}") and what in err, err
    assert "Traceback" not in err and out == ""
    assert not trace.exists()


def test_user_errors_without_a_file(tmp_path, capsys) -> None:
    cases = [
        ([str(tmp_path / "missing.hlo")], "no such file"),
        ([str(tmp_path)], "is a directory"),
        ([str(FIXTURE), "--hardware", "nowhere"], "hardware 'nowhere' not found"),
        ([str(FIXTURE), "--overlap", "2"], "--overlap must be in [0, 1]"),
        ([str(FIXTURE), "--trace", str(tmp_path / "no" / "t.json")], "does not exist"),
        ([str(FIXTURE), "--profile", str(FIXTURE)], "not a JSON profile"),
    ]
    for argv, what in cases:
        code, out, err = _run(capsys, *argv, "--no-bench")
        assert code == 2 and what in err and "Traceback" not in err, (argv, err)


def test_subprocess_has_no_traceback(tmp_path) -> None:
    bad = tmp_path / "bad.hlo"
    bad.write_text("HloModule m\n\nENTRY e {\n  ROOT x = f32[] frob()\n}\n")
    proc = subprocess.run([sys.executable, "-m", "disco_jax", "simulate", str(bad), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{bad}:4:" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_fused_estimator_option(tmp_path, capsys, monkeypatch) -> None:
    """--fused-estimator (and $DISCO_FUSED_ESTIMATOR) swap the GNN in; the report names it."""
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DISCO_FUSED_ESTIMATOR", "gnn")
    code, out, err = _run(capsys, str(FIXTURE), "--no-bench", "--no-in-context", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["fused_estimator"]["name"] == "gnn"
    assert report["cost_model"]["fused_estimator"] == "GnnFusedEstimator"
    code, out, err = _run(capsys, str(FIXTURE), "--no-bench", "--no-in-context",
                          "--fused-estimator", "fallback")
    assert code == 0, err
    assert "fused ops: the fallback rule (--fused-estimator: the fallback rule)" in out
