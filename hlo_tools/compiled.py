"""XLA's compiled (post-optimization) modules: recognising one, and making one that XLA
compiles again into the same program.

A compiled module (``jax.jit(f).lower(...).compile().as_text()``) is the program XLA
runs: its fusions, combined all-reduces and kernel-library calls are final. To time it
in context it has to be compiled once more, and XLA does not take the text as printed:

* the header records the finished compilation (``is_scheduled=true``, the partition
  count of the SPMD program it came from, the entry layout), and the entry parameters
  their shardings, though the program is already the per-device one;
* its fusions do not survive the way in: jax hands XLA MLIR, which keeps no layouts
  inside fused computations, and XLA:CPU's emitters abort the process on a fusion
  whose ops need them (reshapes, transposes, reductions of degenerate shapes...); a
  kernel-library fusion (``kind=kCustom``, XLA:CPU's ``ynn_fusion``) is only compiled
  with the backend configuration the printed text leaves out; a ``bitcast`` means
  nothing without layouts;
* large constants are printed elided, as ``{...}``.

:func:`runnable` gives XLA the module's ops as they are, its fusions unfused: XLA's own
pipeline (``CompileOptions(exact=False)``) then fuses them, wraps the library ops and
assigns layouts as it did the first time, from the ops it made then, and never meets a
fusion it did not make. Its collectives stay as written (a combined all-reduce is one
all-reduce of several buffers already). Each op carries the name of the module's
instruction it belongs to in its ``op_name`` (:data:`NODE_TAG`), so the kernels of the
new compilation (named afresh by XLA) map back to the module's instructions
(:func:`tagged_node`).
"""

from __future__ import annotations

from hlo_tools.ir import HloComputation, HloInstruction, HloModule, Shape

__all__ = ["NODE_TAG", "is_compiled", "is_library_fusion", "runnable", "tagged_node"]

#: Prefix of the ``op_name`` that :func:`runnable` gives each instruction: the name of the
#: module's instruction it belongs to follows it.
NODE_TAG = "disco.node/"

#: Header attributes of a finished compilation, which the recompiled program must not
#: inherit (it is compiled as one replica per device, its layouts assigned afresh).
_COMPILE_STATE = ("is_scheduled", "num_partitions", "entry_computation_layout",
                  "allow_spmd_sharding_propagation_to_parameters",
                  "allow_spmd_sharding_propagation_to_output")


def is_compiled(module: HloModule) -> bool:
    """Whether ``module`` is XLA's compiled module (its header says ``is_scheduled=true``),
    not a pre-optimization one."""
    return module.header_attrs.get("is_scheduled") == "true"


def is_library_fusion(instr: HloInstruction) -> bool:
    """Whether ``instr`` is a kernel-library fusion of XLA's: ``kind=kCustom`` with a
    backend config naming the library kernel (XLA:CPU's ``__ynn_fusion``, XLA:GPU's
    cuBLAS and Triton GEMM fusions). A plan's fusion written for XLA:GPU is ``kCustom``
    too, but carries no backend config (:mod:`hlo_tools.gpu_legal`), before and after
    XLA compiles it: it is an ordinary fusion of the plan's ops."""
    return (instr.opcode == "fusion" and instr.attrs.get("kind") == "kCustom"
            and "backend_config" in instr.attrs)


def tagged_node(op_name: str | None) -> str | None:
    """The module instruction a kernel of :func:`runnable`'s compilation came from, read
    off the kernel's ``op_name`` (None: it carries no tag)."""
    if not op_name or NODE_TAG not in op_name:
        return None
    return op_name.rsplit(NODE_TAG, 1)[1]


