"""``disco_jax.jit`` and ``ENABLE_SEARCH`` (disco_jax/jit.py).

The flag's phases run in fresh processes (tests/jit_worker.py), the zoo models batched
into one process per phase: ``ENABLE_SEARCH=1`` searches, stores and runs; then ``=0``
loads what was stored. The default run takes vgg; the other zoo models run under
``-m slow`` (about 30 s a model here; their programs compile and run as plans in
test_random_plans.py and test_staged_gloo.py). Both give jax.jit's outputs over 5
steps (rtol 1e-5) and never compile again after the first call (jax's backend-compile
events, counted for real). Unusable stores (empty, truncated, another jax version or
device count, HLO that no longer parses) fall back to jax.jit with a warning. The rest
(static and donated arguments, tracers, the flag's values) runs in this process on a
small shard_map step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from step_helpers import mlp_step

import disco_jax
from disco_jax import store as st
from disco_jax import zoo
from disco_jax.jit import DiscoFallbackWarning

ROOT = Path(__file__).resolve().parents[1]
MODELS = list(zoo.MODELS)
FAST = ("vgg",)
SLOW = tuple(m for m in MODELS if m not in FAST)
MODEL_PARAMS = [pytest.param(m, marks=[pytest.mark.slow] if m in SLOW else [])
                for m in MODELS]
QUICK = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
         "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}


def _worker(flag: str | None, models, stores, tmp: Path) -> list[dict]:
    env = dict(os.environ)
    env.pop("ENABLE_SEARCH", None)
    if flag is not None:
        env["ENABLE_SEARCH"] = flag
    out = tmp / f"rows_{flag}_{len(list(tmp.iterdir()))}.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "jit_worker.py"), "--models", ",".join(models),
         "--stores", ",".join(map(str, stores)), "--out", str(out)],
        env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """``phases(model)``: ``(store, searched rows, enacted rows)`` of the batch that
    holds ``model`` (FAST or SLOW), rows by model. On first use of a batch,
    ``ENABLE_SEARCH=1`` runs over it in one fresh process, then ``=0`` in another on the
    same store."""
    done = {}

    def get(model):
        batch = FAST if model in FAST else SLOW
        if batch not in done:
            tmp = tmp_path_factory.mktemp("phases")
            store = tmp / "store"
            searched = {r["model"]: r for r in _worker("1", batch, [store], tmp)}
            enacted = {r["model"]: r for r in _worker("0", batch, [store], tmp)}
            done[batch] = (store, searched, enacted)
        return done[batch]

    return get


def _check_runs_like_jax_jit(row):
    assert row["close"], (row["model"], row["max_abs_diff"])
    assert row["compiles_first"] >= 1  # the counter sees compilations...
    assert row["compiles_after_first"] == 0  # ... and later calls cause none
    assert row["lower_ok"]  # .lower() of the wrapper: jax's own program


@pytest.mark.parametrize("model", MODEL_PARAMS)
def test_search_phase(phases, model):
    store, rows, _ = phases(model)
    row = rows[model]
    info = row["first_info"]
    assert info["mode"] == "searched" and info["reason"] == "" and row["warnings"] == []
    assert info == row["last_info"]
    _check_runs_like_jax_jit(row)
    lookup = st.load_entry(info["source_fingerprint"], st.Setup.current(), root=store)
    assert lookup.entry is not None, lookup.reason
    assert lookup.entry.enactment.fingerprint == info["hlo_fingerprint"]
    record = lookup.entry.record
    assert record.choice == info["choice"] and record.measured_s[info["choice"]] > 0
    assert {"xla_default", "op_fusion", "bucketed_1MiB", "plan_0"} <= set(record.measured_s)
    assert record.predicted_s["plan_0"] > 0
    assert record.search["settings"]["time_budget_s"] == 0.5
    assert record.hardware.name == "inproc4" and len(record.hardware.sha256) == 64


@pytest.mark.parametrize("model", MODEL_PARAMS)
def test_enactment_phase_runs_what_was_stored(phases, model):
    _, searched, enacted = phases(model)
    row, before = enacted[model], searched[model]["first_info"]
    info = row["first_info"]
    assert info["mode"] == "stored" and row["warnings"] == [], info["reason"]
    assert info["hlo_fingerprint"] == before["hlo_fingerprint"]
    assert info["source_fingerprint"] == before["source_fingerprint"]
    assert info["choice"] == before["choice"] and info["measured_s"] == before["measured_s"]
    _check_runs_like_jax_jit(row)


def _variant(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    (entry,) = [p for p in dst.iterdir() if len(p.name) == 64]
    edit(entry)
    return dst


def _edit_record(entry: Path, **changes):
    record = json.loads((entry / st.RECORD_FILE).read_text())
    for key, value in changes.items():
        record.update(value) if key == "top" else record["setup"].update({key: value})
    (entry / st.RECORD_FILE).write_text(json.dumps(record))


def _truncate(entry: Path):
    data = (entry / st.RECORD_FILE).read_bytes()
    (entry / st.RECORD_FILE).write_bytes(data[: len(data) // 3])


def _break_hlo(entry: Path):
    """The stored HLO no longer parses; the record's hash is made to match, so it is the
    parse that catches it."""
    enactment = json.loads((entry / st.ENACTMENT_FILE).read_text())
    enactment["text"] = enactment["text"].replace("ENTRY", "ENTRY %%broken", 1)
    data = json.dumps(enactment, sort_keys=True).encode()
    (entry / st.ENACTMENT_FILE).write_bytes(data)
    import hashlib

    _edit_record(entry, top={"enactment_sha256": hashlib.sha256(data).hexdigest()})


def test_unusable_stores_fall_back_with_a_warning(phases, tmp_path):
    store, searched, _ = phases("vgg")
    vgg = tmp_path / "vgg"
    vgg.mkdir()
    key = searched["vgg"]["first_info"]["source_fingerprint"]
    shutil.copytree(store / key, vgg / key)
    variants = {
        "empty": (tmp_path / "empty", "no stored plan for this program"),
        "truncated": (_variant(vgg, tmp_path / "truncated", _truncate),
                      "corrupt entry: record.json cannot be read"),
        "jax": (_variant(vgg, tmp_path / "jax", partial(_edit_record, jax="0.4.30")),
                "jax version '0.4.30'"),
        "devices": (_variant(vgg, tmp_path / "devices", partial(_edit_record, num_devices=8)),
                    "device count 8"),
        "hlo": (_variant(vgg, tmp_path / "hlo", _break_hlo), "the stored HLO does not parse"),
    }
    rows = _worker("0", ["vgg"], [path for path, _ in variants.values()], tmp_path)
    assert len(rows) == len(variants)
    for (name, (path, words)), row in zip(variants.items(), rows, strict=True):
        info = row["first_info"]
        assert row["store"] == str(path)
        assert info["mode"] == "fallback" and words in info["reason"], (name, info)
        assert len(row["warnings"]) == 1 and words in row["warnings"][0], (name, row)
        assert "running plain jax.jit" in row["warnings"][0]
        assert info["hlo_fingerprint"] == info["source_fingerprint"] == key
        _check_runs_like_jax_jit(row)


# --------------------------------------------------------------------------- in process


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_static_and_donated_arguments(tmp_path, monkeypatch):
    step, make_params, batch = mlp_step()
    ref = jax.jit(step, static_argnums=2)
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    wrapped = disco_jax.jit(step, static_argnums=2, donate_argnums=0, store=tmp_path,
                            search_options=QUICK)
    params = make_params()
    want = ref(params, batch, 0.1)
    donated = make_params()
    got = wrapped(donated, batch, 0.1)
    _close(got, want)
    info = wrapped.last_run_info
    assert info.mode == "searched" and info.store_path is not None
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))  # donated, as jax.jit
    got = wrapped(make_params(), batch, 0.1)  # cached: no new search
    assert wrapped.last_run_info is info
    # the enactment phase, a new wrapper (a fresh process is covered above)
    monkeypatch.setenv("ENABLE_SEARCH", "0")
    again = disco_jax.jit(step, static_argnums=2, donate_argnums=0, store=tmp_path)
    _close(again(make_params(), batch, 0.1), want)
    assert again.last_run_info.mode == "stored"
    assert again.last_run_info.hlo_fingerprint == info.hlo_fingerprint
    # another static value is another program: nothing stored for it
    with pytest.warns(DiscoFallbackWarning, match="no stored plan for this program"):
        out = again(make_params(), batch, 0.2)
    _close(out, ref(make_params(), batch, 0.2))
    assert again.last_run_info.mode == "fallback"
    assert again.last_run_info.source_fingerprint != info.source_fingerprint
    # jax.jit's surface
    assert "all_reduce" in again.lower(make_params(), batch, 0.1).as_text()
    assert again.trace(make_params(), batch, 0.1).jaxpr is not None
    assert again.__name__ == "step"


def test_later_calls_take_jax_s_compiled_program_per_signature(tmp_path, monkeypatch):
    """Later calls of a signature go through jax's compiled program (``_hot``); another
    signature takes the lookup and becomes the fast one; the fast path donates as
    jax.jit does; tracers still get plain jax.jit."""
    step, make_params, batch = mlp_step()

    def fixed_lr(params, batch):
        return step(params, batch, 0.1)

    monkeypatch.setenv("ENABLE_SEARCH", "1")
    wrapped = disco_jax.jit(fixed_lr, donate_argnums=0, store=tmp_path,
                            search_options=QUICK)
    want = jax.jit(fixed_lr)(make_params(), batch)
    _close(wrapped(make_params(), batch), want)
    searched = wrapped.last_run_info
    assert searched.mode == "searched"
    assert isinstance(wrapped._hot.fast, jax.stages.Compiled)
    for _ in range(2):  # the fast path: same program, donated buffers deleted
        donated = make_params()
        _close(wrapped(donated, batch), want)
        assert wrapped.last_run_info is searched
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
    # another signature (half the batch): a first call of its own, then the fast one
    monkeypatch.setenv("ENABLE_SEARCH", "0")
    half = jax.tree.map(lambda x: x[:16], batch)
    with pytest.warns(DiscoFallbackWarning, match="no stored plan"):
        _close(wrapped(make_params(), half), jax.jit(fixed_lr)(make_params(), half))
    assert wrapped.last_run_info.mode == "fallback"
    _close(wrapped(make_params(), half), jax.jit(fixed_lr)(make_params(), half))
    assert wrapped.last_run_info.mode == "fallback"
    _close(wrapped(make_params(), batch), want)  # back to the searched program
    assert wrapped.last_run_info is searched
    # under a transformation (a wrapper that donates nothing: a donated primal is gone
    # before the backward pass, with jax.jit too)
    plain = disco_jax.jit(fixed_lr, store=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DiscoFallbackWarning)
        plain(make_params(), batch)
    assert plain._hot is not None
    grads = jax.grad(lambda p: plain(p, batch)[1])(make_params())
    _close(grads, jax.grad(lambda p: fixed_lr(p, batch)[1])(make_params()))


def test_flag_unset_uses_a_stored_plan_silently_or_jax_jit(tmp_path, monkeypatch):
    step, make_params, batch = mlp_step()
    monkeypatch.delenv("ENABLE_SEARCH", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiscoFallbackWarning)
        plain = disco_jax.jit(step, static_argnums=2, store=tmp_path)
        plain(make_params(), batch, 0.1)
    assert plain.last_run_info.mode == "fallback"
    assert "ENABLE_SEARCH=1" in plain.last_run_info.reason


def test_transformations_and_decorator(tmp_path, monkeypatch):
    monkeypatch.setenv("ENABLE_SEARCH", "0")
    monkeypatch.setenv("DISCO_STORE", str(tmp_path))

    @disco_jax.jit(static_argnames="power")
    def f(x, power):
        return jnp.sum(x ** power)

    x = jnp.arange(4.0)
    with pytest.warns(DiscoFallbackWarning):
        assert float(f(x, power=2)) == 14.0
    assert f.last_run_info.mode == "fallback"
    # under jax.grad the wrapper gets tracers: plain jax.jit inside the trace
    np.testing.assert_allclose(jax.grad(lambda v: f(v, power=2))(x), 2 * x)
    np.testing.assert_allclose(jax.vmap(lambda v: f(v, power=3))(x[:, None]), x ** 3)


def test_not_a_data_parallel_step_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    wrapped = disco_jax.jit(lambda x: jnp.sin(x) * 2, store=tmp_path)
    with pytest.warns(DiscoFallbackWarning, match="no gradient all-reduce"):
        np.testing.assert_allclose(wrapped(jnp.ones(3)), jnp.sin(jnp.ones(3)) * 2)
    assert wrapped.last_run_info.mode == "fallback" and not any(tmp_path.iterdir())


def test_array_keyword_arguments_fall_back(tmp_path, monkeypatch):
    monkeypatch.setenv("ENABLE_SEARCH", "0")
    wrapped = disco_jax.jit(lambda x, y: x + y, store=tmp_path)
    with pytest.warns(DiscoFallbackWarning, match="pass them positionally"):
        np.testing.assert_allclose(wrapped(jnp.ones(2), y=jnp.ones(2)), 2 * jnp.ones(2))


@pytest.mark.parametrize("flag, budget, words", [
    ("yes", None, "ENABLE_SEARCH='yes'"),
    ("1", "soon", "DISCO_TIME_BUDGET='soon' is not a number"),
    ("1", "-1", "must be > 0"),
])
def test_bad_environment_is_a_clear_error(tmp_path, monkeypatch, flag, budget, words):
    monkeypatch.setenv("ENABLE_SEARCH", flag)
    if budget is not None:
        monkeypatch.setenv("DISCO_TIME_BUDGET", budget)
    step, make_params, batch = mlp_step()
    wrapped = disco_jax.jit(step, static_argnums=2, store=tmp_path)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        wrapped(make_params(), batch, 0.1)


def test_verification_allows_what_xla_reordering_moves_and_nothing_more():
    """A value beyond rtol/atol still agrees when XLA's own program with nothing fused
    moves that output as far (twice at most); a value farther off does not."""
    from disco_jax.verify import compare_outputs

    want = {"w": jnp.array([0.5, -0.046454333, 1.0]), "loss": jnp.array(2.0)}
    got = {"w": jnp.array([0.5, -0.046503823, 1.0]), "loss": jnp.array(2.0)}  # 4.9e-5 off
    ok, worst, detail = compare_outputs(got, want)
    assert not ok and "outputs [1] differ" in detail and worst == pytest.approx(4.949e-5,
                                                                                rel=1e-3)
    reordered = {"w": jnp.array([0.5, -0.046454333, 1.0000350]), "loss": jnp.array(2.0)}
    ok, _, detail = compare_outputs(got, want, reordered)
    assert ok and "what XLA's own reordering moves" in detail
    far = {"w": jnp.array([0.5, -0.046554333, 1.0]), "loss": jnp.array(2.0)}  # 1e-4 off
    ok, _, detail = compare_outputs(far, want, reordered)
    assert not ok and "outputs [1] differ" in detail
    ok, _, _ = compare_outputs(got, want, want)  # a reference that moved nothing
    assert not ok
