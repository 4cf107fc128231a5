"""Makes a plan's hand-written fusions legal for XLA:GPU: ``kCustom``, with copies at the edges.

A plan written as for XLA:CPU (:func:`hlo_tools.rewrite.apply_plan`) breaks XLA:GPU's
pipeline in three ways (deviceless compiles for an H100 target, jax 0.11.2 and 0.12):

(a) ``reshape-mover`` moves reshapes across a hand-written fusion as if it were one op
    ("Fused computation shape f32[8,4,32,1] is not equal to the fusion shape
    f32[8,4,32]"). That pass is switched off in the pass list
    (``xla_passes.toml``, ``[gpu].exact_disable``), not here.
(b) Layout assignment gives a fusion's inputs and output the layouts its producers and
    users want (cuBLAS and cuDNN prefer other layouts than the default), so an
    elementwise op inside the fusion would have to change layout ("Instruction
    shouldn't change layouts %mul... f32[3,3,3,16]{2,1,0,3}").
(c) Layout assignment clears the layouts inside a normal (``kLoop``/``kInput``/
    ``kOutput``) fusion, and a reduction over a value computed inside it then aborts
    XLA (``Check failed: has_layout()``, seen on bert).

:func:`gpu_legal` writes every hand-written fusion the way that compiled every plan
tried (vgg, resnet, transformer, bert at ``small``; random plans of seeds 0-2; every
planned fusion kept):

* the fusion is ``kind=kCustom`` without ``backend_config``: layout assignment then
  leaves the layouts inside the fused computation alone (c) and no fusion pass of
  XLA:GPU's own claims it;
* the shapes inside the fused computation carry no layout, so XLA's parser gives them
  the default one (a pre-optimization module has default layouts anyway; nothing
  non-default can leak in);
* each array parameter (rank >= 1) is read through a ``copy`` (the body reads the copy)
  and the root is a ``copy`` of the old root (a tuple root: a tuple of copies of its
  elements). The copies are the only ops inside that may change layout, so whatever
  layouts the fusion's operands and users get (b), the body computes in the default
  layout. A copy that changes a layout is a transpose moved into the fusion, which is
  intended: it is done while the fused kernel reads or writes anyway. Multi-output
  fusions were not in the plans above; their tuple root gets copies of its elements for
  the same reason as a single root, and the hand-written ones of
  ``tests/test_gpu_legal.py`` (a tuple root, a variadic ``reduce`` root) compile so.

The contract: the module is a pre-optimization module (jax's lowering), which holds no
fusion of XLA's own, so every ``fusion`` instruction in it is a hand-written one (a
plan's) and all of them are rewritten. A compiled module (``is_scheduled=true``) is
refused: its fusions are XLA's and already have their layouts.

Left as they are, each for its reason:

* The AllReduce buckets of a plan (flat ``reshape``/``concatenate``/``all-reduce``/
  ``slice`` outside any fusion): plain ops, which layout assignment handles like any
  other; nothing to do.
* Scalar (rank-0) parameters and roots: a scalar has exactly one layout, so layout
  assignment cannot give it another one and a copy would change nothing. (Random plans
  of vgg, resnet, transformer and bert at ``small`` read 27 to 93 scalar parameters
  without copies per three plans and compile deviceless, jax 0.12's plugin.)
* Tuple-shaped parameters (and tuple elements nested in a tuple root): a copy of a
  tuple is a shallow copy that does not touch its elements' layouts; their
  ``get-tuple-element`` readers keep the elements' layouts. Plans do not make them.
* A parameter no instruction of the body reads (but the root) needs no copy: the root's
  copy is the one op between its layout and the output's.
* A parameter already read by copies alone, and a root that is already a copy (or a
  tuple whose array elements are copies), get no second copy: such a copy can change the
  layout already, and :func:`gpu_legal` of its own result changes nothing.

Duplicated producers (the same op copied into several fusions) are instructions of
different fused computations; every added copy gets a name unused anywhere in the
module, so names stay unique across computations.

Collectives sharing a ``channel_id`` get distinct ones (:func:`unique_channels`): jax
lowers every ``psum`` of a ``shard_map`` step with ``channel_id=1`` (jax 0.10.2 and
0.12), and the layout assignment of jax 0.10.2's XLA:GPU plugin gives all instructions
of one channel the same layout, so two all-reduces of different ranks on one channel
abort the compile ("layout minor_to_major field contains 1 elements, but shape has 2
dimensions"; every zoo model, even without a plan). Distinct channels are what XLA's
own SPMD partitioner writes; jax 0.12's plugin compiles either. Send/recv pairs, which
share a channel by design, are left alone.

:func:`fusions_kept` answers whether XLA:GPU kept a plan's fusions: it compares the
fusions of the module as written with those of XLA's optimized module (the benchmark
``benchmarks/gpu_deviceless.py``, ``disco optimize`` for a GPU target and the deviceless
tests all use it).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from hlo_tools.compiled import is_compiled
from hlo_tools.ir import HloComputation, HloInstruction, HloModule, Shape

__all__ = ["CHANNEL_COLLECTIVES", "EDGE_OPS", "GPU_FUSION_KIND", "FusionsKept", "fusion_key",
           "fusions_kept", "gpu_legal", "needs_copy", "unique_channels"]

#: The kind of every hand-written fusion on XLA:GPU (see the module docstring, (c)).
GPU_FUSION_KIND = "kCustom"

#: Collectives whose ``channel_id`` :func:`unique_channels` makes distinct (not send/recv,
#: whose pairs share one channel by design).
CHANNEL_COLLECTIVES = frozenset({
    "all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter",
    "all-to-all", "collective-permute", "collective-permute-start"})


def needs_copy(shape: Shape) -> bool:
    """Whether a value of ``shape`` at a fusion's edge is given a ``copy``: an array of
    rank >= 1 (a scalar has one layout only; a copy of a tuple or token changes no
    layout)."""
    return shape.is_array and len(shape.dims) > 0


def gpu_legal(module: HloModule) -> HloModule:
    """A copy of ``module`` in which every fusion is written as XLA:GPU compiles it.

    Every ``fusion`` instruction becomes ``kind=kCustom`` without ``backend_config``; in
    its fused computation the shapes lose their layouts (XLA gives them the default),
    each array parameter is read through a ``copy`` and the root becomes a ``copy`` of
    the old root (a tuple root: a tuple of copies). Collectives that share a channel get
    distinct ones (:func:`unique_channels`). The module docstring gives the reasons and
    what is left alone.

    Args:
        module: a pre-optimization module whose fusions are all hand-written (a plan's,
            :func:`hlo_tools.rewrite.apply_plan`); left unchanged.

    Returns:
        The rewritten copy. The fusion instructions keep their names, operands and
        shapes, so the computations that call them are unchanged.

    Raises:
        ValueError: ``module`` is a compiled module (``is_scheduled=true``), whose
            fusions are XLA's own.
    """
    if is_compiled(module):
        raise ValueError(f"module {module.name!r} is compiled (is_scheduled=true): its fusions "
                         "are XLA's own; gpu_legal rewrites pre-optimization modules only")
    from hlo_tools.rewrite import UniqueNames  # rewrite.apply_plan imports this module

    out = module.clone()
    names = UniqueNames.of_module(out)
    bodies: dict[str, None] = {}  # fused computations, each once (in order)
    for _, instr in out.instructions():
        if instr.opcode != "fusion":
            continue
        instr.attrs = _custom_attrs(instr.attrs)
        bodies.update(dict.fromkeys(instr.called_computations[:1]))
    index = {c.name: k for k, c in enumerate(out.computations)}
    for name in bodies:
        k = index[name]
        out.computations[k] = _legal_body(out.computations[k], names.fresh)
    unique_channels(out)
    return out


def unique_channels(module: HloModule) -> HloModule:
    """Gives each collective of :data:`CHANNEL_COLLECTIVES` that repeats a ``channel_id``
    a new one, above every channel of ``module``, in place (the module docstring says
    why); the first instruction of each channel keeps it, so a module whose channels are
    distinct already is unchanged.

    Returns:
        ``module``.
    """
    instrs = [i for _, i in module.instructions() if "channel_id" in i.attrs]
    top = max((int(i.attrs["channel_id"]) for i in instrs), default=0)
    seen: set[str] = set()
    for instr in instrs:
        if instr.opcode not in CHANNEL_COLLECTIVES:
            continue
        if instr.attrs["channel_id"] in seen:
            top += 1
            instr.attrs["channel_id"] = str(top)
        seen.add(instr.attrs["channel_id"])
    return module


def _custom_attrs(attrs: dict[str, str]) -> dict[str, str]:
    """A fusion's attributes with ``kind=kCustom`` and no ``backend_config`` (a kCustom
    fusion with a config would be read as one of XLA's custom fusions), in their order."""
    new = {k: (GPU_FUSION_KIND if k == "kind" else v) for k, v in attrs.items()
           if k != "backend_config"}
    new.setdefault("kind", GPU_FUSION_KIND)
    return new


