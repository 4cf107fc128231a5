"""Tests of disco_estimator.ops: trace intake, op keys, stored profiles, fallback model."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import hlo_tools
from disco_estimator import ops
from disco_estimator.ops.keys import OP_CLASSES, OpInfo, OpKey, analyze_module, map_to_original
from disco_estimator.ops.table import OpCostModel, OpEstimate, build_op_profile
from disco_estimator.ops.trace import profile_program

# Opcodes that never run as a thunk of their own on XLA:CPU.
_NO_EVENT = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def _step(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = jnp.tanh(x @ w)
    return y * 2.0 + 1.0, lax.psum(jnp.sum(y, axis=0), "d")


def _program() -> tuple[object, tuple[jax.Array, jax.Array]]:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    fn = jax.jit(jax.shard_map(_step, mesh=mesh, in_specs=(P("d"), P()),
                               out_specs=(P("d"), P())))
    return fn, (jnp.ones((64, 32), jnp.float32), jnp.ones((32, 32), jnp.float32))


@pytest.fixture(scope="module")
def profile() -> ops.ProgramProfile:
    fn, args = _program()
    return profile_program(fn, *args, iterations=4, warmup=1)


def test_every_executed_instruction_has_a_positive_time(profile: ops.ProgramProfile) -> None:
    module = hlo_tools.parse(profile.hlo_text)
    entry = [i for i in module.entry.instructions if i.opcode not in _NO_EVENT]
    assert entry, "the compiled entry should run some instructions"
    for instr in entry:
        assert profile.times_s.get(instr.name, 0) > 0, instr.name
    names = {i.name for _, i in module.instructions()}
    assert set(profile.times_s) <= names  # keys are real compiled instructions
    assert sorted(profile.per_device_s) == list(range(jax.device_count()))
    assert len(profile.wall_times_s) == 4 and min(profile.wall_times_s) > 0
    assert len(profile.trace_iteration_s) == 4 and min(profile.trace_iteration_s) > 0
    for dev in profile.samples_s.values():
        assert all(len(s) == 4 for s in dev.values())


def test_op_profile_keys_and_json_round_trip(profile: ops.ProgramProfile, tmp_path) -> None:
    op = build_op_profile(profile)
    assert op.records and op.module == profile.module
    for name, rec in op.instructions.items():
        assert rec["time_s"] > 0 and rec["key"] in op.records, name
        assert rec["op_names"], name  # metadata maps back to the traced program
    path = tmp_path / "sub" / "profile.json"
    op.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["profile.json"]  # no temp file left
    loaded = ops.OpProfile.load(path)
    assert loaded.to_json() == op.to_json()
    assert json.loads(path.read_text())["backend"] == jax.default_backend()
    info = analyze_module(hlo_tools.parse(profile.hlo_text))[next(iter(op.instructions))]
    assert loaded.estimate(info) == OpEstimate(op.records[info.key.encode()].time_s,
                                                  False, "measured")


def test_map_back_to_the_hlo_text_that_was_compiled() -> None:
    jax_bridge = pytest.importorskip("hlo_tools.jax_bridge")
    fn, args = _program()
    text = jax_bridge.extract(fn, *args)
    compiled = jax_bridge.compile_module(text, jax_bridge.InPlaceOf(fn, args),
                                         jax_bridge.CompileOptions(exact=True))
    prof = profile_program(compiled, *args, iterations=2, warmup=1)
    infos = analyze_module(hlo_tools.parse(prof.hlo_text))
    mapping = map_to_original({n: infos[n].op_names for n in prof.times_s},
                                 hlo_tools.parse(text))
    mapped = {o for names in mapping.values() for o in names}
    original = hlo_tools.parse(text)
    wanted = {i.name for _, i in original.instructions()
              if i.opcode in ("dot", "tanh", "reduce", "all-reduce")}
    assert wanted <= mapped


_HLO = """HloModule m{tag}, entry_computation_layout={{(f32[8,16]{{1,0}})->f32[8,16]{{1,0}}}}

