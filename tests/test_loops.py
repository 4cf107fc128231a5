"""Tests of hlo_tools.loops.known_trip_count on small inline counted loops."""

from __future__ import annotations

import pytest

import hlo_tools
from hlo_tools.loops import known_trip_count

LOOP = """HloModule loop

cond {
  p = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant({bound})
  ROOT c = pred[] compare({lhs}, {rhs}), direction={direction}
}

body {
  bp = (s32[], f32[4]) parameter(0)
  bi = s32[] get-tuple-element(bp), index=0
  x = f32[4] get-tuple-element(bp), index=1
  s = s32[] constant({step})
  j = s32[] {update}(bi, s)
  y = f32[4] add(x, x)
  ROOT t = (s32[], f32[4]) tuple(j, y)
}

ENTRY e {
  x0 = f32[4] parameter(0)
  i0 = s32[] constant({start})
  t0 = (s32[], f32[4]) tuple(i0, x0)
  ROOT w = (s32[], f32[4]) while(t0), condition=cond, body=body
}
"""


def _trips(start=0, bound=16, step=1, direction="LT", update="add", swapped=False):
    lhs, rhs = ("n", "i") if swapped else ("i", "n")
    text = LOOP
    for key, value in dict(bound=bound, lhs=lhs, rhs=rhs, direction=direction, step=step,
                           update=update, start=start).items():
        text = text.replace("{" + key + "}", str(value))
    module = hlo_tools.parse(text)
    entry = module.entry
    return known_trip_count(module, entry, entry.instruction("w"))


@pytest.mark.parametrize("kwargs, want", [
    ({}, 16),                                          # for i in range(16)
    ({"start": 3}, 13),
    ({"direction": "LE"}, 17),
    ({"step": 5}, 4),                                  # 0, 5, 10, 15
    ({"swapped": True, "direction": "GT"}, 16),        # 16 > i
    ({"start": 16, "bound": 0, "step": 1, "update": "subtract", "direction": "GT"}, 16),
    ({"direction": "NE", "step": 2}, 8),
    ({"start": 20}, 0),                                # never runs
])
def test_counted_loops(kwargs, want):
    assert _trips(**kwargs) == want


@pytest.mark.parametrize("kwargs", [
    {"direction": "NE", "step": 3},                    # 16 is not a multiple of 3
    {"step": 0},
    {"update": "multiply"},
    {"direction": "LT", "update": "subtract"},         # counts away from the bound
])
def test_loops_without_a_known_count(kwargs):
    assert _trips(**kwargs) is None


def test_xla_known_trip_count_wins():
    module = hlo_tools.parse(LOOP.replace("{bound}", "16").replace("{lhs}", "i")
                             .replace("{rhs}", "n").replace("{direction}", "LT")
                             .replace("{step}", "1").replace("{update}", "add")
                             .replace("{start}", "0")
                             .replace("body=body", 'body=body, backend_config='
                                      '{"known_trip_count":{"n":"7"}}'))
    assert known_trip_count(module, module.entry, module.entry.instruction("w")) == 7


def test_not_a_while():
    module = hlo_tools.parse(LOOP.replace("{bound}", "1").replace("{lhs}", "i")
                             .replace("{rhs}", "n").replace("{direction}", "LT")
                             .replace("{step}", "1").replace("{update}", "add")
                             .replace("{start}", "0"))
    assert known_trip_count(module, module.entry, module.entry.instruction("t0")) is None
