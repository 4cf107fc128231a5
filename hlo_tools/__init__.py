"""HLO tools: an HLO IR with exact round trip, graph views, plans and rewrites."""

from hlo_tools.graph import DeviceGraph, NodeKind, device_computation, device_graph
from hlo_tools.ir import HloComputation, HloInstruction, HloModule, Shape
from hlo_tools.parser import HloParseError, parse, parse_shape
from hlo_tools.plan import Decision, FusionSpace, Plan, initial_plan, random_plan
from hlo_tools.printer import instruction_to_text, to_text
from hlo_tools.rewrite import apply_plan
from hlo_tools.verify import HloVerifyError, find_problems, verify

__all__ = [
    "CompileOptions",
    "Decision",
    "DeviceGraph",
    "FusionSpace",
    "HloCompileError",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParseError",
    "HloVerifyError",
    "InPlaceOf",
    "NodeKind",
    "Plan",
    "Shape",
    "apply_plan",
    "compile_module",
    "device_computation",
    "device_graph",
    "extract",
    "find_problems",
    "initial_plan",
    "instruction_to_text",
    "parse",
    "parse_shape",
    "random_plan",
    "to_text",
    "verify",
]


_BRIDGE = ("CompileOptions", "HloCompileError", "InPlaceOf", "compile_module", "extract")


def __getattr__(name: str):
    """The jax bridge is imported on first use: parsing and printing need no jax."""
    if name in _BRIDGE:
        from hlo_tools import jax_bridge

        return getattr(jax_bridge, name)
    raise AttributeError(f"module 'hlo_tools' has no attribute {name!r}")
