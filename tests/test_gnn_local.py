"""The local dataset of labeled fused ops, ``disco train-estimator --local`` and the one
choice of fused-op estimator (disco_estimator/gnn/local.py, disco_estimator/costs/fused_choice.py).

Real files, real processes (a writer killed with SIGKILL), real checkpoints and a real
search through ``disco_jax.jit``. The fine-tuning samples are the fused ops of random
plans of tiny vgg; their labels are made up (twice the fallback rule's time, or the
shipped model's own predictions) until ``tests/fixtures/context_samples.jsonl`` holds
fused ops timed in whole-program traces, which are then used instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from disco_estimator.costs.fused_choice import (
    DEFAULT_FUSED_ESTIMATOR,
    FUSED_ESTIMATOR_ENV,
    choose_fused_estimator,
)
from disco_estimator.gnn import checkpoint as ckpt_io
from disco_estimator.gnn.dataset import Sample, dataset_path
from disco_estimator.gnn.features import FusedSubgraph
from disco_estimator.gnn.local import (
    LOCAL_VERSION,
    add_local_samples,
    fingerprint_tag,
    held_out_split,
    load_local_samples,
    local_checkpoint_path,
    local_dataset_path,
)
from disco_jax.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONTEXT_FIXTURE = ROOT / "tests" / "fixtures" / "context_samples.jsonl"
SHIPPED = ckpt_io.pretrained("cpu")
FINGERPRINT = {"platform": "cpu", "test": "local"}


def _sample(key: str, time_s: float = 1e-5, kind: str = "plan") -> Sample:
    """A two-op fused sample (an add feeding a multiply, 4 KiB each)."""
    sub = FusedSubgraph(("add", "multiply"), ("f32", "f32"), np.array([2e-6, 3e-6]),
                        np.array([8192, 8192]), np.array([4096, 4096]),
                        np.array([False, True]), np.array([False, False]),
                        np.array([0], np.int32), np.array([1], np.int32), 8192, 4096)
    return Sample(key, "test", sub, time_s, time_s, time_s, 5, kind)


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --------------------------------------------------------------------------- the dataset


def test_paths_and_same_key_replacement(tmp_path) -> None:
    path = local_dataset_path(FINGERPRINT, tmp_path)
    tag = fingerprint_tag(FINGERPRINT)
    assert path == tmp_path / f"local-v{LOCAL_VERSION}-{tag}.jsonl"
    assert dataset_path(FINGERPRINT, tmp_path).name.endswith(f"-{tag}.jsonl")  # one rule
    assert local_checkpoint_path(FINGERPRINT, tmp_path) == tmp_path / f"local-{tag}.msgpack"
    assert load_local_samples(FINGERPRINT, tmp_path) == []
    assert add_local_samples([_sample("a", 1e-5), _sample("b"), _sample("a", 1e-5, "xla")],
                             FINGERPRINT, tmp_path) == 3
    # the same (kind, key): the newest label replaces the older one and is the newest
    assert add_local_samples([_sample("a", 2e-5), _sample("c")], FINGERPRINT, tmp_path) == 1
    got = load_local_samples(FINGERPRINT, tmp_path)
    assert [(s.kind, s.key) for s in got] == [("plan", "b"), ("xla", "a"), ("plan", "a"),
                                              ("plan", "c")]
    assert got[2].time_s == 2e-5 and got[1].time_s == 1e-5
    assert got[0].subgraph.to_json() == _sample("b").subgraph.to_json()


def test_the_bound_drops_the_oldest(tmp_path) -> None:
    assert add_local_samples([_sample(f"k{i}") for i in range(3)], FINGERPRINT, tmp_path,
                             limit=5) == 3
    assert add_local_samples([_sample(f"k{i}") for i in range(3, 7)], FINGERPRINT, tmp_path,
                             limit=5) == 4
    assert [s.key for s in load_local_samples(FINGERPRINT, tmp_path)] == \
        ["k2", "k3", "k4", "k5", "k6"]
    # a sample refreshed is the newest again: the oldest beside it go first
    add_local_samples([_sample("k2", 3e-5), _sample("k7")], FINGERPRINT, tmp_path, limit=5)
    assert [s.key for s in load_local_samples(FINGERPRINT, tmp_path)] == \
        ["k4", "k5", "k6", "k2", "k7"]
    with pytest.raises(ValueError, match="limit"):
        add_local_samples([_sample("x")], FINGERPRINT, tmp_path, limit=0)


def test_unreadable_lines_and_files_are_skipped(tmp_path) -> None:
    path = local_dataset_path(FINGERPRINT, tmp_path)
    good = json.dumps(_sample("good").to_json())
    old = json.dumps({**_sample("old").to_json(), "feature_version": -1})
    broken = json.dumps({**_sample("broken").to_json(), "subgraph": {"opcodes": 3}})
    path.write_text("\n".join([good, old, broken, "[1, 2]", "not json", good[:40]]) + "\n")
    assert [s.key for s in load_local_samples(FINGERPRINT, tmp_path)] == ["good"]
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary, not JSON lines")
    assert load_local_samples(FINGERPRINT, tmp_path) == []
    assert add_local_samples([_sample("new")], FINGERPRINT, tmp_path) == 1  # rewritten
    assert [s.key for s in load_local_samples(FINGERPRINT, tmp_path)] == ["new"]
    path.unlink()
    path.mkdir()  # a directory where the file should be
    assert load_local_samples(FINGERPRINT, tmp_path) == []


def test_held_out_split_is_by_key(tmp_path) -> None:
    samples = [_sample(f"{i:04x}") for i in range(400)]
    train, held = held_out_split(samples)
    assert sorted(s.key for s in train + held) == sorted(s.key for s in samples)
    assert 50 <= len(held) <= 110  # about a fifth
    assert held_out_split(samples) == (train, held)  # deterministic
    held_keys = {s.key for s in held}
    # each sample on the same side whatever else is in the set, and of any kind
    mixed = [_sample(s.key, kind="xla") for s in samples[::3]]
    assert {s.key for s in held_out_split(mixed)[1]} == held_keys & {s.key for s in mixed}
    assert {s.key for s in held_out_split(samples, seed=1)[1]} != held_keys
    assert held_out_split(samples, 0.0)[1] == [] and held_out_split(samples, 1.0)[0] == []


_WRITER = r"""
import json, sys
from disco_estimator.gnn.dataset import Sample
from disco_estimator.gnn.local import add_local_samples
template, directory, prefix, batch = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], \
    int(sys.argv[4])
