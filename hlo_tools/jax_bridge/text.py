"""HLO text as XLA reads it: parse, verify, convert to the MLIR jax compiles."""

from __future__ import annotations

import re
from typing import Any

from hlo_tools.jax_bridge import internals
from hlo_tools.jax_bridge.errors import HloCompileError

__all__ = [
    "count_all_reduces",
    "hlo_text_to_mlir",
    "module_name",
    "verify_hlo",
    "xla_canonical_text",
    "xla_parse_ok",
]


def parse(hlo_text: str) -> Any:
    """XLA's ``HloModule`` of the text (XLA's own parser), errors as
    :class:`HloCompileError`. The parser checks syntax, names and attributes but not
    operand shapes."""
    try:
        return internals.hlo_module_from_text(hlo_text)
    except Exception as err:  # jax.errors.JaxRuntimeError carries XLA's message
        raise HloCompileError(f"XLA could not parse the HLO text: {err}") from err


def xla_parse_ok(hlo_text: str) -> None:
    """Raises ``HloCompileError`` with XLA's message unless XLA's parser accepts the text.

    Shape errors (e.g. ``add`` of f32[8] and f32[4]) pass this check; ``verify_hlo``
    catches them.
    """
    parse(hlo_text)


def xla_canonical_text(hlo_text: str) -> str:
    """The text XLA's own parser and printer make of ``hlo_text`` (XLA's canonical print).

    Raises:
        HloCompileError: XLA's parser rejects the text.
    """
    return parse(hlo_text).to_string()


def computation(hlo_text: str) -> Any:
    """HLO text -> ``XlaComputation``."""
    return internals.computation(parse(hlo_text))


def to_mlir(comp: Any) -> str:
    """``XlaComputation`` -> MLIR (StableHLO) text, wrapping conversion errors."""
    try:
        return internals.computation_to_mlir(comp)
    except Exception as err:
        raise HloCompileError(f"HLO -> MLIR conversion failed: {err}") from err


def hlo_text_to_mlir(hlo_text: str) -> str:
    """Converts HLO text to MLIR (StableHLO) text that jax can compile.

    A ``fusion`` instruction survives the conversion (as ``mhlo.fusion``); each original
    instruction name is kept as its MLIR location, which XLA reports back as
    ``metadata={op_name="<name>"}`` in the compiled HLO and in profiles (when the text was
    printed without metadata, the default of ``extract``).

    Raises:
        HloCompileError: XLA rejects the text or its conversion.
    """
    return to_mlir(computation(hlo_text))


def mlir_module(comp: Any) -> Any:
    """``XlaComputation`` -> verified MLIR module in a jax MLIR context."""
    mlir_text = to_mlir(comp)
    try:
        return internals.parse_mlir(mlir_text)  # runs the StableHLO verifier
    except Exception as err:  # ir.MLIRError
        raise HloCompileError(f"jax could not parse the converted MLIR: {err}") from err


def verify_hlo(hlo_text: str) -> None:
    """Parses the text and verifies every op's shapes (as MLIR), without compiling.

    Raises:
        HloCompileError: with XLA's or MLIR's message, naming the offending instruction.
    """
    mlir_module(computation(hlo_text))


# An opcode is followed by "(", an instruction name never is.
_ALL_REDUCE_RE = re.compile(r"\sall-reduce(?:-start)?\(")


def count_all_reduces(hlo_text: str) -> int:
    """Number of all-reduce instructions in HLO text (a combined tuple one counts once)."""
    return len(_ALL_REDUCE_RE.findall(hlo_text))


def module_name(hlo_text: str) -> str:
    """The ``HloModule`` name of the text (``""`` when it has no header)."""
    match = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    return match.group(1) if match else ""
