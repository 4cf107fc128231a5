"""``disco calibrate``: real measurements in child processes, a hardware file that loads.

Runs the quick calibration of ``inproc4`` (4 host devices in a child process) and of
``gloo2`` (2 real gloo processes on 127.0.0.1) into a temporary directory, then loads
the file by name through the user's config directory, as ``--hardware NAME`` does.
"""

from __future__ import annotations

import pytest

from disco_estimator.hardware import load_hardware, shipped_hardware_dir
from disco_jax.cli import main


@pytest.mark.parametrize("setup", ["inproc4", "gloo2"])
def test_calibrate_writes_a_hardware_file_found_first(setup, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DISCO_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["calibrate", "--setup", setup, "--quick", "--timeout", "300"]) == 0
    out = capsys.readouterr().out
    path = tmp_path / "hardware" / f"{setup}.toml"
    assert f"wrote {path}" in out
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    hw = load_hardware(setup)  # the user's file wins over the shipped one
    assert "disco calibrate" in hw.hardware["source"]
    assert hw.raw["allreduce"]["time_metric"] == "program"
    probes = hw.raw["probes"]
    assert len(probes["latency_s"]) == (1 if setup == "inproc4" else 2)
    assert hw.allreduce.d_s == pytest.approx(probes["program_d_s"])
    assert 0.0 <= hw.raw["costs"]["overlap"] <= 1.0
    shipped = load_hardware(shipped_hardware_dir() / f"{setup}.toml").raw
    for key, value in shipped.get("costs", {}).items():  # carried over, but phi
        if key != "overlap":
            assert hw.raw["costs"][key] == value
    for key in ("small_bytes", "d_small_s"):  # gloo's short path, carried over
        if key in shipped["allreduce"]:
            assert hw.raw["allreduce"][key] == shipped["allreduce"][key]
    assert hw.allreduce.c_s_per_byte > 0


def test_calibrate_unknown_setup_is_a_user_error(capsys):
    assert main(["calibrate", "--setup", "nope"]) == 2
    assert "unknown setup 'nope'" in capsys.readouterr().err
