"""Store safety: an untrusted, stale, tampered, raced or
copied store never runs something the user did not ask for.

One real search (``ENABLE_SEARCH=1``, a small shard_map MLP step on 4 host devices, a
static learning rate of 0.125, ``donate_argnums=0``) makes the entry every test starts
from; each test edits a copy of it.

* loading reads JSON and HLO text only: a record or enactment that is a live pickle, or
  fields holding Python code, are refused or kept as plain strings, and a load raises no
  ``exec``/``compile``/``import``/``pickle.find_class``/process audit event and imports no
  module;
* no key and no symbolic link leads outside the store;
* unusable entries (garbage, a JSON array, another backend or process count, a changed
  ``enactment.json``, a symlinked entry) fall back to ``jax.jit`` with a warning and train
  exactly like it (what tests/test_jit.py covers already is not repeated);
* a plan is verified against ``jax.jit`` before it is first trusted: a tampered constant
  (hash updated so the store accepts it) is caught, refused and recorded, and a later
  wrapper refuses it without running it; a good plan is verified once, never again;
* two real processes writing different programs under one key at once never leave a
  failed write, a gap or a mixed entry;
* a plan from another device kind, device count, CPU or hardware file is refused with a
  warning naming the difference.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from step_helpers import mlp_step

import disco_jax
from disco_jax import store as st
from disco_jax.enactment import Enactment
from disco_jax.jit import DiscoFallbackWarning

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "store_safety_worker.py"
QUICK = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
         "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}
LR = 0.125  # exactly representable: the HLO text holds constant(0.125)
WRITES = 60  # per writer in the race


# --------------------------------------------------------------------------- the program


class Searched(NamedTuple):
    """The searched entry and what the tests run."""

    store: Path
    key: str
    step: Any
    params: Any
    batch: Any
    want: list  # jax.jit's (params, loss) of 3 training steps, as numpy


def _wrap(step, store, **kwargs):
    return disco_jax.jit(step, static_argnums=2, donate_argnums=0, store=store, **kwargs)


def _train(fn, make_params, batch, steps=3) -> list:
    params, out = make_params(), []
    for _ in range(steps):
        params, loss = fn(params, batch, LR)
        out.append(jax.tree.map(np.array, (params, loss)))  # copies: params get donated
    return out


def _like_jax_jit(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A real ENABLE_SEARCH=1 search of the step; its store holds one entry."""
    step, make_params, batch = mlp_step()
    store = tmp_path_factory.mktemp("searched") / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENABLE_SEARCH", "1")
        wrapped = _wrap(step, store, search_options=QUICK)
        wrapped(make_params(), batch, LR)
    info = wrapped.last_run_info
    assert info.mode == "searched", info.reason
    want = _train(jax.jit(step, static_argnums=2), make_params, batch)
    return Searched(store, info.source_fingerprint, step, make_params, batch, want)


def _copy(searched: Searched, dst: Path) -> Path:
    """A store holding a copy of the searched entry; returns the entry's directory."""
    shutil.copytree(searched.store / searched.key, dst / searched.key)
    return dst / searched.key


def _edit_record(entry: Path, edit) -> None:
    record = json.loads((entry / st.RECORD_FILE).read_text())
    edit(record)
    (entry / st.RECORD_FILE).write_text(json.dumps(record))


def _set_enactment_bytes(entry: Path, data: bytes) -> None:
    """Replaces enactment.json and updates the record's hashes of it, so the store's own
    integrity check accepts the new file."""
    (entry / st.ENACTMENT_FILE).write_bytes(data)

    def edit(record):
        record["enactment_sha256"] = hashlib.sha256(data).hexdigest()
        try:
            record["enactment_fingerprint"] = Enactment.from_json(json.loads(data)).fingerprint
        except (ValueError, UnicodeDecodeError):  # not an enactment: leave it
            pass

    _edit_record(entry, edit)


def _set_text(entry: Path, change) -> None:
    enactment = json.loads((entry / st.ENACTMENT_FILE).read_text())
    enactment["text"] = change(enactment["text"])
    _set_enactment_bytes(entry, json.dumps(enactment, sort_keys=True).encode())


def _tamper(text: str) -> str:
    """The learning-rate constant doubled: still parses and compiles, computes wrong."""
    new, count = re.subn(r"constant\(0\.125\)", "constant(0.25)", text)
    assert count >= 1, "no learning-rate constant in the stored HLO"
    return new


def _tree_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _reason(store: Path, key: str) -> str:
    lookup = st.load_entry(key, st.Setup.current(), root=store, check_hardware=True)
    assert lookup.entry is None
    return lookup.reason


# --------------------------------------------------------------------------- item 2


