"""``hlo_tools.gpu_legal``: plans' fusions written the way XLA:GPU compiles them.

Hand-written modules check the exact structure after the rewrite (``kind=kCustom``
without ``backend_config``, no layouts inside fused computations, one ``copy`` per array
parameter that the body reads instead, a copy root), that the input is untouched, that
our parser re-reads the printed text and that XLA's parser and verifier accept it. Random
plans of every zoo model at ``tiny`` written with ``apply_plan(backend="gpu")`` keep their
planned fusions and pass XLA's verifier. :func:`~hlo_tools.gpu_legal.fusions_kept` is
checked on hand-written pairs of a planned and an "optimized" module. No GPU is needed; the
hand-written modules are also compiled for an H100 without one where XLA:GPU's plugin is
installed (zoo plans: ``tests/test_gpu_deviceless.py``, ``benchmarks/gpu_deviceless.py``).
"""

from __future__ import annotations

import collections
import random

import pytest

import hlo_tools
from hlo_tools.gpu_legal import (
    GPU_FUSION_KIND,
    FusionsKept,
    fusion_key,
    fusions_kept,
    gpu_legal,
    needs_copy,
    unique_channels,
)
from hlo_tools.ir import Shape
from hlo_tools.jax_bridge import verify_hlo
from hlo_tools.printer import instruction_to_text
from hlo_tools.rewrite import fusion_kind

SINGLE = """HloModule single

fused_add {
  p0 = f32[4,8]{0,1} parameter(0)
  p1 = f32[4,8]{1,0} parameter(1)
  neg = f32[4,8]{1,0} negate(p0)
  ROOT add = f32[4,8]{1,0} add(neg, p1)
}

ENTRY main {
  x = f32[4,8]{1,0} parameter(0)
  y = f32[4,8]{1,0} parameter(1)
  ROOT f = f32[4,8]{1,0} fusion(x, y), kind=kLoop, calls=fused_add, \
backend_config={"operation_queue_id":"0"}
}
"""

# a multi-output fusion (tuple root) with a scalar output and a scalar parameter
MULTI = """HloModule multi

sum {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

fused_multi {
  x.param = f32[4,8]{1,0} parameter(0)
  lr.param = f32[] parameter(1)
  lr.b = f32[4,8]{1,0} broadcast(lr.param), dimensions={}
  mul.f = f32[4,8]{1,0} multiply(x.param, lr.b)
  zero.f = f32[] constant(0)
  total.f = f32[] reduce(mul.f, zero.f), dimensions={0,1}, to_apply=sum
  ROOT out = (f32[4,8]{1,0}, f32[]) tuple(mul.f, total.f)
}

ENTRY main {
  x = f32[4,8]{1,0} parameter(0)
  lr = f32[] parameter(1)
  fusion.out = (f32[4,8]{1,0}, f32[]) fusion(x, lr), kind=kLoop, calls=fused_multi
  mul = f32[4,8]{1,0} get-tuple-element(fusion.out), index=0
  total = f32[] get-tuple-element(fusion.out), index=1
  ROOT r = (f32[4,8]{1,0}, f32[]) tuple(mul, total)
}
"""

# a duplicated producer (``b``, copied into two fusions as apply_plan writes it), and a
# name (``x.param.copy``) that the first added copy would take
DUPLICATED = """HloModule duplicated

fused_u {
  x.param = f32[8]{0} parameter(0)
  b.dup = f32[8]{0} negate(x.param)
  ROOT u.f = f32[8]{0} exponential(b.dup)
}

fused_v {
  x.param.1 = f32[8]{0} parameter(0)
  b.dup.1 = f32[8]{0} negate(x.param.1)
  ROOT v.f = f32[8]{0} tanh(b.dup.1)
}

ENTRY main {
  x = f32[8]{0} parameter(0)
  x.param.copy = f32[8]{0} copy(x)
  b = f32[8]{0} negate(x.param.copy)
  u = f32[8]{0} fusion(x), kind=kLoop, calls=fused_u
  v = f32[8]{0} fusion(x), kind=kLoop, calls=fused_v
  ROOT r = (f32[8]{0}, f32[8]{0}, f32[8]{0}) tuple(b, u, v)
}
"""

