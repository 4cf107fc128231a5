"""Cutting a ``shard_map`` train step into per-device stages around its all-reduces.

Staged enactment runs a data-parallel step as several programs: compute stages on one
stream and the gradient all-reduces, bucket by bucket, on another (see
:mod:`disco_jax.enactment.staged`). This module does the HLO part: from the pre-optimization
whole-program module and a bucketing of its gradient all-reduces it builds

* per-device **stage modules** (plain single-device HLO, no collectives): the ``K``
  *pre* stages -- stage ``k < K`` computes what bucket ``k``'s gradients need that no
  earlier stage computed (stage 0 holds the forward pass and the backward pass up to
  bucket 0's last gradient), and outputs bucket ``k``'s gradients as one flat 1-D buffer
  (each gradient reshaped to 1-D, concatenated, as :mod:`hlo_tools.rewrite` writes a
  bucket) and the values later stages read -- then the *post* stages (the update): post
  stage ``k`` holds what depends on communication bucket ``k`` and no later one (e.g. the
  optimizer update of bucket ``k``'s parameters), so it can run while later buckets are
  still being reduced; post stages with nothing to do are dropped. Each step output
  leaves the stage that computes it (outputs that are arguments: the last stage);
* one **communication bucket** per gradient bucket; the other all-reduces (the loss,
  averaged model state) join the last bucket when they share its element type and
  reducer, else get one bucket per element type, reduced after stage ``K - 1``.

Only the all-reduce itself leaves the body: the division of ``pmean`` stays where jax
put it (``divide(all-reduce(g), 4)``), now in a post stage reading the reduced
buffer through a slice and a reshape named like the all-reduce, so the arithmetic is
the step's own.

A stage's parameters are, in order of first use, the body's parameters it reads (named
by the ENTRY argument they come from), values computed by earlier stages (named by
their instruction) and reduced buffers; constants are copied into every stage that
reads them. The assignment is the earliest one: a node belongs to the first stage that
needs it (``stage(x) = min`` over its users, a bucket's operands to that bucket's
stage), and a ``get-tuple-element`` joins its tuple's stage, so only arrays cross.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from hlo_tools.devices import parse_groups
from hlo_tools.graph import DeviceGraph, device_graph
from hlo_tools.ir import HloComputation, HloInstruction, HloModule, Shape
from hlo_tools.opcodes import COLLECTIVE_OPCODES
from hlo_tools.printer import to_text
from hlo_tools.rewrite import UniqueNames

__all__ = [
    "ARG",
    "FLAT",
    "REDUCED",
    "RESULT",
    "VALUE",
    "CommBucket",
    "Stage",
    "StageAssignment",
    "StageCut",
    "ValueRef",
    "assign_stages",
    "cut_stages",
    "default_layout",
]

#: A body parameter; ``key`` is the ENTRY argument (flat leaf) it comes from.
ARG = "arg"
#: A value computed by an earlier stage; ``key`` is its instruction name.
VALUE = "value"
#: A communication bucket's flat buffer before reduction; ``key`` is the bucket index.
FLAT = "flat"
#: A communication bucket's reduced flat buffer; ``key`` is the bucket index.
REDUCED = "reduced"
#: One output of the step (of the stage computing it); ``key`` is the ENTRY output index.
RESULT = "result"

_REDUCERS = {"add": "sum", "maximum": "max", "minimum": "min"}


class ValueRef(NamedTuple):
    """What a stage parameter or output is.

    Attributes:
        kind: :data:`ARG`, :data:`VALUE`, :data:`FLAT`, :data:`REDUCED` or :data:`RESULT`.
        key: the ENTRY argument or output index, the instruction name, or the bucket.
    """

    kind: str
    key: int | str


class CommBucket(NamedTuple):
    """One communication step: the all-reduce of one flat buffer.

    Attributes:
        members: the all-reduce instructions it replaces, in buffer order.
        sizes: elements of each member.
        element_type: HLO element type of the buffer (``"f32"``).
        reducer: ``"sum"``, ``"max"`` or ``"min"`` (the all-reduce's ``to_apply``).
        gradient: whether it is a bucket of the given bucketing (False: the other
            all-reduces, e.g. the loss's).
        after_stage: the compute stage that outputs its flat buffer.
    """

    members: tuple[str, ...]
    sizes: tuple[int, ...]
    element_type: str
    reducer: str
    gradient: bool
    after_stage: int

    @property
    def length(self) -> int:
        """Elements of the flat buffer."""
        return sum(self.sizes)


class Stage(NamedTuple):
    """One per-device compute stage.

    Attributes:
        text: the stage's HLO module (single device, no collectives).
        inputs: what each entry parameter is, in parameter order.
        outputs: what each element of the ROOT tuple is, in order.
    """

    text: str
    inputs: tuple[ValueRef, ...]
    outputs: tuple[ValueRef, ...]


class StageCut(NamedTuple):
    """A step cut into stages (:func:`cut_stages`).

    Attributes:
        stages: the compute stages in order: ``len(buckets)`` pre stages (one per
            gradient bucket), then the post stages (the update).
        buckets: the communication steps in launch order (the gradient buckets in the
            given order, then the other all-reduces).
        arg_shapes: per ENTRY argument, its per-device shape (the body parameter's).
        result_shapes: per ENTRY output, its (global, replicated) shape.
        body_name: the per-device computation that was cut.
    """

    stages: tuple[Stage, ...]
    buckets: tuple[CommBucket, ...]
    arg_shapes: tuple[Shape, ...]
    result_shapes: tuple[Shape, ...]
    body_name: str


def default_layout(shape: Shape) -> Shape:
    """``shape`` with XLA's default (major-to-minor) layout; scalars and tuples alike."""
    if shape.is_tuple:
        return Shape("tuple", tuple_shapes=tuple(default_layout(s) for s in shape.tuple_shapes))
    if not shape.is_array or not shape.dims:
        return Shape(shape.element_type, shape.dims, "", dynamic=shape.dynamic)
    layout = "{" + ",".join(str(d) for d in reversed(range(len(shape.dims)))) + "}"
    return Shape(shape.element_type, shape.dims, layout, dynamic=shape.dynamic)


# ----------------------------------------------------------------------- the ENTRY side


def _body_call(module: HloModule, body: str) -> HloInstruction:
    calls = [i for i in module.entry.instructions
             if i.opcode == "call" and body in i.called_computations]
    if len(calls) != 1:
        raise ValueError(f"ENTRY calls the per-device body {body} {len(calls)} times")
    return calls[0]


def _through_gte(by_name: dict[str, HloInstruction], name: str) -> tuple[HloInstruction, int]:
    """``(tuple producer, index)`` of a ``get-tuple-element``."""
    gte = by_name[name]
    if gte.opcode != "get-tuple-element":
        raise ValueError(f"{name} is a {gte.opcode}, expected a get-tuple-element")
    return by_name[gte.operands[0]], int(gte.attrs["index"])


def _entry_arguments(module: HloModule, call: HloInstruction) -> list[int]:
    """Per body parameter, the ENTRY parameter it is (``GlobalToLocalShape`` between)."""
    by_name = module.entry.by_name()
    out = []
    for name in call.operands:
        instr = by_name[name]
        if instr.opcode == "get-tuple-element":
            producer, index = _through_gte(by_name, name)
            instr = by_name[producer.operands[index]]
        if instr.opcode != "parameter":
            raise ValueError(f"body operand {name} is not an ENTRY parameter")
        out.append(instr.parameter_number)
    return out


def _entry_results(module: HloModule, call: HloInstruction) -> list[int]:
    """Per ENTRY output, the body result element it is (``LocalToGlobalShape`` between)."""
    entry = module.entry
    by_name = entry.by_name()
    root = entry.root
    items = root.operands if root.opcode == "tuple" else [root.name]
    out = []
    for name in items:
        producer, index = _through_gte(by_name, name)
        if producer.name != call.name:  # through the custom-call to the body's gte
            producer, index = _through_gte(by_name, producer.operands[index])
        if producer.name != call.name:
            raise ValueError(f"ENTRY output {name} does not come from the per-device body")
        out.append(index)
    return out


# ----------------------------------------------------------------- stage assignment


def _reducer(module: HloModule, instr: HloInstruction) -> str:
    comps = module.computations_by_name()
    callee = comps[instr.called_computations[0]]
    root = callee.root
    if root.opcode not in _REDUCERS or len(callee.instructions) != 3:
        raise ValueError(f"{instr.name}: unsupported all-reduce computation {callee.name}")
    return _REDUCERS[root.opcode]


def _check_groups(instr: HloInstruction) -> None:
    """Only all-reduces over every device (one replica group) are supported."""
    groups = instr.attrs.get("replica_groups", "{}")
    try:
        count = len(parse_groups(groups))
    except ValueError as err:
        raise ValueError(f"{instr.name}: {err}") from None
    if count > 1:
        raise ValueError(f"{instr.name}: all-reduce over several replica groups {groups}")


def _comm_buckets(module: HloModule, graph: DeviceGraph, buckets: Sequence[Sequence[int]]
                  ) -> tuple[list[list[int]], list[CommBucket]]:
    """The communication buckets (given ones, then the others by element type and
    reducer) as node lists and values."""
    seen: set[int] = set()
    for k, bucket in enumerate(buckets):
        if not bucket:
            raise ValueError(f"bucket {k} is empty")
        for a in bucket:
            if graph.opcodes[a] != "all-reduce" or a in seen:
                raise ValueError(f"bucket {k}: node {a} is not a new all-reduce")
            seen.add(a)
    others: dict[tuple[str, str], list[int]] = {}
    for i, op in enumerate(graph.opcodes):
        if op in COLLECTIVE_OPCODES and op != "all-reduce":
            raise ValueError(f"{graph.names[i]}: collective {op} is not supported")
        if op == "all-reduce" and i not in seen:
            instr = graph.instruction(i)
            key = (instr.shape.element_type, _reducer(module, instr))
            others.setdefault(key, []).append(i)
    nodes = [list(b) for b in buckets]
    last = len(buckets) - 1
    # the others of the last bucket's type and reducer (the loss) ride in it: one
    # collective less, and their values are reduced no later than before
    key = (graph.instruction(nodes[last][0]).shape.element_type,
           _reducer(module, graph.instruction(nodes[last][0])))
    nodes[last] += others.pop(key, [])
    nodes += list(others.values())
    out = []
    for k, members in enumerate(nodes):
        instrs = [graph.instruction(a) for a in members]
        for instr in instrs:
            _check_groups(instr)
            if not instr.shape.is_array or len(instr.operands) != 1:
                raise ValueError(f"{instr.name}: only single-operand array all-reduces")
        types = {i.shape.element_type for i in instrs}
        reducers = {_reducer(module, i) for i in instrs}
        if len(types) != 1 or len(reducers) != 1:
            raise ValueError(f"bucket {k} mixes element types {types} or reducers {reducers}")
        out.append(CommBucket(tuple(i.name for i in instrs),
                              tuple(i.shape.num_elements for i in instrs), types.pop(),
                              reducers.pop(), k < len(buckets), min(k, last)))
    return nodes, out


def _assign(graph: DeviceGraph, comm_stage: dict[int, int], comm_of: dict[int, int],
            first_post: int) -> list[int]:
    """The stage of every node (-1 for parameters, constants, all-reduces and the root).

    Stages ``< first_post`` come before the all-reduces: a node needed there belongs to
    the first stage that needs it. Every other node comes after them, in the post stage
    ``first_post + k`` of the last communication bucket ``k`` it depends on (through
    reduced values), so the update of the first buckets' parameters runs while later
    buckets are still being reduced.
    """
    n = graph.num_nodes
    stage = [first_post] * n
    for i in reversed(range(n)):
        s = first_post
        for u in graph.users[i]:
            s = min(s, comm_stage[u] if u in comm_stage else stage[u])
        stage[i] = s
    dep = [0] * n  # post nodes: the last bucket they depend on
    for i in range(n):
        if stage[i] == first_post:
            dep[i] = max([comm_of[o] if o in comm_of else dep[o]
                          for o in graph.operands[i]], default=0)
            stage[i] = first_post + dep[i]
    for i in range(n):
        if graph.opcodes[i] == "get-tuple-element":
            producer = graph.operands[i][0]
            if graph.opcodes[producer] == "parameter":
                raise ValueError(f"{graph.names[producer]}: tuple parameters are not supported")
            stage[i] = stage[producer]
    for i in range(n):
        if graph.opcodes[i] in ("parameter", "constant") or i in comm_stage or i == graph.root:
            stage[i] = -1
    return stage


class _Cut(NamedTuple):
    """What every stage of one cut shares."""

    module: HloModule
    graph: DeviceGraph
    stage: list[int]                 #: per node, its stage (-1: none)
    first_post: int                  #: the first stage after the all-reduces
    members: list[list[int]]         #: per stage, its nodes in order
    crossing: dict[int, list[int]]   #: per stage, the nodes later stages read
    nodes: list[list[int]]           #: per communication bucket, its all-reduces
    comm: list[CommBucket]
    comm_of: dict[int, int]          #: all-reduce -> its communication bucket
    arg_of: list[int]                #: body parameter -> ENTRY argument
    results: list[str]               #: per ENTRY output, the body value


# ----------------------------------------------------------------------- stage modules


class _Builder:
    """Collects one stage's ENTRY instructions, parameters and outputs."""

    def __init__(self, graph: DeviceGraph, names: set[str]):
        self.graph = graph
        self.names = UniqueNames(names)
        self.params: list[HloInstruction] = []
        self.inputs: list[ValueRef] = []
        self.body: list[HloInstruction] = []
        self.defined: set[str] = set()
        self.outputs: list[tuple[ValueRef, str, Shape]] = []

    def fresh(self, base: str) -> str:
        return self.names.fresh(base)

    def parameter(self, name: str, shape: Shape, ref: ValueRef) -> None:
        self.params.append(HloInstruction(name, "parameter", default_layout(shape),
                                          payload=str(len(self.params))))
        self.inputs.append(ref)
        self.defined.add(name)

    def add(self, instr: HloInstruction) -> None:
        self.body.append(instr)
        self.defined.add(instr.name)

    def module(self, source: HloModule, name: str) -> HloModule:
        root_name = self.fresh(f"{name}.outputs")
        shapes = tuple(default_layout(s) for _, _, s in self.outputs)
        root = HloInstruction(root_name, "tuple", Shape("tuple", tuple_shapes=shapes),
                              [n for _, n, _ in self.outputs])
        instrs = self.params + self.body + [root]
        entry = HloComputation(f"{name}.main", instrs, root_name, is_entry=True)
        called = _called(source, instrs)
        comps = [c for c in source.computations if c.name in called] + [entry]
        return HloModule(name, {}, comps, percent_names=source.percent_names)


def _called(module: HloModule, instrs: list[HloInstruction]) -> set[str]:
    """Names of the computations ``instrs`` call, transitively."""
    comps = module.computations_by_name()
    todo = [c for i in instrs for c in i.called_computations]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [c for i in comps[name].instructions for c in i.called_computations]
    return seen


def _stage(cut: _Cut, s: int) -> Stage:
    """Builds stage ``s`` (the last one returns the step's outputs)."""
    module, graph, comm = cut.module, cut.graph, cut.comm
    last = len(cut.members) - 1
    instrs = graph.computation.instructions
    b = _Builder(graph, set(graph.names) | {c.name for c in module.computations})
    params = {i.name: i.parameter_number for i in instrs if i.opcode == "parameter"}
    reduced: dict[int, str] = {}  # bucket -> its reduced buffer's parameter

    def need(o: int) -> None:
        name = graph.names[o]
        if name in b.defined:
            return
        instr = instrs[o]
        if instr.opcode == "parameter":
            b.parameter(name, instr.shape, ValueRef(ARG, cut.arg_of[params[name]]))
        elif instr.opcode == "constant":
            b.add(instr.copy())
        elif o in cut.comm_of:
            if s < cut.first_post:
                raise ValueError(f"stage {s} reads the all-reduce {name} before the update")
            k = cut.comm_of[o]
            if k not in reduced:
                reduced[k] = b.fresh(f"bucket{k}.reduced")
                b.parameter(reduced[k], Shape(comm[k].element_type, (comm[k].length,), "{0}"),
                            ValueRef(REDUCED, k))
            offset = sum(comm[k].sizes[:comm[k].members.index(name)])
            size = instr.shape.num_elements
            piece = HloInstruction(b.fresh(f"{name}.slice"), "slice",
                                   Shape(instr.shape.element_type, (size,), "{0}"),
                                   [reduced[k]], {"slice": f"{{[{offset}:{offset + size}]}}"})
            b.add(piece)
            b.add(HloInstruction(name, "reshape", instr.shape, [piece.name]))
        else:
            if cut.stage[o] >= s or instr.shape.is_tuple or not instr.shape.is_array:
                raise ValueError(f"stage {s} cannot read {name} ({instr.shape}) of stage "
                                 f"{cut.stage[o]}")
            b.parameter(name, instr.shape, ValueRef(VALUE, name))

    mine = set(cut.members[s])
    for node in cut.members[s]:
        for o in graph.operands[node]:
            if o not in mine:
                need(o)
        src = instrs[node]
        copy = src.copy()
        preds = ("control-predecessors" in (src.attr_text or str(src.attrs))
                 and copy.attrs.get("control-predecessors"))
        if preds:
            kept = [p for p in re.findall(r"[\w.\-]+", preds) if p in b.defined]
            if kept:
                copy.attrs["control-predecessors"] = "{" + ", ".join(kept) + "}"
            else:
                del copy.attrs["control-predecessors"]
        b.add(copy)
    for k, members in enumerate(cut.nodes):
        if comm[k].after_stage != s:
            continue
        pieces = []
        for a in members:
            o = graph.operands[a][0]
            need(o)
            src = instrs[o]
            flat = HloInstruction(b.fresh(f"{src.name}.flat"), "reshape",
                                  Shape(src.shape.element_type, (src.shape.num_elements,), "{0}"),
                                  [src.name])
            b.add(flat)
            pieces.append(flat.name)
        buffer = HloInstruction(b.fresh(f"bucket{k}.flat"), "concatenate",
                                Shape(comm[k].element_type, (comm[k].length,), "{0}"), pieces,
                                {"dimensions": "{0}"})
        b.add(buffer)
        b.outputs.append((ValueRef(FLAT, k), buffer.name, buffer.shape))
    for j, name in enumerate(cut.results):  # a result leaves the stage computing it
        node = graph.index[name]
        if cut.stage[node] == s or (cut.stage[node] < 0 and s == last):
            need(node)
            b.outputs.append((ValueRef(RESULT, j), name, instrs[node].shape))
    values = [(ValueRef(VALUE, graph.names[o]), graph.names[o], instrs[o].shape)
              for o in cut.crossing.get(s, [])]
    b.outputs[:0] = values
    name = f"{module.name}.stage{s}"
    return Stage(to_text(b.module(module, name)), tuple(b.inputs),
                 tuple(ref for ref, _, _ in b.outputs))



class StageAssignment(NamedTuple):
    """Which stage computes each node of a cut (:func:`assign_stages`), without HLO.

    Attributes:
        stage: ``[N]`` the stage of each node of the per-device graph (-1: parameters,
            constants, all-reduces, the root).
        first_post: the first post stage (= the number of gradient buckets).
        num_stages: pre and post stages.
        nodes: per communication bucket, its all-reduce nodes in buffer order.
        comm: the communication buckets.
    """

    stage: tuple[int, ...]
    first_post: int
    num_stages: int
    nodes: tuple[tuple[int, ...], ...]
    comm: tuple[CommBucket, ...]


def assign_stages(module: HloModule, buckets: Sequence[Sequence[int]],
                  graph: DeviceGraph | None = None) -> StageAssignment:
    """The stage of every node for a bucketing (see :func:`cut_stages`): cheap, no HLO
    is built, so a cost model can price many bucketings.

    Raises:
        ValueError: as :func:`cut_stages`.
    """
    graph = graph or device_graph(module)
    if graph.computation.name == module.entry.name:
        raise ValueError("not a shard_map step: no per-device body to cut")
    if not buckets:
        raise ValueError("at least one gradient bucket is needed")
    if graph.computation.root.opcode != "tuple":
        raise ValueError("the body's result is not a tuple")
    nodes, comm = _comm_buckets(module, graph, buckets)
    first_post = len(buckets)
    comm_stage = {a: comm[k].after_stage for k, ms in enumerate(nodes) for a in ms}
    comm_of = {a: k for k, ms in enumerate(nodes) for a in ms}
    stage = _assign(graph, comm_stage, comm_of, first_post)
    # post stages without nodes are dropped (numbers stay in order); the last one stays
    last = first_post + len(comm) - 1
    kept = sorted({s for s in stage if s >= first_post} | {last})
    renumber = {s: first_post + r for r, s in enumerate(kept)}
    return StageAssignment(tuple(renumber.get(s, s) for s in stage), first_post,
                           first_post + len(kept), tuple(map(tuple, nodes)), tuple(comm))


def cut_stages(module: HloModule, buckets: Sequence[Sequence[int]],
               graph: DeviceGraph | None = None) -> StageCut:
    """Cuts a ``shard_map`` step's pre-optimization module into per-device stages.

    Args:
        module: the whole-program module (``extract`` of a zoo step: ``shard_map`` with
            one ``pmean`` per gradient).
        buckets: the gradient buckets: lists of all-reduce node indices of ``graph``, in
            the order they are to be reduced (e.g. :func:`hlo_tools.plan.bucket_members`
            of a :func:`hlo_tools.plan.bucket_plan`); at least one.
        graph: ``device_graph(module)`` (built when None).

    Returns:
        The :class:`StageCut`: ``len(buckets)`` pre stages and at least one post stage,
        the communication buckets.

    Raises:
        ValueError: not a ``shard_map`` step, a bad bucketing, or a program the cut does
            not support (other collectives, all-reduces over several groups, tuple
            values between stages, a compute stage reading an all-reduce).
    """
    graph = graph or device_graph(module)
    plan = assign_stages(module, buckets, graph)
    call = _body_call(module, graph.computation.name)
    params = graph.computation.parameters
    arg_of = _entry_arguments(module, call)
    if len(arg_of) != len(params):
        raise ValueError("the body's parameters and its call's operands differ in number")
    nodes, comm, first_post = [list(b) for b in plan.nodes], list(plan.comm), plan.first_post
    stage = list(plan.stage)
    comm_stage = {a: comm[k].after_stage for k, ms in enumerate(nodes) for a in ms}
    comm_of = {a: k for k, ms in enumerate(nodes) for a in ms}
    results = [graph.computation.root.operands[j] for j in _entry_results(module, call)]
    stage_nodes: list[list[int]] = [[] for _ in range(plan.num_stages)]
    for i, s in enumerate(stage):
        if s >= 0:
            stage_nodes[s].append(i)
    # The values a later stage reads: outputs of the stage that computes them.
    crossing: dict[int, list[int]] = {}
    for i, s in enumerate(stage):
        if s < 0:
            continue
        read = [comm_stage[u] if u in comm_stage else stage[u]
                for u in graph.users[i] if u != graph.root]
        if any(r > s for r in read):
            crossing.setdefault(s, []).append(i)
    cut = _Cut(module, graph, stage, first_post, stage_nodes, crossing, nodes, comm, comm_of,
               arg_of, results)
    stages = tuple(_stage(cut, s) for s in range(len(stage_nodes)))
    by_param = sorted(zip(arg_of, params))
    entry_root = module.entry.root
    out_shapes = (entry_root.shape.tuple_shapes if entry_root.opcode == "tuple"
                  else (entry_root.shape,))
    return StageCut(stages, tuple(comm), tuple(p.shape for _, p in by_param),
                    tuple(out_shapes), graph.computation.name)
