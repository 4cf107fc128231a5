"""Parser from HLO text (as printed by XLA) to :mod:`hlo_tools.ir`.

XLA prints one instruction per line, so the parser works line by line with compiled
regular expressions for the common case and a small bracket-aware scanner for nested
attribute values. Every error is an :class:`HloParseError` naming line and column.
"""

from __future__ import annotations

import gc
import re

from hlo_tools.ir import (
    ELEMENT_BYTES,
    HLO_OPCODES,
    HloComputation,
    HloInstruction,
    HloModule,
    Shape,
)

__all__ = ["HloParseError", "parse", "parse_shape"]


class HloParseError(ValueError):
    """Malformed HLO text.

    Attributes:
        line: 1-based line number of the error.
        column: 1-based column number of the error.
        expected: what the parser expected there.
        source: file name, if the text came from a file.
    """

    def __init__(self, message: str, line: int, column: int = 1, expected: str = "",
                 source: str | None = None, text_line: str = ""):
        self.line, self.column, self.expected, self.source = line, column, expected, source
        self.text_line = text_line
        where = f"{source or '<hlo>'}:{line}:{column}"
        detail = f" (expected {expected})" if expected else ""
        snippet = f"\n    {text_line.strip()[:160]}" if text_line.strip() else ""
        super().__init__(f"{where}: {message}{detail}{snippet}")


