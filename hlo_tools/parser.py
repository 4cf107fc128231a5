"""Parser from HLO text (as printed by XLA) to :mod:`hlo_tools.ir`.

XLA prints one instruction per line, so the parser works line by line with compiled
regular expressions for the common case and a small bracket-aware scanner for nested
attribute values. Every error is an :class:`HloParseError` naming line and column.

Parsing runs in one of two modes. The *exact* mode checks every line completely as it
reads it, so the first error in the text is the one raised. The *fast* mode (tried
first) builds lines in XLA's canonical form straight from one regular expression and
batches the checks that cost most per line (operand names and unique names per body,
attribute brackets and callees per module); when anything is off it gives up and
:func:`parse` re-runs the exact mode, so results and error messages are the same.

The fast mode's hot loop also exists as a small C kernel (``_parse_kernel.c``; see the
end), built on first use when a C compiler and the Python headers are there. It builds
the same instructions as the Python loop and leaves it every line it is not sure about,
so the results never depend on it; ``DISCO_PARSE_BACKEND=python`` turns it off.
"""

from __future__ import annotations

import gc
import os
import re
from itertools import chain, compress
from pathlib import Path

from hlo_tools import native
from hlo_tools.ir import (
    CALLED_COMPUTATION_ATTRS,
    ELEMENT_BYTES,
    HloComputation,
    HloInstruction,
    HloModule,
    Shape,
)
from hlo_tools.opcodes import PARSED_OPCODES

__all__ = ["MAX_ARRAY_BYTES", "MAX_TUPLE_DEPTH", "HloParseError", "parse", "parse_backend",
           "parse_shape"]


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
        quoted = _printable(text_line.strip()[:160])
        snippet = f"\n    {quoted}" if quoted else ""
        super().__init__(f"{where}: {message}{detail}{snippet}")


