"""Every argument layout ``jax.distributed`` allows reaches DisCo's candidates, and one
failing process makes the whole job fall back at once (issue 47, items 2 and 3), in real
2-process gloo jobs (worker: ``tests/layouts_gloo_worker.py``, a small ``shard_map`` MLP
step searched under ``ENABLE_SEARCH=1``).

* CI: one job of one device per process that builds the arguments each way in turn
  (``device_put`` of numpy and of jax arrays, ``host_local_array_to_global_array``,
  ``make_array_from_single_device_arrays``, ``make_array_from_callback``): every first
  call searched (mode ``searched``, no ``DiscoFallbackWarning``), 3 losses equal to
  ``jax.jit``'s. And a job whose process 1 fails in its search: both processes fall back
  with one warning each, within seconds of each other, not the job's 15-min timeout.
* ``slow``: the same with two devices per process, and a failure in process 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("layouts_gloo_worker.py")
CONSTRUCTIONS = ("device_put", "device_put_jax", "host_local", "single_device_arrays",
                 "callback")
#: A budget the small step's whole first call fits in (the quick profile, a brief search).
BUDGET_S = "20"


def _job(tmp_path: Path, devices: int, constructions: tuple[str, ...], *,
         fail: int | None = None, timeout_s: float = 400.0) -> tuple[list[list[dict]], float]:
    """Runs the worker in a 2-process job; every process's rows and the job's seconds."""
    from disco_estimator.gloo import child_env, run_local_job

    env = child_env(devices, {"ENABLE_SEARCH": "1", "DISCO_TIME_BUDGET": BUDGET_S,
                              "DISCO_STORE": str(tmp_path / "store")})
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    extra = [] if fail is None else ["--fail-search", str(fail)]
    t0 = time.monotonic()
    rcs = run_local_job(
        lambda i, coordinator: [sys.executable, str(WORKER), "--coordinator", coordinator,
                                "--process-id", str(i), "--out", str(outs[i]),
                                "--store", str(tmp_path / "store"),
                                "--constructions", ",".join(constructions), *extra],
        2, timeout_s=timeout_s, env=env, grace_s=30.0, cwd=ROOT)
    seconds = time.monotonic() - t0
    assert rcs == [0, 0], f"workers exited with {rcs}"
    return [json.loads(p.read_text()) for p in outs], seconds


def _check_searched(rows: list[list[dict]], devices: int) -> None:
    for p, process_rows in enumerate(rows):
        assert [r["construction"] for r in process_rows] == list(CONSTRUCTIONS)
        for r in process_rows:
            assert "error" not in r, (p, r)
            assert r["warnings"] == [], (p, r["construction"], r["warnings"])
            assert r["info"]["mode"] == "searched", (p, r["construction"], r["info"])
            assert r["devices"] == devices
            assert r["close"], (p, r["construction"], r["losses"], r["jit_losses"])
    for a, b in zip(*rows, strict=True):
        assert a["info"]["choice"] == b["info"]["choice"], a["construction"]
        assert a["losses"] == b["losses"], a["construction"]


def _check_failure(rows: list[list[dict]], failing: int) -> None:
    (a,), (b,) = rows
    for p, r in enumerate((a, b)):
        assert r["info"]["mode"] == "fallback", (p, r["info"])
        assert len(r["warnings"]) == 1, (p, r["warnings"])
        assert "injected failure" in r["info"]["reason"], (p, r["info"]["reason"])
        assert r["close"], (p, r["losses"], r["jit_losses"])
    other = (a, b)[1 - failing]
    assert f"process {failing} failed" in other["info"]["reason"], other["info"]["reason"]
    # the first calls end together: the other process did not wait out a timeout
    assert abs(a["first_call_s"] - b["first_call_s"]) < 10.0, (a["first_call_s"],
                                                               b["first_call_s"])
    assert max(a["first_call_s"], b["first_call_s"]) < 60.0


def test_every_construction_is_searched_one_device_per_process(tmp_path):
    rows, _ = _job(tmp_path, 1, CONSTRUCTIONS)
    _check_searched(rows, 1)


def test_a_failing_process_makes_the_job_fall_back_at_once(tmp_path):
    rows, seconds = _job(tmp_path, 1, ("device_put_jax",), fail=1, timeout_s=180.0)
    _check_failure(rows, 1)
    assert seconds < 120.0


@pytest.mark.slow
def test_every_construction_is_searched_two_devices_per_process(tmp_path):
    rows, _ = _job(tmp_path, 2, CONSTRUCTIONS)
    _check_searched(rows, 2)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_a_failure_in_process_0_makes_the_job_fall_back_at_once(tmp_path, devices):
    rows, _ = _job(tmp_path, devices, ("host_local",), fail=0, timeout_s=180.0)
    _check_failure(rows, 0)