# an AllReduce bucket as apply_plan writes it (flat buffer outside any fusion)
BUCKET = """HloModule bucket, entry_computation_layout={(f32[2,3]{1,0}, f32[4]{0})->\
(f32[2,3]{1,0}, f32[4]{0})}

sum {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  g0 = f32[2,3]{1,0} parameter(0)
  g1 = f32[4]{0} parameter(1)
  g0.flat = f32[6]{0} reshape(g0)
  g1.flat = f32[4]{0} reshape(g1)
  g0.buffer = f32[10]{0} concatenate(g0.flat, g1.flat), dimensions={0}
  g0.bucket = f32[10]{0} all-reduce(g0.buffer), replica_groups={}, to_apply=sum
  g0.slice = f32[6]{0} slice(g0.bucket), slice={[0:6]}
  ar0 = f32[2,3]{1,0} reshape(g0.slice)
  g1.slice = f32[4]{0} slice(g0.bucket), slice={[6:10]}
  ar1 = f32[4]{0} reshape(g1.slice)
  ROOT r = (f32[2,3]{1,0}, f32[4]{0}) tuple(ar0, ar1)
}
"""

# a fusion whose root is its parameter, and one reading nothing (a broadcast constant)
EDGES = """HloModule edges

fused_pass {
  p = f32[3,5]{1,0} parameter(0)
  ROOT p.neg = f32[3,5]{1,0} negate(p)
}

fused_id {
  q = f32[3,5]{1,0} parameter(0)
  ROOT q.root = f32[3,5]{1,0} copy(q)
}

fused_root_param {
  ROOT s = f32[3,5]{1,0} parameter(0)
}

fused_zeros {
  c = f32[] constant(0)
  ROOT z = f32[3,5]{1,0} broadcast(c), dimensions={}
}

ENTRY main {
  x = f32[3,5]{1,0} parameter(0)
  a = f32[3,5]{1,0} fusion(x), kind=kLoop, calls=fused_pass
  b = f32[3,5]{1,0} fusion(a), kind=kLoop, calls=fused_id
  d = f32[3,5]{1,0} fusion(b), kind=kLoop, calls=fused_root_param
  e = f32[3,5]{1,0} fusion(), kind=kLoop, calls=fused_zeros
  ROOT r = (f32[3,5]{1,0}, f32[3,5]{1,0}) tuple(d, e)
}
"""


# a tuple-shaped root that is not a tuple instruction (a variadic reduce)
VARIADIC = """HloModule variadic

minmax {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  c = f32[] parameter(2)
  d = f32[] parameter(3)
  lo = f32[] minimum(a, c)
  hi = f32[] maximum(b, d)
  ROOT r = (f32[], f32[]) tuple(lo, hi)
}

fused_minmax {
  v = f32[4,8]{1,0} parameter(0)
  init = f32[] constant(0)
  ROOT mm = (f32[4]{0}, f32[4]{0}) reduce(v, v, init, init), dimensions={1}, to_apply=minmax
}

ENTRY main {
  x = f32[4,8]{1,0} parameter(0)
  ROOT f = (f32[4]{0}, f32[4]{0}) fusion(x), kind=kLoop, calls=fused_minmax
}
"""

# jax's psums: all on channel 1 (jax 0.10.2's XLA:GPU gives one channel one layout)
CHANNELS = """HloModule channels

sum {
  s.a = f32[] parameter(0)
  s.b = f32[] parameter(1)
  ROOT s = f32[] add(s.a, s.b)
}

ENTRY main {
  a = f32[8]{0} parameter(0)
  b = f32[3,4]{1,0} parameter(1)
  x = f32[8]{0} all-reduce(a), channel_id=1, replica_groups={{0}}, use_global_device_ids=true, \
to_apply=sum
  y = f32[3,4]{1,0} all-reduce(b), channel_id=1, replica_groups={{0}}, \
use_global_device_ids=true, to_apply=sum
  z = f32[8]{0} all-reduce(x), channel_id=2, replica_groups={{0}}, use_global_device_ids=true, \
to_apply=sum
  ROOT t = (f32[8]{0}, f32[3,4]{1,0}, f32[8]{0}) tuple(x, y, z)
}
"""


