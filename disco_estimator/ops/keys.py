"""What identifies an op and describes it: op keys, opcode classes, bytes and flops.

An :class:`OpKey` says what an op computes, independent of names and layouts: opcode,
operand shapes, result shape, dtype and a hash of the attributes that change what it
computes. Equal keys cost the same time, so a time measured in one program serves
identical ops elsewhere. :func:`describe_instruction` gives an op's key with the features
of the analytic fallback model (:mod:`disco_estimator.ops.table`): its opcode class, bytes
and flops. :func:`timing_key` is the key an op's time is stored under (its
:func:`library_key` when it runs inside XLA's kernel library), and :func:`op_status` says
whether an op is timed standalone (:mod:`disco_estimator.ops.standalone`), runs no kernel,
or is skipped.

Sizes are bytes and work flops throughout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from hlo_tools.compiled import is_library_fusion
from hlo_tools.ir import NUMPY_DTYPES, HloInstruction, HloModule
from hlo_tools.opcodes import (
    COLLECTIVE_PREFIXES,
    CONTROL_FLOW_OPCODES,
    FREE_OPCODES,
    NOT_STANDALONE_OPCODES,
)

__all__ = [
    "LIBRARY_SUFFIX",
    "OP_CLASSES",
    "OpInfo",
    "OpKey",
    "OpStatus",
    "analyze_module",
    "describe_instruction",
    "dims_attr",
    "fusion_computations",
    "is_library_fusion",
    "library_computations",
    "library_info",
    "library_instructions",
    "library_key",
    "map_to_original",
    "module_view",
    "op_key",
    "op_status",
    "opcode_class",
    "timing_key",
]

#: Opcode classes of the analytic fallback model.
OP_CLASSES = ("elementwise", "reduce", "dot-conv", "data-movement", "other")

_ELEMENTWISE = frozenset("""
abs add and atan2 cbrt ceil clamp compare complex convert cosine divide erf exponential
exponential-minus-one floor imag is-finite log log-plus-one logistic maximum minimum multiply
negate not or popcnt count-leading-zeros power real reduce-precision remainder
round-nearest-afz round-nearest-even rsqrt select shift-left shift-right-arithmetic
shift-right-logical sign sine sqrt stochastic-convert subtract tan tanh xor map
""".split())
_REDUCE = frozenset(["reduce", "reduce-window", "select-and-scatter", "sort", "scan"])
_DOT = frozenset(["dot", "convolution", "ragged-dot", "cholesky", "triangular-solve", "fft"])
_DATA = frozenset("""
copy transpose broadcast reshape slice concatenate dynamic-slice dynamic-update-slice pad
reverse gather scatter iota bitcast bitcast-convert copy-start copy-done
""".split())
#: Attributes that do not change what an op computes (left out of its key).
_KEY_SKIP_ATTRS = frozenset([
    "metadata", "sharding", "frontend_attributes", "channel_id", "statistics",
    "origin", "control-predecessors", "schedule_id",
])
_CALL_ATTRS = ("calls", "to_apply", "condition", "body", "branch_computations")


# --------------------------------------------------------------------------- op keys


@dataclasses.dataclass(frozen=True)
class OpKey:
    """What an op computes, independent of names: equal keys cost the same time.

    Attributes:
        opcode: HLO opcode; fusions as ``"fusion:kLoop"``.
        operand_shapes: operand shapes without layout, e.g. ``("f32[16,32]",)``.
        result_shape: result shape without layout.
        dtype: result element type (``"tuple"`` for tuple results).
        detail: hash of the attributes that change the computation (dimensions,
            contracting dims, the fused body, ...); empty if none.
    """

    opcode: str
    operand_shapes: tuple[str, ...]
    result_shape: str
    dtype: str
    detail: str = ""

    def encode(self) -> str:
        """A one-line string form, used as the JSON key."""
        return "|".join([self.opcode, ";".join(self.operand_shapes), self.result_shape,
                         self.dtype, self.detail])

    @classmethod
    def decode(cls, text: str) -> OpKey:
        """Inverse of :meth:`encode`."""
        opcode, operands, result, dtype, detail = text.split("|")
        return cls(opcode, tuple(operands.split(";")) if operands else (), result, dtype,
                   detail)


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """An op's key with the features of the fallback model.

    Attributes:
        key: the op key.
        cls: opcode class (one of :data:`OP_CLASSES`).
        bytes: operand plus result bytes.
        flops: estimated floating-point operations.
        op_names: ``metadata op_name`` of the op and of the ops fused into it: the
            original instruction names when the program came from HLO text.
    """

    key: OpKey
    cls: str
    bytes: int
    flops: float
    op_names: tuple[str, ...] = ()


def opcode_class(opcode: str) -> str:
    """Fallback-model class of a plain (non-fusion) opcode."""
    if opcode in _ELEMENTWISE:
        return "elementwise"
    if opcode in _REDUCE:
        return "reduce"
    if opcode in _DOT:
        return "dot-conv"
    if opcode in _DATA:
        return "data-movement"
    return "other"


def _shape_text(shape: Any) -> str:
    return str(shape.without_layout()) if hasattr(shape, "without_layout") else str(shape)


def _elements(shape: Any) -> int:
    return int(getattr(shape, "num_elements", 0) or 0)


def dims_attr(text: str | None) -> list[int]:
    """The integers of a list attribute such as ``dimensions={0,2}`` (empty for none)."""
    if not text:
        return []
    inner = text.strip().strip("{}").strip()
    return [int(x) for x in inner.split(",") if x.strip()]


class _ModuleView:
    """Lookup tables over a parsed ``hlo_tools.HloModule``."""

    def __init__(self, module: Any):
        self.module = module
        self.comps = {c.name: c for c in module.computations}
        self.instr = {i.name: i for c in module.computations for i in c.instructions}
        self._body_hash: dict[str, str] = {}

    def called(self, instr: Any) -> list[Any]:
        names = instr.called_computations if hasattr(instr, "called_computations") else []
        return [self.comps[n] for n in names if n in self.comps]

    def body_hash(self, comp: Any) -> str:
        """A name-free fingerprint of a computation (opcodes, shapes, wiring, attrs)."""
        if comp.name not in self._body_hash:
            index = {i.name: k for k, i in enumerate(comp.instructions)}
            parts = []
            for i in comp.instructions:
                ops = ",".join(str(index.get(o, o)) for o in i.operands)
                parts.append(f"{i.opcode}:{_shape_text(i.shape)}({ops}){self.attr_text(i)}")
            digest = hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]
            self._body_hash[comp.name] = digest
        return self._body_hash[comp.name]

    def attr_text(self, instr: Any) -> str:
        parts = []
        for k, v in instr.attrs.items():
            if k in _KEY_SKIP_ATTRS:
                continue
            if k in _CALL_ATTRS:
                v = ",".join(self.body_hash(c) for c in self.called(instr))
            parts.append(f"{k}={v}")
        if instr.opcode == "constant":
            parts.append(f"value={getattr(instr, 'payload', '')}")
        return ";".join(parts)


def _fusion_class(view: _ModuleView, instr: Any) -> str:
    opcodes = _body_opcodes(view, instr)
    for cls in ("dot-conv", "reduce", "elementwise", "data-movement"):
        if any(opcode_class(o) == cls for o in opcodes):
            return cls
    return "other"


def _body_opcodes(view: _ModuleView, instr: Any) -> list[str]:
    out = []
    for comp in view.called(instr):
        for i in comp.instructions:
            out.extend(_body_opcodes(view, i) if i.opcode == "fusion" else [i.opcode])
    return out


def _flops(view: _ModuleView, instr: Any) -> float:
    """Rough flop count of one instruction (fusions: sum over the body)."""
    op = instr.opcode
    if op in ("fusion", "call"):
        return float(sum(_flops(view, i) for c in view.called(instr) for i in c.instructions))
    if op in _ELEMENTWISE:
        return float(_elements(instr.shape))
    if op in _REDUCE or op.startswith("all-reduce") or op == "reduce-scatter":
        return float(sum(_elements(view.instr[o].shape) for o in instr.operands
                         if o in view.instr))
    if op == "dot":
        return 2.0 * _elements(instr.shape) * _contracting_size(view, instr)
    if op == "convolution":
        return 2.0 * _elements(instr.shape) * _conv_window_size(view, instr)
    return 0.0


def _contracting_size(view: _ModuleView, instr: Any) -> int:
    lhs = view.instr.get(instr.operands[0]) if instr.operands else None
    if lhs is None:
        return 1
    dims = dims_attr(instr.attrs.get("lhs_contracting_dims"))
    return math.prod(lhs.shape.dims[d] for d in dims if d < len(lhs.shape.dims))


def _conv_window_size(view: _ModuleView, instr: Any) -> int:
    """Kernel elements per output element (kernel size / output features)."""
    if len(instr.operands) < 2 or instr.operands[1] not in view.instr:
        return 1
    kernel = view.instr[instr.operands[1]].shape
    labels = instr.attrs.get("dim_labels", "")
    kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    out_feat = kernel.dims[kernel_labels.index("o")] if "o" in kernel_labels else 1
    return max(1, _elements(kernel) // max(1, out_feat))


def _op_names(view: _ModuleView, instr: Any) -> tuple[str, ...]:
    """``op_name`` metadata of the op and, for a fusion, of the ops fused into it."""
    fused = [i for c in view.called(instr) for i in c.instructions] if instr.opcode == "fusion" \
        else []
    names: list[str] = []
    for i in [instr] + fused:
        n = getattr(i, "op_name", None)
        if n and i.opcode != "parameter" and n not in names:
            names.append(n)
    return tuple(names)


def describe_instruction(view_or_module: Any, instr: Any) -> OpInfo:
    """Key, class, bytes and flops of one instruction of a parsed module.

    Args:
        view_or_module: the ``hlo_tools.HloModule`` holding ``instr`` (operands and
            called computations are looked up there).
        instr: an ``hlo_tools.HloInstruction``.

    Returns:
        The op's :class:`OpInfo` (bytes = operands + result).
    """
    view = view_or_module if isinstance(view_or_module, _ModuleView) else _ModuleView(
        view_or_module)
    operands = [view.instr[o] for o in instr.operands if o in view.instr]
    opcode = instr.opcode
    if opcode == "fusion":
        opcode = f"fusion:{instr.attrs.get('kind', '')}"
    key = OpKey(opcode, tuple(_shape_text(o.shape) for o in operands),
                _shape_text(instr.shape), instr.shape.element_type,
                _short_hash(view.attr_text(instr)))
    cls = _fusion_class(view, instr) if instr.opcode == "fusion" else opcode_class(opcode)
    nbytes = instr.shape.byte_size() + sum(o.shape.byte_size() for o in operands)
    return OpInfo(key, cls, int(nbytes), _flops(view, instr), _op_names(view, instr))


def map_to_original(op_names_by_instr: Mapping[str, Sequence[str]],
                    original: Any) -> dict[str, list[str]]:
    """Maps compiled instructions to the instructions of the program that was compiled.

    When a program is compiled from HLO text (HLO -> MLIR import), XLA records each
    original instruction name as ``op_name`` metadata, prefixed with the names of the
    inlined call sites: ``"shard_map.16/add.5"`` is instruction ``add.5`` of the body
    called by ``shard_map.16``. Only names that exist in ``original`` are kept.

    Args:
        op_names_by_instr: compiled instruction -> its ``op_name``s (the ``"op_names"`` of
            :attr:`OpProfile.instructions`, or :attr:`OpInfo.op_names`).
        original: the parsed ``hlo_tools.HloModule`` that was compiled.

    Returns:
        compiled instruction -> original instruction names (empty list if none).
    """
    known = {i.name for c in original.computations for i in c.instructions}
    out = {}
    for name, op_names in op_names_by_instr.items():
        found = [n.rsplit("/", 1)[-1] for n in op_names]
        out[name] = list(dict.fromkeys(n for n in found if n in known))
    return out


def _short_hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12] if text else ""


def analyze_module(module: Any) -> dict[str, OpInfo]:
    """:class:`OpInfo` of every instruction of a parsed module, keyed by name."""
    view = _ModuleView(module)
    return {name: describe_instruction(view, instr) for name, instr in view.instr.items()}


# --------------------------------------------------------------------------- timing keys


def module_view(module: HloModule) -> Any:
    """The lookup tables :func:`op_key` needs; build once per module and reuse."""
    return _ModuleView(module)


def op_key(view: Any, instr: HloInstruction) -> OpKey:
    """The :class:`OpKey` of one instruction (name- and layout-free).

    Args:
        view: :func:`module_view` of the module holding ``instr``.
        instr: the instruction.

    Returns:
        The key shared by every op that computes the same thing on the same shapes.
    """
    return describe_instruction(view, instr).key


#: Appended to the opcode of an op's key when the op is timed as XLA's kernel library
#: runs it (XLA:CPU's ``__ynn_fusion``, see :func:`library_key`).
LIBRARY_SUFFIX = "@library"


def library_key(key: OpKey) -> OpKey:
    """The key of ``key``'s op run by XLA's kernel library instead of XLA's own emitter.

    XLA's default CPU pipeline hands dots, convolutions and reduces to a library
    (YNNPACK) by wrapping them in a ``kind=kCustom`` fusion; a plan compiled with
    ``exact=True`` does not (``hlo_tools/jax_bridge/xla_passes.toml``). The two can differ several
    fold on the same shapes, so their times are kept under different keys.
    """
    return dataclasses.replace(key, opcode=key.opcode + LIBRARY_SUFFIX)


def library_info(info: OpInfo) -> OpInfo:
    """``info`` with its key replaced by :func:`library_key` of it."""
    return dataclasses.replace(info, key=library_key(info.key))




def fusion_computations(module: HloModule) -> frozenset[str]:
    """Names of the fused computations of ``module``'s fusions (``fusion`` and
    ``fusion-start``), library fusions included."""
    return frozenset(name for _, instr in module.instructions()
                     if instr.opcode in ("fusion", "fusion-start")
                     for name in instr.called_computations)


def library_computations(module: HloModule) -> frozenset[str]:
    """Names of the fused computations of ``module``'s library fusions."""
    return frozenset(name for _, instr in module.instructions() if is_library_fusion(instr)
                     for name in instr.called_computations)