def _legal_body(comp: HloComputation, fresh) -> HloComputation:
    """The fused computation ``comp`` without layouts, with a copy after each array
    parameter and a copy root (:func:`gpu_legal`); ``fresh(base)`` names new
    instructions."""
    instrs = [i.copy(shape=i.shape.without_layout()) for i in comp.instructions]
    readers: dict[str, list[HloInstruction]] = {}
    for instr in instrs:
        for op in dict.fromkeys(instr.operands):
            readers.setdefault(op, []).append(instr)
    renamed: dict[str, str] = {}  # parameter -> the copy the body reads instead
    body: list[HloInstruction] = []
    for instr in instrs:
        if instr.opcode != "parameter":
            instr.operands = [renamed.get(op, op) for op in instr.operands]
            body.append(instr)
            continue
        body.append(instr)
        users = readers.get(instr.name, [])
        if needs_copy(instr.shape) and any(u.opcode != "copy" for u in users):
            copy = HloInstruction(fresh(f"{instr.name}.copy"), "copy", instr.shape,
                                  [instr.name])
            renamed[instr.name] = copy.name
            body.append(copy)
    root_name = renamed.get(comp.root_name, comp.root_name)
    root = next(i for i in body if i.name == root_name)
    edge, root_name = _copied_root(root, {i.name: i for i in body}, fresh)
    if edge:
        at = body.index(root)
        if root.opcode == "tuple" and root.name == root_name:  # the tuple stays the root
            body[at:at] = edge[:-1]
            body[at + len(edge) - 1] = edge[-1]
        else:
            body += edge
    return HloComputation(comp.name, body, root_name, comp.is_entry, comp.suffix)


