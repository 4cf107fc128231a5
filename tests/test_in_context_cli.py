"""A module given only as HLO text, profiled in context: ``compile_module`` for
``FromText`` (the program and its inputs, no train step), and ``disco simulate`` /
``disco optimize`` taking the in-context profile themselves -- or saying in one line why
not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import hlo_tools
from disco_jax import zoo
from disco_jax.cli import main
from disco_jax.cli.options import in_context_line
from hlo_tools.devices import module_devices, parse_groups
from hlo_tools.jax_bridge import (
    CompileOptions,
    DevicesUnavailableError,
    FromText,
    HloCompileError,
    InPlaceOf,
    compile_module,
)

#: The options profile_module_in_context compiles with (as enacted plans run).
PLAN = CompileOptions(exact=True, library=True)

SMALL = """HloModule small

ENTRY main {
  a = f32[4,3]{1,0} parameter(0)
  b = s32[5]{0} parameter(1)
  n = f32[4,3]{1,0} negate(a)
  c = s32[5]{0} add(b, b)
  ROOT t = (f32[4,3]{1,0}, s32[5]{0}) tuple(n, c)
}
"""


@pytest.fixture(scope="module")
def vgg(tmp_path_factory):
    step, args = zoo.get("vgg")(4, "tiny")
    text = hlo_tools.extract(step, *args)
    path = tmp_path_factory.mktemp("hlo") / "vgg.hlo"
    path.write_text(text)
    return step, args, text, path


def test_compile_from_text_runs_the_module_as_in_place_of_the_step(vgg):
    step, args, text, _ = vgg
    assert module_devices(hlo_tools.parse(text)) == 4
    run, inputs = compile_module(text, FromText(), PLAN)
    assert [x.shape for x in inputs] == [a.shape for a in jax.tree.leaves(args)]
    assert [x.sharding.is_fully_replicated for x in inputs][-2:] == [False, False]  # batch
    floats = np.asarray(inputs[0])
    labels = np.asarray(inputs[-1])
    assert floats.std() > 0.3 and labels.dtype == np.int32 and 0 <= labels.min()
    assert labels.max() < 8 and len(set(labels.tolist())) > 1
    got = jax.tree.leaves(run(*inputs))
    ref = compile_module(text, InPlaceOf(step, args), PLAN)
    want = jax.tree.leaves(ref(*jax.tree.unflatten(jax.tree.structure(args), inputs)))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


def test_compile_from_text_inputs_are_seeded_and_errors_are_clear():
    first, again = compile_module(SMALL, FromText(), PLAN), compile_module(SMALL, FromText(), PLAN)
    for x, y in zip(first.inputs, again.inputs):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    other = compile_module(SMALL, FromText(seed=1), PLAN).inputs
    assert not np.array_equal(np.asarray(first.inputs[0]), np.asarray(other[0]))
    neg, doubled = first.run(*first.inputs)
    np.testing.assert_array_equal(np.asarray(neg), -np.asarray(first.inputs[0]))
    np.testing.assert_array_equal(np.asarray(doubled), 2 * np.asarray(first.inputs[1]))
    assert compile_module(SMALL, FromText(inputs=False), PLAN).inputs == ()

    wide = SMALL.replace("parameter(0)", "parameter(0), sharding={devices=[8,1]<=[8]}")
    assert module_devices(hlo_tools.parse(wide)) == 8
    with pytest.raises(DevicesUnavailableError, match="runs on 8 devices, this process has 4"):
        compile_module(wide, FromText(), PLAN)
    compiled = SMALL.replace("HloModule small", "HloModule small, is_scheduled=true")
    with pytest.raises(HloCompileError, match="post-optimization"):
        compile_module(compiled, FromText(), PLAN)


def test_replica_groups_in_every_form_and_the_devices_they_name():
    assert parse_groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert parse_groups("{}") == [] and parse_groups("{{}}") == [[]]
    assert parse_groups("{{0,4},{4,0}}") == [[0, 4], [4, 0]]  # source_target_pairs
    assert parse_groups("[2,2]<=[4]") == [[0, 1], [2, 3]]
    assert parse_groups("[1,4]<=[4]") == [[0, 1, 2, 3]]
    assert parse_groups("[2,2]<=[2,2]T(1,0)") == [[0, 2], [1, 3]]
    assert parse_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parse_groups("[2,4]<=[2,2,2]T(2,1,0)") == [[0, 4, 2, 6], [1, 5, 3, 7]]
    # mesh-axes form (newer XLA): the groups jax 0.10.2 prints as lists for the same psums
    mesh = "mesh['a'=2,'b'=2,'c'=2]"
    assert parse_groups(f"{mesh} {{'c','a'}}") == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert parse_groups(f"{mesh} {{'b'}}") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert parse_groups(f"{mesh} {{'a','b','c'}}") == [list(range(8))]
    for bad in ("[2,2]<=[8]", "[2,2]<=[2,2]T(0,0)", "nope", f"{mesh} {{'x'}}"):
        with pytest.raises(ValueError):
            parse_groups(bad)
    module = hlo_tools.parse(SMALL.replace(
        "c = s32[5]{0} add(b, b)",
        "c = s32[5]{0} collective-permute(b), channel_id=1, source_target_pairs={{0,5},{5,0}}"))
    assert module_devices(module) == 6
    maximal = SMALL.replace("HloModule small", "HloModule small, num_partitions=2").replace(
        "n = f32[4,3]{1,0} negate(a)", "n = f32[4,3]{1,0} negate(a), sharding={maximal device=2}")
    assert module_devices(hlo_tools.parse(maximal)) == 3


def test_simulate_profiles_in_context_and_reports_the_fit(vgg, capsys):
    *_, path = vgg
    assert main(["simulate", str(path), "--no-bench", "--json"]) == 0
    captured = capsys.readouterr()
    assert "note" not in captured.err, captured.err
    report = json.loads(captured.out)
    ic = report["in_context"]
    assert ic["profiled"] and ic["devices"] == 4 and ic["platform"] == "cpu"
    assert ic["d_s"] >= 0 and ic["compute_scale"] > 0 and ic["saving_share"] > 0
    assert ic["wall_s"]["xla_default"] > 0  # XLA's default, measured too
    assert report["cost_model"]["saving_share"] == ic["saving_share"]
    assert report["cost_model"]["overlap"] == ic["overlap"]
    assert "xla_combined" not in ic["wall_s"]  # one process: not measured
    assert ic["d_tuple_extra_s"] == 0.0
    for name in ("no_fusion", "one_bucket"):
        assert ic["wall_s"][name] > 0
        assert ic["predicted_s"][name] == pytest.approx(ic["wall_s"][name], rel=0.1)
    assert report["iteration_s"] == pytest.approx(ic["predicted_s"]["no_fusion"], rel=1e-6)
    assert report["time_sources"].get("profile", 0) > 0
    assert report["cost_model"]["allreduce"]["d_s"] == pytest.approx(ic["d_s"])
    line = in_context_line(ic)
    assert line.startswith("in context on 4 cpu devices: measured no fusion") and "fit" in line


def test_optimize_profiles_in_context(vgg, tmp_path, capsys):
    *_, path = vgg
    out = tmp_path / "opt.hlo"
    assert main(["optimize", str(path), "-o", str(out), "--no-bench", "--time-budget", "1",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["in_context"]["profiled"] and report["predicted_s"] > 0
    assert hlo_tools.parse(out.read_text())


def _disco_on_two_devices(*argv):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return subprocess.run([sys.executable, "-m", "disco_jax", *argv], capture_output=True,
                          text=True, timeout=300, env=env)


def test_too_few_devices_fall_back_with_a_note(vgg):
    *_, path = vgg
    proc = _disco_on_two_devices("simulate", str(path), "--no-bench", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "disco: note: not profiling in context: the module runs on 4 devices, this "
        "process has 2 local cpu devices"), proc.stderr
    report = json.loads(proc.stdout)
    assert report["iteration_s"] > 0
    assert not report["in_context"]["profiled"]
    assert "runs on 4 devices" in report["in_context"]["reason"]

    forced = _disco_on_two_devices("simulate", str(path), "--no-bench", "--in-context")
    assert forced.returncode == 2 and forced.stdout == ""
    assert forced.stderr.startswith("disco: error: --in-context: the module runs on 4")
    assert "Traceback" not in forced.stderr


def test_the_cli_gives_itself_the_module_s_host_devices(vgg):
    """Without XLA_FLAGS the CLI process starts with as many host devices as the module
    runs on (a note says so), and profiles it in context."""
    *_, path = vgg
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "disco_jax", "simulate", str(path),
                           "--no-bench", "--json"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"disco: note: {path} runs on 4 devices: this process has 4 host CPU devices "
        "(XLA_FLAGS=--xla_force_host_platform_device_count=4)"]
    report = json.loads(proc.stdout)
    assert report["in_context"]["profiled"] and report["in_context"]["devices"] == 4


def test_optimize_refuses_a_compiled_module(tmp_path, capsys):
    """A post-optimization module: one line that says what to give instead, no output."""
    compiled = jax.jit(lambda x: (x * 2).sum()).lower(np.ones(8, np.float32)).compile()
    path = tmp_path / "post.hlo"
    path.write_text(compiled.as_text())
    out = tmp_path / "out.hlo"
    assert main(["optimize", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"disco: error: {path}:1: a compiled module") and err.count("\n") == 1
    assert "lower(*args).as_text(dialect='hlo')" in err
    assert not out.exists()
