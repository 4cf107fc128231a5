"""Structural checks of a module: SSA, acyclicity and the shapes of rewritten ops."""

from __future__ import annotations

from collections.abc import Iterator

from hlo_tools.ir import HloComputation, HloInstruction, HloModule, Shape
from hlo_tools.opcodes import ELEMENTWISE_OPCODES

__all__ = ["HloVerifyError", "verify", "find_problems"]


class HloVerifyError(ValueError):
    """The module is structurally invalid; ``problems`` lists every reason found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(problems[0] + more)


def verify(module: HloModule) -> None:
    """Raises :class:`HloVerifyError` if :func:`find_problems` finds anything."""
    problems = find_problems(module)
    if problems:
        raise HloVerifyError(problems)


def find_problems(module: HloModule) -> list[str]:
    """Every structural problem of ``module``, as readable reasons (empty if valid).

    Checks: unique names; each operand defined earlier in its computation (SSA,
    def-before-use, which also rules out cycles; a cycle is named as such, with its
    instructions); the root exists; called computations
    exist and the call graph is acyclic; result shapes of ``fusion``, ``all-reduce``,
    ``tuple``, ``get-tuple-element`` and elementwise ops agree with their operands.
    """
    problems = list(_name_problems(module))
    problems += _call_graph_problems(module)
    comps = module.computations_by_name()
    for comp in module.computations:
        problems += _ssa_problems(comp)
        defined = comp.by_name()
        for instr in comp.instructions:
            problems += _shape_problems(instr, defined, comps)
    return problems


def _name_problems(module: HloModule) -> Iterator[str]:
    seen: set[str] = set()
    for comp, instr in module.instructions():
        if instr.name in seen:
            yield f"duplicate instruction name {instr.name!r} (in {comp.name})"
        seen.add(instr.name)


def _ssa_problems(comp: HloComputation) -> list[str]:
    problems, defined = [], set()
    later = comp.by_name()
    searched = 0  # cycles are looked for behind the first few misplaced operands only
    for instr in comp.instructions:
        for op in instr.operands:
            if op in defined:
                continue
            where = f"{comp.name}/{instr.name}: operand {op!r}"
            if op not in later:
                problems.append(f"{where} is not defined")
                continue
            searched += 1
            cycle = _cycle_through(instr.name, op, later) if searched <= 3 else []
            if cycle:
                problems.append(f"{where} is part of a cycle: {' -> '.join(cycle)}")
            else:
                problems.append(f"{where} is used before definition (instructions must "
                                "come in def-before-use order)")
        defined.add(instr.name)
    if comp.root_name not in defined:
        problems.append(f"{comp.name}: root {comp.root_name!r} is not an instruction")
    return problems


def _cycle_through(user: str, operand: str, by_name: dict[str, HloInstruction],
                   limit: int = 8) -> list[str]:
    """A dataflow cycle ``user -> operand -> ... -> user`` (each name reads the next), as
    names (at most ``limit`` of them, then ``...``); empty if ``operand`` does not
    depend on ``user``."""
    if operand == user:
        return [user, user]
    parent: dict[str, str] = {operand: user}
    stack = [operand]
    while stack:  # depth-first over the operands of operand
        name = stack.pop()
        for op in by_name[name].operands:
            if op == user:
                chain, node = [name], name
                while node != operand:
                    node = parent[node]
                    chain.append(node)
                names = [user, *reversed(chain), user]
                return names if len(names) <= limit else [*names[:limit - 1], "...", user]
            if op in by_name and op not in parent:
                parent[op] = name
                stack.append(op)
    return []


def _call_graph_problems(module: HloModule) -> list[str]:
    comps = module.computations_by_name()
    callees = {
        c.name: {n for i in c.instructions for n in i.called_computations}
        for c in module.computations
    }
    problems = [f"{name}: calls undefined computation {callee!r}"
                for name, cs in callees.items() for callee in sorted(cs) if callee not in comps]
    state: dict[str, int] = {}

    def visit(name: str) -> bool:  # True if a cycle is reachable
        if state.get(name) == 1:
            return True
        if state.get(name) == 2 or name not in comps:
            return False
        state[name] = 1
        cyclic = any(visit(c) for c in callees[name])
        state[name] = 2
        return cyclic

    if any(visit(name) for name in comps):
        problems.append("the computation call graph has a cycle")
    return problems


def _same(a: Shape, b: Shape) -> bool:
    return a.without_layout() == b.without_layout()


def _shape_problems(instr: HloInstruction, defined: dict[str, HloInstruction],
                    comps: dict[str, HloComputation]) -> list[str]:
    ops = [defined[o].shape for o in instr.operands if o in defined]
    if len(ops) != len(instr.operands):
        return []  # already reported as an SSA problem
    where = instr.name
    if instr.opcode == "fusion":
        return _fusion_problems(instr, ops, comps)
    if instr.opcode == "all-reduce":
        want = ops[0] if len(ops) == 1 else Shape("tuple", tuple_shapes=tuple(ops))
        if not _same(instr.shape, want):
            return [f"{where}: all-reduce result {instr.shape} does not match its "
                    f"operands {want}"]
    elif instr.opcode == "tuple":
        if not _same(instr.shape, Shape("tuple", tuple_shapes=tuple(ops))):
            return [f"{where}: tuple shape {instr.shape} does not match its operands "
                    f"{tuple(str(o) for o in ops)}"]
    elif instr.opcode == "get-tuple-element":
        if len(ops) != 1:
            return [f"{where}: get-tuple-element has {len(ops)} operands, expected 1"]
        return _gte_problems(instr, ops[0])
    elif instr.opcode in ELEMENTWISE_OPCODES:
        bad = [s for s in ops if s.is_array and s.dims and s.dims != instr.shape.dims]
        if bad:
            return [f"{where}: elementwise {instr.opcode} operand dims {bad[0].dims} "
                    f"differ from result dims {instr.shape.dims}"]
    return []


def _gte_problems(instr: HloInstruction, operand: Shape) -> list[str]:
    text = instr.attrs.get("index", "")
    if not (text.isascii() and text.isdigit()):
        return [f"{instr.name}: get-tuple-element index {text!r} is not a number"]
    index = int(text)
    if not operand.is_tuple or not 0 <= index < len(operand.tuple_shapes):
        return [f"{instr.name}: get-tuple-element index {index} out of range for {operand}"]
    if not _same(instr.shape, operand.tuple_shapes[index]):
        return [f"{instr.name}: get-tuple-element shape {instr.shape} != element {index}"]
    return []


def _fusion_problems(instr: HloInstruction, ops: list[Shape],
                     comps: dict[str, HloComputation]) -> list[str]:
    called = instr.called_computations
    if len(called) != 1 or called[0] not in comps:
        return [f"{instr.name}: fusion must call exactly one defined computation"]
    body = comps[called[0]]
    params = body.parameters
    if len(params) != len(ops):
        return [f"{instr.name}: fusion has {len(ops)} operands but {body.name} has "
                f"{len(params)} parameters"]
    problems = [
        f"{instr.name}: operand {k} is {s} but {body.name} parameter {k} is {p.shape}"
        for k, (s, p) in enumerate(zip(ops, params)) if not _same(s, p.shape)
    ]
    if not _same(body.root.shape, instr.shape):
        problems.append(f"{instr.name}: fusion result {instr.shape} != root of {body.name} "
                        f"{body.root.shape}")
    return problems