def library_instructions(module: HloModule) -> set[int]:
    """``id()`` of every instruction inside the fused computation of a library fusion."""
    comps = module.computations_by_name()
    return {id(i) for name in library_computations(module) if name in comps
            for i in comps[name].instructions}


def timing_key(view: Any, instr: HloInstruction, library: bool = False) -> str:
    """The encoded key an op's time is stored under: :func:`op_key`, or its
    :func:`library_key` when the op runs inside a library fusion."""
    key = op_key(view, instr)
    return (library_key(key) if library else key).encode()


#: Whether an op is timed standalone, free (runs no kernel), or skipped (:func:`op_status`).
OpStatus = Literal["bench", "free", "skip"]


def op_status(instr: HloInstruction) -> tuple[OpStatus, str]:
    """Whether an op is timed standalone (``"bench"``), free, or skipped, with the reason.

    Returns:
        ``("bench", "")``, ``("free", reason)`` or ``("skip", reason)``.
    """
    op = instr.opcode
    if op in FREE_OPCODES:
        return "free", f"{op} runs no kernel"
    if _is_bitcast(instr):
        return "free", f"this {op} only adds or moves size-1 dimensions (a bitcast)"
    if op == "fusion":
        return "skip", "fusions are predicted from their members, never timed"
    if op.startswith(COLLECTIVE_PREFIXES):
        return "skip", f"{op} is a collective (AllReduce model)"
    if op in CONTROL_FLOW_OPCODES:
        return "skip", f"{op} is control flow (its bodies' ops are timed)"
    if op in NOT_STANDALONE_OPCODES:
        return "skip", f"{op} cannot run standalone"
    leaves = list(instr.shape.leaves())
    if any(leaf.element_type not in NUMPY_DTYPES for leaf in leaves):
        return "skip", f"result type {instr.shape} is not supported"
    return "bench", ""


def _is_bitcast(instr: HloInstruction) -> bool:
    """A broadcast or transpose that keeps every element in place (XLA emits a bitcast):
    it only adds size-1 dimensions, or only moves them."""
    shape = instr.shape
    if instr.opcode not in ("broadcast", "transpose") or not shape.is_array:
        return False
    dims = dims_attr(instr.attrs.get("dimensions"))
    if instr.opcode == "broadcast":
        kept = [shape.dims[d] for d in dims if d < len(shape.dims)]
        return dims == sorted(dims) and math.prod(kept) == shape.num_elements
    moved = [d for d in dims if d < len(shape.dims) and shape.dims[dims.index(d)] != 1]
    return moved == sorted(moved)