def _legal(text: str):
    module = hlo_tools.parse(text)
    before = hlo_tools.to_text(module)
    out = gpu_legal(module)
    assert hlo_tools.to_text(module) == before  # the input is untouched
    printed = hlo_tools.to_text(out)
    assert hlo_tools.to_text(hlo_tools.parse(printed)) == printed  # our parser re-reads it
    assert hlo_tools.to_text(gpu_legal(out)) == printed  # nothing left to do
    names = [i.name for _, i in out.instructions()]
    assert len(names) == len(set(names))
    return out, printed


def _lines(module, name: str) -> list[str]:
    """The instructions of computation ``name`` as printed (root marked)."""
    comp = module.computation(name)
    return [instruction_to_text(i, i.name == comp.root_name)
            for i in comp.instructions]


def _fusion(module, name: str):
    return module.entry.instruction(name)


def test_single_output_fusion_is_kcustom_with_copies_at_its_edges():
    out, printed = _legal(SINGLE)
    assert _lines(out, "fused_add") == [
        "p0 = f32[4,8] parameter(0)",
        "p0.copy = f32[4,8] copy(p0)",
        "p1 = f32[4,8] parameter(1)",
        "p1.copy = f32[4,8] copy(p1)",
        "neg = f32[4,8] negate(p0.copy)",
        "add = f32[4,8] add(neg, p1.copy)",
        "ROOT add.copy = f32[4,8] copy(add)",
    ]
    fusion = _fusion(out, "f")
    assert fusion.attrs == {"kind": "kCustom", "calls": "fused_add"}  # no backend_config
    assert str(fusion.shape) == "f32[4,8]{1,0}"  # the caller's side keeps its layouts
    assert _lines(out, "main")[:2] == _lines(hlo_tools.parse(SINGLE), "main")[:2]
    verify_hlo(printed)


def test_multi_output_fusion_copies_each_array_element_of_its_tuple_root():
    out, printed = _legal(MULTI)
    assert _lines(out, "fused_multi") == [
        "x.param = f32[4,8] parameter(0)",
        "x.param.copy = f32[4,8] copy(x.param)",
        "lr.param = f32[] parameter(1)",  # a scalar has one layout: no copy
        "lr.b = f32[4,8] broadcast(lr.param), dimensions={}",
        "mul.f = f32[4,8] multiply(x.param.copy, lr.b)",
        "zero.f = f32[] constant(0)",
        "total.f = f32[] reduce(mul.f, zero.f), dimensions={0,1}, to_apply=sum",
        "mul.f.copy = f32[4,8] copy(mul.f)",
        "ROOT out = (f32[4,8], f32[]) tuple(mul.f.copy, total.f)",
    ]
    assert _fusion(out, "fusion.out").attrs["kind"] == GPU_FUSION_KIND
    assert _lines(out, "sum") == _lines(hlo_tools.parse(MULTI), "sum")  # reducers untouched
    verify_hlo(printed)


