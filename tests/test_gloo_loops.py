"""gloo's TCP event loop moved to ``SCHED_BATCH`` or ``SCHED_IDLE``
(:func:`disco_estimator.gloo.quiet_gloo_loops`)
in a real 2-process gloo job (worker: tests/gloo_loop_worker.py): the loop is found
(one per process, none before the backend starts), only it changes class, and the
job's all-reduces still compute the right values."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("gloo_loop_worker.py")


def test_no_gloo_loop_in_a_process_without_gloo():
    import jax

    from disco_estimator.gloo import gloo_loop_threads, quiet_gloo_loops

    jax.devices()  # this process's backend (CPU, no gloo) is running
    assert gloo_loop_threads() == []
    assert quiet_gloo_loops(attempts=2) == []
    with pytest.raises(ValueError, match="unknown loop policy 'nice'"):
        quiet_gloo_loops("nice")


@pytest.mark.parametrize("policy, want", [("batch", os.SCHED_BATCH), ("idle", os.SCHED_IDLE)])
def test_quiet_gloo_loop_in_a_two_process_job(tmp_path, policy, want):
    from disco_estimator.gloo import child_env, run_local_job

    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    rcs = run_local_job(
        lambda i, coordinator: [sys.executable, str(WORKER), "--coordinator", coordinator,
                                "--process-id", str(i), "--out", str(outs[i]),
                                "--policy", policy],
        2, timeout_s=180, env=child_env(1), grace_s=20.0, cwd=ROOT)
    assert rcs == [0, 0], f"workers exited with {rcs}"
    for out in outs:
        row = json.loads(out.read_text())
        assert row["before_backend"] == [], row
        assert len(row["quieted"]) == 1, row
        assert row["policies"] == [want], row
        assert row["other_policies"] == [os.SCHED_OTHER], row
        assert row["max_abs_diff"] == 0.0, row