_NAME = r"[A-Za-z_][\w.\-]*"
_HEADER = re.compile(rf"HloModule\s+({_NAME})\s*(?:,\s*(.*))?$")
_COMP_HEADER = re.compile(rf"(ENTRY\s+)?%?({_NAME})\s*(.*?)\s*\{{\s*$")
_INSTR_HEAD = re.compile(rf"\s*(ROOT\s+)?(%?)({_NAME})\s*=\s*")
_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_SIMPLE_OPERANDS = re.compile(r"([^(){}\[\]\"]*)\)")
_OPERAND_SHAPE = r"(?:\([^%]*\)|[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?)"
_OPERAND = re.compile(rf"\s*(?:{_OPERAND_SHAPE}\s+)?%?({_NAME})\s*$")
_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[{}()\[\],]|[^"{}()\[\],]+')
_SECTION_TITLE = re.compile(r"[A-Z][A-Za-z]*$")
_OPENERS = {"{": "}", "(": ")", "[": "]"}
_NO_OPERAND_OPCODES = ("constant", "parameter")


def parse(text: str, source: str | None = None) -> HloModule:
    """Parses HLO text into an :class:`HloModule`.

    Args:
        text: the module as XLA prints it (pre- or post-optimization).
        source: optional file name used in error messages.

    Returns:
        The parsed module.

    Raises:
        HloParseError: if the text is not a well-formed HLO module.
    """
    was_enabled = gc.isenabled()
    gc.disable()  # the parser allocates many small acyclic objects; GC passes only cost
    try:
        return _Parser(text, source).module()
    finally:
        if was_enabled:
            gc.enable()


def parse_shape(text: str) -> Shape:
    """Parses one shape such as ``f32[8,16]{1,0}`` or ``(f32[], s32[4])``."""
    shape, end = _parse_shape(text, 0, 1)
    if text[end:].strip():
        raise HloParseError(f"trailing text after shape: {text[end:]!r}", 1, end + 1, "end")
    return shape


def _parse_shape(line: str, pos: int, lineno: int) -> tuple[Shape, int]:
    """Parses a shape starting at ``line[pos]``; returns it and the position after it."""
    if line.startswith("(", pos):
        return _parse_tuple_shape(line, pos, lineno)
    m = _ARRAY_SHAPE.match(line, pos)
    if not m:
        raise HloParseError("bad shape", lineno, pos + 1, "a shape like f32[8,16]{1,0}",
                            text_line=line)
    etype, dims_text, layout = m.group(1), m.group(2), m.group(3) or ""
    cached = _SHAPE_CACHE.get((etype, dims_text, m.group(3)))
    if cached is not None:
        return cached, m.end()
    if etype not in ELEMENT_BYTES:
        raise HloParseError(f"unknown element type {etype!r}", lineno, pos + 1,
                            "a primitive type", text_line=line)
    dims, dynamic = _parse_dims(dims_text, lineno, m.start(2) + 1, line)
    shape = Shape(etype, dims, layout, (), dynamic)
    if len(_SHAPE_CACHE) < 100_000:
        _SHAPE_CACHE[(etype, dims_text, m.group(3))] = shape
    return shape, m.end()


def _parse_dims(text: str, lineno: int, col: int, line: str) -> tuple[tuple[int, ...], tuple]:
    if not text:
        return (), ()
    dims, dynamic = [], []
    for part in text.split(","):
        part = part.strip()
        dyn = part.startswith("<=")
        digits = part[2:] if dyn else part
        if not digits.isdigit():
            raise HloParseError(f"bad dimension {part!r}", lineno, col, "an integer",
                                text_line=line)
        dims.append(int(digits))
        dynamic.append(dyn)
    return tuple(dims), (tuple(dynamic) if any(dynamic) else ())


def _parse_tuple_shape(line: str, pos: int, lineno: int) -> tuple[Shape, int]:
    pos += 1
    elements = []
    while True:
        while line.startswith(" ", pos):
            pos += 1
        if line.startswith(")", pos):
            return Shape("tuple", tuple_shapes=tuple(elements)), pos + 1
        shape, pos = _parse_shape(line, pos, lineno)
        elements.append(shape)
        while line.startswith(" ", pos):
            pos += 1
        if line.startswith(",", pos):
            pos += 1
        elif not line.startswith(")", pos):
            raise HloParseError("bad tuple shape", lineno, pos + 1, "',' or ')'",
                                text_line=line)


def _split_top_level(text: str, lineno: int, col: int, line: str) -> list[str]:
    """Splits at commas that are outside brackets and strings."""
    if not any(c in text for c in '{(["'):
        return [p.strip() for p in text.split(",")]
    parts, current, stack = [], [], []
    for tok in _TOKENS.findall(text):
        if tok in _OPENERS:
            stack.append(_OPENERS[tok])
        elif tok in ")}]":
            if not stack or stack.pop() != tok:
                raise HloParseError(f"unbalanced {tok!r}", lineno, col, "matching brackets",
                                    text_line=line)
        elif tok == "," and not stack:
            parts.append("".join(current).strip())
            current = []
            continue
        elif tok.startswith('"') and (len(tok) < 2 or not tok.endswith('"')):
            raise HloParseError("unterminated string", lineno, col, '"', text_line=line)
        current.append(tok)
    if stack:
        raise HloParseError("unclosed bracket", lineno, col, f"{stack[-1]!r}", text_line=line)
    parts.append("".join(current).strip())
    return parts


def _matching_paren(line: str, pos: int, lineno: int) -> int:
    """Index of the ``)`` closing the group whose contents start at ``pos``."""
    m = _SIMPLE_OPERANDS.match(line, pos)
    if m:
        return m.end() - 1
    depth = 1
    for tok_match in _TOKENS.finditer(line, pos):
        tok = tok_match.group()
        if tok in "({[":
            depth += 1
        elif tok in ")}]":
            depth -= 1
            if depth == 0:
                if tok != ")":
                    break
                return tok_match.start()
    raise HloParseError("unbalanced parentheses in operand list", lineno, pos + 1, "')'",
                        text_line=line)


class _Parser:
    def __init__(self, text: str, source: str | None):
        self.lines = text.splitlines()
        self.source = source
        self.i = 0
        self.line_of: dict[str, int] = {}

    def error(self, message: str, column: int = 1, expected: str = "") -> HloParseError:
        lineno = min(self.i, len(self.lines) - 1) if self.lines else 0
        text_line = self.lines[lineno] if self.lines else ""
        return HloParseError(message, lineno + 1, column, expected, self.source, text_line)

    def _skip_blank(self) -> None:
        while self.i < len(self.lines) and not self.lines[self.i].strip():
            self.i += 1

    def module(self) -> HloModule:
        self._skip_blank()
        if self.i >= len(self.lines):
            raise HloParseError("empty input", 1, 1, "'HloModule <name>'", self.source)
        m = _HEADER.match(self.lines[self.i].strip())
        if not m:
            raise self.error("missing module header", 1, "'HloModule <name>, ...'")
        try:
            header_attrs = self._attrs(m.group(2) or "", self.lines[self.i], 0)
        except HloParseError as e:
            raise self._with_source(e) from None
        self.i += 1
        sections, computations = [], []
        self._skip_blank()
        while self.i < len(self.lines):
            line = self.lines[self.i].strip()
            if _SECTION_TITLE.match(line):
                sections.append(self._section(line))
            else:
                computations.append(self._computation())
            self._skip_blank()
        module = HloModule(m.group(1), header_attrs, computations, sections)
        self._check_module(module)
        return module

    def _section(self, title: str) -> tuple[str, list[str]]:
        self.i += 1
        lines = []
        while self.i < len(self.lines) and self.lines[self.i].strip():
            lines.append(self.lines[self.i])
            self.i += 1
        return title, lines

    def _computation(self) -> HloComputation:
        header = self.lines[self.i]
        m = _COMP_HEADER.match(header.strip())
        if not m:
            raise self.error("expected a computation", 1, "'[ENTRY] name {'")
        suffix = _signature_suffix(m.group(3))
        instructions, root_name = self._body()
        if not instructions:
            raise self.error(f"computation {m.group(2)!r} is empty", 1, "instructions")
        if root_name is None:
            root_name = instructions[-1].name
        return HloComputation(m.group(2), instructions, root_name, bool(m.group(1)), suffix)

    def _body(self) -> tuple[list[HloInstruction], str | None]:
        """Instructions up to the closing ``}`` (the hot loop: kept tight)."""
        lines, line_of, opcodes = self.lines, self.line_of, HLO_OPCODES
        instructions: list[HloInstruction] = []
        append = instructions.append
        root_name = None
        parse_one = _parse_instruction
        for k in range(self.i + 1, len(lines)):
            line = lines[k]
            if not line or line.isspace():
                continue
            if line.lstrip() in ("}", "}\n") or line.strip() == "}":
                self.i = k + 1
                return instructions, root_name
            self.i = k
            if "/*" in line:
                line = _INDEX_COMMENT.sub("", line)
            try:
                instr, is_root = parse_one(line, k + 1)
            except HloParseError as e:
                raise self._with_source(e) from None
            name = instr.name
            if name in line_of:
                raise self.error(f"duplicate instruction name {name!r}", 1, "unique names")
            if instr.opcode not in opcodes:
                col = line.find(f" {instr.opcode}(") + 2
                raise self.error(f"unknown opcode {instr.opcode!r}", col, "an HLO opcode")
            line_of[name] = k + 1
            append(instr)
            if is_root:
                if root_name is not None:
                    raise self.error("second ROOT in computation", 1, "one ROOT")
                root_name = name
        self.i = len(lines)
        raise self.error("unexpected end of input inside computation", 1, "'}'")

    def _with_source(self, e: HloParseError) -> HloParseError:
        if self.source is None:
            return e
        return HloParseError(str(e).split(": ", 1)[1].split(" (expected")[0].split("\n")[0],
                             e.line, e.column, e.expected, self.source, e.text_line)

    def _attrs(self, text: str, line: str, lineno: int) -> dict[str, str]:
        return _parse_attrs(text, lineno + 1, line)

    def _check_module(self, module: HloModule) -> None:
        comps = {c.name for c in module.computations}
        if len(comps) != len(module.computations):
            raise HloParseError("duplicate computation name", len(self.lines), 1,
                                "unique computation names", self.source)
        if sum(c.is_entry for c in module.computations) != 1:
            raise HloParseError("module needs exactly one ENTRY computation", len(self.lines),
                                1, "one ENTRY", self.source)
        for comp in module.computations:
            local = set()
            for instr in comp.instructions:
                local.add(instr.name)
                for callee in instr.called_computations:
                    if callee not in comps:
                        raise self._error_at(instr, f"calls unknown computation {callee!r}",
                                             "a computation defined in the module")
            for instr in comp.instructions:
                for op in instr.operands:
                    if op not in local:
                        raise self._error_at(instr, f"operand {op!r} is not defined in "
                                             f"{comp.name}", "a defined operand")
        first = module.computations[0].instructions[0].name
        module.percent_names = f"%{first} " in self.lines[self.line_of[first] - 1]

    def _error_at(self, instr, message: str, expected: str) -> HloParseError:
        line = self.line_of[instr.name]
        return HloParseError(f"{instr.name}: {message}", line, 1, expected, self.source,
                             self.lines[line - 1])


def _signature_suffix(signature: str) -> str:
    """Keeps what follows ``(params) -> shape`` (e.g. ``execution_thread=...``)."""
    if not signature:
        return ""
    m = re.search(r",\s*(execution_thread=.*)$", signature)
    return m.group(1) if m else ""


_FAST_INSTR = re.compile(
    rf"\s*(ROOT\s+)?%?({_NAME})\s*=\s*([a-z][a-z0-9]*)\[([^\]]*)\](\{{[^}}]*\}})?"
    r"\s+([a-z][a-z0-9\-]*)\(([^(){}\[\]\"]*)\)(.*)$")
_OPERAND_LIST = re.compile(r"[A-Za-z_][\w.\-]*(?:,[A-Za-z_][\w.\-]*)*")
_ATTR_BOUNDARY = re.compile(r",\s*(?=[A-Za-z_][\w\-]*=)")
_SHAPE_CACHE: dict[tuple[str, str, str], Shape] = {}


def _parse_instruction(line: str, lineno: int) -> tuple[HloInstruction, bool]:
    m = _FAST_INSTR.match(line)
    if m is None:
        return _parse_instruction_slow(line, lineno)
    is_root, name, etype, dims, layout, opcode, inner, rest = m.groups()
    payload = ""
    if opcode in _NO_OPERAND_OPCODES:
        payload = inner.strip()
        if opcode == "parameter" and not payload.isdigit():
            return _parse_instruction_slow(line, lineno)
        inner = ""
    key = (etype, dims, layout)
    shape = _SHAPE_CACHE.get(key)
    if shape is None:
        if len(_SHAPE_CACHE) > 100_000:
            _SHAPE_CACHE.clear()
        shape, _ = _parse_shape(line, m.start(3), lineno)
        _SHAPE_CACHE[key] = shape
    if inner:
        compact = inner.replace(" ", "").replace("%", "")
        if not _OPERAND_LIST.fullmatch(compact):
            if compact:
                return _parse_instruction_slow(line, lineno)
            operands = []
        else:
            operands = compact.split(",")
    else:
        operands = []
    text = _attr_text(rest, lineno, line, m.end(7) + 1) if rest else ""
    return (HloInstruction(name, opcode, shape, operands, None, payload, attr_text=text),
            bool(is_root))


def _attr_text(rest: str, lineno: int, line: str, col: int) -> str:
    """Checks the text after the operand list and returns it without the leading comma.

    The split into attributes is deferred (see :attr:`HloInstruction.attrs`); here only
    cheap checks run: a leading comma, a ``key=`` first attribute, balanced brackets.
    When they fail the full split runs now so that the error names line and column.
    """
    rest = rest.strip()
    if not rest:
        return ""
    if not rest.startswith(","):
        raise HloParseError(f"unexpected text {rest[:20]!r}", lineno, col + 1,
                            "',' before attributes", text_line=line)
    text = rest[1:].strip()
    if not (_FIRST_ATTR.match(text) and _balanced(text)):
        _parse_attrs(text, lineno, line)
    return text


_FIRST_ATTR = re.compile(r"[A-Za-z_][\w\-]*=")


def parse_attributes(text: str) -> dict[str, str]:
    """Splits attribute text (``key=value, key=value``) into an ordered dict."""
    return _parse_attrs(text, 0, text)


def _parse_instruction_slow(line: str, lineno: int) -> tuple[HloInstruction, bool]:
    m = _INSTR_HEAD.match(line)
    if not m:
        raise HloParseError("expected an instruction", lineno, 1, "'name = shape opcode(...)'",
                            text_line=line)
    is_root, name = bool(m.group(1)), m.group(3)
    shape, pos = _parse_shape(line, m.end(), lineno)
    op = _OPCODE.match(line, pos)
    if not op:
        raise HloParseError("expected an opcode", lineno, pos + 1, "'opcode('", text_line=line)
    opcode = op.group(1)
    start = op.end()
    end = _matching_paren(line, start, lineno)
    inner = line[start:end]
    operands, payload = [], ""
    if opcode in _NO_OPERAND_OPCODES:
        payload = inner.strip()
        if opcode == "parameter" and not payload.isdigit():
            raise HloParseError("bad parameter number", lineno, start + 1, "an integer",
                                text_line=line)
    elif inner.strip():
        operands = _parse_operands(inner, lineno, start, line)
    text = _attr_text(line[end + 1:], lineno, line, end + 1)
    return HloInstruction(name, opcode, shape, operands, None, payload, attr_text=text), is_root


def _parse_operands(inner: str, lineno: int, start: int, line: str) -> list[str]:
    operands = []
    for part in _split_top_level(inner, lineno, start + 1, line):
        om = _OPERAND.match(part)
        if not om:
            raise HloParseError(f"bad operand {part!r}", lineno, start + 1,
                                "an operand name", text_line=line)
        operands.append(om.group(1))
    return operands


def _parse_attrs(text: str, lineno: int, line: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    if not text.strip():
        return attrs
    parts = _ATTR_BOUNDARY.split(text)
    if not all(_balanced(p) for p in parts):
        col = max(line.find(text.strip()[:10]), 0) + 1
        parts = _split_top_level(text, lineno, col, line)
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not _ATTR_KEY.fullmatch(key):
            col = max(line.find(part.strip()[:10]), 0) + 1
            raise HloParseError(f"bad attribute {part.strip()[:40]!r}", lineno, col,
                                "'key=value'", text_line=line)
        attrs[key] = value.strip()
    return attrs


_ATTR_KEY = re.compile(r"[A-Za-z_][\w\-]*")


def _balanced(part: str) -> bool:
    """Cheap check that a piece split at ", key=" lies outside brackets and strings."""
    if '"' in part and (part.count('"') % 2 or "\\" in part):
        return False
    return (part.count("{") == part.count("}") and part.count("(") == part.count(")")
            and part.count("[") == part.count("]"))