def test_duplicated_producers_get_copies_with_names_unique_in_the_module():
    out, printed = _legal(DUPLICATED)
    assert _lines(out, "fused_u") == [
        "x.param = f32[8] parameter(0)",
        "x.param.copy.1 = f32[8] copy(x.param)",  # x.param.copy is taken in main
        "b.dup = f32[8] negate(x.param.copy.1)",
        "u.f = f32[8] exponential(b.dup)",
        "ROOT u.f.copy = f32[8] copy(u.f)",
    ]
    assert _lines(out, "fused_v") == [
        "x.param.1 = f32[8] parameter(0)",
        "x.param.1.copy = f32[8] copy(x.param.1)",
        "b.dup.1 = f32[8] negate(x.param.1.copy)",
        "v.f = f32[8] tanh(b.dup.1)",
        "ROOT v.f.copy = f32[8] copy(v.f)",
    ]
    assert _lines(out, "main") == _lines(hlo_tools.parse(DUPLICATED), "main")[:3] + [
        "u = f32[8]{0} fusion(x), kind=kCustom, calls=fused_u",
        "v = f32[8]{0} fusion(x), kind=kCustom, calls=fused_v",
        "ROOT r = (f32[8]{0}, f32[8]{0}, f32[8]{0}) tuple(b, u, v)",
    ]
    verify_hlo(printed)


def test_a_bucket_outside_fusions_is_left_as_it_is():
    out, printed = _legal(BUCKET)
    assert printed == hlo_tools.to_text(hlo_tools.parse(BUCKET))
    verify_hlo(printed)


def test_parameter_and_root_edge_cases():
    out, printed = _legal(EDGES)
    assert _lines(out, "fused_pass") == [
        "p = f32[3,5] parameter(0)",
        "p.copy = f32[3,5] copy(p)",
        "p.neg = f32[3,5] negate(p.copy)",
        "ROOT p.neg.copy = f32[3,5] copy(p.neg)",
    ]
    # read by a copy already, and a copy root: that copy may change the layout
    assert _lines(out, "fused_id") == ["q = f32[3,5] parameter(0)",
                                       "ROOT q.root = f32[3,5] copy(q)"]
    # a root that is a parameter: one copy between its layout and the output's
    assert _lines(out, "fused_root_param") == ["s = f32[3,5] parameter(0)",
                                               "ROOT s.copy = f32[3,5] copy(s)"]
    assert _lines(out, "fused_zeros") == ["c = f32[] constant(0)",
                                          "z = f32[3,5] broadcast(c), dimensions={}",
                                          "ROOT z.copy = f32[3,5] copy(z)"]
    verify_hlo(printed)


def test_a_variadic_root_becomes_a_tuple_of_copies_of_its_elements():
    out, printed = _legal(VARIADIC)
    assert _lines(out, "fused_minmax") == [
        "v = f32[4,8] parameter(0)",
        "v.copy = f32[4,8] copy(v)",
        "init = f32[] constant(0)",
        "mm = (f32[4], f32[4]) reduce(v.copy, v.copy, init, init), dimensions={1}, "
        "to_apply=minmax",
        "mm.0 = f32[4] get-tuple-element(mm), index=0",
        "mm.0.copy = f32[4] copy(mm.0)",
        "mm.1 = f32[4] get-tuple-element(mm), index=1",
        "mm.1.copy = f32[4] copy(mm.1)",
        "ROOT mm.copies = (f32[4], f32[4]) tuple(mm.0.copy, mm.1.copy)",
    ]
    verify_hlo(printed)

def test_collectives_sharing_a_channel_get_distinct_ones():
    out, printed = _legal(CHANNELS)
    channels = {i.name: i.attrs["channel_id"] for _, i in out.instructions()
                if "channel_id" in i.attrs}
    assert channels == {"x": "1", "y": "3", "z": "2"}  # the first of a channel keeps it
    module = hlo_tools.parse(CHANNELS)
    assert unique_channels(module) is module
    assert hlo_tools.to_text(unique_channels(module)) == hlo_tools.to_text(out)
    verify_hlo(printed)


def test_a_compiled_module_is_refused():
    module = hlo_tools.parse(SINGLE.replace("HloModule single", "HloModule single, "
                                            "is_scheduled=true"))
    with pytest.raises(ValueError, match="is_scheduled"):
        gpu_legal(module)


def test_needs_copy_and_fusion_kind():
    assert needs_copy(Shape("f32", (4,), "{0}")) and needs_copy(Shape("f32", (1, 1)))
    assert not needs_copy(Shape("f32"))
    assert not needs_copy(Shape("tuple", tuple_shapes=(Shape("f32", (4,)),)))
    assert not needs_copy(Shape("token"))
    assert fusion_kind(["dot", "add"], "gpu") == fusion_kind(["reduce"], "gpu") == "kCustom"
    assert fusion_kind(["dot", "add"]) == "kLoop"


