"""Materializes a :class:`~hlo_tools.plan.Plan` as HLO: fusions, copies and buckets.

* A fusion group becomes one ``fusion`` instruction calling a new fused computation that
  holds the group's members (and copies of duplicated producers). Its outputs are the
  members read outside the group (:func:`hlo_tools.plan.group_outputs`). A group with
  several outputs is a multi-output fusion: its root is a tuple and ``get-tuple-element``
  instructions named like the original members give the other instructions the values
  they read, so users need no renaming.
* An AllReduce bucket becomes one all-reduce over a flat buffer: each gradient is
  reshaped to 1-D, the pieces are concatenated, one all-reduce sums the buffer, and
  slices of the result, reshaped back and named like the original all-reduces, give the
  users their values (see :func:`_bucket`).
* The plan's all-reduces (buckets and single ones) are chained in schedule order: each
  one reads a zero made from the previous one's result (:func:`_tie`), so none can start
  before the one before it has ended. Every process of a job must run a program's
  collectives in the same order (gloo pairs messages by arrival), and XLA orders
  collectives that no data connects differently in different processes: its compile is
  not deterministic across processes, and it drops ``opt-barrier`` and control
  dependencies from this order. A bucket carries the zero as one extra element of its
  buffer (the gradients' arithmetic is untouched); a single all-reduce adds it to the
  first element of its operand (``x + 0``, :func:`_add_to_head`).
* Compute groups nobody reads any more (every reader holds its own copy) are left out
  (:func:`hlo_tools.plan.dead_groups`).
* The per-device computation is printed in the plan's schedule order.
* For XLA:GPU (``backend="gpu"``) the fusions are then written as XLA:GPU compiles them
  (:func:`hlo_tools.gpu_legal.gpu_legal`: ``kCustom``, copies at their edges).
"""

from __future__ import annotations

from hlo_tools.gpu_legal import GPU_FUSION_KIND, gpu_legal
from hlo_tools.graph import DeviceGraph, device_graph
from hlo_tools.ir import HloComputation, HloInstruction, HloModule, Shape
from hlo_tools.plan import FusionSpace, Plan, copy_readers, dead_groups, group_outputs

__all__ = ["UniqueNames", "apply_plan", "fusion_kind"]


def fusion_kind(opcodes: list[str], backend: str = "cpu") -> str:
    """The fusion kind a hand-written fusion of these opcodes is given on ``backend``.

    XLA:CPU fuses everything we fuse (elementwise ops, broadcasts, reductions) as
    ``kLoop``; a ``kOutput`` dot fusion written as text aborts its emitter, and dots are
    never fused on CPU. On XLA:GPU every hand-written fusion is ``kCustom`` whatever it
    holds: layout assignment would clear the layouts inside a ``kLoop``/``kInput``/
    ``kOutput`` fusion (:mod:`hlo_tools.gpu_legal`, which writes the rest of that form).
    """
    if backend == "gpu":
        return GPU_FUSION_KIND
    return "kLoop"


class UniqueNames:
    """Hands out names not yet taken: ``fresh("x")`` is ``x``, else ``x.1``, ``x.2``, ...

    Args:
        taken: the names in use (kept: every name handed out is added to it).
    """

    def __init__(self, taken: set[str]):
        self.taken = taken

    @classmethod
    def of_module(cls, module: HloModule) -> UniqueNames:
        """Names unique among ``module``'s instructions and computations."""
        return cls({i.name for _, i in module.instructions()}
                   | {c.name for c in module.computations})

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}.{k}"
        self.taken.add(name)
        return name


