"""Staged enactment (disco_jax.enactment.staged, hlo_tools.stages): the staged step computes what
``jax.jit(step)`` computes, in one process with 4 host devices and in a 2-process gloo job.

Run as a script (``python tests/test_staged.py --worker ...``) this file is the worker of
the gloo test: one process of the job, writing its losses to a JSON file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import threading
from pathlib import Path

import pytest
from step_helpers import local, run_steps

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def _run_steps(fn, args, steps=STEPS):
    return run_steps(fn, args, steps)


_STEPS_CACHE: dict[str, tuple] = {}


def _zoo_step(name):
    if name not in _STEPS_CACHE:
        from disco_jax import zoo

        _STEPS_CACHE[name] = zoo.get(name)(4, "tiny")
    return _STEPS_CACHE[name]


@pytest.mark.parametrize("name, buckets", [
    ("vgg", 1), ("vgg", 2), ("vgg", 3),
    # transformer's staged steps: tests/test_staged_gloo.py's zoo job in CI
    pytest.param("transformer", 2, marks=pytest.mark.slow),
    pytest.param("transformer", 1, marks=pytest.mark.slow),
    pytest.param("transformer", 3, marks=pytest.mark.slow)])
def test_staged_matches_jit(name, buckets, monkeypatch):
    import jax
    import numpy as np

    from disco_jax.enactment import staged as st

    step, args = _zoo_step(name)
    threads: set[str] = set()
    reduce = st.StagedStep._reduce

    def spy(self, k, flat):
        threads.add(threading.current_thread().name)
        return reduce(self, k, flat)

    monkeypatch.setattr(st.StagedStep, "_reduce", spy)
    staged = st.staged_step(step, args, buckets)
    try:
        plan = staged.plan
        assert sum(b.gradient for b in plan.comms) == buckets
        # pre stages: one per bucket, none reads a reduced buffer; post stages read
        # reduced buffers in bucket order (the update split by bucket)
        pre, post = plan.stages[:buckets], plan.stages[buckets:]
        assert post and not any(r.kind == "reduced" for s in pre for r in s.inputs)
        last_read = [max((int(r.key) for r in s.inputs if r.kind == "reduced"), default=-1)
                     for s in post]
        assert last_read == sorted(last_read), last_read
        if buckets > 1:  # the first buckets' updates leave the last post stage
            assert len(post) > 1 and last_read[0] < buckets - 1, last_read
        results = [r.key for s in plan.stages for r in s.outputs if r.kind == "result"]
        assert sorted(results) == list(range(len(plan.cut.result_shapes)))
        assert plan.fingerprints == tuple(hashlib.sha256(s.text.encode()).hexdigest()
                                          for s in plan.stages)
        assert all(" all-reduce(" not in s.text for s in plan.stages)
        assert [launch.stream for launch in plan.schedule].count(st.COMM) == len(plan.comms)
        got = _run_steps(staged, args)
        want = _run_steps(jax.jit(step), args)
    finally:
        staged.close()
    assert threads and all(t.startswith("disco-comm") for t in threads)
    assert threading.current_thread().name not in threads
    for i, (g, w) in enumerate(zip(got, want)):
        leaves_g, leaves_w = jax.tree.leaves(g), jax.tree.leaves(w)
        assert jax.tree.structure(g) == jax.tree.structure(w)
        for a, b in zip(leaves_g, leaves_w):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
            np.testing.assert_allclose(local(a), local(b), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}, {buckets} buckets, step {i}")


def test_chunked_reduction_matches_one_collective_per_bucket():
    """Buckets reduced in small pieces (several collectives each) give the same steps."""
    import jax
    import numpy as np

    from disco_jax.enactment import staged as st

    step, args = _zoo_step("vgg")
    results = []
    for chunk in (None, 256):
        staged = st.staged_step(step, args, 2, chunk_bytes=chunk)
        try:
            # buffers reduced: XLA combines the pieces into one tuple all-reduce, whose
            # buffers XLA:CPU still reduces one by one
            operands = _allreduce_operands(staged.comm_programs[0].as_text())
            results.append((operands, _run_steps(staged, args)))
        finally:
            staged.close()
    (whole, got_whole), (pieces, got_pieces) = results
    assert pieces > whole >= 1
    for g, w in zip(jax.tree.leaves(got_pieces), jax.tree.leaves(got_whole)):
        np.testing.assert_array_equal(local(g), local(w))


def test_even_buckets_cover_the_gradients():
    import hlo_tools
    from disco_jax.enactment.staged import even_buckets
    from hlo_tools.graph import device_graph
    from hlo_tools.plan import FusionSpace, ready_order

    step, args = _zoo_step("vgg")
    graph = device_graph(hlo_tools.parse(hlo_tools.extract(step, *args)))
    order = ready_order(FusionSpace(graph))
    for count in (1, 2, 3, len(order)):
        buckets = even_buckets(graph, count)
        assert len(buckets) == count and all(buckets)
        assert [a for b in buckets for a in b] == order
    with pytest.raises(ValueError):
        even_buckets(graph, len(order) + 1)


def _allreduce_operands(text: str) -> int:
    """Buffers the all-reduces of a compiled program's text reduce."""
    return sum(len(re.findall(r"%[\w.\-]+", line.split(" all-reduce(", 1)[1].split(")", 1)[0]))
               for line in text.splitlines() if " all-reduce(" in line)


