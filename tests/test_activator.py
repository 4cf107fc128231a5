"""The activator in real 2-process gloo jobs (``disco launch``, 127.0.0.1, a free port
each time, every job bounded): process 0 alone searches or reads the store, broadcasts
the enactment over the collective backend, and both processes run it or both fall back.

Each job runs ``tests/activator_worker.py`` (tiny vgg, one device per process, 5 steps of
``disco_jax.jit`` beside ``jax.jit`` in the same job) with a store per process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "activator_worker.py"
JOB_TIMEOUT_S = 150


def _job(tmp: Path, stores: list[Path], *, flag: str | None, extra: tuple[str, ...] = (),
         env_extra: dict[str, str] | None = None, check: bool = True) -> list[dict]:
    """Runs a 2-process job; returns each process's JSON (index = process id; with
    ``check=False`` the exit code is not checked and only the JSON written is read)."""
    out = tmp / f"out_{len(list(tmp.glob('out_*')))}"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ENABLE_SEARCH", "DISCO_STORE")}
    env.update({f"DISCO_STORE_{i}": str(s) for i, s in enumerate(stores)})
    # a short budget (under 20 s: the quick profile) that affords the profile (five
    # compiles of the tiny step) and little after it: a brief search, a quick choice
    env["DISCO_TIME_BUDGET"] = "19"
    if flag is not None:
        env["ENABLE_SEARCH"] = flag
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "disco_jax", "launch", "-n", "2", "--timeout",
           str(JOB_TIMEOUT_S), "--", sys.executable, str(WORKER), "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S + 30, start_new_session=True)
    if not check:
        return [json.loads(p.read_text()) for p in sorted(out.glob("p*.json"))]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return [json.loads((out / f"p{i}.json").read_text()) for i in range(2)]


def _stores(tmp: Path, name: str) -> list[Path]:
    stores = [tmp / f"{name}_0", tmp / f"{name}_1"]
    for s in stores:
        s.mkdir()
    return stores


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> tuple[Path, list[Path], list[dict]]:
    """(c): a 2-process ``ENABLE_SEARCH=1`` job; its stores are reused by (a) and (b)."""
    tmp = tmp_path_factory.mktemp("activator")
    stores = _stores(tmp, "search")
    return tmp, stores, _job(tmp, stores, flag="1")


def test_search_only_on_process_0_same_fingerprint(searched):
    """(c) Only process 0 searches and stores; both run the same enactment."""
    _, stores, rows = searched
    p0, p1 = rows
    # process 0 searches unless its profile used up the short budget (a loaded machine),
    # which its record says; process 1 never does
    assert p1["searches"] == 0
    assert p0["searches"] == 1 or (p0["searches"] == 0 and p0["search_skipped"][0]), p0
    assert len(p0["store_entries"]) == 1 and p1["store_entries"] == []
    assert p0["info"]["mode"] == p1["info"]["mode"] == "searched"
    assert p0["info"]["hlo_fingerprint"] == p1["info"]["hlo_fingerprint"]
    assert p0["info"]["choice"] == p1["info"]["choice"]
    for row in rows:
        assert row["loss_disco"] == pytest.approx(row["loss_jax"], rel=1e-5)
        assert row["gloo_loop_policies"] == [os.SCHED_BATCH]  # DISCO_GLOO_LOOP's default


def test_only_process_0_has_the_plan(searched):
    """(a) Only process 0's store holds the plan: both run it, losses equal jax.jit's. The
    plan was never verified (a search does not verify): both processes verify it on the
    first call, and process 0's store records the verdict."""
    tmp, stores, found = searched
    assert not any(stores[1].iterdir())
    assert found[0]["verdicts"] == [None]
    rows = _job(tmp, stores, flag="0")
    assert rows[0]["verdicts"][0]["ok"] is True and rows[1]["verdicts"] == []
    fp = found[0]["info"]["hlo_fingerprint"]
    for row in rows:
        assert row["info"]["mode"] == "stored", row["info"]
        assert row["info"]["hlo_fingerprint"] == fp
        assert row["warnings"] == []
        assert row["loss_disco"] == pytest.approx(row["loss_jax"], rel=1e-5)
        assert row["close"], row["max_abs_diff"]
    assert rows[0]["loss_jax"] == rows[1]["loss_jax"]


