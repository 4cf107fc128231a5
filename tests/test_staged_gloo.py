"""Staged enactment in real 2-process gloo jobs (worker: tests/staged_gloo_worker.py).

* shard_map zoo models (vgg by default, the others under ``-m slow``): 5 staged
  steps equal 5 ``jax.jit`` steps (rtol 1e-5), and both processes issue the same
  all-reduces in the same order;
* the fallback of a staged enactment to one program (``DISCO_STAGED=0``), with a warning
  naming the reason, computes the same steps (under ``-m slow``);
* a stage that fails in one process raises a clear error in both, not a hang;
* a first call under a budget that cannot pay for the full profile builds the staged
  programs first and computes what ``jax.jit`` computes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("staged_gloo_worker.py")


def _job(tmp_path: Path, mode: str, *, pin: bool = False, timeout_s: float = 300.0,
         env_extra: dict | None = None, extra: tuple[str, ...] = ()) -> list[dict]:
    from disco_estimator.gloo import child_env, run_local_job

    env = child_env(1, env_extra)
    if pin:  # one CPU and no NPROC: one thread in XLA:CPU's pool
        env.pop("NPROC", None)
    outs = [tmp_path / f"{mode}{i}.json" for i in range(2)]
    rcs = run_local_job(
        lambda i, coordinator: [sys.executable, str(WORKER), "--mode", mode, "--coordinator",
                                coordinator, "--process-id", str(i), "--out", str(outs[i]),
                                *extra] + (["--pin"] if pin else []),
        2, timeout_s=timeout_s, env=env, grace_s=30.0, cwd=ROOT)
    assert rcs == [0, 0], f"{mode} workers exited with {rcs}"
    return [json.loads(p.read_text()) for p in outs]


FAST_MODELS = ("vgg",)


def _check_zoo(tmp_path: Path, models: list[str]) -> None:
    rows = _job(tmp_path, "zoo", timeout_s=600.0, extra=("--models", ",".join(models)))
    assert sorted(rows[0]) == sorted(models)
    for name in models:
        for p, row in enumerate(rows):
            r = row[name]
            assert len(r["staged"]) == 5
            assert r["staged"] == pytest.approx(r["jit"], rel=1e-5), (name, p)
            assert r["max_scaled_diff"] <= 1.0, (name, p, r["max_scaled_diff"])
            assert r["stages"] >= 3  # 2 pre stages and at least one post stage
        # the same collectives, in the same order, in both processes (5 steps x buckets)
        assert rows[0][name]["comm_log"] == rows[1][name]["comm_log"], name
        assert len(rows[0][name]["comm_log"]) >= 5 * 2
        assert rows[0][name]["staged"] == rows[1][name]["staged"]


def test_zoo_models_staged_equal_jit_in_two_processes(tmp_path):
    _check_zoo(tmp_path, list(FAST_MODELS))


@pytest.mark.slow
def test_the_other_zoo_models_staged_equal_jit_in_two_processes(tmp_path):
    from disco_jax import zoo

    _check_zoo(tmp_path, [m for m in zoo.MODELS if m not in FAST_MODELS])


@pytest.mark.slow
def test_fallback_to_one_program_gives_the_same_steps(tmp_path):
    """The fallback path of a staged enactment (DISCO_STAGED=0 in both processes, pinned
    to one CPU without NPROC): one program with the same buckets, a warning naming the
    reason, the same 5 steps as jax.jit. (Whether the self-test itself finds no overlap
    in such a pinned job varies from run to run at the tiny size, so it is not forced.)"""
    rows = _job(tmp_path, "fallback", pin=True, env_extra={"DISCO_STAGED": "0"})
    for row in rows:
        assert row["cpus"] == 1
        assert row["is_staged"] is False, row  # built as one program
        assert any("falls back to one program" in w and "DISCO_STAGED=0" in w
                   for w in row["warnings"]), row["warnings"]
        assert row["staged"] == pytest.approx(row["jit"], rel=1e-5)
        assert row["max_scaled_diff"] <= 1.0


def test_failing_stage_is_a_clear_error_in_both_processes(tmp_path):
    rows = _job(tmp_path, "fail", timeout_s=180.0)
    assert "stage 1 failed" in rows[1]["error"] and "injected" in rows[1]["error"], rows[1]
    assert "process 0" in rows[0]["error"] and "all-reduce of bucket" in rows[0]["error"]
    assert rows[0]["seconds"] < 60


def test_a_short_budget_builds_the_staged_programs_before_the_profile(tmp_path):
    """15 s for vgg (tiny) in a 2-process job: the full profile (3 s and 7.5 compiles of
    XLA's default) does not fit in a third of it, so XLA's default is timed once and
    the staged programs come next; the lean profile and the search follow only if they
    still fit. The winner's steps are jax.jit's in both processes, and each program was
    compiled in one process and loaded by the other."""
    rows = _job(tmp_path, "budget", timeout_s=300.0)
    for p, r in enumerate(rows):
        assert any("staged programs and baselines first" in line for line in r["lines"]) \
            or p == 1, r["lines"]
        assert any(name.startswith("staged_") for name in r["measured"]), r["measured"]
        assert r["staged"] == pytest.approx(r["jit"], rel=1e-5), p
        assert r["max_scaled_diff"] <= 1.0, (p, r["max_scaled_diff"])
        assert r["seconds"]["total"] < 1.2 * 15.0, r["seconds"]
    assert rows[0]["choice"] == rows[1]["choice"]
    assert rows[0]["staged"] == rows[1]["staged"]
    # every program compiled once in the job: what one process compiled the other
    # loaded (process 0 the candidates, each a share of the staged programs' stages)
    counts = [[int(n) for n in re.findall(r"(\d+) (?:here|loaded)", line)]
              for r in rows for line in r["lines"] if line.startswith("compiles in the job")]
    assert len(counts) == 2 and counts[0][0] >= 5 and counts[1][1] >= 5, counts
    assert counts[0][:2] == counts[1][1::-1] and counts[0][2] == counts[1][2] == 0, counts
    search = rows[0]["search"]
    if "skipped" in (search or {}):  # no time left for the profile: no calibration
        assert rows[0]["calibration"] is None
    else:
        assert rows[0]["calibration"] is not None