def apply_plan(module: HloModule, plan: Plan, graph: DeviceGraph | None = None,
               backend: str = "cpu", ordered: bool | None = None) -> HloModule:
    """Writes ``plan`` into a copy of ``module``.

    Args:
        module: the module the plan's graph was built from (left unchanged).
        plan: the plan to enact.
        graph: the plan's graph (default: ``device_graph(module)``).
        backend: ``"cpu"`` or ``"gpu"``: on ``"gpu"`` the result is made legal for
            XLA:GPU by :func:`hlo_tools.gpu_legal.gpu_legal` (``kCustom`` fusions with
            copies at their edges).
        ordered: chain the all-reduces in schedule order (the module docstring; None:
            on ``"cpu"``, where a program's gloo all-reduces run inline and the chain
            costs no overlap). On a GPU the zero's small kernel would hold the compute
            stream until the all-reduce before it ends. False also writes the plan alone
            for comparing it with the plan's own cost (the simulator does not price the
            chain).

    Returns:
        A new module in which the per-device computation holds the planned fusions and
        AllReduce buckets, in the plan's schedule order.
    """
    graph = graph or device_graph(module)
    if ordered is None:
        ordered = backend == "cpu"
    out = module.clone()
    comp = out.computation(graph.computation.name)
    instrs = comp.instructions
    names = UniqueNames.of_module(out)
    groups = plan.groups()
    copies: dict[int, list[int]] = {}
    for p, g in plan.dups:
        copies.setdefault(g, []).append(p)
    readers = copy_readers(graph, plan)
    done: set[int] = dead_groups(FusionSpace(graph), plan)
    new_instrs: list[HloInstruction] = []
    new_comps: list[HloComputation] = []
    last: HloInstruction | None = None  # the latest all-reduce written
    for node in plan.order:
        gid = plan.group[node]
        if gid in done:
            continue
        if gid not in groups:
            instr = instrs[node]
            if graph.opcodes[node] == "all-reduce" and last is not None:
                first = instr.operands[0]
                shape = graph.computation.instructions[graph.index[first]].shape
                if shape.is_array:
                    tie, zero = _tie(last, shape.element_type, names)
                    new_instrs += tie + _add_to_head(first, shape, zero, names)
                    tied = new_instrs[-1]
                    instr = instr.copy(operands=[tied.name, *instr.operands[1:]])
            new_instrs.append(instr)
            if graph.opcodes[node] == "all-reduce" and ordered:
                last = instr
            done.add(gid)
            continue
        done.add(gid)
        ms = groups[gid]
        if graph.opcodes[ms[0]] == "all-reduce":
            written = _bucket(instrs, ms, names, last)
            new_instrs += written
            if ordered:
                last = next(i for i in written if i.opcode == "all-reduce")
        else:
            outputs = list(group_outputs(graph, plan, ms, readers))
            fused, body = _fusion(out, instrs, ms, copies.get(gid, []), outputs, names,
                                  backend, graph)
            new_instrs += fused
            new_comps.append(body)
    comp.instructions = new_instrs
    index = out.computations.index(comp)
    out.computations[index:index] = new_comps
    return gpu_legal(out) if backend == "gpu" else out


def _tie(last: HloInstruction, element_type: str, names: UniqueNames
         ) -> tuple[list[HloInstruction], str]:
    """A scalar zero of ``element_type`` computed from the all-reduce ``last``'s result
    (its first element times 0), so that whatever reads it waits for ``last``.

    XLA does not fold ``x * 0`` for floating-point types (it is NaN for an infinite or
    NaN ``x``); for integer types it does, and such an all-reduce stays unordered.

    Returns:
        The instructions to write, and the name of the zero.
    """
    out: list[HloInstruction] = []
    value, shape = last.name, last.shape
    while shape.is_tuple:
        shape = shape.tuple_shapes[0]
        gte = HloInstruction(names.fresh(f"{last.name}.first"), "get-tuple-element", shape,
                             [value], {"index": "0"})
        out.append(gte)
        value = gte.name
    etype = shape.element_type
    if shape.dims:
        one = HloInstruction(names.fresh(f"{last.name}.head"), "slice",
                             Shape(etype, (1,) * len(shape.dims), ""), [value],
                             {"slice": "{" + ",".join("[0:1]" for _ in shape.dims) + "}"})
        scalar = HloInstruction(names.fresh(f"{last.name}.head"), "reshape", Shape(etype),
                                [one.name])
        out += [one, scalar]
        value = scalar.name
    if etype != element_type:
        cast = HloInstruction(names.fresh(f"{last.name}.head"), "convert",
                              Shape(element_type), [value])
        out.append(cast)
        value = cast.name
    zero = HloInstruction(names.fresh(f"{last.name}.nought"), "constant", Shape(element_type),
                          payload="0")
    tie = HloInstruction(names.fresh(f"{last.name}.tie"), "multiply", Shape(element_type),
                         [value, zero.name])
    return [*out, zero, tie], tie.name


def _add_to_head(name: str, shape: Shape, zero: str, names: UniqueNames
                 ) -> list[HloInstruction]:
    """``name`` with the scalar ``zero`` added to its first element alone (a scalar: to
    it), written back with ``dynamic-update-slice``: the value is unchanged and now
    depends on ``zero``. Only one element is touched, and no elementwise op over the
    whole array gives XLA's simplifier a reshape to move out of a hand-written fusion.

    Returns:
        The instructions to write; the last one stands for ``name``.
    """
    etype = shape.element_type
    if not shape.dims:
        return [HloInstruction(names.fresh(f"{name}.ordered"), "add", shape, [name, zero])]
    ones = Shape(etype, (1,) * len(shape.dims), "")
    head = HloInstruction(names.fresh(f"{name}.head"), "slice", ones, [name],
                          {"slice": "{" + ",".join("[0:1]" for _ in shape.dims) + "}"})
    wide = HloInstruction(names.fresh(f"{name}.zero"), "broadcast", ones, [zero],
                          {"dimensions": "{}"})
    moved = HloInstruction(names.fresh(f"{name}.head"), "add", ones, [head.name, wide.name])
    index = HloInstruction(names.fresh(f"{name}.origin"), "constant", Shape("s32"),
                           payload="0")
    tied = HloInstruction(names.fresh(f"{name}.ordered"), "dynamic-update-slice", shape,
                          [name, moved.name, *[index.name] * len(shape.dims)])
    return [head, wide, moved, index, tied]