# ------------------------------------------------------------- fusions_kept

# a plan as written for XLA:GPU: one fusion XLA keeps, two equal masks (XLA's CSE merges
# them), one XLA splits (lost) and a one-op fusion (not compared by default)
PLANNED = """HloModule planned

fused_axpb {
  p0 = f32[8] parameter(0)
  p0.copy = f32[8] copy(p0)
  m = f32[8] multiply(p0.copy, p0.copy)
  two = f32[] constant(2)
  two.b = f32[8] broadcast(two), dimensions={}
  a = f32[8] add(m, two.b)
  ROOT a.copy = f32[8] copy(a)
}

fused_mask {
  i = s32[4,4] iota(), iota_dimension=0
  j = s32[4,4] iota(), iota_dimension=1
  lt = pred[4,4] compare(i, j), direction=LT
  ninf = f32[] constant(-inf)
  ninf.2 = f32[] constant(-inf)
  nb = f32[4,4] broadcast(ninf), dimensions={}
  nb.2 = f32[4,4] broadcast(ninf.2), dimensions={}
  ROOT s = f32[4,4] select(lt, nb, nb.2)
}

fused_mask.1 {
  i.1 = s32[4,4] iota(), iota_dimension=0
  j.1 = s32[4,4] iota(), iota_dimension=1
  lt.1 = pred[4,4] compare(i.1, j.1), direction=LT
  ninf.1 = f32[] constant(-inf)
  ninf.3 = f32[] constant(-inf)
  nb.1 = f32[4,4] broadcast(ninf.1), dimensions={}
  nb.3 = f32[4,4] broadcast(ninf.3), dimensions={}
  ROOT s.1 = f32[4,4] select(lt.1, nb.1, nb.3)
}

fused_explog {
  q = f32[8] parameter(0)
  q.copy = f32[8] copy(q)
  e = f32[8] exponential(q.copy)
  ROOT l = f32[8] log(e)
}

fused_neg {
  r = f32[8] parameter(0)
  r.copy = f32[8] copy(r)
  ROOT n = f32[8] negate(r.copy)
}

ENTRY main {
  x = f32[8]{0} parameter(0)
  f0 = f32[8]{0} fusion(x), kind=kCustom, calls=fused_axpb
  f1 = f32[4,4]{1,0} fusion(), kind=kCustom, calls=fused_mask
  f2 = f32[4,4]{1,0} fusion(), kind=kCustom, calls=fused_mask.1
  f3 = f32[8]{0} fusion(f0), kind=kCustom, calls=fused_explog
  f4 = f32[8]{0} fusion(f3), kind=kCustom, calls=fused_neg
  ROOT t = (f32[8]{0}, f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(f4, f1, f2)
}
"""

