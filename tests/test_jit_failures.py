"""``disco_jax.jit`` never crashes a user's step: failures injected at each stage of the
search and of the stored path become one ``DiscoFallbackWarning`` with the reason and plain
``jax.jit``'s outputs; and the route of a backend without hand-written fusions (AllReduce
buckets over XLA's own fusion), forced on XLA:CPU, searches, stores and runs as a plan.

Each injection replaces one of DisCo's own steps with one that fails the way that step
fails for real: an XLA option XLA rejects (a real compile error of a candidate), a
profiler that raises, a candidate that raises when run, a store that cannot be read.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import jax
import numpy as np
import pytest
from step_helpers import mlp_step

import disco_jax
from disco_jax import store as st
from disco_jax.jit import DiscoFallbackWarning

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 host devices")

QUICK = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
         "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}


def _run(tmp_path, monkeypatch, flag: str, **options):
    """One call of the wrapped mlp step under ``ENABLE_SEARCH=flag``: ``(outputs,
    jax.jit's outputs, run info, DisCo's warnings)``."""
    monkeypatch.setenv("ENABLE_SEARCH", flag)
    step, params, batch = mlp_step()
    wrapped = disco_jax.jit(step, static_argnums=2, store=tmp_path,
                            search_options={**QUICK, **options})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = wrapped(params(), batch, 0.1)
    want = jax.jit(step, static_argnums=2)(params(), batch, 0.1)
    ours = [w for w in seen if issubclass(w.category, DiscoFallbackWarning)]
    return got, want, wrapped.last_run_info, ours


def _same(got, want) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _raise(message: str):
    def fail(*args, **kwargs):
        raise RuntimeError(message)
    return fail


def _bad_plan_options(real):
    def options(route):  # an option XLA does not know: XLA itself rejects the compile
        return {**real(route), "compiler_options": {"xla_no_such_option": 1}}
    return options


def _raising_candidates(real):
    def candidates(*args, **kwargs):  # hand bucketing's programs raise when run
        from hlo_tools.jax_bridge import CompiledHlo

        return [dataclasses.replace(c, run=CompiledHlo(
            _raise("injected: the candidate failed"), c.run.hlo_text, c.run.compiler_options))
            for c in real(*args, **kwargs)]
    return candidates


def test_a_plan_xla_rejects_is_left_out(tmp_path, monkeypatch, capfd):
    """A real compile error of the search's plans leaves them out of the final choice;
    the search ends with another program, no warning, no traceback."""
    target = "disco_jax.pipeline.candidates.plan_compile_options"
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(target, _bad_plan_options(getattr(importlib.import_module(module),
                                                          name)))
    got, want, info, ours = _run(tmp_path, monkeypatch, "1")
    _same(got, want)
    assert info.mode == "searched" and not info.choice.startswith("plan_"), info
    assert ours == []
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("stage, target, replace, words", [
    ("profiler error", "disco_estimator.ops.trace.profile_program",
     lambda _: _raise("injected: the profiler failed"), "the profiler failed"),
    ("a candidate that raises", "hlo_tools.baselines.bucketed_candidates",
     _raising_candidates, "the candidate failed"),
    ("the store", "disco_jax.store.write_entry", lambda _: _raise("injected: no store"),
     "no store"),
])
def test_search_failures_fall_back(tmp_path, monkeypatch, capfd, stage, target, replace, words):
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(target, replace(getattr(importlib.import_module(module), name)))
    got, want, info, ours = _run(tmp_path, monkeypatch, "1")
    _same(got, want)
    assert info.mode == "fallback" and words in info.reason, (stage, info)
    assert len(ours) == 1 and words in str(ours[0].message)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("stage, target, words", [
    ("reading the store", "disco_jax.store.load_entry", "cannot read"),
    ("building the stored program", "disco_jax.enactment.build", "cannot build"),
])
def test_stored_path_failures_fall_back(tmp_path, monkeypatch, capfd, stage, target, words):
    _, _, info, _ = _run(tmp_path, monkeypatch, "1")
    assert info.mode == "searched"
    monkeypatch.setattr(target, _raise(f"injected: {words}"))
    got, want, info, ours = _run(tmp_path, monkeypatch, "0")
    _same(got, want)
    assert info.mode == "fallback" and words in info.reason, (stage, info)
    assert len(ours) == 1 and words in str(ours[0].message)
    assert "Traceback" not in capfd.readouterr().err


def test_the_users_own_error_is_jax_jits(tmp_path, monkeypatch):
    """A step that jax cannot lower raises jax's error, with no DisCo warning."""
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    wrapped = disco_jax.jit(lambda x: x @ x, store=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiscoFallbackWarning)
        with pytest.raises(TypeError):
            wrapped(jax.numpy.ones((2, 3)))


def test_buckets_route_searches_stores_and_runs(tmp_path, monkeypatch):
    """The route of a backend that compiles no hand-written fusion, forced here: the plans
    hold AllReduce buckets alone and compile over XLA's fusion; the record names the
    route; the stored plan runs under ENABLE_SEARCH=0 with jax.jit's outputs."""
    got, want, info, ours = _run(tmp_path, monkeypatch, "1", route="buckets")
    _same(got, want)
    assert info.mode == "searched" and not ours
    entry = st.load_entry(info.source_fingerprint, st.Setup.current(), root=tmp_path).entry
    assert entry.record.extra["route"]["name"] == "buckets"
    plan = [n for n in entry.record.measured_s if n.startswith("plan_")]
    assert plan, entry.record.measured_s
    if info.choice.startswith("plan_"):
        assert not entry.enactment.exact and " fusion(" not in entry.enactment.text
    got, want, info, ours = _run(tmp_path, monkeypatch, "0")
    _same(got, want)
    assert info.mode == "stored" and not ours


def test_this_backend_and_gpu_compile_handwritten_fusions():
    """XLA:CPU, probed here, and XLA:GPU, recorded in ``xla_passes.toml`` (its PJRT
    plugin's own compile of HLO takes the fusions as written): both exact routes."""
    from hlo_tools.jax_bridge import EXACT, known_route, probe_route
    from hlo_tools.jax_bridge.passes import load_pass_config

    here = probe_route("cpu")
    assert here.name == EXACT and "compiles hand-written fusions" in here.reason
    gpu = known_route("gpu")
    assert gpu.name == EXACT and gpu.reason == load_pass_config()["gpu"]["route_reason"]
    assert "PJRT plugin" in gpu.reason and "kCustom" in gpu.reason
