"""Tests of disco_estimator.allreduce (the linear fit, real psum runs) and disco_estimator.hardware
(hardware files: lookup, loading, validation, writing)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import jax
import pytest

from disco_estimator import allreduce as ar
from disco_estimator import gloo
from disco_estimator import hardware as hwf

SIZES = [4 * 4**k for k in range(13)]


@pytest.mark.parametrize("weighting", ["relative", "none"])
def test_fit_recovers_c_and_d_exactly(weighting: str) -> None:
    c, d = 2.5e-9, 150e-6
    fit = ar.fit_allreduce(SIZES, [c * b + d for b in SIZES], weighting)
    assert fit.model.c_s_per_byte == pytest.approx(c, rel=1e-9)
    assert fit.model.d_s == pytest.approx(d, rel=1e-9)
    assert fit.max_rel_err < 1e-9 and fit.weighting == weighting
    assert fit.model.time(1 << 20) == pytest.approx(c * (1 << 20) + d)


def test_fit_errors_and_non_negative() -> None:
    times = [1e-4 * (1.2 if i % 2 else 0.8) + 1e-9 * b for i, b in enumerate(SIZES)]
    fit = ar.fit_allreduce(SIZES, times)
    errs = ar.relative_errors(fit.model, SIZES, times)
    assert fit.mean_rel_err == pytest.approx(errs.mean()) and fit.max_rel_err == errs.max()
    assert fit.model.c_s_per_byte >= 0 and fit.model.d_s >= 0
    flat = ar.fit_allreduce([4, 8, 16], [3e-3, 2e-3, 1e-3])  # decreasing: C clipped at 0
    assert flat.model.c_s_per_byte == 0 and flat.model.d_s > 0


def test_combine_processes_takes_min_per_iteration() -> None:
    p0 = [ar.AllReducePoint(4, [1.0, 5.0, 3.0], [2.0, 6.0, 4.0])]
    p1 = [ar.AllReducePoint(4, [2.0, 1.0, 4.0], [3.0, 2.0, 5.0])]
    (merged,) = ar.combine_processes([p0, p1])
    assert merged.op_times_s == [1.0, 1.0, 3.0] and merged.wall_times_s == [2.0, 2.0, 4.0]
    assert merged.op_time_s == 1.0 and merged.op_time("min") == 1.0


def test_inproc_psum_microbenchmark() -> None:
    lines: list[str] = []
    points = ar.measure_psum([4, 64 * 1024], quick=True, warmup=1, progress=lines.append)
    assert [p.bytes for p in points] == [4, 64 * 1024] and len(lines) == 2
    for p in points:
        assert len(p.op_times_s) == ar.default_repeats(p.bytes, quick=True)
        assert min(p.op_times_s) > 0 and min(p.wall_times_s) > 0
        assert p.op_time_s <= p.wall_time_s * 1.5  # the op is part of the call
    assert jax.device_count() == 4


def test_gloo_two_processes() -> None:
    raw = ar.run_gloo(2, [4, 4096], quick=True, timeout_s=90, tag="test-gloo2")
    assert len(raw["processes"]) == 2 and raw["facts"]["num_devices"] == 2
    for pts in raw["processes"]:
        points = [ar.AllReducePoint.from_json(p) for p in pts]
        assert [p.bytes for p in points] == [4, 4096]
        assert all(min(p.op_times_s) > 0 and min(p.wall_times_s) > 0 for p in points)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("tc") is None,
                    reason="needs unshare and tc (root)")
def test_gloo_rate_limited_loopback() -> None:
    res = ar.run_setup("gloo2-1gbit", [4, 4 << 20], quick=True, timeout_s=120)
    assert "rate 1Gbit" in res.facts["qdisc"]
    # both directions share lo's token bucket: >= 2 * 4 MiB at 125 MB/s ~ 67 ms
    assert res.points[-1].op_time_s > 0.05


def _result() -> ar.SetupResult:
    pts = [ar.AllReducePoint(b, [1e-9 * b + 1e-4] * 3, [1e-9 * b + 3e-4] * 3)
           for b in (4, 1024, 1 << 20)]
    fit = ar.fit_allreduce([p.bytes for p in pts], [p.op_time_s for p in pts])
    wall = ar.fit_allreduce([p.bytes for p in pts], [p.wall_time_s for p in pts])
    facts = {"backend": "cpu", "device_kind": "cpu", "jax_version": "0.10.2", "host_cpus": 2}
    return ar.SetupResult(ar.SETUPS["gloo2"], pts, fit, wall, facts)


def test_hardware_toml_round_trip(tmp_path) -> None:
    res = _result()
    path = hwf.write_hardware(res, tmp_path)
    assert path.name == "gloo2.toml" and path.read_text().startswith("# DisCo hardware")
    hw = hwf.load_hardware(path)
    assert hw.name == "gloo2" and hw.num_devices == 2
    assert hw.allreduce.c_s_per_byte == pytest.approx(1e-9)
    assert hw.allreduce.d_s == pytest.approx(1e-4)
    assert hw.raw["allreduce"]["points"]["bytes"] == [4, 1024, 1 << 20]
    table = hw.measured()
    assert table.time(1024) == pytest.approx(1e-9 * 1024 + 1e-4)
    assert table.time(2) == table.time(4) > 0
    assert table.time(2 << 20) == pytest.approx(1e-9 * (2 << 20) + 1e-4)


def test_measured_interpolation_is_monotone() -> None:
    lin = ar.AllReduceModel(1e-9, 1e-4)
    table = ar.MeasuredAllReduce((4, 64, 1024), (2e-4, 1e-4, 3e-4), lin)  # noisy dip
    ts = [table.time(b) for b in (4, 16, 64, 512, 1024, 4096)]
    assert all(x <= y for x, y in zip(ts, ts[1:], strict=False))


@pytest.mark.parametrize("name", ["gpu_cluster_example", "gpu_nvlink8", "gpu_100g", "gpu_400g",
                                  "inproc4", "gloo2", "gloo2-1gbit"])
def test_shipped_hardware_files_load(name: str) -> None:
    if not (hwf.shipped_hardware_dir() / f"{name}.toml").exists():
        pytest.skip(f"{name}.toml not generated yet")
    hw = hwf.load_hardware(name)
    assert hw.allreduce.time(0) > 0 and hw.allreduce.c_s_per_byte > 0
    assert hw.raw["schema"] == 1 and hw.hardware["num_devices"] >= 2


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """An empty user config directory (``$DISCO_CONFIG_DIR``); returns its hardware dir."""
    monkeypatch.setenv("DISCO_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config" / "hardware"


def test_available_hardware_lists_shipped_files(user_dir) -> None:
    names = hwf.available_hardware()
    assert {"inproc4", "gloo2", "gloo2-1gbit", "gpu_cluster_example"} <= set(names)
    assert names == sorted(names)
    assert hwf.user_hardware_dir() == user_dir
    assert (hwf.shipped_hardware_dir() / "inproc4.toml").is_file()


def test_user_hardware_file_wins_over_shipped(user_dir) -> None:
    shipped = hwf.load_hardware("gloo2")
    user_dir.mkdir(parents=True)
    text = hwf.find_hardware("gloo2").read_text()
    text = text.replace(f"\nd_s = {shipped.allreduce.d_s!r}\n", "\nd_s = 0.125\n", 1)
    (user_dir / "gloo2.toml").write_text(text)
    (user_dir / "mine.toml").write_text(text)
    assert hwf.find_hardware("gloo2") == user_dir / "gloo2.toml"
    assert hwf.load_hardware("gloo2").allreduce.d_s == 0.125
    assert hwf.load_hardware("inproc4").allreduce.d_s > 0  # others still shipped
    assert "mine" in hwf.available_hardware()


def test_unknown_hardware_lists_valid_names(user_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"hardware 'nope' not found \(a \.toml "
                       r"path or one of: .*gloo2, gloo2-1gbit, gpu_100g, gpu_400g, "
                       r"gpu_cluster_example, gpu_nvlink8, inproc4"):
        hwf.load_hardware("nope")
    with pytest.raises(hwf.HardwareNotFoundError):
        hwf.load_hardware(tmp_path / "missing.toml")  # a path is never looked up by name


@pytest.mark.parametrize("text, problem", [
    ("schema = 1\n[allreduce\nd_s = 1\n", "invalid hardware file"),
    ("schema = 1\nname = 'x'\n", "missing table \\[allreduce\\]"),
    ("[allreduce]\nc_s_per_byte = 1e-9\n", "misses d_s"),
    ("[allreduce]\nc_s_per_byte = 1e-9\nd_s = 'fast'\n", "d_s must be a number"),
    ("schema = 2\n[allreduce]\nc_s_per_byte = 1e-9\nd_s = 1e-4\n", "schema is 2"),
])
def test_malformed_hardware_file_names_the_file(tmp_path, text: str, problem: str) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(hwf.InvalidHardwareError, match=problem) as err:
        hwf.load_hardware(path)
    assert str(err.value).startswith(f"{path}: invalid hardware file")
    assert isinstance(err.value, ValueError)


def test_write_hardware_is_atomic_into_user_dir(user_dir) -> None:
    path = hwf.write_hardware(_result())
    assert path == user_dir / "gloo2.toml"
    assert sorted(p.name for p in user_dir.iterdir()) == ["gloo2.toml"]  # no temp file left
    assert hwf.load_hardware("gloo2").allreduce.d_s == pytest.approx(1e-4)
    path2 = hwf.write_hardware(_result())  # overwrites in place
    assert path2 == path and sorted(p.name for p in user_dir.iterdir()) == ["gloo2.toml"]


# --------------------------------------------------------------------------- gloo helpers


def _sleeper(seconds: float, rc: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c",
                             f"import time, sys; time.sleep({seconds}); sys.exit({rc})"])


def test_wait_all_returns_exit_codes_and_kills_at_deadline() -> None:
    assert gloo.wait_all([_sleeper(0, 0), _sleeper(0, 3)], time.monotonic() + 30) == [0, 3]
    procs = [_sleeper(0, 0), _sleeper(60)]
    t0 = time.monotonic()
    assert gloo.wait_all(procs, t0 + 1.0) == [0, -9]
    assert time.monotonic() - t0 < 10
    with pytest.raises(TimeoutError):
        gloo.wait_all([_sleeper(60)], time.monotonic() + 0.5, raise_on_timeout=True)


def test_wait_all_grace_after_first_failure() -> None:
    procs = [_sleeper(0, 2), _sleeper(60)]
    failed = lambda: any(p.poll() not in (None, 0) for p in procs)
    t0 = time.monotonic()
    rcs = gloo.wait_all(procs, t0 + 60, failed, grace_s=0.5)
    assert rcs == [2, -9] and time.monotonic() - t0 < 10


def test_run_local_job_shares_one_coordinator_and_bounds_a_failed_job(tmp_path) -> None:
    """Every process gets the same coordinator on 127.0.0.1; when one fails, the others
    get the grace and are killed."""
    code = ("import sys, time; i, c, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]; "
            "open(out + str(i), 'w').write(c); sys.exit(3) if i == 1 else time.sleep(60)")
    t0 = time.monotonic()
    rcs = gloo.run_local_job(
        lambda i, coordinator: [sys.executable, "-c", code, str(i), coordinator,
                                str(tmp_path / "p")], 2, timeout_s=60, grace_s=0.5)
    assert rcs == [-9, 3] and time.monotonic() - t0 < 30
    seen = {(tmp_path / f"p{i}").read_text() for i in range(2)}
    assert len(seen) == 1 and seen.pop().startswith("127.0.0.1:")


def test_child_env_and_network_helpers(monkeypatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --foo=1")
    env = gloo.child_env(2, extra={"PYTHONHASHSEED": "0"})
    assert env["XLA_FLAGS"] == "--foo=1 --xla_force_host_platform_device_count=2"
    assert env["JAX_PLATFORMS"] == "cpu" and env["PYTHONHASHSEED"] == "0"
    assert gloo.child_env(1)["XLA_FLAGS"] == "--foo=1"
    assert 0 < gloo.free_port() < 65536
    assert not gloo.in_private_netns("")
    assert not gloo.in_private_netns(os.readlink("/proc/self/ns/net"))
    with pytest.raises(SystemExit, match="private network namespace"):
        gloo.set_loopback_rate("1gbit", "")  # never touches this namespace's lo
    code = "import sys; sys.exit(5)"
    assert gloo.run_bounded([sys.executable, "-c", code], os.environ, 30, check=False) == 5
    with pytest.raises(RuntimeError, match="status 5"):
        gloo.run_bounded([sys.executable, "-c", code], os.environ, 30)


def test_tuple_buffer_latency_is_the_slope_per_extra_buffer() -> None:
    from disco_estimator.probes import tuple_buffer_latency

    # C*B = 1 ms, d = 0.2 ms: 10 buffers take 1 + 10 * 0.2 = 3 ms, one flat 1.2 ms
    assert tuple_buffer_latency(3.0e-3, 1.2e-3, 10) == pytest.approx(0.2e-3)
    assert tuple_buffer_latency(1.0e-3, 1.2e-3, 10) == 0.0  # noise below the flat one
    with pytest.raises(ValueError, match="at least 2"):
        tuple_buffer_latency(1.0, 1.0, 1)


def test_tuple_allreduce_programs_one_variadic_all_reduce_and_one_flat() -> None:
    import numpy as np

    from disco_estimator.probes import tuple_allreduce_programs

    probe = tuple_allreduce_programs([16, 4096, 6])  # 6 B: 2 floats
    got = probe.run_tuple()
    assert [x.shape for x in got] == [(4 * 4,), (4 * 1024,), (4 * 2,)]
    assert all(np.all(np.asarray(x) == 1.0) for x in got)
    assert probe.run_flat().shape == (4 * (4 + 1024 + 2),)
    # what runs: one all-reduce of the three buffers (XLA's combiner), one of one buffer
    for text, buffers in ((probe.tuple_text, 3), (probe.flat_text, 1)):
        ops = [line for line in text.splitlines() if " all-reduce(" in line]
        assert len(ops) == 1, text
        assert ops[0].split("=")[1].split("all-reduce(")[0].count("f32[") == buffers, text
