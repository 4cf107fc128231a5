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

The fast mode's hot loop also exists as a small C kernel (see ``_KERNEL_SOURCE`` at the
end), built on first use when a C compiler and the Python headers are there. It builds
the same instructions as the Python loop and leaves it every line it is not sure about,
so the results never depend on it; ``DISCO_PARSE_BACKEND=python`` turns it off.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from itertools import chain, compress
from pathlib import Path
from types import ModuleType

from hlo_tools.ir import (
    CALLED_COMPUTATION_ATTRS,
    ELEMENT_BYTES,
    HLO_OPCODES,
    HloComputation,
    HloInstruction,
    HloModule,
    Shape,
)

__all__ = ["HloParseError", "parse", "parse_backend", "parse_shape"]


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
        try:
            return _Parser(text, source, fast=True).module()
        except (HloParseError, _Retry):
            return _Parser(text, source, fast=False).module()  # raises the first error
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
    cached = _SHAPE_CACHE.get(m.group())
    if cached is not None:
        return cached, m.end()
    etype, dims_text, layout = m.group(1), m.group(2), m.group(3) or ""
    if etype not in ELEMENT_BYTES:
        raise HloParseError(f"unknown element type {etype!r}", lineno, pos + 1,
                            "a primitive type", text_line=line)
    dims, dynamic = _parse_dims(dims_text, lineno, m.start(2) + 1, line)
    shape = Shape(etype, dims, layout, (), dynamic)
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
        if not digits.isdigit():
            raise HloParseError(f"bad dimension {part!r}", lineno, col, "an integer",
                                text_line=line)
        dims.append(int(digits))
        dynamic.append(dyn)
    return tuple(dims), (tuple(dynamic) if any(dynamic) else ())


def _parse_tuple_shape(line: str, pos: int, lineno: int) -> tuple[Shape, int]:
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
    def __init__(self, text: str, source: str | None, fast: bool = False):
        self.lines = _split_lines(text)
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

    def _body_fast(self) -> tuple[list[HloInstruction], str | None]:
        """Fast mode: :meth:`_body` for the common case (the hot loop: kept tight).

        A line that ``_CANONICAL_INSTR`` matches is built here with the same result as
        ``_parse_instruction`` (by the C kernel when there is one: ``_KERNEL_SOURCE``);
        any other line goes through ``_parse_instruction`` as in the exact mode. The
        checks that cost most per line are batched: per body (one ROOT, unique names,
        operands defined, in :meth:`_check_body`) and per module (attribute brackets,
        callees, names unique across computations). Errors need no line numbers here:
        any error makes :func:`parse` re-run the exact mode.
        """
        lines, opcodes, shapes = self.lines, HLO_OPCODES, _SHAPE_CACHE
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
                    if opcode == "parameter" and not payload.isdigit():
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
        if opcode == "parameter" and not payload.isdigit():
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
        if opcode == "parameter" and not payload.isdigit():
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
# The fast mode's hot loop as a CPython extension, compiled with the system C compiler on
# first use (as the simulator's kernel is) into the cache directory ($DISCO_CACHE_DIR, or
# disco_jax in $XDG_CACHE_HOME, default ~/.cache/disco_jax). It builds exactly what the
# Python code of _Parser._body_fast builds and leaves to that code every line it is not
# sure about, so results never depend on it (the tests compare both). The environment
# variable DISCO_PARSE_BACKEND selects: auto (the default: the kernel when it can be
# built, else the Python code, with one warning), c (the kernel or an error) or python.