# what XLA makes of it: renamed, copies that change no layout turned into bitcasts, the
# constants of a fused computation merged, one mask for two, exp and log apart
OPTIMIZED = """HloModule planned, is_scheduled=true

fused_computation {
  param_0 = f32[8]{0} parameter(0)
  bitcast.1 = f32[8]{0} bitcast(param_0)
  multiply.3 = f32[8]{0} multiply(bitcast.1, bitcast.1)
  constant.1 = f32[] constant(2)
  broadcast.2 = f32[8]{0} broadcast(constant.1), dimensions={}
  add.5 = f32[8]{0} add(multiply.3, broadcast.2)
  ROOT copy.4 = f32[8]{0} copy(add.5)
}

fused_computation.1 {
  iota.1 = s32[4,4]{1,0} iota(), iota_dimension=0
  iota.2 = s32[4,4]{1,0} iota(), iota_dimension=1
  compare.1 = pred[4,4]{1,0} compare(iota.1, iota.2), direction=LT
  constant.2 = f32[] constant(-inf)
  broadcast.3 = f32[4,4]{1,0} broadcast(constant.2), dimensions={}
  broadcast.4 = f32[4,4]{1,0} broadcast(constant.2), dimensions={}
  ROOT select.1 = f32[4,4]{1,0} select(compare.1, broadcast.3, broadcast.4)
}

fused_computation.2 {
  param_0.1 = f32[8]{0} parameter(0)
  ROOT exponential.1 = f32[8]{0} exponential(param_0.1)
}

fused_computation.3 {
  param_0.2 = f32[8]{0} parameter(0)
  ROOT log.1 = f32[8]{0} log(param_0.2)
}

fused_computation.4 {
  param_0.3 = f32[8]{0} parameter(0)
  ROOT negate.1 = f32[8]{0} negate(param_0.3)
}

ENTRY main {
  p = f32[8]{0} parameter(0)
  fusion = f32[8]{0} fusion(p), kind=kCustom, calls=fused_computation
  fusion.1 = f32[4,4]{1,0} fusion(), kind=kCustom, calls=fused_computation.1
  fusion.2 = f32[8]{0} fusion(fusion), kind=kLoop, calls=fused_computation.2
  fusion.3 = f32[8]{0} fusion(fusion.2), kind=kLoop, calls=fused_computation.3
  fusion.4 = f32[8]{0} fusion(fusion.3), kind=kCustom, calls=fused_computation.4
  ROOT tuple = (f32[8]{0}, f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(fusion.4, fusion.1, fusion.1)
}
"""


def test_fusion_key_leaves_out_edges_and_counts_constants_once():
    planned, optimized = hlo_tools.parse(PLANNED), hlo_tools.parse(OPTIMIZED)
    assert fusion_key(planned.computation("fused_axpb")) == (
        "add", "broadcast", "multiply", "constant")
    mask = ("broadcast", "broadcast", "compare", "iota", "iota", "select", "constant")
    assert fusion_key(planned.computation("fused_mask")) == mask
    assert fusion_key(optimized.computation("fused_computation.1")) == mask
    assert fusion_key(optimized.computation("fused_computation")) == \
        fusion_key(planned.computation("fused_axpb"))
    assert fusion_key(planned.computation("fused_neg")) == ("negate",)


def test_fusions_kept_tells_kept_merged_and_lost_fusions_apart():
    planned, optimized = hlo_tools.parse(PLANNED), hlo_tools.parse(OPTIMIZED)
    got = fusions_kept(planned, optimized)
    assert isinstance(got, FusionsKept)
    # the one-op fusion is not compared; one mask kept, its twin merged; exp+log lost
    assert got == FusionsKept(planned=4, kept=2, merged=1, lost=(("exponential", "log"),))
    assert got.kept + got.merged + len(got.lost) == got.planned
    assert fusions_kept(planned, optimized, min_ops=0) == (5, 3, 1, (("exponential", "log"),))
    assert fusions_kept(planned, optimized, min_ops=7) == (2, 1, 1, ())  # the masks alone
    assert fusions_kept(planned, planned) == (4, 4, 0, ())
    assert fusions_kept(planned, gpu_legal(planned)) == (4, 4, 0, ())  # copies are edges
    # a module without fusions keeps none of them
    bare = hlo_tools.parse(BUCKET)
    assert fusions_kept(planned, bare).lost == fusions_kept(planned, bare, min_ops=2).lost
    assert fusions_kept(planned, bare).kept == 0 and fusions_kept(bare, planned) == (0, 0, 0, ())


# ------------------------------------------------------------------------ zoo plans

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def zoo_modules():
    """Each zoo model's pre-optimization module at ``tiny`` (4 devices), parsed once."""
    from step_helpers import zoo_modules

    return zoo_modules(4)


def _fusion_bodies(module) -> list[tuple[object, object]]:
    comps = module.computations_by_name()
    return [(i, comps[i.called_computations[0]]) for _, i in module.instructions()
            if i.opcode == "fusion"]


