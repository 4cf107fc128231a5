"""Multi-process steps built as users build them, in real 2-process gloo jobs
(``disco launch``, 127.0.0.1): one or two host devices per process, the batch made by
``device_put``, ``make_array_from_process_local_data``,
``host_local_array_to_global_array`` or ``make_array_from_single_device_arrays``. Each
layout searches (``ENABLE_SEARCH=1``: mode ``searched``, staged candidates included),
then runs what it stored (``=0``: mode ``stored``), with outputs equal to ``jax.jit``'s.

Each job runs ``tests/user_job_worker.py`` (tiny vgg, a store per process). One layout
(two devices per process) runs in CI, where tests/test_layouts_gloo.py runs every
construction with one device per process; the whole matrix is ``slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "user_job_worker.py"
JOB_TIMEOUT_S = 240
INPUTS = ("device_put", "process_local", "host_local", "single_device")


def _job(tmp: Path, flag: str, local: int, inputs: str) -> list[dict]:
    out = tmp / f"out_{flag}"
    out.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("ENABLE_SEARCH", "DISCO_STORE", "XLA_FLAGS")}
    env.update({f"DISCO_STORE_{i}": str(tmp / f"store_{i}") for i in range(2)})
    # a short budget (under 20 s: the quick profile) that affords the profile (five
    # compiles of the tiny step) and little after it: a brief search, a quick choice
    env.update({"DISCO_TIME_BUDGET": "19", "ENABLE_SEARCH": flag})
    cmd = [sys.executable, "-m", "disco_jax", "launch", "-n", "2", "--devices-per-process",
           str(local), "--timeout", str(JOB_TIMEOUT_S), "--", sys.executable, str(WORKER),
           "--out", str(out), "--inputs", inputs]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S + 30, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return [json.loads((out / f"p{i}.json").read_text()) for i in range(2)]


def _check(tmp: Path, local: int, inputs: str) -> None:
    for flag, mode in (("1", "searched"), ("0", "stored")):
        rows = _job(tmp, flag, local, inputs)
        for row in rows:
            assert row["warnings"] == [], row
            assert (row["mode"], row["same"]) == (mode, True), row
            assert (row["devices"], row["local"]) == (2 * local, local)
        assert rows[0]["choice"] == rows[1]["choice"]


@pytest.mark.parametrize("local,inputs", [
    pytest.param(1, "host_local", marks=pytest.mark.slow),  # tests/test_layouts_gloo.py's too
    (2, "single_device")])
def test_user_built_job(tmp_path, local, inputs):
    _check(tmp_path, local, inputs)


@pytest.mark.slow
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("local", [1, 2])
def test_user_built_job_matrix(tmp_path, local, inputs):
    _check(tmp_path, local, inputs)
