"""Printer from :mod:`hlo_tools.ir` back to HLO text that XLA's parser accepts."""

from __future__ import annotations

from hlo_tools.ir import HloComputation, HloInstruction, HloModule

__all__ = ["to_text", "instruction_to_text"]


def to_text(module: HloModule) -> str:
    """Prints a module as HLO text.

    The output re-parses to an equal module (``parse(to_text(m))`` prints identically),
    and XLA's own parser accepts it. Computation signatures are not printed: XLA derives
    them from the parameter and root instructions.

    Args:
        module: the module to print.

    Returns:
        The HLO text, ending with a newline.
    """
    header = f"HloModule {module.name}"
    if module.header_attrs:
        header += ", " + _attrs_text(module.header_attrs)
    parts = [header, ""]
    for title, lines in module.sections:
        parts.extend([title, *lines, ""])
    for comp in module.computations:
        parts.extend(_computation_lines(comp, module.percent_names))
        parts.append("")
    return "\n".join(parts)


def _computation_lines(comp: HloComputation, percent: bool) -> list[str]:
    sigil = "%" if percent else ""
    head = f"{'ENTRY ' if comp.is_entry else ''}{sigil}{comp.name}"
    if comp.suffix:
        head += f" {comp.suffix}"
    lines = [head + " {"]
    for instr in comp.instructions:
        lines.append("  " + instruction_to_text(instr, instr.name == comp.root_name, percent))
    lines.append("}")
    return lines


def instruction_to_text(instr: HloInstruction, is_root: bool = False,
                        percent: bool = False) -> str:
    """Prints one instruction (without indentation)."""
    sigil = "%" if percent else ""
    if instr.opcode in ("constant", "parameter"):
        inner = instr.payload
    else:
        inner = ", ".join(sigil + op for op in instr.operands)
    root = "ROOT " if is_root else ""
    text = f"{root}{sigil}{instr.name} = {instr.shape} {instr.opcode}({inner})"
    attr_text = instr.attr_text if instr._attrs is None else _attrs_text(instr.attrs)
    if attr_text:
        text += ", " + attr_text
    return text


def _attrs_text(attrs: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in attrs.items())