for k in range(10 ** 6):
    add_local_samples([Sample.from_json({**template, "key": f"{prefix}{k:06d}-{j}"})
                       for j in range(batch)], {"platform": "cpu", "test": "killed"},
                      directory)
    print(k, flush=True)
"""


def test_a_killed_writer_leaves_a_whole_file(tmp_path) -> None:
    """A writer adding batches in a loop, killed with SIGKILL after a few writes (twice,
    at different moments): the file still parses line by line, entirely, and holds a
    whole number of batches."""
    fingerprint, batch = {"platform": "cpu", "test": "killed"}, 40
    path = local_dataset_path(fingerprint, tmp_path)
    template = json.dumps(_sample("t").to_json())
    for prefix, writes, pause in (("a", 3, 0.0), ("b", 2, 0.013)):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, template, str(tmp_path), prefix, str(batch)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
        try:
            for _ in range(writes):  # some whole writes, then a kill while it writes more
                assert proc.stdout.readline(), proc.stderr.read()
            time.sleep(pause)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=60)
        lines = path.read_text().splitlines()
        assert all(isinstance(json.loads(line), dict) for line in lines)
        samples = load_local_samples(fingerprint, tmp_path)
        assert len(samples) == len(lines) and len(samples) % batch == 0
        assert len({s.key for s in samples if s.key.startswith(prefix)}) >= writes * batch
    assert add_local_samples([_sample("after")], fingerprint, tmp_path) == 1  # not locked
    assert not list(tmp_path.glob(".*.tmp"))  # a killed writer's temporary file is removed


# --------------------------------------------------------------------------- the choice


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache directory (no local checkpoint) and no estimator setting."""
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(FUSED_ESTIMATOR_ENV, raising=False)
    return tmp_path / "cache"