def runnable(module: HloModule, *, split_combined: bool = False) -> HloModule:
    """``module`` (a compiled module) as ops that XLA compiles again into its program.

    The compile state leaves the header and the parameters' shardings are dropped; so are
    layouts, and a ``bitcast`` becomes the ``reshape`` (and ``bitcast-convert``) it stands
    for. Every fusion is
    replaced by its fused computation's instructions (the root taking the fusion's name,
    the others ``<fusion>.<name>``). An elided constant (``{...}``) becomes a broadcast
    zero of its shape (its values cannot be known; timing does not depend on them).
    Every instruction outside fused bodies is tagged (:data:`NODE_TAG`) with its own
    name, or the name of the fusion it came from. ``module`` is not changed.

    ``split_combined``: each combined (tuple-shaped) all-reduce becomes one all-reduce
    per buffer, all tagged with its name, and a tuple of them under its name, for XLA
    versions that do not compile a combined all-reduce given as text (jaxlib < 0.12 on
    CPU); XLA's combiner combines them again.
    """
    out = module.clone()
    for key in _COMPILE_STATE:
        out.header_attrs.pop(key, None)
    comps = out.computations_by_name()
    fused = {name for _, i in out.instructions() if i.opcode == "fusion"
             for name in i.called_computations}
    channels = [max((int(i.attrs["channel_id"]) for _, i in out.instructions()
                     if "channel_id" in i.attrs), default=0) if split_combined else 0]
    for comp in out.computations:
        if comp.name in fused:
            continue
        kept: list[tuple[str, HloInstruction]] = []
        for instr in comp.instructions:
            if instr.opcode == "fusion":
                made = _inlined(comps[instr.called_computations[0]], instr)
            elif instr.opcode == "constant" and "..." in instr.payload:
                made = _zeros(instr)
            elif split_combined and instr.opcode == "all-reduce" and instr.shape.is_tuple:
                made = _split(instr, channels)
            else:
                if instr.opcode == "parameter":
                    instr.attrs.pop("sharding", None)
                made = [instr]
            kept.extend((instr.name, i) for i in made)
        for node, instr in kept:
            instr.attrs["metadata"] = f'{{op_name="{NODE_TAG}{node}"}}'
        comp.instructions = [i for _, i in kept]
    for comp in out.computations:
        for instr in comp.instructions:
            instr.shape = instr.shape.without_layout()
        shapes = {i.name: i.shape for i in comp.instructions}
        comp.instructions = [r for i in comp.instructions for r in _unbitcast(i, shapes)]
    called = {name for _, i in out.instructions() for name in i.called_computations}
    out.computations = [c for c in out.computations if c.name not in fused or c.name in called]
    return out


def _inlined(body: HloComputation, fusion: HloInstruction) -> list[HloInstruction]:
    """The instructions of a fusion's ``body`` in the caller, its parameters replaced by
    the fusion's operands; the root takes the fusion's name, the others
    ``<fusion>.<name>``."""
    rename = {p.name: fusion.operands[p.parameter_number] for p in body.parameters}
    out = []
    for instr in body.instructions:
        if instr.opcode == "parameter":
            continue
        name = fusion.name if instr.name == body.root_name else f"{fusion.name}.{instr.name}"
        rename[instr.name] = name
        out.append(instr.copy(name=name, operands=[rename[o] for o in instr.operands]))
    return out


def _split(combined: HloInstruction, channels: list[int]) -> list[HloInstruction]:
    """One all-reduce per buffer of a combined all-reduce (``channels``: the last channel
    id used, advanced), and their tuple under its name."""
    parts = []
    for k, (operand, leaf) in enumerate(zip(combined.operands, combined.shape.tuple_shapes,
                                            strict=True)):
        attrs = dict(combined.attrs)
        if "channel_id" in attrs:
            channels[0] += 1
            attrs["channel_id"] = str(channels[0])
        parts.append(HloInstruction(f"{combined.name}.part{k}", "all-reduce", leaf,
                                    [operand], attrs))
    return [*parts, HloInstruction(combined.name, "tuple", combined.shape,
                                   [p.name for p in parts])]


def _unbitcast(instr: HloInstruction, shapes: dict[str, Shape]) -> list[HloInstruction]:
    """A ``bitcast`` as the ops it stands for without layouts: a ``reshape``, after a
    ``bitcast-convert`` where it changes the element type (same bit width); any other
    instruction as it is."""
    if instr.opcode != "bitcast" or not instr.shape.is_array:
        return [instr]
    source = shapes[instr.operands[0]]
    if source.element_type == instr.shape.element_type:
        return [instr.copy(opcode="reshape")]
    converted = HloInstruction(f"{instr.name}.convert", "bitcast-convert",
                               Shape(instr.shape.element_type, source.dims), instr.operands,
                               {k: v for k, v in instr.attrs.items() if k == "metadata"})
    return [converted, instr.copy(opcode="reshape", operands=[converted.name])]


def _zeros(constant: HloInstruction) -> list[HloInstruction]:
    """An elided constant as a zero scalar broadcast to its shape."""
    zero = "false" if constant.shape.element_type == "pred" else "0"
    scalar = HloInstruction(f"{constant.name}.zero", "constant",
                            Shape(constant.shape.element_type), payload=zero)
    return [scalar, HloInstruction(constant.name, "broadcast", constant.shape, [scalar.name],
                                   {"dimensions": "{}"})]
