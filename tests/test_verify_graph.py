"""verify() and the per-device graph view, on small inline HLO."""

from __future__ import annotations

import pathlib

import pytest

from hlo_tools import parse
from hlo_tools.graph import NodeKind, device_computation, device_graph
from hlo_tools.verify import HloVerifyError, find_problems, verify

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

MODULE = """HloModule m

add_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

fused {
  fp0 = f32[4]{0} parameter(0)
  fp1 = f32[4]{0} parameter(1)
  ROOT fm = f32[4]{0} multiply(fp0, fp1)
}

ENTRY main {
  p = f32[4]{0} parameter(0)
  q = f32[4]{0} parameter(1)
  f = f32[4]{0} fusion(p, q), kind=kLoop, calls=fused
  ar = (f32[4]{0}, f32[4]{0}) all-reduce(f, q), replica_groups={{0,1}}, to_apply=add_f32
  g0 = f32[4]{0} get-tuple-element(ar), index=0
  g1 = f32[4]{0} get-tuple-element(ar), index=1
  ROOT out = f32[4]{0} add(g0, g1)
}
"""


def test_valid_module_has_no_problems():
    assert find_problems(parse(MODULE)) == []


@pytest.mark.parametrize("old,new,reason", [
    ("ar = (f32[4]{0}, f32[4]{0}) all-reduce(f, q)", "ar = (f32[4]{0}, f32[2]{0}) all-reduce(f, q)",
     "all-reduce result"),
    ("get-tuple-element(ar), index=1", "get-tuple-element(ar), index=2", "index 2 out of range"),
    ("f = f32[4]{0} fusion(p, q)", "f = f32[4]{0} fusion(p)", "fusion has 1 operands"),
    ("f = f32[4]{0} fusion(p, q)", "f = f32[8]{0} fusion(p, q)", "fusion result"),
    ("ROOT out = f32[4]{0} add(g0, g1)", "ROOT out = f32[5]{0} add(g0, g1)", "elementwise add"),
])
def test_shape_problems_are_reported(old, new, reason):
    module = parse(MODULE.replace(old, new))
    with pytest.raises(HloVerifyError, match=reason):
        verify(module)


def test_use_before_definition_and_cycles_are_reported():
    module = parse(MODULE)
    main = module.entry
    # Move the fusion after its user: a use before definition (what a cycle looks like).
    f = main.instructions.pop(2)
    main.instructions.insert(3, f)
    problems = find_problems(module)
    assert any("used before definition" in p for p in problems), problems


def test_duplicate_names_are_reported():
    module = parse(MODULE)
    module.entry.instruction("g1").name = "g0"
    assert any("duplicate instruction name" in p for p in find_problems(module))


def test_graph_view_of_entry():
    g = device_graph(parse(MODULE))
    assert g.computation.name == "main"
    assert g.names == ("p", "q", "f", "ar", "g0", "g1", "out")
    assert g.operands[g.index["f"]] == (0, 1)
    assert g.users[g.index["q"]] == (2, 3)
    kinds = dict(zip(g.names, g.kinds))
    assert kinds["p"] == NodeKind.PARAMETER
    assert kinds["f"] == NodeKind.FUSION
    assert kinds["ar"] == NodeKind.COLLECTIVE
    assert kinds["g0"] == NodeKind.PLUMBING
    assert kinds["out"] == NodeKind.COMPUTE
    assert g.gradient_allreduces == (3,)
    assert g.out_bytes[g.index["ar"]] == 32
    assert g.root == g.index["out"]


def test_graph_view_of_shard_map_step():
    module = parse((FIXTURES / "shard_map_mlp.pre.hlo").read_text())
    comp = device_computation(module)
    assert comp.name.startswith("xla.sdy.manual_computation_body")
    g = device_graph(module)
    allreduces = g.nodes_of_kind(NodeKind.COLLECTIVE)
    assert len(allreduces) == 7
    # The scalar loss all-reduce is not a gradient; every other one is.
    assert len(g.gradient_allreduces) == 6
    for i, ops in enumerate(g.operands):
        assert all(o < i for o in ops), "nodes must be in topological order"


def test_graph_view_of_while_loop_marks_control_flow():
    module = parse((FIXTURES / "scan_rnn.pre.hlo").read_text())
    g = device_graph(module)
    assert NodeKind.CONTROL_FLOW in g.kinds
