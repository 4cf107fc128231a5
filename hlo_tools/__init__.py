"""HLO tools: an HLO IR with exact round trip, graph views, plans and rewrites."""

from hlo_tools.ir import HloComputation, HloInstruction, HloModule, Shape
from hlo_tools.parser import HloParseError, parse, parse_shape
from hlo_tools.printer import instruction_to_text, to_text

__all__ = [
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParseError",
    "Shape",
    "instruction_to_text",
    "parse",
    "parse_shape",
    "to_text",
]