def _printable(text: str) -> str:
    """``text`` with control and other unprintable characters escaped (as ``repr`` does),
    so that quoting a line of a binary or hostile file cannot drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


_NAME = r"[A-Za-z_][\w.\-]*"
_HEADER = re.compile(rf"HloModule\s+({_NAME})\s*(?:,\s*(.*))?$")
# (Applied to a stripped line; group 3 is the signature plus trailing whitespace.)
_COMP_HEADER = re.compile(rf"(ENTRY\s+)?%?({_NAME})\s*(.*)\{{$")
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
_SHAPE_TEXT = r"[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?"  # the text _ARRAY_SHAPE matches
_SHAPE_TEXTS = re.compile(_SHAPE_TEXT)
_FLAT_TUPLE = re.compile(rf"\(((?:{_SHAPE_TEXT}, )*{_SHAPE_TEXT})\)")
_OPERAND_NAMES = re.compile(rf"%?{_NAME}(?:, %?{_NAME})*")
#: array shapes by their text (``f32[8,16]{1,0}``); cleared when it grows past 100k
_SHAPE_CACHE: dict[str, Shape] = {}
#: Tuple shapes nested deeper than this are refused (XLA's own are a few levels deep;
#: the limit keeps the recursive shape parser far from Python's recursion limit).
MAX_TUPLE_DEPTH = 64
#: Arrays of more bytes than this (1 PiB) are refused: no device holds one, and sums of
#: such sizes would overflow the int64 arithmetic of the graph and the simulator.
MAX_ARRAY_BYTES = 1 << 50


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
        lines = _split_lines(text)  # (once: on a large text the split costs most)
        try:
            return _Parser(text, source, fast=True, lines=lines).module()
        except (HloParseError, _Retry):
            # raises the first error
            return _Parser(text, source, fast=False, lines=lines).module()
    finally:
        if was_enabled:
            gc.enable()


def parse_shape(text: str) -> Shape:
    """Parses one shape such as ``f32[8,16]{1,0}`` or ``(f32[], s32[4])``."""
    shape, end = _parse_shape(text, 0, 1)
    if text[end:].strip():
        raise HloParseError(f"trailing text after shape: {text[end:]!r}", 1, end + 1, "end")
    return shape


def _parse_shape(line: str, pos: int, lineno: int, depth: int = 0) -> tuple[Shape, int]:
    """Parses a shape starting at ``line[pos]``; returns it and the position after it."""
    if line.startswith("(", pos):
        if depth >= MAX_TUPLE_DEPTH:
            raise HloParseError(f"tuple shape nested more than {MAX_TUPLE_DEPTH} deep",
                                lineno, pos + 1, "a shape", text_line=line)
        return _parse_tuple_shape(line, pos, lineno, depth + 1)
    m = _ARRAY_SHAPE.match(line, pos)
    if not m:
        raise HloParseError("bad shape", lineno, pos + 1, "a shape like f32[8,16]{1,0}",
                            text_line=line)
    cached = _SHAPE_CACHE.get(m.group())
    if cached is not None:
        return cached, m.end()
    etype, dims_text, layout = m.group(1), m.group(2), m.group(3) or ""
    if etype not in ELEMENT_BYTES:
        raise HloParseError(f"unknown element type {etype!r}", lineno, pos + 1,
                            "a primitive type", text_line=line)
    dims, dynamic = _parse_dims(dims_text, lineno, m.start(2) + 1, line)
    shape = Shape(etype, dims, layout, (), dynamic)
    if shape.byte_size() > MAX_ARRAY_BYTES:
        raise HloParseError(f"shape {m.group()[:60]} is too large ({shape.byte_size()} "
                            "bytes)", lineno, pos + 1, f"at most {MAX_ARRAY_BYTES} bytes",
                            text_line=line)
    if len(_SHAPE_CACHE) >= 100_000:
        _SHAPE_CACHE.clear()
    _SHAPE_CACHE[m.group()] = shape
    return shape, m.end()


def _parse_dims(text: str, lineno: int, col: int, line: str) -> tuple[tuple[int, ...], tuple]:
    if not text:
        return (), ()
    dims, dynamic = [], []
    for part in text.split(","):
        part = part.strip()
        dyn = part.startswith("<=")
        digits = part[2:] if dyn else part
        if not (digits.isascii() and digits.isdigit()):
            raise HloParseError(f"bad dimension {part!r}", lineno, col, "an integer",
                                text_line=line)
        dims.append(int(digits))
        dynamic.append(dyn)
    return tuple(dims), (tuple(dynamic) if any(dynamic) else ())


def _parse_tuple_shape(line: str, pos: int, lineno: int, depth: int = 1
                       ) -> tuple[Shape, int]:
    m = _FLAT_TUPLE.match(line, pos)
    if m:  # common case first: "(shape, shape, ...)" of array shapes seen before
        elements = [_SHAPE_CACHE.get(text) for text in _SHAPE_TEXTS.findall(m.group(1))]
        if None not in elements:
            return Shape("tuple", tuple_shapes=tuple(elements)), m.end()
    pos += 1
    elements = []
    while True:
        while line.startswith(" ", pos):
            pos += 1
        if line.startswith(")", pos):
            return Shape("tuple", tuple_shapes=tuple(elements)), pos + 1
        shape, pos = _parse_shape(line, pos, lineno, depth)
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


_ODD_LINE_BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e")  # (ASCII, but "\n")


def _split_lines(text: str) -> list[str]:
    """``text.splitlines()``, faster for the usual text (ASCII, no line break but "\\n")."""
    if not text.isascii() or any(c in text for c in _ODD_LINE_BREAKS):
        return text.splitlines()
    lines = text.split("\n")
    if not lines[-1]:
        lines.pop()
    return lines


class _Retry(Exception):
    """Raised by the fast mode when the exact mode has to decide (usually: an error)."""


class _Parser:
    def __init__(self, text: str, source: str | None, fast: bool = False,
                 lines: list[str] | None = None):
        self.lines = _split_lines(text) if lines is None else lines  # (never modified)
        self.source = source
        self.fast = fast
        self.i = 0
        self.line_of: dict[str, int] = {}  # exact mode only
        self.first_instr_line = -1  # 0-based line of the module's first instruction
        # fast mode: attribute texts not checked yet, and the instruction names seen so
        # far with their count (to find duplicates across computations at the end)
        self.attr_texts: list[str] = []
        self.names: set[str] = set()
        self.name_count = 0
        self.kernel_run = _kernel_run() if fast else None  # the C kernel, if any

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
        if self.fast:
            _check_module_fast(module, self.attr_texts, len(self.names) == self.name_count)
        else:
            self._check_module(module)
        first = module.computations[0].instructions[0].name
        module.percent_names = f"%{first} " in self.lines[self.first_instr_line]
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
        suffix = _signature_suffix(m.group(3).rstrip())
        start = self.i
        instructions, root_name = self._body_fast() if self.fast else self._body()
        if not instructions:
            raise self.error(f"computation {m.group(2)!r} is empty", 1, "instructions")
        if self.first_instr_line < 0:  # the body's first non-blank line
            self.first_instr_line = start + 1
            while not self.lines[self.first_instr_line].strip():
                self.first_instr_line += 1
        if root_name is None:
            root_name = instructions[-1].name
        return HloComputation(m.group(2), instructions, root_name, bool(m.group(1)), suffix)

    def _body(self) -> tuple[list[HloInstruction], str | None]:
        """Exact mode: instructions up to the closing ``}``, each line checked fully."""
        lines, line_of, opcodes = self.lines, self.line_of, PARSED_OPCODES
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

    def _body_fast(self) -> tuple[list[HloInstruction], str | None]:
        """Fast mode: :meth:`_body` for the common case (the hot loop: kept tight).

        A line that ``_CANONICAL_INSTR`` matches is built here with the same result as
        ``_parse_instruction`` (by the C kernel when there is one: ``_parse_kernel.c``);
        any other line goes through ``_parse_instruction`` as in the exact mode. The
        checks that cost most per line are batched: per body (one ROOT, unique names,
        operands defined, in :meth:`_check_body`) and per module (attribute brackets,
        callees, names unique across computations). Errors need no line numbers here:
        any error makes :func:`parse` re-run the exact mode.
        """
        lines, opcodes, shapes = self.lines, PARSED_OPCODES, _SHAPE_CACHE
        match, no_operands = _CANONICAL_INSTR.match, _NO_OPERAND_OPCODES
        run = self.kernel_run
        body = instructions, roots, names, operand_lists, texts = [], [], [], [], []
        add_instr, add_name, add_ops, add_text = (
            instructions.append, names.append, operand_lists.append, texts.append)
        k, n = self.i + 1, len(lines)
        while k < n:
            if run is not None:  # builds lines k, k + 1, ... as below, as far as it can
                k = run(lines, k, body, _KERNEL_CONTEXT)
                if k == n:
                    break
            line = lines[k]
            k += 1
            m = match(line)
            if m is not None:
                is_root, name, shape_text, opcode, inner, text = m.groups("")
                shape = shapes.get(shape_text) or _shape_at(shape_text, line, m.start(3), k)
                payload = ""
                if opcode in no_operands:
                    payload, operands = inner.strip(), []
                    if opcode == "parameter" and not (payload.isascii() and payload.isdigit()):
                        raise _Retry  # a bad parameter number
                elif not inner:
                    operands = []
                elif "%" in inner:
                    operands = inner.replace("%", "").split(", ")
                else:
                    operands = inner.split(", ")
                add_instr(HloInstruction(name, opcode, shape, operands, None, payload, text))
                if opcode not in opcodes:
                    raise _Retry
            elif not line or line.isspace():
                continue
            elif line.strip() == "}":
                self.i = k
                return self._check_body(*body)
            else:
                instr, is_root = _parse_instruction(_INDEX_COMMENT.sub("", line), k)
                if instr.opcode not in opcodes:
                    raise _Retry
                add_instr(instr)
                name, operands, text = instr.name, instr.operands, instr.attr_text
            add_name(name)
            add_ops(operands)
            add_text(text)
            if is_root:
                roots.append(name)
        raise _Retry  # end of input inside the computation

    def _check_body(self, instructions: list[HloInstruction], roots: list[str],
                    names: list[str], operand_lists: list[list[str]],
                    texts: list[str]) -> tuple[list[HloInstruction], str | None]:
        """Fast mode: the checks of one body (one ROOT at most, unique names, operands
        defined in it); keeps names and attribute texts for the module-wide checks."""
        local = set(names)
        if (len(roots) > 1 or len(local) != len(names)
                or not local.issuperset(chain.from_iterable(operand_lists))):
            raise _Retry  # (an operand list not like "a, b" has an undefined operand)
        if len(local) > len(self.names):  # (the smaller set goes into the larger)
            self.names, local = local, self.names
        self.names |= local
        self.name_count += len(names)
        self.attr_texts += texts
        return instructions, (roots[0] if roots else None)

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

    def _error_at(self, instr, message: str, expected: str) -> HloParseError:
        line = self.line_of[instr.name]
        return HloParseError(f"{instr.name}: {message}", line, 1, expected, self.source,
                             self.lines[line - 1])


def _check_module_fast(module: HloModule, attr_texts: list[str], unique_names: bool) -> None:
    """The module-wide checks of the fast mode; raises _Retry when one fails.

    Those of ``_check_module`` not done per body (computation names, one ENTRY, callees
    defined), that instruction names are unique across computations
    (``unique_names``), and the bracket check of ``_attr_text`` for ``attr_texts``.
    """
    computations = module.computations
    comps = {c.name for c in computations}
    if (len(comps) != len(computations) or sum(c.is_entry for c in computations) != 1
            or not unique_names):
        raise _Retry
    texts = "\n".join(attr_texts)
    if not comps.issuperset(_called_in(texts)):
        raise _Retry
    _check_attr_texts(texts)


_CALLEE_KEYS = "|".join(rf"(?<={key}=)" for key in CALLED_COMPUTATION_ATTRS)
_CALLEE_ENDS = "".join(sorted({key[-1] for key in CALLED_COMPUTATION_ATTRS}))
# Values of the attributes that name computations, in newline-separated attribute texts.
# Unlike HloInstruction.called_computations it does not ask for ", " before the key, and
# it starts at the "=" (found fast, then the key is looked up behind it); it finds the
# same values and possibly more (a value it reads past holds the names of any value
# inside it), so the check is no weaker.
_CALLEE_VALUES = re.compile(
    rf"=(?<=[{_CALLEE_ENDS}]=)(?:{_CALLEE_KEYS})(\{{[^}}\n]*\}}|%?{_NAME})")
_COMPUTATION_REF = re.compile(rf"%?({_NAME})")


def _called_in(attr_texts: str) -> list[str]:
    """Computations named in newline-separated attribute texts (a superset of what
    ``called_computations`` gives for each text)."""
    return _COMPUTATION_REF.findall(" ".join(_CALLEE_VALUES.findall(attr_texts)))


# Deleting all bytes but these keeps what _balanced looks at (non-ASCII characters
# are never among them).
_SKELETON_DELETE = bytes(c for c in range(256) if chr(c) not in '{}()[]"\\\n')
_S = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'  # a string: (?:[^"\\]|\\.)*+ unrolled (faster in re)


def _nested(inner: str) -> str:
    """A bracketed group or a string whose contents match ``inner``."""
    return rf"(?:\{{{inner}\}}|\({inner}\)|\[{inner}\]|{_S})"


_IN0 = r'[^{}()\[\]"\\]*+'  # group contents without groups or strings (commas allowed)
_IN1 = rf"{_IN0}(?:{_nested(_IN0)}{_IN0})*+"
_IN2 = rf"{_IN0}(?:{_nested(_IN1)}{_IN0})*+"
_TOP = r'[^{}()\[\]"\\,]*+'  # top level: no commas
_ATTR = rf"[A-Za-z_][\w\-]*={_TOP}(?:{_nested(_IN2)}{_TOP})*+"
#: A well-formed attribute list (brackets nested at most three deep): _parse_attrs
#: splits it without error, whatever _balanced says.
_WELL_FORMED_ATTRS = re.compile(rf"{_ATTR}(?:, {_ATTR})*+")


def _check_attr_texts(texts: str) -> None:
    """The bracket check of ``_attr_text`` for many newline-joined texts at once.

    ``_balanced`` only counts brackets, quotes and backslashes, so it is decided per
    distinct *skeleton* (the text without other characters), and few skeletons occur.
    Texts it rejects must split without error (else the exact mode reports it).
    """
    skeletons = texts.encode("utf-8", "surrogatepass").translate(None, _SKELETON_DELETE)
    skeletons = skeletons.split(b"\n")
    bad = {s for s in set(skeletons) if not _balanced(s.decode())}
    if not bad:
        return
    for text in set(compress(texts.split("\n"), map(bad.__contains__, skeletons))):
        if not _WELL_FORMED_ATTRS.fullmatch(text):
            try:
                _parse_attrs(text, 1, text)
            except HloParseError:
                raise _Retry from None


def _signature_suffix(signature: str) -> str:
    """Keeps what follows ``(params) -> shape`` (e.g. ``execution_thread=...``)."""
    if "execution_thread=" not in signature:
        return ""
    m = re.search(r",\s*(execution_thread=.*)$", signature)
    return m.group(1) if m else ""


_FAST_INSTR = re.compile(
    rf"\s*(ROOT\s+)?%?({_NAME})\s*=\s*({_SHAPE_TEXT})"
    r"\s+([a-z][a-z0-9\-]*)\(([^(){}\[\]\"]*)\)(.*)$")
# The subset of _FAST_INSTR lines XLA prints: ", " before the first ``key=`` attribute
# and nothing after the last non-blank character. Same groups, but the last one is the
# attribute text exactly as _attr_text would return it (None when there is none).
# Narrower still: ASCII names, and no "*" anywhere, so that a line with an index
# comment (which the exact mode deletes first) never matches. (Single spaces, ASCII
# classes and possessive repeats only make it faster.)
_CANONICAL_INSTR = re.compile(
    r" *(ROOT )?%?([A-Za-z_][0-9A-Za-z_.\-]*+) = ([a-z][a-z0-9]*+\[[^\]*]*+\](?:\{[^}*]*+\})?)"
    r" ([a-z][a-z0-9\-]*+)\(([^(){}\[\]\"*]*+)\)"
    r"(?:, ([A-Za-z_][0-9A-Za-z_\-]*+=[^*]*[^*\s]))?$")
_OPERAND_LIST = re.compile(r"[A-Za-z_][\w.\-]*(?:,[A-Za-z_][\w.\-]*)*")
_ATTR_BOUNDARY = re.compile(r",\s*(?=[A-Za-z_][\w\-]*=)")


def _shape_at(shape_text: str, line: str, pos: int, lineno: int) -> Shape:
    """The array shape ``shape_text`` found at ``line[pos]``, from the cache if seen."""
    shape = _SHAPE_CACHE.get(shape_text)
    if shape is None:
        shape, _ = _parse_shape(line, pos, lineno)
    return shape


def _parse_instruction(line: str, lineno: int) -> tuple[HloInstruction, bool]:
    m = _FAST_INSTR.match(line)
    if m is None:
        return _parse_instruction_slow(line, lineno)
    is_root, name, shape_text, opcode, inner, rest = m.groups()
    payload = ""
    if opcode in _NO_OPERAND_OPCODES:
        payload = inner.strip()
        if opcode == "parameter" and not (payload.isascii() and payload.isdigit()):
            return _parse_instruction_slow(line, lineno)
        inner = ""
    shape = _shape_at(shape_text, line, m.start(3), lineno)
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
    text = _attr_text(rest, lineno, line, m.end(5) + 1) if rest else ""
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
        if opcode == "parameter" and not (payload.isascii() and payload.isdigit()):
            raise HloParseError("bad parameter number", lineno, start + 1, "an integer",
                                text_line=line)
    elif inner.strip():
        operands = _parse_operands(inner, lineno, start, line)
    text = _attr_text(line[end + 1:], lineno, line, end + 1)
    return HloInstruction(name, opcode, shape, operands, None, payload, attr_text=text), is_root


def _parse_operands(inner: str, lineno: int, start: int, line: str) -> list[str]:
    if _OPERAND_NAMES.fullmatch(inner):  # common case first: "a, %b, ..."
        return inner.replace("%", "").split(", ")
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


# --- The C kernel ----------------------------------------------------------------------
# The fast mode's hot loop as a CPython extension (_parse_kernel.c), compiled with the
# system C compiler on first use (by hlo_tools.native, as the plan's kernel is) into the
# cache directory (hlo_tools.dirs.cache_dir). It builds exactly what the Python code of
# _Parser._body_fast builds and leaves to that code every line it is not sure about, so
# results never depend on it (the tests compare both). The environment variable
# DISCO_PARSE_BACKEND selects: auto (the default: the kernel when it can be built, else the
# Python code, with one warning), c (the kernel or an error) or python.

#: the kernel (its init function is ``PyInit__hlo_parse_kernel``); the backend is selected
#: by :func:`_kernel_run`
_KERNEL = native.Kernel(Path(__file__).with_name("_parse_kernel.c"), "_hlo_parse_kernel",
                       "parsekernel", owner="hlo_tools parser", fallback="parser",
                       stacklevel=5)
#: what the kernel's ``run`` needs besides the lines and the body's lists
_KERNEL_CONTEXT = (_SHAPE_CACHE, PARSED_OPCODES, HloInstruction, CALLED_COMPUTATION_ATTRS)
#: builds (first use) and imports the kernel; None, with one warning, if impossible
_load_kernel = _KERNEL.load


def parse_backend() -> str:
    """What runs the fast mode's hot loop now: ``"c"`` (the C kernel) or ``"python"``."""
    return "python" if _kernel_run() is None else "c"


def _kernel_run():
    """The kernel's ``run`` for the backend ``$DISCO_PARSE_BACKEND`` selects, or None."""
    kernel = native.choose(os.environ.get("DISCO_PARSE_BACKEND", "auto"), "parser",
                          _load_kernel)
    return None if kernel is None else kernel.run
