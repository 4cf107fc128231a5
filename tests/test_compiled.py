"""XLA's compiled modules run again in context: :mod:`hlo_tools.compiled` (the rewrite,
pure), XLA compiling the result into a program that computes what ``jax.jit`` computes,
the in-context profile of it, the cost model pricing instructions at measured times,
and ``disco simulate`` on a compiled module."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from step_helpers import local, mlp_step

import hlo_tools
from disco_estimator.costs.cost_model import CostModel
from disco_estimator.costs.lower import sim_graph_from_module
from disco_estimator.costs.simulator import simulate
from disco_jax.cli import main
from disco_jax.pipeline.fit import COMPUTE_SCALE_BOUNDS, compiled_in_context_costs
from disco_jax.pipeline.profile import compile_again, profile_compiled_in_context
from hlo_tools.compiled import NODE_TAG, is_compiled, runnable, tagged_node

FIXTURES = Path(__file__).parent / "fixtures"

HEADER = ("HloModule m, is_scheduled=true, entry_computation_layout={(f32[4,8]{1,0}, "
          "f32[8,2]{1,0})->(f32[4,2]{1,0}, s32[32]{0})}, num_partitions=2")
ALL_REDUCE = ("(f32[4,2]{1,0}, f32[4,2]{1,0}) all-reduce(%ynn_fusion, %big), channel_id=3, "
              "replica_groups={{0,1}}, use_global_device_ids=true, to_apply=%add_r")
COMPILED = HEADER + """

