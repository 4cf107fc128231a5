"""The strategy store (disco_jax/store.py) and ``disco store``: atomic entries, keys that
cannot escape the directory, every reason an entry cannot be used, a writer killed
mid-write. Real jax programs on the CPU (4 host devices, tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from disco_jax import store as st
from disco_jax.cli import main as disco_main
from disco_jax.enactment import Enactment, build
from hlo_tools.jax_bridge import lowered_text

ROOT = Path(__file__).resolve().parents[1]


def _step(x, y):
    return jnp.sin(x) @ y + 1.0


ARGS = (jnp.ones((8, 8), jnp.float32), jnp.full((8, 4), 0.5, jnp.float32))


@pytest.fixture(scope="module")
def program():
    """(key, enactment) of a small real program: its own HLO, compiled as XLA would."""
    text = lowered_text(jax.jit(_step).lower(*ARGS))
    return st.source_fingerprint(text), Enactment.single("xla_default", text, exact=False)


def _save(root, key, enactment, **setup_changes):
    setup = st.Setup.current()._replace(**setup_changes)
    record = st.make_record(key, setup, enactment_fingerprint=enactment.fingerprint,
                            choice=enactment.name, hardware="inproc4", hardware_sha256="0" * 64,
                            predicted_s={"xla_default": 1e-3}, measured_s={"xla_default": 2e-3},
                            search={"evaluated": 3})
    return st.write_entry(key, record, enactment, root=root)


def test_a_record_is_typed_and_names_what_is_wrong():
    """``record.json`` reads into a :class:`~disco_jax.store.Record` and back unchanged;
    a missing or mistyped field is a ValueError that names it."""
    record = st.make_record("a" * 64, st.Setup.current(), enactment_fingerprint="f",
                            choice="plan_0", hardware="inproc4", hardware_sha256=None,
                            predicted_s={"plan_0": 1e-3}, measured_s={"plan_0": 2e-3},
                            search=None, extra={"route": {"name": "exact"}})
    data = json.loads(json.dumps(record.to_json()))
    assert st.Record.from_json(data) == record and data["route"] == {"name": "exact"}
    for field, value, words in [("choice", 3, "'choice' is not a string"),
                                ("setup", [], "'setup' is not an object"),
                                ("format", 0, "record format 0"),
                                ("measured_s", None, "'measured_s' is not an object")]:
        with pytest.raises(ValueError, match=words):
            st.Record.from_json({**data, field: value})
    with pytest.raises(ValueError, match="'key' is missing"):
        st.Record.from_json({k: v for k, v in data.items() if k != "key"})
    assert record._replace(verified={"ok": True, "enactment_sha256": "x"}).verdict is None


def test_round_trip_loads_and_runs(tmp_path, program):
    key, enactment = program
    path = _save(tmp_path, key, enactment)
    assert path == tmp_path / key and sorted(p.name for p in path.iterdir()) == [
        st.ENACTMENT_FILE, st.RECORD_FILE]
    lookup = st.load_entry(key, st.Setup.current(), root=tmp_path)
    assert lookup.reason == "" and lookup.entry.enactment == enactment
    record = lookup.entry.record
    assert record.key == key and record.to_json()["format"] == st.FORMAT
    assert record.setup.num_devices == jax.device_count() == 4
    assert record.measured_s == {"xla_default": 2e-3} and record.created
    run = build(lookup.entry.enactment, _step, ARGS)
    assert jnp.allclose(run(*ARGS), jax.jit(_step)(*ARGS))
    # nothing else is left in the store (no temporary directories)
    assert [p.name for p in tmp_path.iterdir()] == [key]


def test_replacing_an_entry(tmp_path, program):
    key, enactment = program
    _save(tmp_path, key, enactment)
    other = enactment._replace(name="again")
    _save(tmp_path, key, other)
    assert st.load_entry(key, None, root=tmp_path).entry.enactment.name == "again"
    assert [p.name for p in tmp_path.iterdir()] == [key]


@pytest.mark.parametrize("bad", ["../etc", "ab", "A" * 64, "g" * 64, "0" * 63 + "/",
                                 "0" * 65, ""])
def test_keys_are_hex_only(tmp_path, program, bad):
    _, enactment = program
    with pytest.raises(ValueError, match="not a store key"):
        st.check_key(bad)
    with pytest.raises(ValueError):
        _save(tmp_path, bad, enactment)
    with pytest.raises(ValueError):
        st.remove_entry(bad, root=tmp_path)
    assert not any(tmp_path.iterdir())


def test_store_directory_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("DISCO_STORE", str(tmp_path / "a"))
    assert st.store_dir() == tmp_path / "a"
    assert st.store_dir(tmp_path / "b") == tmp_path / "b"
    monkeypatch.delenv("DISCO_STORE")
    monkeypatch.setenv("DISCO_CACHE_DIR", str(tmp_path / "cache"))
    assert st.store_dir() == tmp_path / "cache" / "store"


def test_missing_entry(tmp_path, program):
    key, _ = program
    assert st.load_entry(key, st.Setup.current(), root=tmp_path) == st.Lookup(None,
                                                                              st.NOT_FOUND)
    assert st.list_entries(root=tmp_path / "nowhere") == []


def _reason(tmp_path, key):
    lookup = st.load_entry(key, st.Setup.current(), root=tmp_path)
    assert lookup.entry is None
    return lookup.reason


def test_truncated_record(tmp_path, program):
    key, enactment = program
    path = _save(tmp_path, key, enactment)
    data = (path / st.RECORD_FILE).read_bytes()
    (path / st.RECORD_FILE).write_bytes(data[: len(data) // 2])
    assert "corrupt entry: record.json cannot be read" in _reason(tmp_path, key)
    listed = st.list_entries(root=tmp_path)
    assert [(e.key, e.record) for e in listed] == [(key, None)] and "corrupt" in listed[0].problem


def test_truncated_or_changed_enactment(tmp_path, program):
    key, enactment = program
    path = _save(tmp_path, key, enactment)
    data = (path / st.ENACTMENT_FILE).read_bytes()
    (path / st.ENACTMENT_FILE).write_bytes(data[:-10])
    assert "does not match its record" in _reason(tmp_path, key)
    (path / st.ENACTMENT_FILE).unlink()
    assert "enactment.json cannot be read" in _reason(tmp_path, key)


@pytest.mark.parametrize("change, words", [
    ({"jax": "0.4.1"}, "jax version '0.4.1'"),
    ({"jaxlib": "0.4.1"}, "jaxlib version"),
    ({"num_devices": 8}, "device count 8"),
    ({"num_processes": 2}, "process count 2"),
    ({"backend": "gpu"}, "backend 'gpu'"),
])
def test_other_setup(tmp_path, program, change, words):
    key, enactment = program
    _save(tmp_path, key, enactment, **change)
    reason = _reason(tmp_path, key)
    assert words in reason and "ENABLE_SEARCH=1" in reason


def test_other_format_and_other_key(tmp_path, program):
    key, enactment = program
    path = _save(tmp_path, key, enactment)
    record = json.loads((path / st.RECORD_FILE).read_text())
    (path / st.RECORD_FILE).write_text(json.dumps({**record, "format": 99}))
    assert "record format 99" in _reason(tmp_path, key)
    (path / st.RECORD_FILE).write_text(json.dumps({**record, "key": "0" * 64}))
    assert "record.json is for key" in _reason(tmp_path, key)


def test_hlo_that_does_not_parse(tmp_path, program):
    key, enactment = program
    broken = enactment._replace(text=enactment.text.replace("ENTRY", "ENTRY_GONE", 1))
    _save(tmp_path, key, broken)
    assert "the stored HLO does not parse" in _reason(tmp_path, key)
    assert st.load_entry(key, None, root=tmp_path, check_hlo=False).entry is not None


def test_list_and_remove(tmp_path, program):
    key, enactment = program
    _save(tmp_path, key, enactment)
    (tmp_path / ".tmp-abandoned").mkdir()  # a dead writer's directory is not an entry
    (tmp_path / "notes.txt").write_text("not an entry")
    assert [e.key for e in st.list_entries(root=tmp_path)] == [key]
    assert st.remove_entry(key, root=tmp_path) is True
    assert st.remove_entry(key, root=tmp_path) is False
    assert st.list_entries(root=tmp_path) == []


def test_killed_writer_leaves_no_entry(tmp_path, program):
    """A real writer process, SIGKILLed with the whole entry written to its temporary
    directory and not yet renamed: no entry loads, none is listed, and the next writer
    succeeds."""
    key, enactment = program
    src = tmp_path / "enactment.json"
    src.write_text(json.dumps(enactment.to_json()))
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "jit_killed_writer.py"),
                             str(store), key, str(src)], stdout=subprocess.PIPE, text=True,
                            cwd=str(ROOT))
    try:
        assert proc.stdout.readline().strip() == "READY"
        # the entry is complete in the writer's temporary directory...
        (tmp,) = [p for p in store.iterdir() if p.name.startswith(".tmp-")]
        assert sorted(p.name for p in tmp.iterdir()) == [st.ENACTMENT_FILE, st.RECORD_FILE]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    # ... but it never became an entry
    assert st.load_entry(key, st.Setup.current(), root=store).reason == st.NOT_FOUND
    assert st.list_entries(root=store) == []
    _save(store, key, enactment)
    assert st.load_entry(key, st.Setup.current(), root=store).entry is not None


# --------------------------------------------------------------------------- disco store


def test_cli_list_show_rm(tmp_path, program, capsys):
    key, enactment = program
    _save(tmp_path, key, enactment)
    assert disco_main(["store", "list", "--store", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 entries" in out and key[:12] in out and "xla_default" in out and "2.00 ms" in out
    header = next(line for line in out.splitlines() if "key" in line)
    assert header.split() == ["key", "step", "setup", "choice", "measured", "vs", "XLA", "vs",
                              "buckets", "created", "verified"]
    assert "1.00x" in out and "not yet" in out  # XLA's default over itself; never verified
    assert disco_main(["store", "show", key[:8], "--store", str(tmp_path), "--check"]) == 0
    out = capsys.readouterr().out
    assert key in out and "usable here" in out and "hardware file: inproc4" in out
    assert disco_main(["store", "show", key, "--store", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["record"]["key"] == key
    assert disco_main(["store", "rm", key[:6], "--store", str(tmp_path)]) == 0
    assert f"removed {key}" in capsys.readouterr().out
    assert disco_main(["store", "list", "--store", str(tmp_path)]) == 0
    assert "no entries" in capsys.readouterr().out


def test_cli_store_from_environment(tmp_path, program, capsys, monkeypatch):
    key, enactment = program
    _save(tmp_path, key, enactment)
    monkeypatch.setenv("DISCO_STORE", str(tmp_path))
    assert disco_main(["store", "list", "--json"]) == 0
    assert [e["key"] for e in json.loads(capsys.readouterr().out)] == [key]


@pytest.mark.parametrize("argv, words", [
    (["store", "show", "../../etc"], "is not a key"),
    (["store", "show", "abcd"], "no entry abcd"),
    (["store", "rm"], "give the keys to remove, or --all"),
])
def test_cli_user_errors(tmp_path, capsys, argv, words):
    assert disco_main([*argv, "--store", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("disco: error:") and words in err and "Traceback" not in err


def test_list_rows_say_the_step_speedups_and_verdict(tmp_path, program):
    """A searched entry's row: the step's qualified name, the speed-up of the choice over
    XLA's default and the best bucketing measured beside it, the verification."""
    from disco_jax.cli.store import list_rows

    key, enactment = program
    record = st.make_record(
        key, st.Setup.current(), enactment_fingerprint=enactment.fingerprint,
        choice="plan_0", hardware="inproc4", hardware_sha256=None, predicted_s={},
        measured_s={"xla_default": 4e-3, "bucketed_1MiB": 3e-3, "bucketed_4MiB": 3.5e-3,
                    "plan_0": 2e-3},
        search=None, extra={"function": "train.step", "source": "train.py:12"})
    st.write_entry(key, record, enactment, root=tmp_path)
    written = st.read_record(key, root=tmp_path)
    st.record_verification(key, enactment_sha256=written.enactment_sha256, ok=True,
                           max_abs_diff=0.0, detail="", root=tmp_path)
    (row,) = list_rows(st.list_entries(root=tmp_path))
    assert (row["step"], row["choice"], row["vs XLA"], row["vs buckets"], row["verified"]) \
        == ("train.step", "plan_0", "2.00x", "1.50x", "yes")