def _copied_root(root: HloInstruction, by_name: dict[str, HloInstruction], fresh
                 ) -> tuple[list[HloInstruction], str]:
    """The instructions that give a fused computation a copy root, and the new root's
    name (none and the old name: the root needs no copy).

    * An array root: its copy.
    * A ``tuple`` root: the same tuple (same name) of copies of its elements; the last
      instruction returned replaces it.
    * Another tuple-shaped root (a variadic op): ``get-tuple-element`` of each element,
      its copy, and a new tuple of them as the root.
    """
    if not root.shape.is_tuple:
        if not needs_copy(root.shape) or root.opcode == "copy":
            return [], root.name
        copy = HloInstruction(fresh(f"{root.name}.copy"), "copy", root.shape, [root.name])
        return [copy], copy.name
    out: list[HloInstruction] = []
    elements: list[str] = []
    for k, shape in enumerate(root.shape.tuple_shapes):
        if root.opcode == "tuple":
            element = root.operands[k]
        else:
            gte = HloInstruction(fresh(f"{root.name}.{k}"), "get-tuple-element", shape,
                                 [root.name], {"index": str(k)})
            out.append(gte)
            element = gte.name
        if needs_copy(shape) and (root.opcode != "tuple"
                                  or by_name[element].opcode != "copy"):
            copy = HloInstruction(fresh(f"{element}.copy"), "copy", shape, [element])
            out.append(copy)
            element = copy.name
        elements.append(element)
    if root.opcode == "tuple":
        if not out:
            return [], root.name
        return [*out, root.copy(operands=elements)], root.name
    tup = HloInstruction(fresh(f"{root.name}.copies"), "tuple", root.shape, elements)
    return [*out, tup], tup.name