def test_mismatched_plan_all_fall_back(searched):
    """(b) Process 0's record is from another jax version: both fall back, with a warning;
    and one process voting no makes the vote no everywhere."""
    tmp, stores, _ = searched
    bad = _stores(tmp, "bad")
    for entry in stores[0].iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            shutil.copytree(entry, bad[0] / entry.name)
            record = json.loads((entry / "record.json").read_text())
            record["setup"]["jax"] = "0.0.1"
            (bad[0] / entry.name / "record.json").write_text(json.dumps(record))
    rows = _job(tmp, bad, flag=None, extra=("--vote-no-on", "1"))
    for row in rows:
        assert row["vote"][0] is False and "process 1 votes no" in row["vote"][1]
        assert row["info"]["mode"] == "fallback"
        assert "jax version" in row["info"]["reason"]
        assert any("jax version" in w for w in row["warnings"])
        assert row["loss_disco"] == row["loss_jax"]
        assert row["gloo_loop_policies"] == [os.SCHED_BATCH]  # settled in a fallback too
    assert rows[0]["info"]["hlo_fingerprint"] == rows[1]["info"]["hlo_fingerprint"]


def test_staged_enactment_runs_in_both(tmp_path):
    """(d) A staged enactment in process 0's store runs in both, as jax.jit does (here
    with gloo's event loops left as jaxlib starts them: ``DISCO_GLOO_LOOP=asis``)."""
    stores = _stores(tmp_path, "staged")
    rows = _job(tmp_path, stores, flag="0", extra=("--put-staged",),
                env_extra={"DISCO_GLOO_LOOP": "asis"})
    for row in rows:
        assert row["gloo_loop_policies"] == [os.SCHED_OTHER]
        assert row["info"]["mode"] == "stored", row["info"]
        assert row["info"]["choice"] == "staged_test"
        assert row["info"]["hlo_fingerprint"] == rows[0]["staged_fingerprint"]
        assert row["loss_disco"] == pytest.approx(row["loss_jax"], rel=1e-5)
        assert row["close"], row["max_abs_diff"]


@pytest.mark.slow  # in one process: tests/test_store_safety.py's tampered plan
def test_verification_refuses_a_tampered_plan_in_both(tmp_path):
    """Process 0's stored plan computes something else (its learning rate doubled):
    both processes verify it on the first call, both refuse it with the same warning and
    run jax.jit's program, and process 0's store records the refusal."""
    stores = _stores(tmp_path, "tampered")
    rows = _job(tmp_path, stores, flag="0", extra=("--put-tampered",))
    for row in rows:
        assert row["info"]["mode"] == "fallback", row["info"]
        assert "verification refused the stored plan" in row["info"]["reason"]
        assert len(row["warnings"]) == 1 and "differ" in row["warnings"][0]
        assert row["loss_disco"] == row["loss_jax"]
    verdict = rows[0]["verdicts"][0]
    assert verdict["ok"] is False and verdict["detail"]


def test_a_process_that_never_comes_is_a_clear_error(tmp_path):
    """Process 1 never calls the step: process 0 gets an ActivatorError naming the step
    after DISCO_ACTIVATOR_TIMEOUT, not a hang (and jax then stops process 1: its
    coordinator is gone)."""
    stores = _stores(tmp_path, "absent")
    rows = _job(tmp_path, stores, flag=None, extra=("--absent", "1"),
                env_extra={"DISCO_ACTIVATOR_TIMEOUT": "3"}, check=False)
    assert rows and rows[0]["pid"] == 0
    assert "barrier before the broadcast" in rows[0]["error"]
    assert "process 0 of 2" in rows[0]["error"]


def test_launch_usage_errors_and_exit_codes():
    """``disco launch``: no command is a usage error; the first failure's exit code comes
    back; a job past --timeout is killed (exit 124)."""
    from disco_jax.cli import main

    assert main(["launch", "-n", "2"]) == 2
    assert main(["launch", "-n", "0", "--", "true"]) == 2
    code = "import os, sys; sys.exit(3 if os.environ['DISCO_PROCESS_ID'] == '1' else 0)"
    assert main(["launch", "-n", "2", "--", sys.executable, "-c", code]) == 3
    assert main(["launch", "-n", "2", "--timeout", "1", "--", sys.executable, "-c",
                 "import time; time.sleep(30)"]) == 124
