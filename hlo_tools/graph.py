"""A dataflow view of the per-device program, for plans, rewrites and the simulator.

For a ``shard_map`` train step the per-device program is the body computation that
ENTRY calls between Shardy's ``GlobalToLocalShape`` and ``LocalToGlobalShape``
custom-calls; otherwise it is the ENTRY computation itself. The view is immutable and
index-based: node ``i`` is the ``i``-th instruction in print order (a topological
order), operands and users are tuples of node indices.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from hlo_tools.ir import HloComputation, HloInstruction, HloModule
from hlo_tools.opcodes import (
    COLLECTIVE_OPCODES,
    CONTROL_FLOW_OPCODES,
    ELEMENTWISE_OPCODES,
    PLUMBING_OPCODES,
    SIDE_EFFECT_OPCODES,
)

__all__ = [
    "NodeKind",
    "DeviceGraph",
    "device_computation",
    "device_graph",
    "classify",
    "ELEMENTWISE_OPCODES",
]


class NodeKind(enum.IntEnum):
    """What a node is, as far as fusion and scheduling are concerned."""

    PARAMETER = 0
    CONSTANT = 1
    COMPUTE = 2         #: an ordinary kernel that may be fused
    COLLECTIVE = 3      #: all-reduce and other cross-device communication
    CONTROL_FLOW = 4    #: while / conditional / call: never fused across or into
    CUSTOM_CALL = 5     #: opaque target code
    SIDE_EFFECT = 6     #: infeed/outfeed/send/recv/rng with state/tokens
    PLUMBING = 7        #: tuple / get-tuple-element / bitcast of tuples: never fused
    FUSION = 8          #: an existing fusion instruction (post-optimization HLO)




def classify(instr: HloInstruction) -> NodeKind:
    """The :class:`NodeKind` of one instruction."""
    op = instr.opcode
    if op == "parameter":
        return NodeKind.PARAMETER
    if op == "constant":
        return NodeKind.CONSTANT
    if op in COLLECTIVE_OPCODES:
        return NodeKind.COLLECTIVE
    if op in CONTROL_FLOW_OPCODES:
        return NodeKind.CONTROL_FLOW
    if op == "custom-call":
        return NodeKind.CUSTOM_CALL
    if op in SIDE_EFFECT_OPCODES:
        return NodeKind.SIDE_EFFECT
    if op in PLUMBING_OPCODES or instr.shape.is_tuple or instr.shape.element_type == "token":
        return NodeKind.PLUMBING
    if op == "fusion":
        return NodeKind.FUSION
    return NodeKind.COMPUTE


class DeviceGraph(NamedTuple):
    """Immutable dataflow graph of one computation, indexed by node.

    Attributes:
        module: the module the graph was built from (not modified by plans).
        computation: the per-device computation the nodes belong to.
        names: ``[N]`` instruction names in print (topological) order.
        opcodes: ``[N]`` opcodes.
        kinds: ``[N]`` :class:`NodeKind` of each node.
        operands: ``[N]`` operand node indices of each node, in operand order
            (an operand used twice appears twice).
        users: ``[N]`` distinct user node indices of each node, ascending.
        out_bytes: ``[N]`` bytes of each node's result.
        gradient_allreduces: indices of all-reduces that carry gradients, in print order.
        index: name -> node index.
    """

    module: HloModule
    computation: HloComputation
    names: tuple[str, ...]
    opcodes: tuple[str, ...]
    kinds: tuple[NodeKind, ...]
    operands: tuple[tuple[int, ...], ...]
    users: tuple[tuple[int, ...], ...]
    out_bytes: tuple[int, ...]
    gradient_allreduces: tuple[int, ...]
    index: dict[str, int]

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    def instruction(self, node: int) -> HloInstruction:
        return self.computation.instructions[node]

    def nodes_of_kind(self, *kinds: NodeKind) -> list[int]:
        return [i for i, k in enumerate(self.kinds) if k in kinds]

    @property
    def root(self) -> int:
        return self.index[self.computation.root_name]


def device_computation(module: HloModule) -> HloComputation:
    """The per-device program: the largest shard_map body ENTRY calls, else ENTRY.

    A ``shard_map`` lowers to ``call(...), to_apply=xla.sdy.manual_computation_body...``
    in ENTRY (pre-optimization HLO). Post-optimization HLO has no such call and the
    per-device program is ENTRY itself.
    """
    entry = module.entry
    comps = module.computations_by_name()
    bodies = [
        comps[callee]
        for instr in entry.instructions if instr.opcode == "call"
        for callee in instr.called_computations
        if callee.startswith("xla.sdy.manual_computation_body") or callee.startswith("shmap_body")
    ]
    if not bodies:
        return entry
    return max(bodies, key=lambda c: len(c.instructions))


def device_graph(module: HloModule, computation: HloComputation | None = None) -> DeviceGraph:
    """Builds the :class:`DeviceGraph` of ``computation`` (default: the per-device program)."""
    comp = computation or device_computation(module)
    instrs = comp.instructions
    index = {instr.name: i for i, instr in enumerate(instrs)}
    operands = tuple(tuple(index[o] for o in instr.operands) for instr in instrs)
    users: list[list[int]] = [[] for _ in instrs]
    for i, ops in enumerate(operands):
        for o in sorted(set(ops)):
            users[o].append(i)
    kinds = tuple(classify(i) for i in instrs)
    param_sizes = {i.shape.num_elements for i in instrs if i.opcode == "parameter"}
    grads = tuple(
        i for i, instr in enumerate(instrs)
        if instr.opcode == "all-reduce" and _is_gradient(instr, param_sizes)
    )
    return DeviceGraph(
        module=module,
        computation=comp,
        names=tuple(i.name for i in instrs),
        opcodes=tuple(i.opcode for i in instrs),
        kinds=kinds,
        operands=operands,
        users=tuple(tuple(u) for u in users),
        out_bytes=tuple(i.shape.byte_size() for i in instrs),
        gradient_allreduces=grads,
        index=index,
    )


def _is_gradient(instr: HloInstruction, param_sizes: set[int]) -> bool:
    """Heuristic: an all-reduce carries a gradient if each of its results has as many
    elements as some parameter of the per-device program (the loss, a scalar, only
    counts when a parameter is a scalar too)."""
    leaves = list(instr.shape.leaves())
    return all(leaf.num_elements in param_sizes for leaf in leaves)
