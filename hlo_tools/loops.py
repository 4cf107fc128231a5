"""Trip counts of counted ``while`` loops, as XLA's while-loop analysis finds them.

XLA's post-optimization HLO carries ``backend_config={"known_trip_count":{"n":"16"}}``
on the loops whose trip count its analysis proved; the pre-optimization HLO that jax
lowers to does not. A ``lax.scan`` or ``fori_loop`` lowers to the canonical counted
loop, which :func:`known_trip_count` recognizes:

- the init tuple's element ``k`` is an integer constant ``start``;
- the condition's root is ``compare(get-tuple-element(param, k), constant bound)``
  (either operand order) with direction LT, LE, GT, GE or NE;
- the body's root tuple element ``k`` is ``add(get-tuple-element(param, k),
  constant step)`` (or ``subtract``, a negative step).
"""

from __future__ import annotations

import math
import re

from hlo_tools.ir import HloComputation, HloInstruction, HloModule

__all__ = ["known_trip_count"]

_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE", "EQ": "EQ"}


def known_trip_count(module: HloModule, computation: HloComputation,
                     instr: HloInstruction) -> int | None:
    """How many times the ``while`` instruction ``instr`` of ``computation`` runs its
    body, or None when it is not a counted loop with constant start, bound and step."""
    if instr.opcode != "while":
        return None
    match = _TRIP_COUNT.search(instr.attrs.get("backend_config", ""))
    if match:
        return int(match.group(1))
    try:
        cond = module.computation(instr.attrs["condition"])
        body = module.computation(instr.attrs["body"])
        found = _condition(cond)
        if found is None:
            return None
        k, direction, bound = found
        start = _constant(computation, _tuple_operand(computation, instr.operands[0], k))
        step = _step(body, k)
    except (KeyError, IndexError, ValueError):
        return None
    if start is None or step is None:
        return None
    return _trips(start, bound, step, direction)


def _condition(cond: HloComputation) -> tuple[int, str, int] | None:
    """``(tuple index, direction as index OP bound, bound)`` of a counted condition."""
    root = cond.root
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = root.attrs.get("direction", "")
    lhs, rhs = (cond.instruction(o) for o in root.operands)
    if lhs.opcode != "get-tuple-element":
        lhs, rhs, direction = rhs, lhs, _FLIP.get(direction, "")
    bound = _constant(cond, rhs.name)
    if lhs.opcode != "get-tuple-element" or bound is None or direction not in _FLIP:
        return None
    if cond.instruction(lhs.operands[0]).opcode != "parameter":
        return None
    return int(lhs.attrs["index"]), direction, bound


def _tuple_operand(comp: HloComputation, name: str, k: int) -> str:
    """The name of element ``k`` of the tuple instruction ``name``."""
    tup = comp.instruction(name)
    if tup.opcode != "tuple":
        raise ValueError(f"{name} is not a tuple")
    return tup.operands[k]


def _constant(comp: HloComputation, name: str) -> int | None:
    """The value of a scalar integer constant, else None."""
    instr = comp.instruction(name)
    if (instr.opcode != "constant" or instr.shape.dims
            or instr.shape.element_type[:1] not in ("s", "u")):
        return None
    try:
        return int(instr.payload.strip())
    except ValueError:
        return None


def _step(body: HloComputation, k: int) -> int | None:
    """The constant the body adds to tuple element ``k`` (negative for subtract)."""
    update = body.instruction(_tuple_operand(body, body.root_name, k))
    if update.opcode not in ("add", "subtract"):
        return None
    a, b = (body.instruction(o) for o in update.operands)
    if update.opcode == "add" and a.opcode == "constant":
        a, b = b, a
    if a.opcode != "get-tuple-element" or int(a.attrs["index"]) != k:
        return None
    if body.instruction(a.operands[0]).opcode != "parameter":
        return None
    step = _constant(body, b.name)
    if step is None:
        return None
    return -step if update.opcode == "subtract" else step


def _trips(start: int, bound: int, step: int, direction: str) -> int | None:
    """Iterations of ``for (i = start; i OP bound; i += step)``; None if unbounded."""
    if step == 0:
        return None
    if direction in ("LT", "LE"):
        end = bound + (1 if direction == "LE" else 0)
        return max(0, math.ceil((end - start) / step)) if step > 0 else None
    if direction in ("GT", "GE"):
        end = bound - (1 if direction == "GE" else 0)
        return max(0, math.ceil((start - end) / -step)) if step < 0 else None
    if direction == "NE":
        span = bound - start
        return span // step if span % step == 0 and span // step >= 0 else None
    return None