class _Exploit:
    """Unpickling it runs code: it writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


_DANGEROUS = ("exec", "compile", "import", "pickle.find_class", "marshal.loads",
              "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
              "subprocess.Popen", "ctypes.dlopen")
_RECORDINGS: list[list[str]] = []
_HOOKED: list[bool] = []


def _audit(event: str, args: tuple) -> None:
    if _RECORDINGS and event.startswith(_DANGEROUS):
        for events in _RECORDINGS:
            events.append(event)


def _load_watched(store: Path, key: str) -> tuple[st.Lookup, list[str], set[str]]:
    """load_entry with CPython's audit hooks watching: the dangerous events it raised and
    the modules it imported."""
    if not _HOOKED:
        sys.addaudithook(_audit)  # cannot be removed: it records only inside this function
        _HOOKED.append(True)
    setup = st.Setup.current()
    before, events = set(sys.modules), []
    _RECORDINGS.append(events)
    try:
        lookup = st.load_entry(key, setup, root=store, check_hardware=True)
    finally:
        _RECORDINGS.remove(events)
    return lookup, events, set(sys.modules) - before


def test_loading_executes_and_imports_nothing(searched, tmp_path):
    key = searched.key
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Exploit(marker))
    probe = tmp_path / "payload.pickle"
    probe.write_bytes(payload)
    # the payload is live: unpickling it (in another process) runs its code
    subprocess.run([sys.executable, "-c", "import pickle, sys; "
                    "pickle.loads(open(sys.argv[1], 'rb').read())", str(probe)],
                   check=True, timeout=60)
    assert marker.read_text() == "pwned"
    marker.unlink()
    code = f"__import__('os').system('touch {marker}')"
    lookup, _, _ = _load_watched(searched.store, key)  # warm-up: lazy imports happen here
    assert lookup.entry is not None, lookup.reason

    def code_fields(entry):
        _edit_record(entry, lambda r: r.update(
            choice=code, note=code, calibration={"__reduce__": code, "py/object": "os.system",
                                                 "pickle": base64.b64encode(payload).decode()}))

    variants = {
        "record is a pickle": (lambda e: (e / st.RECORD_FILE).write_bytes(payload),
                               "corrupt entry: record.json cannot be read"),
        "enactment is a pickle": (lambda e: _set_enactment_bytes(e, payload),
                                  "corrupt entry: enactment.json"),
        "HLO text is Python": (lambda e: _set_text(e, lambda _: code),
                               "the stored HLO does not parse"),
        "record fields hold code": (code_fields, None),
    }
    for name, (edit, words) in variants.items():
        store = tmp_path / name.replace(" ", "_")
        edit(_copy(searched, store))
        lookup, events, imported = _load_watched(store, key)
        assert events == [] and imported == set(), (name, events, imported)
        assert not marker.exists(), name
        if words is None:  # plain data: the strings come back as strings
            record = lookup.entry.record
            assert record.choice == record.extra["note"] == code
            assert base64.b64decode(record.extra["calibration"]["pickle"]) == payload
        else:
            assert lookup.entry is None and words in lookup.reason, (name, lookup.reason)


def test_keys_and_links_never_leave_the_store(searched, tmp_path):
    key = searched.key
    good = st.load_entry(key, None, root=searched.store).entry
    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir()
    _copy(searched, outside)  # a valid entry outside the store
    snapshot = _tree_bytes(outside)
    # a fingerprint is always a key, whatever the program text holds
    assert st.check_key(st.source_fingerprint("../../etc/passwd\0/" * 3))
    for bad in ("../outside/" + key, str(outside / key), "/" + key[1:],
                key + "/../../outside/" + key, "..", key.upper(), key + "\0", "./" + key[2:]):
        assert "not a store key" in st.load_entry(bad, None, root=store).reason
        for call in (partial(st.read_record, bad, root=store),
                     partial(st.write_entry, bad, good.record, good.enactment, root=store),
                     partial(st.remove_entry, bad, root=store),
                     partial(st.record_verification, bad, enactment_sha256="0" * 64,
                             ok=False, max_abs_diff=None, root=store)):
            with pytest.raises(ValueError, match="not a store key"):
                call()
    assert list(store.iterdir()) == [] and _tree_bytes(outside) == snapshot

    # an entry that is a symbolic link to a directory outside the store
    (store / key).symlink_to(outside / key, target_is_directory=True)
    assert "is a symbolic link" in _reason(store, key)
    with pytest.raises(ValueError, match="symbolic link"):
        st.read_record(key, root=store)
    (listed,) = st.list_entries(root=store)
    assert listed.record is None and "symbolic link" in listed.problem
    assert st.record_verification(key, enactment_sha256=good.record.enactment_sha256,
                                  ok=False, max_abs_diff=1.0, root=store) is None
    assert st.remove_entry(key, root=store) is True  # the link goes, not what it points to
    assert not os.path.lexists(store / key) and _tree_bytes(outside) == snapshot
    (store / key).symlink_to(outside / key, target_is_directory=True)
    st.write_entry(key, good.record, good.enactment, root=store)  # replaces the link
    assert (store / key).is_dir() and not (store / key).is_symlink()
    assert [p.name for p in store.iterdir()] == [key] and _tree_bytes(outside) == snapshot
    assert st.load_entry(key, st.Setup.current(), root=store).entry is not None
    # a file of a real entry that is a symbolic link
    (store / key / st.RECORD_FILE).unlink()
    (store / key / st.RECORD_FILE).symlink_to(outside / key / st.RECORD_FILE)
    reason = _reason(store, key)
    assert "record.json cannot be read" in reason and "symbolic link" in reason


def _garbage(entry):
    (entry / st.RECORD_FILE).write_bytes(bytes(range(256)) * 4)


def _json_array(entry):
    (entry / st.RECORD_FILE).write_text("[1, 2, 3]")


def _changed_enactment(entry):
    with open(entry / st.ENACTMENT_FILE, "ab") as fh:
        fh.write(b" ")


def _setup(entry, **changes):
    _edit_record(entry, lambda r: r["setup"].update(changes))


def _hardware(entry, **changes):
    _edit_record(entry, lambda r: r["hardware"].update(changes))


def _symlinked(entry):
    outside = entry.parent.parent / "outside"
    outside.mkdir()
    entry.rename(outside / entry.name)
    entry.symlink_to(outside / entry.name, target_is_directory=True)


def _fell_back(searched, store, words, monkeypatch):
    """A new wrapper on ``store`` under ENABLE_SEARCH=0 warns with ``words``, runs plain
    jax.jit and trains exactly like it."""
    monkeypatch.setenv("ENABLE_SEARCH", "0")
    wrapped = _wrap(searched.step, store)
    with pytest.warns(DiscoFallbackWarning, match=re.escape(words)) as caught:
        got = _train(wrapped, searched.params, searched.batch)
    assert any("running plain jax.jit" in str(w.message) for w in caught)
    info = wrapped.last_run_info
    assert info.mode == "fallback" and words in info.reason, info
    assert info.source_fingerprint == searched.key
    _like_jax_jit(got, searched.want)
    return info


@pytest.mark.parametrize("edit, words", [
    (_garbage, "corrupt entry: record.json cannot be read"),
    (_json_array, "record.json is not a JSON object"),
    (partial(_setup, backend="gpu"), "made with backend 'gpu'"),
    (partial(_setup, num_processes=2), "made with process count 2"),
    (_changed_enactment, "enactment.json does not match its record"),
    (_symlinked, "is a symbolic link"),
], ids=["garbage", "json_array", "backend", "processes", "changed_enactment", "symlink"])
def test_unusable_entries_train_like_jax_jit(searched, tmp_path, monkeypatch, edit, words):
    edit(_copy(searched, tmp_path / "store"))
    _fell_back(searched, tmp_path / "store", words, monkeypatch)


# --------------------------------------------------------------------------- item 3


def test_verification_refuses_a_tampered_plan(searched, tmp_path, monkeypatch):
    store = tmp_path / "store"
    entry = _copy(searched, store)
    record = st.read_record(searched.key, root=store)
    assert record.verified is None  # a search does not verify; the first load does
    # an earlier verdict for the original program does not carry over to another one
    assert st.record_verification(searched.key, enactment_sha256=record.enactment_sha256,
                                  ok=True, max_abs_diff=0.0, root=store)["ok"] is True
    _set_text(entry, _tamper)
    lookup = st.load_entry(searched.key, st.Setup.current(), root=store, check_hardware=True)
    assert lookup.entry is not None, lookup.reason  # the store itself accepts it ...
    assert lookup.entry.record.verdict is None  # ... as never verified

    info = _fell_back(searched, store, "verification refused the stored plan", monkeypatch)
    assert "does not compute what jax.jit computes" in info.reason
    assert "differ" in info.reason and "refused in the store" in info.reason
    record = st.read_record(searched.key, root=store)
    verdict = record.verified
    assert verdict["ok"] is False and verdict["max_abs_diff"] > 1e-3 and verdict["when"]
    assert verdict["enactment_sha256"] == record.enactment_sha256
    assert record.verdict == verdict

    # a later wrapper (or process) does not trust it either, and does not run it again
    inode = (entry / st.RECORD_FILE).stat().st_ino
    info = _fell_back(searched, store, "the stored plan failed its verification against "
                      "jax.jit", monkeypatch)
    assert (entry / st.RECORD_FILE).stat().st_ino == inode
    assert "failed its verification" in _reason(store, searched.key)


def test_verification_passes_once_without_donating(searched, tmp_path, monkeypatch):
    store = tmp_path / "store"
    entry = _copy(searched, store)
    monkeypatch.setenv("ENABLE_SEARCH", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiscoFallbackWarning)
        wrapped = _wrap(searched.step, store)
        donated = searched.params()
        first = wrapped(donated, searched.batch, LR)
        # verification ran both programs on the same buffers; only the real call donated
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
        _like_jax_jit(jax.tree.map(np.asarray, first), searched.want[0])
        info = wrapped.last_run_info
        assert info.mode == "stored" and info.reason == "", info
        _like_jax_jit(_train(wrapped, searched.params, searched.batch), searched.want)
        record = st.read_record(searched.key, root=store)
        verdict = record.verified
        assert verdict["ok"] is True and 0.0 <= verdict["max_abs_diff"] <= 1e-5
        assert record.verdict == verdict
        # a later wrapper trusts the verdict: no second verification (record untouched)
        inode = (entry / st.RECORD_FILE).stat().st_ino
        again = _wrap(searched.step, store)
        _like_jax_jit(_train(again, searched.params, searched.batch), searched.want)
    assert again.last_run_info.mode == "stored"
    assert again.last_run_info.hlo_fingerprint == info.hlo_fingerprint
    assert (entry / st.RECORD_FILE).stat().st_ino == inode


# --------------------------------------------------------------------------- item 5


def _whole(entry: st.Entry) -> None:
    """The record and the enactment of an entry were written together."""
    record, enactment = entry.record, entry.enactment
    assert record.choice == enactment.name, (record.choice, enactment.name)
    assert record.enactment_fingerprint == enactment.fingerprint
    verdict = record.verified
    if verdict is not None:
        assert verdict["enactment_sha256"] == record.enactment_sha256
        assert verdict["detail"] == enactment.name


def test_concurrent_writers_never_mix_an_entry(searched, tmp_path):
    """Two real processes write different programs under one key at the same time, each
    recording a verdict after each write, while this process reads the entry in a loop:
    no write fails, no read after the first write misses the entry, every read (and the
    end state) is one writer's record with that writer's enactment and verdict."""
    key = searched.key
    original = st.load_entry(key, None, root=searched.store).entry.enactment
    programs = {"writer_a": original, "writer_b": original._replace(text=_tamper(
        original.text))}
    store, go = tmp_path / "store", tmp_path / "go"
    procs = []
    try:
        for name, enactment in programs.items():
            src = tmp_path / f"{name}.json"
            src.write_text(json.dumps(enactment.to_json()))
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), str(store), key, str(src), name, str(WRITES),
                 str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                cwd=str(ROOT)))
        for proc in procs:
            assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-2000:]
        go.touch()
        seen: set[str] = set()
        reads = 0
        while any(proc.poll() is None for proc in procs):
            lookup = st.load_entry(key, None, root=store, check_hlo=False)
            if lookup.entry is None:
                assert lookup.reason == st.NOT_FOUND and not seen, lookup.reason
                continue
            _whole(lookup.entry)
            seen.add(lookup.entry.enactment.name)
            reads += 1
        outs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert out.split()[:2] == ["DONE", str(WRITES)], out
    final = st.load_entry(key, st.Setup.current(), root=store)
    assert final.entry is not None, final.reason
    _whole(final.entry)
    assert final.entry.record.verdict["ok"] is True  # the last writer's verdict
    assert [p.name for p in store.iterdir()] == [key]  # no temporary or trash left
    assert reads > 0 and seen <= set(programs)


# --------------------------------------------------------------------------- item 6


@pytest.mark.parametrize("edit, words", [
    (partial(_setup, device_kind="NVIDIA H100 80GB HBM3"),
     "made with device kind 'NVIDIA H100 80GB HBM3', this process has 'cpu'"),
    (partial(_setup, num_devices=8), "made with device count 8, this process has 4"),
    (partial(_setup, cpu="Intel(R) Xeon(R) Platinum 8480+"),
     "made with CPU 'Intel(R) Xeon(R) Platinum 8480+', this process has"),
    (partial(_hardware, sha256="f" * 64),
     "hardware file 'inproc4' sha256 ffffffffffff, this machine's 'inproc4' has sha256"),
    (partial(_hardware, name="cluster_b200x64"),
     "hardware file 'cluster_b200x64' (sha256"),
], ids=["device_kind", "device_count", "cpu", "hardware_file_hash", "hardware_file_name"])
def test_plan_from_another_machine_is_refused(searched, tmp_path, monkeypatch, edit, words):
    assert st.read_record(searched.key, root=searched.store).hardware.name == "inproc4"
    edit(_copy(searched, tmp_path / "store"))
    info = _fell_back(searched, tmp_path / "store", words, monkeypatch)
    assert "ENABLE_SEARCH=1" in info.reason