def _assert_body_legal(body) -> None:
    """The form :func:`gpu_legal` writes: no layouts, array parameters read by copies
    alone, a copy root (or a tuple of copies and scalars)."""
    by_name = body.by_name()
    readers = collections.defaultdict(list)
    for instr in body.instructions:
        assert not any(s.layout for s in instr.shape.leaves()), instr
        for op in instr.operands:
            readers[op].append(instr.opcode)
    for param in body.parameters:
        if needs_copy(param.shape):
            assert set(readers[param.name]) <= {"copy"}, (body.name, param)
    root = body.root
    elements = ([by_name[op] for op in root.operands] if root.opcode == "tuple" else [root])
    for element in elements:
        assert element.opcode == "copy" or not needs_copy(element.shape), (body.name, root)


@pytest.mark.parametrize("model", ["bert", "reformer", "resnet", "rnnlm", "rnnlm_unrolled",
                                   "transformer", "vgg"])
def test_zoo_random_plans_written_for_gpu_keep_their_fusions(zoo_modules, model):
    from hlo_tools import plan as P

    module = zoo_modules(model)
    graph = hlo_tools.device_graph(module)
    space = P.FusionSpace(graph)
    before = hlo_tools.to_text(module)
    for seed in SEEDS:
        plan = P.random_moves(space, P.initial_plan(graph), random.Random(seed), 200)
        cpu = hlo_tools.apply_plan(module, plan, graph)
        gpu = hlo_tools.apply_plan(module, plan, graph, backend="gpu")
        cpu_fusions, gpu_fusions = _fusion_bodies(cpu), _fusion_bodies(gpu)
        dead = P.dead_groups(space, plan)
        planned = [ms for g, ms in plan.groups().items()
                   if graph.opcodes[ms[0]] != "all-reduce" and g not in dead]
        assert len(gpu_fusions) == len(cpu_fusions) == len(planned) > 0, (model, seed)
        for (c, c_body), (g, g_body) in zip(cpu_fusions, gpu_fusions):
            assert (c.name, c.operands, c.shape) == (g.name, g.operands, g.shape)
            assert g.attrs["kind"] == "kCustom" and "backend_config" not in g.attrs
            _assert_body_legal(g_body)
            # the same ops, plus the copies at the edges
            ops = collections.Counter(i.opcode for i in c_body.instructions)
            ops_gpu = collections.Counter(i.opcode for i in g_body.instructions)
            assert set(ops_gpu - ops) <= {"copy"} and not ops - ops_gpu
        text = hlo_tools.to_text(gpu)
        assert hlo_tools.to_text(hlo_tools.parse(text)) == text
        verify_hlo(text)
    assert hlo_tools.to_text(module) == before


# ------------------------------------------------- XLA:GPU itself (deviceless, no GPU)


def _deviceless_or_skip():
    from hlo_tools.jax_bridge import pjrt

    reason = pjrt.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no deviceless XLA:GPU compile: {reason}")
    return pjrt


@pytest.mark.parametrize("name", ["SINGLE", "MULTI", "DUPLICATED", "EDGES", "VARIADIC",
                                  "CHANNELS"])
def test_hand_written_fusions_compile_for_an_h100_as_written(name):
    pjrt = _deviceless_or_skip()
    out = gpu_legal(hlo_tools.parse(globals()[name]))
    from hlo_tools.jax_bridge import exact_compiler_options

    compiled = pjrt.compile_deviceless(hlo_tools.to_text(out), exact_compiler_options("cuda"),
                                       timeout_s=300)
    optimized = hlo_tools.parse(compiled.optimized_text)
    custom = [i for i, _ in _fusion_bodies(optimized) if i.attrs.get("kind") == "kCustom"]
    assert len(custom) == len(_fusion_bodies(out))  # every one kept, none of XLA's own
    # (XLA wraps the ops outside fusions in fusions of its own: optimized holds more)
    assert fusions_kept(out, optimized, min_ops=0) == (len(custom), len(custom), 0, ())