_KERNEL_SOURCE = r"""/* The fast mode's hot loop of hlo_tools.parser, as a CPython extension.

   run(lines, k, body, context) builds the instructions of lines[k], lines[k + 1], ...
   exactly as _Parser._body_fast's Python code does, for as long as each line is ASCII
   and canonical (_CANONICAL_INSTR matches it), its shape text is in the shape cache, its
   opcode is known and a parameter's number is a number; it returns the index of the
   first line it leaves to the Python code. It appends to the lists of
   body = (instructions, roots, names, operand_lists, texts), where texts only gets the
   attribute texts the module-wide checks need: those _balanced rejects and those with a
   callee key right before a '='. context = (shapes, opcodes, make, callee_keys), make
   being HloInstruction.

   groups(line) is _CANONICAL_INSTR.match(line).groups("") as the kernel reads it, or
   None where it leaves the line to Python (for the tests). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Character classes of _CANONICAL_INSTR (ASCII only) and of Python's \s and str.strip. */
static int is_lower(Py_UCS1 c) { return c >= 'a' && c <= 'z'; }
static int is_digit(Py_UCS1 c) { return c >= '0' && c <= '9'; }
static int is_first(Py_UCS1 c) { return is_lower(c) || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_key(Py_UCS1 c) { return is_first(c) || is_digit(c) || c == '-'; }
static int is_name(Py_UCS1 c) { return is_key(c) || c == '.'; }
static int is_space(Py_UCS1 c) {
    return c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f);
}
static int is_inner(Py_UCS1 c) {  /* [^(){}\[\]"*] */
    return c != '(' && c != ')' && c != '{' && c != '}' && c != '[' && c != ']' && c != '"'
        && c != '*';
}

typedef struct {  /* where the groups of _CANONICAL_INSTR are: s[name0:name1], ... */
    int root;
    Py_ssize_t name0, name1, shape0, shape1, op0, op1, in0, in1, attr0;
} Groups;

/* _CANONICAL_INSTR after "(ROOT )?", from s[i] to the end of s[0:n]:
   %?NAME = SHAPE OPCODE(INNER)(, KEY=VALUE)?$ with its possessive repeats. */
static int match_rest(const Py_UCS1 *s, Py_ssize_t n, Py_ssize_t i, Groups *g) {
    Py_ssize_t j;
    if (i < n && s[i] == '%') i++;
    if (i >= n || !is_first(s[i])) return 0;
    g->name0 = i;
    for (i++; i < n && is_name(s[i]); i++) {}
    g->name1 = i;
    if (n - i < 3 || memcmp(s + i, " = ", 3) != 0) return 0;
    g->shape0 = i += 3;
    if (i >= n || !is_lower(s[i])) return 0;
    for (i++; i < n && (is_lower(s[i]) || is_digit(s[i])); i++) {}
    if (i >= n || s[i] != '[') return 0;
    for (i++; i < n && s[i] != ']' && s[i] != '*'; i++) {}
    if (i >= n || s[i] != ']') return 0;
    i++;
    if (i < n && s[i] == '{') {  /* the layout (without it, "{" cannot follow) */
        for (j = i + 1; j < n && s[j] != '}' && s[j] != '*'; j++) {}
        if (j >= n || s[j] != '}') return 0;
        i = j + 1;
    }
    g->shape1 = i;
    if (i >= n || s[i] != ' ') return 0;
    g->op0 = ++i;
    if (i >= n || !is_lower(s[i])) return 0;
    for (i++; i < n && (is_lower(s[i]) || is_digit(s[i]) || s[i] == '-'); i++) {}
    g->op1 = i;
    if (i >= n || s[i] != '(') return 0;
    g->in0 = ++i;
    for (; i < n && is_inner(s[i]); i++) {}
    if (i >= n || s[i] != ')') return 0;
    g->in1 = i++;
    g->attr0 = i;
    if (i == n) return 1;  /* no attributes */
    if (n - i < 2 || s[i] != ',' || s[i + 1] != ' ') return 0;
    g->attr0 = i += 2;
    if (i >= n || !is_first(s[i])) return 0;
    for (i++; i < n && is_key(s[i]); i++) {}
    if (i >= n || s[i] != '=') return 0;
    i++;  /* then [^*]*[^*\s]$: a character at least, no '*', no space at the end */
    return i < n && memchr(s + i, '*', n - i) == NULL && !is_space(s[n - 1]);
}

/* _CANONICAL_INSTR.match on s[0:n], trying "ROOT " first as the regex does. */
static int match_line(const Py_UCS1 *s, Py_ssize_t n, Groups *g) {
    Py_ssize_t i = 0;
    while (i < n && s[i] == ' ') i++;
    g->root = n - i >= 5 && memcmp(s + i, "ROOT ", 5) == 0 && match_rest(s, n, i + 5, g);
    return g->root || match_rest(s, n, i, g);
}

static PyObject *ascii_str(const Py_UCS1 *s, Py_ssize_t n) {
    PyObject *str = PyUnicode_New(n, 127);
    if (str != NULL) memcpy(PyUnicode_1BYTE_DATA(str), s, n);
    return str;
}

/* inner.replace("%", "").split(", ") */
static PyObject *split_operands(const Py_UCS1 *s, Py_ssize_t n) {
    Py_UCS1 stack[512], *buf = n <= 512 ? stack : PyMem_Malloc(n);
    Py_ssize_t m = 0, i, start = 0;
    PyObject *list, *item;
    if (buf == NULL) return PyErr_NoMemory();
    for (i = 0; i < n; i++)
        if (s[i] != '%') buf[m++] = s[i];
    list = PyList_New(0);
    for (i = 0; list != NULL && i <= m; i++) {
        if (i < m && !(buf[i] == ',' && i + 1 < m && buf[i + 1] == ' ')) continue;
        item = ascii_str(buf + start, i - start);
        if (item == NULL || PyList_Append(list, item) < 0) Py_CLEAR(list);
        Py_XDECREF(item);
        start = ++i + 1;  /* past the ", " (or the end) */
    }
    if (buf != stack) PyMem_Free(buf);
    return list;
}

/* inner.strip() of a constant or parameter; NULL without an exception for a parameter
   number that is not a number (the Python code raises then). */
static PyObject *payload(PyObject *line, const Py_UCS1 *s, Py_ssize_t a, Py_ssize_t b,
                         int parameter) {
    Py_ssize_t i;
    while (a < b && is_space(s[a])) a++;
    while (b > a && is_space(s[b - 1])) b--;
    if (parameter) {
        if (a == b) return NULL;
        for (i = a; i < b; i++)
            if (!is_digit(s[i])) return NULL;
    }
    return PyUnicode_Substring(line, a, b);
}

typedef struct {  /* the callee keys of one run() call; ends[c]: some key ends with c */
    Py_ssize_t count, len[16];
    const char *key[16];
    char ends[256];
} Keys;

static int read_keys(PyObject *keys, Keys *out) {
    Py_ssize_t j;
    if (!PyTuple_Check(keys) || PyTuple_GET_SIZE(keys) > 16) {
        PyErr_SetString(PyExc_TypeError, "callee keys: a tuple of at most 16 str");
        return -1;
    }
    out->count = PyTuple_GET_SIZE(keys);
    memset(out->ends, 0, sizeof out->ends);
    for (j = 0; j < out->count; j++) {
        out->key[j] = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(keys, j), &out->len[j]);
        if (out->key[j] == NULL) return -1;
        if (out->len[j] == 0) {
            PyErr_SetString(PyExc_ValueError, "callee keys: empty key");
            return -1;
        }
        out->ends[(unsigned char)out->key[j][out->len[j] - 1]] = 1;
    }
    return 0;
}

/* Whether a callee key ends right before s[i] (a '='). */
static int callee_key_before(const Py_UCS1 *s, Py_ssize_t i, const Keys *keys) {
    Py_ssize_t j;
    if (i == 0 || !keys->ends[s[i - 1]]) return 0;
    for (j = 0; j < keys->count; j++)
        if (keys->len[j] <= i && memcmp(s + i - keys->len[j], keys->key[j], keys->len[j]) == 0)
            return 1;
    return 0;
}

static const char SPECIAL[256] = {  /* the characters needs_check looks at */
    ['{'] = 1, ['}'] = 1, ['('] = 1, [')'] = 1, ['['] = 1, [']'] = 1, ['"'] = 1, ['\\'] = 1,
    ['='] = 1,
};

/* Whether the module-wide checks need the attribute text s[0:n]: _balanced(text) is
   false, or a callee key stands right before a '='. */
static int needs_check(const Py_UCS1 *s, Py_ssize_t n, const Keys *keys) {
    Py_ssize_t curly = 0, round = 0, square = 0, quotes = 0, backslashes = 0, i;
    for (i = 0; i < n; i++) {
        if (!SPECIAL[s[i]]) continue;
        switch (s[i]) {
        case '{': curly++; break;
        case '}': curly--; break;
        case '(': round++; break;
        case ')': round--; break;
        case '[': square++; break;
        case ']': square--; break;
        case '"': quotes++; break;
        case '\\': backslashes++; break;
        default:
            if (callee_key_before(s, i, keys)) return 1;
        }
    }
    return curly || round || square || (quotes && (quotes % 2 || backslashes));
}

typedef struct {
    PyObject *instructions, *roots, *names, *operand_lists, *texts;  /* borrowed */
    PyObject *shapes, *opcodes, *make;
    Keys keys;
} Context;

static int read_context(PyObject *body, PyObject *context, Context *c) {
    if (!PyTuple_Check(body) || PyTuple_GET_SIZE(body) != 5 || !PyTuple_Check(context)
            || PyTuple_GET_SIZE(context) != 4) {
        PyErr_SetString(PyExc_TypeError, "run(): body and context are tuples of 5 and 4");
        return -1;
    }
    c->instructions = PyTuple_GET_ITEM(body, 0);
    c->roots = PyTuple_GET_ITEM(body, 1);
    c->names = PyTuple_GET_ITEM(body, 2);
    c->operand_lists = PyTuple_GET_ITEM(body, 3);
    c->texts = PyTuple_GET_ITEM(body, 4);
    c->shapes = PyTuple_GET_ITEM(context, 0);
    c->opcodes = PyTuple_GET_ITEM(context, 1);
    c->make = PyTuple_GET_ITEM(context, 2);
    if (!PyList_Check(c->instructions) || !PyList_Check(c->roots) || !PyList_Check(c->names)
            || !PyList_Check(c->operand_lists) || !PyList_Check(c->texts)
            || !PyDict_Check(c->shapes) || !PyAnySet_Check(c->opcodes)
            || !PyCallable_Check(c->make)) {
        PyErr_SetString(PyExc_TypeError, "run(): bad body or context");
        return -1;
    }
    return read_keys(PyTuple_GET_ITEM(context, 3), &c->keys);
}

/* Appends a built instruction and its parts to the body's lists. */
static int append(const Context *c, PyObject *instr, PyObject *name, PyObject *operands,
                  PyObject *text, int root, int check) {
    if (PyList_Append(c->instructions, instr) < 0 || PyList_Append(c->names, name) < 0
            || PyList_Append(c->operand_lists, operands) < 0)
        return -1;
    if (root && PyList_Append(c->roots, name) < 0) return -1;
    return check ? PyList_Append(c->texts, text) : 0;
}

/* Builds the instruction of a matched line: 1 if appended, 0 if left to Python, -1 on
   an error. */
static int build(PyObject *line, const Py_UCS1 *s, const Groups *g, const Context *c) {
    PyObject *opcode, *key = NULL, *shape = NULL, *name = NULL, *operands = NULL;
    PyObject *pay = NULL, *text = NULL, *instr = NULL;
    Py_ssize_t oplen = g->op1 - g->op0, n = PyUnicode_GET_LENGTH(line);
    int rc = -1, parameter;
    opcode = PyUnicode_Substring(line, g->op0, g->op1);
    if (opcode == NULL) return -1;
    rc = PySet_Contains(c->opcodes, opcode);  /* 0: unknown, Python raises */
    if (rc <= 0) goto done;
    rc = -1;
    key = PyUnicode_Substring(line, g->shape0, g->shape1);
    if (key == NULL) goto done;
    shape = PyDict_GetItemWithError(c->shapes, key);
    if (shape == NULL) {  /* not cached: Python parses it */
        rc = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    Py_INCREF(shape);  /* (`make` runs Python code, which may clear the cache) */
    parameter = oplen == 9 && memcmp(s + g->op0, "parameter", 9) == 0;
    if (parameter || (oplen == 8 && memcmp(s + g->op0, "constant", 8) == 0)) {
        pay = payload(line, s, g->in0, g->in1, parameter);
        if (pay == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            goto done;
        }
        operands = PyList_New(0);
    } else {
        pay = PyUnicode_New(0, 127);
        operands = g->in0 == g->in1 ? PyList_New(0) : split_operands(s + g->in0, g->in1 - g->in0);
    }
    name = PyUnicode_Substring(line, g->name0, g->name1);
    text = PyUnicode_Substring(line, g->attr0, n);
    if (pay == NULL || operands == NULL || name == NULL || text == NULL) goto done;
    {
        PyObject *args[7] = {name, opcode, shape, operands, Py_None, pay, text};
        instr = PyObject_Vectorcall(c->make, args, 7, NULL);
    }
    if (instr != NULL && append(c, instr, name, operands, text, g->root,
                                needs_check(s + g->attr0, n - g->attr0, &c->keys)) == 0)
        rc = 1;
done:
    Py_DECREF(opcode);
    Py_XDECREF(key);
    Py_XDECREF(shape);
    Py_XDECREF(name);
    Py_XDECREF(operands);
    Py_XDECREF(pay);
    Py_XDECREF(text);
    Py_XDECREF(instr);
    return rc;
}

static PyObject *run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Context c;
    Py_ssize_t k;
    (void)self;
    if (nargs != 4 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "run(lines: list, k, body, context)");
        return NULL;
    }
    k = PyLong_AsSsize_t(args[1]);
    if ((k == -1 && PyErr_Occurred()) || read_context(args[2], args[3], &c) < 0) return NULL;
    for (; k >= 0 && k < PyList_GET_SIZE(args[0]); k++) {
        PyObject *line = PyList_GET_ITEM(args[0], k);
        Groups g;
        int rc;
        if (!PyUnicode_Check(line) || !PyUnicode_IS_ASCII(line)
                || !match_line(PyUnicode_1BYTE_DATA(line), PyUnicode_GET_LENGTH(line), &g))
            break;
        Py_INCREF(line);
        rc = build(line, PyUnicode_1BYTE_DATA(line), &g, &c);
        Py_DECREF(line);
        if (rc < 0) return NULL;
        if (rc == 0) break;
    }
    return PyLong_FromSsize_t(k);
}

static PyObject *groups(PyObject *self, PyObject *line) {
    Groups g;
    Py_ssize_t n;
    (void)self;
    if (!PyUnicode_Check(line)) {
        PyErr_SetString(PyExc_TypeError, "groups(line: str)");
        return NULL;
    }
    n = PyUnicode_GET_LENGTH(line);
    if (!PyUnicode_IS_ASCII(line) || !match_line(PyUnicode_1BYTE_DATA(line), n, &g))
        Py_RETURN_NONE;
    return Py_BuildValue("(sNNNNN)", g.root ? "ROOT " : "",
                         PyUnicode_Substring(line, g.name0, g.name1),
                         PyUnicode_Substring(line, g.shape0, g.shape1),
                         PyUnicode_Substring(line, g.op0, g.op1),
                         PyUnicode_Substring(line, g.in0, g.in1),
                         PyUnicode_Substring(line, g.attr0, n));
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL, "Builds canonical lines."},
    {"groups", groups, METH_O, "The groups of a canonical line, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hlo_parse_kernel", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hlo_parse_kernel(void) { return PyModule_Create(&module); }
"""
_KERNEL_NAME = "_hlo_parse_kernel"  # (its init function is PyInit__hlo_parse_kernel)
_KERNEL_CFLAGS = ("-O2", "-shared", "-fPIC", "-fno-strict-aliasing",
                  *(("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()))
#: what the kernel's ``run`` needs besides the lines and the body's lists
_KERNEL_CONTEXT = (_SHAPE_CACHE, HLO_OPCODES, HloInstruction, CALLED_COMPUTATION_ATTRS)
_kernel: ModuleType | None = None
_kernel_tried = False
_kernel_lock = threading.Lock()


def parse_backend() -> str:
    """What runs the fast mode's hot loop now: ``"c"`` (the C kernel) or ``"python"``."""
    return "python" if _kernel_run() is None else "c"


def _kernel_run():
    """The kernel's ``run`` for the backend ``$DISCO_PARSE_BACKEND`` selects, or None."""
    choice = os.environ.get("DISCO_PARSE_BACKEND", "auto")
    if choice == "python":
        return None
    if choice not in ("auto", "c"):
        raise ValueError(f"unknown parser backend {choice!r} (auto | c | python)")
    kernel = _load_kernel()
    if kernel is None and choice == "c":
        raise RuntimeError("parser backend 'c' requested but the C kernel is unavailable")
    return None if kernel is None else kernel.run


def _load_kernel() -> ModuleType | None:
    """Builds (first use) and imports the kernel; None, with one warning, if impossible."""
    global _kernel, _kernel_tried
    if _kernel_tried:
        return _kernel
    with _kernel_lock:
        if _kernel_tried:
            return _kernel
        _kernel_tried = True
        try:
            path = _build_kernel()
            loader = importlib.machinery.ExtensionFileLoader(_KERNEL_NAME, str(path))
            module = importlib.util.module_from_spec(
                importlib.util.spec_from_loader(_KERNEL_NAME, loader))
            loader.exec_module(module)
            _kernel = module
        except (OSError, ImportError, subprocess.SubprocessError) as err:
            warnings.warn(f"hlo_tools parser: C kernel unavailable ({err}); using the "
                          "slower pure-Python parser", RuntimeWarning, stacklevel=5)
    return _kernel


def _build_kernel() -> Path:
    """Compiles the kernel into the cache directory unless it is there already (into a
    fresh private temporary directory if the cache is not writable); its path.

    Raises:
        OSError | subprocess.SubprocessError: no compiler or headers, or a failed compile.
    """
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError("no C compiler (cc) found")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise OSError(f"no Python.h in {include}")
    tag = "\0".join([_KERNEL_SOURCE, cc, *_KERNEL_CFLAGS, include, sys.version,
                     platform.machine()]).encode()
    name = (f"parsekernel-{hashlib.sha256(tag).hexdigest()[:16]}"
            f"{importlib.machinery.EXTENSION_SUFFIXES[0]}")
    out = _kernel_cache_dir() / name
    if out.exists():
        return out
    try:
        _compile_kernel(cc, include, out)
    except PermissionError:
        out = Path(tempfile.mkdtemp(prefix="disco_jax-")) / name
        _compile_kernel(cc, include, out)
    return out


def _kernel_cache_dir() -> Path:
    """``$DISCO_CACHE_DIR``, or ``disco_jax`` in the user's cache directory."""
    if os.environ.get("DISCO_CACHE_DIR"):
        return Path(os.environ["DISCO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "disco_jax"


def _compile_kernel(cc: str, include: str, out: Path) -> None:
    """Compiles ``_KERNEL_SOURCE`` into the extension ``out``, atomically (build, rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "parse_kernel.c"
        src.write_text(_KERNEL_SOURCE)
        lib = Path(tmp) / out.name
        subprocess.run([cc, *_KERNEL_CFLAGS, f"-I{include}", "-o", str(lib), str(src)],
                       check=True, capture_output=True, timeout=120)
        os.replace(lib, out)