def test_staged_candidates_auto_fits_a_reference_and_adds_the_best_predicted_layouts():
    """``"auto"``: one reference layout is measured, the staged cost model fitted on it,
    and the ``top`` best predicted layouts join it; every one computes what jax.jit does
    and reduces each bucket as ``chunk_bytes`` says."""
    import jax
    import numpy as np

    from disco_estimator.costs.cost_model import CostModel
    from disco_jax.pipeline.candidates import staged_candidates
    from disco_jax.pipeline.program import lower_program

    step, args = _zoo_step("vgg")
    lines: list[str] = []
    runs, info = staged_candidates(lower_program(step, args), ["auto"],
                                   costs=CostModel("inproc4"), say=lines.append, top=2,
                                   chunk_bytes=None)
    try:
        preds, ref = info["predicted_s"], info["reference"]
        best = sorted(preds, key=preds.__getitem__)[:2]
        assert set(runs) == {ref, *best} and ref in preds, (sorted(runs), preds)
        assert all(t > 0 for t in preds.values())
        assert set(info["self_test"]) >= {"overlaps", "reason"}
        fit = info["fit"]
        assert fit["overlap"] == 1.0 and fit["step_s"] >= 0 and fit["compute_scale"] > 0
        # the reference priced at its measured total (more where its simulation is slower)
        assert preds[ref] >= info["reference_s"] * (1 - 1e-9)
        if fit["step_s"] > 0:
            assert preds[ref] == pytest.approx(info["reference_s"])
        assert info["compute_s"] == pytest.approx(sum(info["parts"]["stage_s"]))
        assert any(line.startswith(f"staged fit on {ref}") for line in lines), lines
        want = _run_steps(jax.jit(step), args)
        for name, run in runs.items():
            # one collective per bucket: each communication program reduces one buffer
            assert [_allreduce_operands(p.as_text()) for p in run.comm_programs] == \
                [1] * len(run.plan.comms), name
            got = _run_steps(run, args)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(local(g), local(w), rtol=1e-5, atol=1e-6,
                                           err_msg=name)
    finally:
        for run in runs.values():
            run.close()


# ------------------------------------------------------------------ 2-process gloo job


def _worker(args: argparse.Namespace) -> None:
    """One process of the gloo job: 3 staged steps and 3 jitted steps, losses to JSON."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=2,
                               process_id=args.process_id, initialization_timeout=60)
    import numpy as np

    from disco_jax import zoo
    from disco_jax.enactment.staged import staged_step

    step, step_args = zoo.get(args.model)(2, "tiny")
    staged = staged_step(step, step_args, args.buckets)
    want = _run_steps(jax.jit(step), step_args)
    got = _run_steps(staged, step_args)
    staged.close()
    diff = max(float(np.max(np.abs(local(a) - local(b))))
               for g, w in zip(got, want)
               for a, b in zip(jax.tree.leaves(g[:2]), jax.tree.leaves(w[:2])))
    row = {"process": args.process_id, "devices": jax.device_count(),
           "local_devices": jax.local_device_count(),
           "comms": len(staged.plan.comms), "stages": len(staged.plan.stages),
           "staged": [float(local(g[2])) for g in got],
           "jit": [float(local(w[2])) for w in want], "max_param_diff": diff}
    Path(args.out).write_text(json.dumps(row))
    jax.distributed.shutdown()


@pytest.mark.slow  # CI: tests/test_staged_gloo.py runs vgg with 2 buckets in 2 processes
def test_staged_gloo_two_processes(tmp_path):
    from disco_estimator.gloo import child_env, run_local_job

    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    rcs = run_local_job(
        lambda i, coordinator: [sys.executable, __file__, "--worker", "--coordinator",
                                coordinator, "--process-id", str(i), "--model", "vgg",
                                "--buckets", "2", "--out", str(outs[i])],
        2, timeout_s=300, env=child_env(1), grace_s=20.0, cwd=ROOT)
    assert rcs == [0, 0], f"gloo workers exited with {rcs}"
    rows = [json.loads(p.read_text()) for p in outs]
    for row in rows:
        assert row["devices"] == 2 and row["local_devices"] == 1
        # 2 pre stages, then the post stages of bucket 0 and bucket 1 (with the loss)
        assert row["stages"] == 2 + 2 and row["comms"] == 2
        assert len(row["staged"]) == STEPS
        for s, j in zip(row["staged"], row["jit"]):
            assert s == pytest.approx(j, rel=1e-5)
        assert row["max_param_diff"] < 1e-5
    assert rows[0]["staged"] == rows[1]["staged"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--model", default="vgg")
    parser.add_argument("--buckets", type=int, default=2)
    parser.add_argument("--out", required=True)
    sys.path.insert(0, str(ROOT))
    _worker(parser.parse_args())
