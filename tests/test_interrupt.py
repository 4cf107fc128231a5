"""An interrupted ``disco optimize`` keeps its best plan, and a rerun resumes from it.

A real ``python -m disco_jax optimize`` on the tiny vgg step (patience too large to end
the search, a time budget of minutes) is sent SIGINT or SIGTERM once it says it is
searching. It must exit with code 130 and no traceback, having written OUT and
OUT.plan.json atomically (no temporary file left); the plan loads with
:meth:`hlo_tools.plan.Plan.from_json`, is a legal plan of the module (node count, group
ids, contiguous groups, the rewritten module verifies, and it is exactly OUT), compiles
exactly and computes what ``jax.jit`` computes. ``--resume`` then starts from it: the
report names it as a start plan and the new best is never predicted worse.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import hlo_tools
from disco_jax import zoo
from disco_jax.cli import EXIT_INTERRUPTED, EXIT_USAGE, main
from disco_jax.cli.optimize import PLAN_FORMAT, graph_fingerprint, plan_path
from hlo_tools.plan import Plan

NO_COST_MODEL_IO = ["--no-bench", "--no-in-context"]


@pytest.fixture(scope="module")
def vgg(tmp_path_factory):
    step, args = zoo.get("vgg")(4, "tiny")
    src = tmp_path_factory.mktemp("vgg") / "vgg.hlo"
    src.write_text(hlo_tools.extract(step, *args))
    return src, step, args


def _check_legal(module, plan: Plan) -> None:
    graph = hlo_tools.device_graph(module)
    n = graph.num_nodes
    assert sorted(plan.order) == list(range(n)) and len(plan.group) == n
    assert all(plan.group[g] == g <= i for i, g in enumerate(plan.group))
    runs = [plan.group[node] for k, node in enumerate(plan.order)
            if k == 0 or plan.group[plan.order[k - 1]] != plan.group[node]]
    assert len(runs) == len(set(runs)), "a group is not contiguous in the schedule"
    hlo_tools.verify(hlo_tools.apply_plan(module, plan, graph))


def _interrupt(argv: list[str], signum: int, after_s: float = 1.0,
               timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Runs ``python -m disco_jax *argv``, sends ``signum`` ``after_s`` seconds after it
    says it is searching, and waits for it."""
    proc = subprocess.Popen([sys.executable, "-m", "disco_jax", *argv], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    err, deadline = [], time.monotonic() + timeout_s
    try:
        while not any("disco: searching" in x for x in err):
            assert proc.poll() is None, "".join(err)
            assert time.monotonic() < deadline, "".join(err)
            try:
                err.append(lines.get(timeout=0.5))
            except queue.Empty:
                pass
        time.sleep(after_s)
        proc.send_signal(signum)
        out = proc.stdout.read()
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.1)
    while not lines.empty():
        err.append(lines.get())
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(err))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_search_keeps_its_best_plan_and_resumes(signum, vgg, tmp_path, capsys):
    src, step, args = vgg
    out = tmp_path / "vgg.opt.hlo"
    argv = ["optimize", str(src), "-o", str(out), *NO_COST_MODEL_IO, "--json",
            "--time-budget", "300", "--patience", "100000000"]
    t0 = time.monotonic()
    proc = _interrupt(argv, signum)
    assert time.monotonic() - t0 < 120
    assert proc.returncode == EXIT_INTERRUPTED, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    name = signal.Signals(signum).name
    assert f"disco: interrupted ({name}): the best plan so far is in {out}" in proc.stderr
    report = json.loads(proc.stdout)
    assert report["search"]["stop_reason"] == "interrupted"
    assert report["search"]["evaluated"] > 1 and report["plan_file"] == str(plan_path(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vgg.opt.hlo",
                                                          "vgg.opt.hlo.plan.json"]

    module = hlo_tools.parse(src.read_text())
    record = json.loads(plan_path(out).read_text())
    assert record["format"] == PLAN_FORMAT and record["stop_reason"] == "interrupted"
    assert record["fingerprint"] == graph_fingerprint(hlo_tools.device_graph(module))
    assert record["predicted_s"] == report["predicted_s"]
    plan = Plan.from_json(record["plan"])
    _check_legal(module, plan)
    assert out.read_text() == hlo_tools.to_text(hlo_tools.apply_plan(module, plan))
    if signum == signal.SIGINT:  # (once: compiling costs seconds)
        run = hlo_tools.compile_module(out.read_text(), hlo_tools.InPlaceOf(step, args),
                                       hlo_tools.CompileOptions(exact=True))
        got, want = jax.tree.leaves(run(*args)), jax.tree.leaves(jax.jit(step)(*args))
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

    # The rerun resumes from the kept plan (and ends by itself: exit code 0).
    code = main(["optimize", str(src), "-o", str(out), *NO_COST_MODEL_IO, "--json",
                 "--time-budget", "1", "--patience", "100000000", "--resume"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    again = json.loads(captured.out)
    assert again["resumed"] and again["search"]["stop_reason"] != "interrupted"
    assert again["start_predicted_s"]["resumed"] == pytest.approx(report["predicted_s"])
    assert again["predicted_s"] <= again["start_predicted_s"]["resumed"]
    _check_legal(module, Plan.from_json(json.loads(plan_path(out).read_text())["plan"]))


def test_resume_refuses_a_plan_of_another_module_or_a_broken_file(vgg, tmp_path, capsys):
    src, _, _ = vgg
    other = tmp_path / "other.hlo"
    other.write_text((pathlib.Path(__file__).parent / "fixtures" / "shard_map_mlp.pre.hlo")
                     .read_text())
    out = tmp_path / "o.hlo"
    argv = ["optimize", str(src), "-o", str(out), *NO_COST_MODEL_IO, "--time-budget", "1",
            "--resume"]
    assert main(argv) == 0  # no plan yet: a note, and a fresh search
    assert "--resume: no plan at" in capsys.readouterr().err
    kept = plan_path(out).read_text()
    assert main(["optimize", str(other), *argv[2:]]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--resume: the plan is for another module" in err and "Traceback" not in err
    assert plan_path(out).read_text() == kept  # refused: nothing written
    for broken, what in [("{", ":1: --resume: not JSON"),
                         ('{"format": "disco-plan/1", "fingerprint": "x"}', "not a plan file"),
                         ("[]", "not a plan file")]:
        plan_path(out).write_text(broken)
        assert main(argv) == EXIT_USAGE
        err = capsys.readouterr().err
        assert what in err and "Traceback" not in err, err
    record = json.loads(kept)
    record["plan"]["order"] = record["plan"]["order"][::-1]  # not a topological schedule
    plan_path(out).write_text(json.dumps(record))
    assert main(argv) == EXIT_USAGE
    assert "--resume: not a legal plan of this module" in capsys.readouterr().err
