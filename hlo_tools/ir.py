"""The HLO intermediate representation: shapes, instructions, computations, modules.

The IR mirrors XLA's own (``HloModule`` > ``HloComputation`` > ``HloInstruction``) and
keeps every attribute as the raw text XLA printed, in order, so that printing a parsed
module gives text XLA accepts and that re-parses to the same module. Only the parts the
rewrites need are interpreted: opcode, result shape, operands, called computations.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

import numpy as np

from hlo_tools.opcodes import CALLED_COMPUTATION_ATTRS, HLO_OPCODES

__all__ = [
    "ELEMENT_BYTES",
    "NUMPY_DTYPES",
    "HLO_OPCODES",
    "Shape",
    "HloInstruction",
    "HloComputation",
    "HloModule",
    "CALLED_COMPUTATION_ATTRS",
]

#: Bytes per element for each HLO primitive type (sub-byte types rounded up to 1).
ELEMENT_BYTES: dict[str, int] = {
    "pred": 1, "s2": 1, "s4": 1, "s8": 1, "s16": 2, "s32": 4, "s64": 8,
    "u2": 1, "u4": 1, "u8": 1, "u16": 2, "u32": 4, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e5m2": 1, "f8e4m3fn": 1, "f8e4m3b11fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1,
    "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1,
    "token": 0, "opaque": 0,
}

#: The numpy type of each HLO primitive type that has one (jax's ``ml_dtypes`` for bf16
#: and the 8-bit floats).
NUMPY_DTYPES: dict[str, np.dtype] = {k: np.dtype(v) for k, v in {
    "pred": np.bool_, "s8": np.int8, "s16": np.int16, "s32": np.int32, "s64": np.int64,
    "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
    "f16": np.float16, "f32": np.float32, "f64": np.float64,
    "c64": np.complex64, "c128": np.complex128,
}.items()}
try:  # jax's own extension types (a jax dependency)
    import ml_dtypes

    NUMPY_DTYPES.update({"bf16": np.dtype(ml_dtypes.bfloat16),
                         "f8e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
                         "f8e5m2": np.dtype(ml_dtypes.float8_e5m2)})
except ImportError:  # pragma: no cover
    pass


_COMPUTATION_REF = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_CALL_VALUES = re.compile(r"(?:^|, )(?:" + "|".join(CALLED_COMPUTATION_ATTRS)
                          + r")=(\{[^}]*\}|%?[A-Za-z_][\w.\-]*)")


@dataclasses.dataclass(frozen=True)
class Shape:
    """An HLO shape: an array, a tuple of shapes, or a token.

    Attributes:
        element_type: primitive type (``"f32"``, ``"pred"``, ...), ``"tuple"`` or ``"token"``.
        dims: array dimensions (empty for scalars, tuples and tokens).
        layout: the layout exactly as printed (``"{1,0}"``), or ``""`` when absent.
        tuple_shapes: element shapes when ``element_type == "tuple"``.
        dynamic: per-dimension flags for bounded-dynamic dims (printed ``<=N``); empty if none.
    """

    element_type: str
    dims: tuple[int, ...] = ()
    layout: str = ""
    tuple_shapes: tuple[Shape, ...] = ()
    dynamic: tuple[bool, ...] = ()

    @property
    def is_tuple(self) -> bool:
        return self.element_type == "tuple"

    @property
    def is_array(self) -> bool:
        return self.element_type not in ("tuple", "token")

    @property
    def num_elements(self) -> int:
        """Number of array elements (0 for tuples and tokens)."""
        return math.prod(self.dims) if self.is_array else 0

    def byte_size(self) -> int:
        """Total bytes of the value, summed over tuple leaves (bounds for dynamic dims)."""
        if self.is_tuple:
            return sum(s.byte_size() for s in self.tuple_shapes)
        return self.num_elements * ELEMENT_BYTES.get(self.element_type, 4)

    def leaves(self) -> Iterator[Shape]:
        """Array/token leaves in order."""
        if self.is_tuple:
            for s in self.tuple_shapes:
                yield from s.leaves()
        else:
            yield self

    def without_layout(self) -> Shape:
        return dataclasses.replace(
            self, layout="", tuple_shapes=tuple(s.without_layout() for s in self.tuple_shapes)
        )

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        if self.dynamic:
            dims = ",".join(f"<={d}" if dyn else str(d) for d, dyn in zip(self.dims, self.dynamic))
        else:
            dims = ",".join(map(str, self.dims))
        return f"{self.element_type}[{dims}]{self.layout}"


class HloInstruction:
    """One HLO instruction: ``name = shape opcode(operands), attr=value, ...``.

    Attributes:
        name: instruction name without the ``%`` sigil, unique in the module.
        opcode: XLA opcode (``"add"``, ``"fusion"``, ``"all-reduce"``, ...).
        shape: result shape.
        operands: operand instruction names, in order.
        attrs: attribute name -> value text exactly as printed, in print order. The
            parser keeps the attribute text and splits it on first access, so parsing
            stays fast for modules whose attributes are never looked at.
        payload: raw text inside the parentheses for ``constant`` (the literal) and
            ``parameter`` (the parameter number); empty otherwise.
    """

    __slots__ = ("name", "opcode", "shape", "operands", "payload", "_attrs", "attr_text")

    def __init__(self, name: str, opcode: str, shape: Shape, operands: list[str] | None = None,
                 attrs: dict[str, str] | None = None, payload: str = "",
                 attr_text: str = ""):
        self.name = name
        self.opcode = opcode
        self.shape = shape
        self.operands = [] if operands is None else operands
        self.payload = payload
        #: unparsed attribute text (after the first comma); used while ``_attrs`` is None
        #: (so an instruction without attributes gets its empty dict on first access)
        self.attr_text = attr_text
        self._attrs = attrs

    @property
    def attrs(self) -> dict[str, str]:
        if self._attrs is None:
            if not self.attr_text:
                self._attrs = {}
            else:
                from hlo_tools.parser import parse_attributes

                self._attrs = parse_attributes(self.attr_text)
        return self._attrs

    @attrs.setter
    def attrs(self, value: dict[str, str]) -> None:
        self._attrs = value

    def copy(self, **changes) -> HloInstruction:
        """A copy with fresh operand and attribute containers, and ``changes`` applied."""
        new = HloInstruction(self.name, self.opcode, self.shape, list(self.operands),
                             None if self._attrs is None else dict(self._attrs), self.payload,
                             attr_text=self.attr_text)
        for key, value in changes.items():
            setattr(new, key, value)
        return new

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HloInstruction):
            return NotImplemented
        return (self.name, self.opcode, self.shape, self.operands, self.attrs, self.payload) == (
            other.name, other.opcode, other.shape, other.operands, other.attrs, other.payload)

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"HloInstruction({self.name!r}, {self.opcode!r}, {self.shape}, {self.operands})"

    @property
    def parameter_number(self) -> int:
        """The parameter index of a ``parameter`` instruction."""
        if self.opcode != "parameter":
            raise ValueError(f"{self.name} is a {self.opcode}, not a parameter")
        return int(self.payload)

    @property
    def called_computations(self) -> list[str]:
        """Names of the computations this instruction calls (fusion bodies, reducers, ...)."""
        attrs = self._attrs
        if attrs is None:  # not split yet: read the callees straight from the text
            if not self.attr_text:
                return []
            return [ref for value in _CALL_VALUES.findall(self.attr_text)
                    for ref in _COMPUTATION_REF.findall(value)]
        if not attrs:
            return []
        names: list[str] = []
        for key in CALLED_COMPUTATION_ATTRS:
            value = attrs.get(key)
            if value is not None:
                names.extend(_COMPUTATION_REF.findall(value))
        return names

    @property
    def op_name(self) -> str | None:
        """``op_name`` from the metadata attribute, if any."""
        meta = self.attrs.get("metadata")
        if not meta:
            return None
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', meta)
        return m.group(1) if m else None


@dataclasses.dataclass(slots=True)
class HloComputation:
    """A computation: an ordered list of instructions with one root.

    Attributes:
        name: computation name without ``%``.
        instructions: instructions in print order (a valid def-before-use order).
        root_name: name of the ROOT instruction.
        is_entry: True for the module's ENTRY computation.
        suffix: text printed after the signature and before ``{`` (e.g.
            ``execution_thread="host"``), kept verbatim; usually empty.
    """

    name: str
    instructions: list[HloInstruction]
    root_name: str
    is_entry: bool = False
    suffix: str = ""

    @property
    def root(self) -> HloInstruction:
        return self.instruction(self.root_name)

    def instruction(self, name: str) -> HloInstruction:
        for instr in self.instructions:
            if instr.name == name:
                return instr
        raise KeyError(f"no instruction {name!r} in computation {self.name!r}")

    def by_name(self) -> dict[str, HloInstruction]:
        return {i.name: i for i in self.instructions}

    @property
    def parameters(self) -> list[HloInstruction]:
        """Parameter instructions sorted by parameter number."""
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.parameter_number)


@dataclasses.dataclass(slots=True)
class HloModule:
    """A whole HLO module.

    Attributes:
        name: module name from the ``HloModule`` header line.
        header_attrs: header attributes (``entry_computation_layout``, ``is_scheduled``, ...)
            as raw text, in order.
        computations: computations in print order (callees before callers).
        sections: extra top-level sections XLA prints between the header and the
            computations (``FileNames``, ``StackFrames``, ...): ``(title, lines)`` kept verbatim.
        percent_names: whether names are printed with the ``%`` sigil.
    """

    name: str
    header_attrs: dict[str, str]
    computations: list[HloComputation]
    sections: list[tuple[str, list[str]]] = dataclasses.field(default_factory=list)
    percent_names: bool = False

    @property
    def entry(self) -> HloComputation:
        for comp in self.computations:
            if comp.is_entry:
                return comp
        raise ValueError(f"module {self.name!r} has no ENTRY computation")

    def computation(self, name: str) -> HloComputation:
        for comp in self.computations:
            if comp.name == name:
                return comp
        raise KeyError(f"no computation {name!r} in module {self.name!r}")

    def computations_by_name(self) -> dict[str, HloComputation]:
        return {c.name: c for c in self.computations}

    def instructions(self) -> Iterator[tuple[HloComputation, HloInstruction]]:
        """All ``(computation, instruction)`` pairs in print order."""
        for comp in self.computations:
            for instr in comp.instructions:
                yield comp, instr

    @property
    def instruction_count(self) -> int:
        return sum(len(c.instructions) for c in self.computations)

    def clone(self) -> HloModule:
        """A deep copy that can be rewritten without touching this module."""
        comps = [
            dataclasses.replace(
                c,
                instructions=[i.copy() for i in c.instructions],
            )
            for c in self.computations
        ]
        return dataclasses.replace(
            self,
            header_attrs=dict(self.header_attrs),
            computations=comps,
            sections=[(t, list(lines)) for t, lines in self.sections],
        )
