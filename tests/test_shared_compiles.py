"""One compile per job (``hlo_tools.jax_bridge.compiles_shared``) in a real 2-process
gloo job (worker: tests/shared_compiles_worker.py): process 0 compiles, process 1 loads
its executables, a batch is spread over both, and both compute what ``jax.jit``
computes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("shared_compiles_worker.py")


def test_process_0_compiles_and_process_1_loads(tmp_path):
    from disco_estimator.gloo import child_env, run_local_job

    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    rcs = run_local_job(
        lambda i, coordinator: [sys.executable, str(WORKER), "--coordinator", coordinator,
                                "--process-id", str(i), "--out", str(outs[i])],
        2, timeout_s=180.0, env=child_env(1), cwd=ROOT)
    assert rcs == [0, 0]
    rows = [json.loads(p.read_text()) for p in outs]
    for row in rows:
        assert row["close"] == {"default": True, "exact": True, "again": True}, row
        assert row["stage_ok"], row
        assert "bad_add" in row["error"], row
    # one executable, the same all-reduced results to the bit in both processes; the
    # rejected text is process 0's error in both; the same program compiled twice is two
    # compiles of process 0, each loaded by process 1
    assert rows[0]["bytes"] == rows[1]["bytes"]
    assert rows[0]["error"] == rows[1]["error"]
    # ... and the module that differs in process 1 is compiled there, not loaded
    assert rows[0]["counts"] == {"compiled": 5, "loaded": 0, "local": 0}
    assert rows[1]["counts"] == {"compiled": 0, "loaded": 4, "local": 1}
    assert rows[0]["own_ok"] and rows[1]["own_ok"]
    # a spread batch: each process compiled its share and loaded the other's; the
    # batch with a rejected module raised the same error in both
    for row in rows:
        assert row["spread_ok"] == [True] * 4, row
        assert "bad_add" in row["spread_error"], row
    assert rows[0]["spread_error"] == rows[1]["spread_error"]
    # a standalone module runs on the process's own device in both (assigned to global
    # device 0, process 1's failed: "local device count is 0"), so the route probe
    # finds hand-written fusions compile in both, and both compile plans alike
    assert [row["standalone_ok"] for row in rows] == [True, True]
    assert [row["route"] for row in rows] == ["exact", "exact"]
    assert [row["job_route"][0] for row in rows] == ["exact", "exact"]
    # one process's probe failing: the job takes buckets in both, with its reason
    for row in rows:
        assert row["job_route_failed"] == ["buckets", "cpu", "process 1: no fusion here"]
    assert rows[0]["spread_counts"] == {"compiled": 4, "loaded": 2, "local": 0}
    assert rows[1]["spread_counts"] == {"compiled": 2, "loaded": 4, "local": 0}