def test_choice_by_default_environment_and_name(cache, monkeypatch) -> None:
    default = choose_fused_estimator()
    assert default.name == DEFAULT_FUSED_ESTIMATOR and default.why.startswith("default")
    monkeypatch.setenv(FUSED_ESTIMATOR_ENV, "gnn")
    gnn = choose_fused_estimator()
    assert gnn.name == "gnn" and gnn.why.startswith(f"${FUSED_ESTIMATOR_ENV}")
    assert gnn.checkpoint == str(SHIPPED) and gnn.sha256 == _sha256(SHIPPED)
    assert type(gnn.estimator).__name__ == "GnnFusedEstimator"
    assert gnn.to_json() == {"name": "gnn", "checkpoint": str(SHIPPED),
                             "sha256": _sha256(SHIPPED)}
    # an explicit name wins over the environment, both ways
    fallback = choose_fused_estimator("fallback", origin="--fused-estimator")
    assert fallback == ("fallback", None, None, None, "--fused-estimator: the fallback rule")
    monkeypatch.setenv(FUSED_ESTIMATOR_ENV, "fallback")
    assert choose_fused_estimator("gnn").checkpoint == str(SHIPPED)
    # no checkpoint for the platform: the fallback rule, saying why
    none = choose_fused_estimator("gnn", platform="cuda")
    assert none.name == "fallback" and "no checkpoint for gpu" in none.why
    with pytest.raises(ValueError, match="unknown fused-op estimator 'mlp'; valid: gnn, "
                                         "fallback"):
        choose_fused_estimator("mlp")
    monkeypatch.setenv(FUSED_ESTIMATOR_ENV, "GNN")
    with pytest.raises(ValueError, match=f"^{FUSED_ESTIMATOR_ENV}='GNN': use one of gnn"):
        choose_fused_estimator()


def test_choice_of_a_checkpoint(cache, tmp_path) -> None:
    mine = tmp_path / "mine.msgpack"
    mine.write_bytes(SHIPPED.read_bytes())
    chosen = choose_fused_estimator(checkpoint=mine, origin="--gnn")
    assert chosen.to_json() == {"name": "gnn", "checkpoint": str(mine),
                                "sha256": _sha256(SHIPPED)}
    assert chosen.why == "--gnn: the checkpoint given"
    with pytest.raises(ValueError, match="checkpoint is for the gnn estimator"):
        choose_fused_estimator("fallback", checkpoint=mine)
    with pytest.raises(FileNotFoundError):
        choose_fused_estimator(checkpoint=tmp_path / "missing.msgpack")
    junk = tmp_path / "junk.msgpack"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a GNN estimator checkpoint"):
        choose_fused_estimator(checkpoint=junk)


def test_choice_of_the_local_checkpoint(cache) -> None:
    """The local checkpoint is taken only when it loads and beat the shipped one."""
    from disco_estimator.ops import backend_fingerprint

    local = local_checkpoint_path(backend_fingerprint(1))
    local.parent.mkdir(parents=True)
    shipped = ckpt_io.load(SHIPPED)
    for content in (b"", b"\x93NUMPY corrupt", SHIPPED.read_bytes()[:5000]):
        local.write_bytes(content)
        assert choose_fused_estimator("gnn").checkpoint == str(SHIPPED)
    ckpt_io.save(local, ckpt_io.Checkpoint(shipped.params, shipped.config, {},
                                           {"beats_shipped": False}))
    assert choose_fused_estimator("gnn").checkpoint == str(SHIPPED)
    ckpt_io.save(local, ckpt_io.Checkpoint(shipped.params, shipped.config, {},
                                           {"beats_shipped": True}))
    chosen = choose_fused_estimator("gnn")
    assert chosen.checkpoint == str(local) and chosen.sha256 == _sha256(local)
    assert "local checkpoint beats the shipped one" in chosen.why
    # another platform family's costs do not take this backend's local checkpoint
    assert choose_fused_estimator("gnn", platform="cuda").name == "fallback"