# ------------------------------------------------------------ did XLA keep the fusions

#: Ops a fusion is compared without: the copies :func:`gpu_legal` adds at its edges (XLA
#: may turn a copy that changes no layout into a bitcast) and its parameters.
EDGE_OPS = frozenset({"copy", "bitcast", "parameter"})


class FusionsKept(NamedTuple):
    """Which planned fusions an optimized module holds (:func:`fusions_kept`).

    Attributes:
        planned: the planned fusions compared (those of ``min_ops`` ops or more).
        kept: how many of them a fusion of the optimized module holds, one each.
        merged: how many are not found once more but an equal fusion is kept: XLA's CSE
            merged equal fusions of equal operands into one (the same attention mask
            computed in two layers of reformer), which changes nothing the plan decided.
        lost: the keys (:func:`fusion_key`) of the others, in the plan's order.
    """

    planned: int
    kept: int
    merged: int
    lost: tuple[tuple[str, ...], ...]


def fusion_key(body: HloComputation) -> tuple[str, ...]:
    """A fused computation as XLA keeps it, whatever it renames: the sorted opcodes of its
    ops but :data:`EDGE_OPS`, ``constant`` at most once (XLA's CSE merges equal constants
    inside a fused computation: two ``-inf`` of rnnlm), last."""
    ops = [i.opcode for i in body.instructions if i.opcode not in EDGE_OPS]
    key = sorted(op for op in ops if op != "constant")
    return tuple(key + ["constant"] * ("constant" in ops))


def _fusion_ops(module: HloModule) -> list[tuple[tuple[str, ...], int]]:
    """``(key, number of ops but edges)`` of every fusion of ``module``, in order."""
    comps = module.computations_by_name()
    out = []
    for _, instr in module.instructions():
        if instr.opcode == "fusion":
            body = comps[instr.called_computations[0]]
            ops = sum(i.opcode not in EDGE_OPS for i in body.instructions)
            out.append((fusion_key(body), ops))
    return out


def fusions_kept(planned: HloModule, optimized: HloModule, *, min_ops: int = 2
                 ) -> FusionsKept:
    """Whether XLA kept the fusions of ``planned`` in ``optimized``, its compiled module.

    XLA renames instructions and computations, so fusions are compared as multisets of
    :func:`fusion_key`. Only planned fusions of ``min_ops`` ops or more (edges not
    counted) are compared: a fusion of one op is what XLA makes of any op anyway, so
    finding one proves nothing (``min_ops=0`` compares every fusion). Each of them is
    matched against the fusions of ``optimized`` of any size, each used once.

    Args:
        planned: the module as written (:func:`hlo_tools.rewrite.apply_plan`).
        optimized: XLA's optimized module compiled from it.
        min_ops: the fewest ops (but :data:`EDGE_OPS`) of a planned fusion compared.

    Returns:
        The counts and the lost fusions' keys; ``kept + merged + len(lost) == planned``.
    """
    keys = [key for key, ops in _fusion_ops(planned) if ops >= min_ops]
    left = collections.Counter(key for key, _ in _fusion_ops(optimized))
    kept, merged, lost = 0, 0, []
    for key in keys:
        if left[key] > 0:
            left[key] -= 1
            kept += 1
        elif key in left:  # an equal fusion is kept: XLA's CSE merged the two
            merged += 1
        else:
            lost.append(key)
    return FusionsKept(len(keys), kept, merged, tuple(lost))