%add_r (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_exp (p0: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %n = f32[4,8]{1,0} negate(%p0)
  ROOT %e = f32[4,8]{1,0} exponential(%n)
}

%ynn_body (q0: f32[4,8], q1: f32[8,2]) -> f32[4,2] {
  %q0 = f32[4,8]{1,0} parameter(0)
  %q1 = f32[8,2]{1,0} parameter(1)
  ROOT %d = f32[4,2]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[4,8], w: f32[8,2]) -> (f32[4,2], s32[32]) {
  %x = f32[4,8]{1,0} parameter(0), sharding={devices=[2,1]<=[2]}
  %w = f32[8,2]{1,0} parameter(1), sharding={replicated}
  %big = f32[4,2]{1,0} constant({...})
  %exp_fusion = f32[4,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_exp
  %ynn_fusion = f32[4,2]{1,0} fusion(%exp_fusion, %w), kind=kCustom, calls=%ynn_body
  %flat = f32[8]{0} bitcast(%ynn_fusion)
  %ints = s32[8]{0} bitcast(%flat)
  %ar = ALL_REDUCE
  %g0 = f32[4,2]{1,0} get-tuple-element(%ar), index=0
  %zero = s32[] constant(0)
  %pad = s32[32]{0} pad(%ints, %zero), padding=0_24
  ROOT %out = (f32[4,2]{1,0}, s32[32]{0}) tuple(%g0, %pad)
}
""".replace("ALL_REDUCE", ALL_REDUCE)


def test_runnable_unfuses_tags_and_drops_what_the_text_cannot_carry():
    module = hlo_tools.parse(COMPILED)
    before = hlo_tools.to_text(module)
    assert is_compiled(module) and not is_compiled(hlo_tools.parse(
        COMPILED.replace("is_scheduled=true, ", "")))
    out = runnable(module)
    assert hlo_tools.to_text(module) == before  # the input is not changed
    assert not {"is_scheduled", "num_partitions", "entry_computation_layout"} & set(
        out.header_attrs)
    entry = out.entry.by_name()
    assert not any(i.opcode == "fusion" for _, i in out.instructions())
    assert {c.name for c in out.computations} == {"add_r", "main"}  # bodies dropped
    # a fusion's ops under its name (root) and <fusion>.<name>, tagged with the fusion
    assert entry["exp_fusion"].opcode == "exponential"
    assert entry["exp_fusion.n"].opcode == "negate"
    assert entry["exp_fusion.n"].operands == ["x"]
    assert entry["ynn_fusion"].opcode == "dot"
    assert entry["ynn_fusion"].operands == ["exp_fusion", "w"]
    assert {tagged_node(i.op_name) for n, i in entry.items() if n.startswith("exp_fusion")} \
        == {"exp_fusion"}
    assert tagged_node(entry["x"].op_name) == "x" and tagged_node("jit(f)/add") is None
    assert "sharding" not in entry["x"].attrs
    # an elided constant as a broadcast zero; bitcasts as what they stand for
    assert entry["big"].opcode == "broadcast" and entry["big"].operands == ["big.zero"]
    assert entry["big.zero"].payload == "0"
    assert entry["flat"].opcode == "reshape"
    assert entry["ints.convert"].opcode == "bitcast-convert"
    assert str(entry["ints.convert"].shape) == "s32[8]"
    assert entry["ints"].opcode == "reshape" and entry["ints"].operands == ["ints.convert"]
    assert tagged_node(entry["ints.convert"].op_name) == "ints"
    text = hlo_tools.to_text(out)
    assert "{1,0}" not in text and "{...}" not in text and NODE_TAG in text
    assert entry["ar"].opcode == "all-reduce"  # collectives stay as written
    hlo_tools.verify(out)


def test_runnable_can_give_a_combined_all_reduce_buffer_by_buffer():
    out = runnable(hlo_tools.parse(COMPILED), split_combined=True)
    entry = out.entry.by_name()
    parts = [entry[f"ar.part{k}"] for k in range(2)]
    assert [p.opcode for p in parts] == ["all-reduce", "all-reduce"]
    assert [p.operands for p in parts] == [["ynn_fusion"], ["big"]]
    assert [p.attrs["channel_id"] for p in parts] == ["4", "5"]  # unique, after the last
    assert entry["ar"].opcode == "tuple" and entry["ar"].operands == ["ar.part0", "ar.part1"]
    assert {tagged_node(p.op_name) for p in parts} == {"ar"}
    hlo_tools.verify(out)


@pytest.fixture(scope="module")
def mlp_compiled():
    """The mlp step's compiled module, on a batch whose 4 device shards are equal (so
    that one set of inputs on every device is the step's own data), and its outputs."""
    step, params, batch = mlp_step()
    x, y = (np.asarray(batch[k])[:8] for k in ("x", "y"))
    sharding = batch["x"].sharding
    same = {"x": jax.device_put(np.tile(x, (4, 1)), sharding),
            "y": jax.device_put(np.tile(y, (4, 1)), sharding)}
    fn = jax.jit(step)
    compiled = fn.lower(params(), same, 0.1).compile()
    want = fn(params(), same, 0.1)
    p = params()
    inputs = [local(p["w1"]), local(p["w2"]), x, y, np.float32(0.1)]
    return compiled.as_text(), inputs, want


def test_a_compiled_module_compiled_again_computes_what_jax_jit_computes(mlp_compiled):
    text, inputs, (want_params, want_loss) = mlp_compiled
    module = hlo_tools.parse(text)
    assert is_compiled(module)
    got = compile_again(module, 4)(*inputs)
    want = [local(want_params["w1"]), local(want_params["w2"]), local(want_loss)]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_the_in_context_profile_times_every_instruction_and_the_fit_meets_the_wall(
        mlp_compiled):
    module = hlo_tools.parse(mlp_compiled[0])
    measured = profile_compiled_in_context(module, iterations=3, rounds=3)
    graph = hlo_tools.device_graph(module)
    fusions = [i.name for i in graph.computation.instructions if i.opcode == "fusion"]
    reduces = [i.name for i in graph.computation.instructions if i.opcode == "all-reduce"]
    assert measured.devices == 4 and measured.wall_s > 0 and len(measured.samples_s) == 3
    assert set(fusions + reduces) <= set(measured.node_s)
    assert all(measured.node_s[n] > 0 for n in reduces)
    assert sum(measured.node_s.values()) > 0
    costs, fit = compiled_in_context_costs(module, "inproc4", measured)
    gc = costs.graph_costs(graph)
    timed = [k for k, s in enumerate(gc.source) if s == "in context"]
    assert {graph.names[k] for k in timed} >= set(reduces)
    assert fit.wall_s == measured.wall_s and fit.traced_s > 0
    lo, hi = COMPUTE_SCALE_BOUNDS
    if lo < fit.compute_scale < hi:  # not clamped: the fit meets the measured iteration
        assert fit.predicted_s == pytest.approx(fit.wall_s, rel=0.02)
    again = simulate(sim_graph_from_module(module, costs), costs.overlap).iteration_s
    assert again == pytest.approx(fit.predicted_s, rel=1e-9)


CHAIN = """HloModule chain

%add_r (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[64]) -> f32[64] {
  %p = f32[64] parameter(0)
  %e = f32[64] exponential(%p)
  %n = f32[64] negate(%e)
  %r = f32[64] all-reduce(%n), replica_groups={{0,1}}, to_apply=%add_r
  ROOT %m = f32[64] multiply(%r, %e)
}
"""


def test_measured_node_times_price_the_module_and_the_rest_keeps_the_rule():
    module = hlo_tools.parse(CHAIN)
    base = CostModel("inproc4")
    costs = CostModel(base.hardware, constants=dataclasses.replace(
        base.constants, compute_scale=1.0, overlap=0.0))
    times = {"e": 1e-3, "n": 2e-3, "r": 3e-3, "m": 4e-3}
    costs.set_node_times(module, times)
    assert costs.node_times(module) == times
    # a chain: e, n on the compute stream, r on the channel, then m: 1 + 2 + 3 + 4 ms
    got = simulate(sim_graph_from_module(module, costs), 0.0)
    assert got.iteration_s == pytest.approx(10e-3, rel=1e-12)
    assert got.comm_s == pytest.approx(3e-3, rel=1e-12)
    other = hlo_tools.parse(CHAIN)  # another module object: none of its times are measured
    assert costs.node_times(other) is None
    partial = CostModel(base.hardware, constants=costs.constants)
    partial.set_node_times(module, {"e": 1e-3, "n": 2e-3, "r": 3e-3})
    gc = partial.graph_costs(hlo_tools.device_graph(module))
    k = gc.graph.names.index("m")
    assert gc.source[k] != "in context" and gc.time_s[k] > 0  # the rule's time


def test_simulate_runs_a_compiled_module_here_and_reports_it(capsys):
    path = FIXTURES / "shard_map_mlp.post.hlo"
    assert main(["simulate", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert "not profiling" not in captured.err, captured.err
    report = json.loads(captured.out)
    ic = report["in_context"]
    assert ic["profiled"] and ic["as_written"] and ic["devices"] == 4
    assert ic["timed_nodes"] >= report["comm_nodes"]
    assert report["time_sources"]["in context"] == ic["timed_nodes"]
    assert report["estimated_nodes"] == 0
    assert report["cost_model"]["compute_scale"] == pytest.approx(ic["compute_scale"])
    assert main(["simulate", str(path)]) == 0
    assert "compiled again and run" in capsys.readouterr().out