def test_the_fallback_rule_imports_no_jax() -> None:
    code = ("import sys; from disco_estimator.costs.fused_choice import choose_fused_estimator; "
            "c = choose_fused_estimator('fallback'); assert c.estimator is None; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_store_record_names_the_estimator(tmp_path, monkeypatch) -> None:
    """``disco_jax.jit`` under ``ENABLE_SEARCH=1`` with ``$DISCO_FUSED_ESTIMATOR=gnn``:
    the stored record names the estimator, its checkpoint and the checkpoint's sha256."""
    import jax
    from step_helpers import mlp_step

    import disco_jax
    from disco_jax import store as st

    step, make_params, batch = mlp_step()
    monkeypatch.setenv("ENABLE_SEARCH", "1")
    monkeypatch.setenv(FUSED_ESTIMATOR_ENV, "gnn")
    expected = choose_fused_estimator(platform=jax.default_backend()).to_json()
    assert expected["name"] == "gnn" and len(expected["sha256"]) == 64
    quick = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
             "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}
    wrapped = disco_jax.jit(step, static_argnums=2, store=tmp_path, search_options=quick)
    wrapped(make_params(), batch, 0.1)
    info = wrapped.last_run_info
    assert info.mode == "searched", info.reason
    record = st.read_record(info.source_fingerprint, root=tmp_path)
    assert record.extra["fused_estimator"] == expected
    # a malformed setting is an error of the setting, not a silent fallback
    monkeypatch.setenv(FUSED_ESTIMATOR_ENV, "nope")
    again = disco_jax.jit(step, static_argnums=2, store=tmp_path / "other",
                          search_options=quick)
    with pytest.raises(ValueError, match=f"^{FUSED_ESTIMATOR_ENV}='nope'"):
        again(make_params(), batch, 0.1)


# --------------------------------------------------------------------------- --local


def _user_error(code: int, err: str) -> bool:
    return (code == 2 and err.startswith("disco: error: ") and err.count("\n") == 1
            and "Traceback" not in err)


def test_local_with_too_few_samples_or_with_generate(cache, capsys) -> None:
    from disco_estimator.ops import backend_fingerprint

    add_local_samples([_sample(f"k{i}") for i in range(5)], backend_fingerprint(1))
    code, out, err = _main("train-estimator", "--local")
    assert _user_error(code, err), err
    assert "5 local samples" in err and "disco_jax.jit" in err and "disco demo" in err
    assert out == "" and not local_checkpoint_path(backend_fingerprint(1)).exists()
    code, _, err = _main("train-estimator", "--local", "--out", "x.msgpack")
    assert _user_error(code, err) and "--local does not go with --out" in err, err
    code, _, err = _main("train-estimator", "--base", "x.msgpack")
    assert _user_error(code, err) and "--base needs --local" in err, err
    with pytest.raises(SystemExit) as exit_:
        main(["train-estimator", "--local", "--generate"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.fixture(scope="module")
def local_subgraphs() -> list[Sample]:
    """The samples fine-tuning is tested on: ``tests/fixtures/context_samples.jsonl``
    when it exists, else the distinct fused ops of random plans of tiny vgg (member
    times from the analytic model) labeled twice the fallback rule's time."""
    if CONTEXT_FIXTURE.is_file():
        return [Sample.from_json(json.loads(line))
                for line in CONTEXT_FIXTURE.read_text().splitlines() if line.strip()]
    import hlo_tools
    from disco_estimator.costs.cost_model import CostModel
    from disco_estimator.gnn.dataset import plan_groups
    from disco_estimator.gnn.evaluate import fallback_time
    from disco_estimator.gnn.features import canonical_key, subgraph_from_group
    from disco_jax import zoo

    step, args = zoo.get("vgg")(4, "tiny")
    graph = hlo_tools.device_graph(hlo_tools.parse(hlo_tools.extract(step, *args)))
    costs = CostModel("inproc4")  # analytic single-op times: nothing measured
    nodes, c = costs.node_costs(graph), costs.constants
    subs = {}
    for ms, cs in plan_groups(graph, 0, plans=8):
        sub = subgraph_from_group(graph, nodes, ms, cs)
        subs.setdefault(canonical_key(sub).hex(), sub)
    out = []
    for key, sub in subs.items():
        t = 2.0 * fallback_time(sub, c.kernel_launch_s, c.mem_s_per_byte)
        out.append(Sample(key, "vgg", sub, t, t, t, 5, "context"))
    return out


def _fine_tune(epochs: int) -> tuple[str, Path]:
    from disco_estimator.ops import backend_fingerprint

    code, out, err = _main("train-estimator", "--local", "--epochs", str(epochs))
    assert code == 0, err
    assert "loss" in err  # progress lines
    return out, local_checkpoint_path(backend_fingerprint(1))


def test_fine_tune_improves_held_out_local_loss(cache, local_subgraphs) -> None:
    from disco_estimator.ops import backend_fingerprint

    samples = local_subgraphs
    assert len(samples) >= 20
    assert add_local_samples(samples, backend_fingerprint(1)) == len(samples)
    out, path = _fine_tune(2)  # a few steps: kept only if they already beat the base
    assert ("checkpoint written to" in out) == path.exists(), out
    if path.exists():
        notes = ckpt_io.load(path).notes
        assert notes["held_out_loss"] < notes["base_held_out_loss"]
        path.unlink()
    else:
        assert "checkpoint not written" in out and str(SHIPPED) in out
    out, path = _fine_tune(30)
    assert f"checkpoint written to {path}" in out, out
    ck = ckpt_io.load(path)
    notes = ck.notes
    assert notes["beats_shipped"] is True and notes["samples"] == len(samples)
    assert notes["held_out_loss"] < notes["base_held_out_loss"]
    assert notes["base_sha256"] == _sha256(SHIPPED)
    assert ck.fingerprint == backend_fingerprint(1)
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()
            if ln.split()[:1] in (["base"], ["fine-tuned"])}
    assert float(rows["fine-tuned"][2]) < float(rows["base"][2])  # the held-out log loss
    assert all(r[-1].endswith("%") for r in rows.values())
    chosen = choose_fused_estimator("gnn")  # the estimator of --fused-estimator gnn
    assert chosen.checkpoint == str(path) and "local checkpoint" in chosen.why


def test_a_fine_tune_that_does_not_beat_the_base_is_not_kept(cache, local_subgraphs) -> None:
    """Labels that are the shipped model's own predictions: nothing beats its held-out
    loss of 0, so no checkpoint is written and the shipped one stays in use."""
    from disco_estimator.gnn.estimator import GnnFusedEstimator
    from disco_estimator.ops import backend_fingerprint

    own = GnnFusedEstimator.from_checkpoint(str(SHIPPED)).predict_subgraphs(
        [s.subgraph for s in local_subgraphs])
    add_local_samples([Sample(s.key, s.source, s.subgraph, float(t), float(t), float(t), 5,
                              "context") for s, t in zip(local_subgraphs, own)],
                      backend_fingerprint(1))
    out, path = _fine_tune(1)
    assert not path.exists() and "checkpoint not written" in out, out
    assert f"keeps using {SHIPPED}" in out
    assert not list(path.parent.glob("*.msgpack"))