ENTRY %main{tag} (p{tag}: f32[8,16]) -> f32[8,16] {{
  %p{tag} = f32[8,16]{{1,0}} parameter(0)
  %t{tag} = f32[8,16]{{1,0}} tanh(%p{tag}), metadata={{op_name="t{tag}"}}
  ROOT %a{tag} = f32[8,16]{{1,0}} add(%t{tag}, %p{tag})
}}
"""


def test_identical_ops_in_different_programs_share_a_key() -> None:
    a = analyze_module(hlo_tools.parse(_HLO.format(tag="a")))
    b = analyze_module(hlo_tools.parse(_HLO.format(tag="b")))
    assert a["ta"].key == b["tb"].key and a["aa"].key == b["ab"].key
    assert a["ta"].key != a["aa"].key
    assert a["ta"].cls == "elementwise" and a["ta"].bytes == 2 * 8 * 16 * 4
    assert OpKey.decode(a["aa"].key.encode()) == a["aa"].key
    assert a["ta"].op_names == ("ta",)


def test_trace_events_by_device_and_iteration() -> None:
    def ev(name, dev, run, ts, dur, module="jit_f"):
        return {"ph": "X", "pid": 1, "tid": 7, "ts": ts, "dur": dur, "name": name,
                "args": {"hlo_op": name, "hlo_module": module, "device_ordinal": str(dev),
                         "run_id": run}}

    raw = [ev("b", 0, "r2", 100, 2), ev("a", 0, "r1", 0, 5), ev("a", 0, "r1", 10, 5),
           ev("a", 1, "r1", 1, 3), ev("a", 0, "r2", 90, 4), ev("x", 0, "r1", 0, 9, "other"),
           {"ph": "X", "pid": 1, "tid": 7, "ts": 6, "dur": 1, "name": "end: a",
            "args": {"_src": "thunk_executor.cc"}}]
    events = ops.op_events(raw, "jit_f")
    assert ops.iteration_order(events) == ["r1", "r2"]
    s = ops.per_device_samples(events)
    assert s[0]["a"] == pytest.approx([10e-6, 4e-6])  # same op twice in one run: summed
    assert s[0]["b"] == pytest.approx([2e-6]) and s[1]["a"] == pytest.approx([3e-6])


def test_gpu_trace_events_are_the_device_kernels_by_scope() -> None:
    """A GPU trace as jax 0.11.2 records it on an H200 (tests/fixtures/gpu_trace_h200.json):
    kernels in a ``/device:GPU:0`` process, no ``run_id``, one ``scope_range_id`` per
    execution. A host-side event naming an op is not a kernel time and is left out."""
    path = Path(__file__).parent / "fixtures" / "gpu_trace_h200.json"
    raw = json.loads(path.read_text())["traceEvents"]
    events = ops.op_events(raw, "jit__lambda")
    assert [(e.name, e.device) for e in events] == [("loop_add_fusion", 0)] * 3
    assert len(ops.iteration_order(events)) == 3  # three calls, three launches
    assert ops.per_device_samples(events)[0]["loop_add_fusion"] == pytest.approx(
        [2.623e-6, 2.496e-6, 2.496e-6])
    kernel = next(e for e in raw if e.get("ph") == "X")
    host = {**kernel, "pid": 701, "dur": 500.0}  # pid 701 is /host:CPU in the fixture
    second = {**kernel, "ts": kernel["ts"] + 5.0, "dur": 1.0,  # a 2nd kernel, same launch
              "args": {**kernel["args"], "hlo_op": "loop_tanh_fusion"}}
    events = ops.op_events([*raw, host, second], "jit__lambda")
    assert len(events) == 4 and len(ops.iteration_order(events)) == 3
    assert ops.per_device_samples(events)[0]["loop_tanh_fusion"] == pytest.approx([1e-6])


def test_module_name_and_summarize_are_public(profile: ops.ProgramProfile) -> None:
    assert ops.module_name(profile.hlo_text) == profile.module
    with pytest.raises(ValueError, match="HloModule header"):
        ops.module_name("ENTRY main {}")
    events = [ops.OpEvent(n, profile.module, d, f"r{k}", 1, float(k), t)
              for d, names in profile.samples_s.items()
              for n, ts in names.items() for k, t in enumerate(ts)]
    again = ops.summarize(profile.module, profile.hlo_text, events, profile.wall_times_s)
    assert again.times_s == pytest.approx(profile.times_s)
    assert again.per_device_s == profile.per_device_s


def test_measured_trace_uses_the_shared_thread_ids() -> None:
    assert (ops.COMPUTE_TID, ops.COMM_TID) == (0, 1)
    evs = [ops.OpEvent("fusion", "m", 0, "r", 1, 0.0, 1e-3),
           ops.OpEvent("all-reduce.1", "m", 0, "r", 1, 1e-3, 2e-3)]
    trace = ops.measured_chrome_trace(evs)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["tid"] for e in xs] == [ops.COMPUTE_TID, ops.COMM_TID]


def test_fallback_is_positive_flagged_and_monotone() -> None:
    rng = np.random.default_rng(0)
    samples = [("elementwise", b, b / 8, 1e-6 + b * 1e-10 * rng.uniform(0.9, 1.1))
               for b in (1e3, 1e4, 1e5, 1e6)]
    samples.append(("dot-conv", 1e5, 1e8, 2e-3))
    model = OpCostModel.fit(samples)
    for cls in OP_CLASSES:
        assert model.predict(cls, 0, 0) > 0
    sizes = [0, 1e2, 1e4, 1e6, 1e8]
    preds = [model.predict("elementwise", b, 0) for b in sizes]
    assert all(x <= y for x, y in zip(preds, preds[1:], strict=False)) and preds[-1] > preds[0]
    for m in (OpCostModel.fit([]), OpCostModel.fit([("reduce", 100, 10, 1e-6)])):
        preds = [m.predict("reduce", b, 0) for b in sizes]
        assert min(preds) > 0 and preds[-1] > preds[0]
    key = OpKey("exponential", ("f32[4]",), "f32[4]", "f32")
    prof = ops.OpProfile("cpu", "cpu", jax.__version__, "0", "m", "now", {}, {}, [], [])
    est = prof.estimate(OpInfo(key, "elementwise", 32, 4))
    assert est.estimated and est.time_s > 0 and est.source == "model:elementwise"


def test_loop_body_ops_are_counted_per_execution() -> None:
    """In a program compiled as DisCo profiles it (exact mode: XLA:CPU from jaxlib 0.12
    would otherwise run a small loop as one call), each op of a loop body counts once per
    trip."""
    def f(x: jax.Array) -> jax.Array:
        return lax.fori_loop(0, 5, lambda i, c: jnp.tanh(c * 0.5), x)

    x = jnp.ones((32, 32))
    run = hlo_tools.compile_module(None, hlo_tools.InPlaceOf(f, (x,)),
                                   hlo_tools.CompileOptions(exact=True))
    prof = profile_program(run, x, iterations=2, warmup=1)
    body = [n for n, c in prof.counts.items() if c == 5]
    assert body, prof.counts  # the loop body ran 5 times per iteration
    op = build_op_profile(prof)
    name = body[0]
    rec = op.records[op.instructions[name]["key"]]
    assert rec.time_s == pytest.approx(prof.times_s[name] / 5)