def _bucket(instrs: list[HloInstruction], ms: list[int], names: UniqueNames,
            last: HloInstruction | None = None) -> list[HloInstruction]:
    """One all-reduce for the bucket ``ms`` over a flat buffer of all its gradients.

    Each gradient is reshaped to 1-D, the pieces are concatenated, one all-reduce sums
    the buffer, and each member's name is given to a slice (reshaped back) of the result,
    so users need no renaming. This is the fusion buffer of Horovod and DDP. A variadic
    (tuple) all-reduce would avoid the copies, but inside a shard_map body on jax 0.10.2
    Shardy rejects tuple-shaped results and GSPMD supports only single-operand
    all-reduces in manual mode, so the flat buffer is what compiles.
    """
    first = instrs[ms[0]]
    etype = first.shape.element_type
    sizes = [instrs[m].shape.num_elements for m in ms]
    out: list[HloInstruction] = []
    flat = []
    if last is not None:  # element 0 of the buffer: the zero that orders it after ``last``
        tie, zero = _tie(last, etype, names)
        head = HloInstruction(names.fresh(f"{first.name}.order"), "reshape",
                              Shape(etype, (1,), "{0}"), [zero])
        out += [*tie, head]
        flat.append(head.name)
    lead = len(flat)
    total = lead + sum(sizes)
    for m, n in zip(ms, sizes):
        piece = HloInstruction(names.fresh(f"{instrs[m].name}.flat"), "reshape",
                               Shape(etype, (n,), "{0}"), list(instrs[m].operands))
        out.append(piece)
        flat.append(piece.name)
    buffer = HloInstruction(names.fresh(f"{first.name}.buffer"), "concatenate",
                            Shape(etype, (total,), "{0}"), flat, {"dimensions": "{0}"})
    attrs = {k: v for k, v in first.attrs.items() if k != "metadata"}
    bucket = HloInstruction(names.fresh(f"{first.name}.bucket"), "all-reduce",
                            Shape(etype, (total,), "{0}"), [buffer.name], attrs)
    out += [buffer, bucket]
    offset = lead
    for m, n in zip(ms, sizes):
        member = instrs[m]
        piece = HloInstruction(names.fresh(f"{member.name}.slice"), "slice",
                               Shape(etype, (n,), "{0}"), [bucket.name],
                               {"slice": f"{{[{offset}:{offset + n}]}}"})
        out += [piece, HloInstruction(member.name, "reshape", member.shape, [piece.name])]
        offset += n
    return out


def _fusion(module: HloModule, instrs: list[HloInstruction], ms: list[int], copied: list[int],
            outputs: list[int], names: UniqueNames, backend: str,
            graph: DeviceGraph) -> tuple[list[HloInstruction], HloComputation]:
    """The fusion instruction(s) for group ``ms`` and its fused computation."""
    inner: dict[str, str] = {}  # outer name -> name inside the fused computation
    params: list[HloInstruction] = []
    operands: list[str] = []
    body: list[HloInstruction] = []
    member_names = {instrs[m].name for m in ms}

    def inside(name: str) -> str:
        if name not in inner:
            k = len(params)
            shape = graph.computation.instructions[graph.index[name]].shape
            param = HloInstruction(names.fresh(f"{name}.param"), "parameter", shape,
                                   payload=str(k))
            params.append(param)
            operands.append(name)
            inner[name] = param.name
        return inner[name]

    copy_names = {instrs[p].name for p in copied}
    # Original node indices are a topological order, so sorting by them orders the body.
    for node in sorted(set(copied) | set(ms)):
        src = instrs[node]
        suffix = "dup" if src.name in copy_names else "f"
        new_name = names.fresh(f"{src.name}.{suffix}")
        ops = [inner[op] if op in member_names or op in copy_names else inside(op)
               for op in src.operands]
        body.append(src.copy(name=new_name, operands=ops))
        inner[src.name] = new_name
    out_names = [instrs[m].name for m in outputs] or [instrs[ms[-1]].name]
    if len(out_names) == 1:
        root_name = inner[out_names[0]]
        shape = instrs[graph.index[out_names[0]]].shape
    else:
        shape = Shape("tuple", tuple_shapes=tuple(instrs[graph.index[n]].shape for n in out_names))
        root_name = names.fresh(f"{out_names[-1]}.tuple")
        body.append(HloInstruction(root_name, "tuple", shape, [inner[n] for n in out_names]))
    comp = HloComputation(names.fresh(f"fused_{out_names[-1]}"), params + body, root_name)
    kind = fusion_kind([instrs[m].opcode for m in ms], backend)
    sigil = "%" if module.percent_names else ""
    attrs = {"kind": kind, "calls": f"{sigil}{comp.name}"}
    if len(out_names) == 1:
        return [HloInstruction(out_names[0], "fusion", shape, operands, attrs)], comp
    fusion = HloInstruction(names.fresh(f"fusion.{out_names[-1]}"), "fusion", shape, operands,
                            attrs)
    gtes = [HloInstruction(n, "get-tuple-element", instrs[graph.index[n]].shape, [fusion.name],
                           {"index": str(k)}) for k, n in enumerate(out_names)]
    return [fusion, *gtes], comp
