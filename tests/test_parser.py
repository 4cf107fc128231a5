"""Parser and printer: golden round trips, malformed input, fuzzing."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hlo_tools
from hlo_tools import HloParseError, parse, parse_shape, to_text
from hlo_tools.jax_bridge import xla_canonical_text

FIXTURES = sorted((pathlib.Path(__file__).parent / "fixtures").glob("*.hlo"))

SMALL = """HloModule small, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

add_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}

ENTRY main {
  p = f32[4]{0} parameter(0)
  c = f32[] constant(2)
  bc = f32[4]{0} broadcast(c), dimensions={}
  m = f32[4]{0} multiply(p, bc)
  ar = f32[4]{0} all-reduce(m), replica_groups={{0,1,2,3}}, to_apply=add_f32
  ROOT out = f32[4]{0} add(ar, p), metadata={op_name="jit(f)/add, with comma" source_line=3}
}
"""


def xla_canonical(text: str) -> str:
    return xla_canonical_text(text)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name)
def test_golden_round_trip(path):
    text = path.read_text()
    printed = to_text(parse(text, source=str(path)))
    assert to_text(parse(printed)) == printed, "parse∘print is not idempotent"
    assert xla_canonical(printed) == xla_canonical(text), printed


def test_small_module_structure():
    m = parse(SMALL)
    assert m.name == "small"
    assert [c.name for c in m.computations] == ["add_f32", "main"]
    assert m.entry.name == "main" and m.entry.root_name == "out"
    ar = m.entry.instruction("ar")
    assert ar.opcode == "all-reduce" and ar.operands == ["m"]
    assert ar.called_computations == ["add_f32"]
    assert ar.attrs["replica_groups"] == "{{0,1,2,3}}"
    out = m.entry.instruction("out")
    assert out.op_name == "jit(f)/add, with comma"
    assert m.entry.instruction("c").payload == "2"
    assert m.instruction_count == 9
    assert xla_canonical(to_text(m)) == xla_canonical(SMALL)


def test_attribute_edit_is_printed():
    m = parse(SMALL)
    m.entry.instruction("bc").attrs["dimensions"] = "{}"
    m.entry.instruction("ar").attrs["channel_id"] = "7"
    text = to_text(m)
    assert "to_apply=add_f32, channel_id=7" in text
    assert parse(text).entry.instruction("ar").attrs["channel_id"] == "7"


@pytest.mark.parametrize("text,shape", [
    ("f32[8,16]{1,0}", ("f32", (8, 16), 512)),
    ("f32[]", ("f32", (), 4)),
    ("pred[3]{0}", ("pred", (3,), 3)),
    ("bf16[2,<=5]", ("bf16", (2, 5), 20)),
    ("(f32[2]{0}, (s32[], u8[4]{0}))", ("tuple", (), 16)),
    ("token[]", ("token", (), 0)),
])
def test_parse_shape(text, shape):
    s = parse_shape(text)
    assert (s.element_type, s.dims, s.byte_size()) == shape
    assert str(s) == text.replace(", (", ", (")


def _broken(old: str, new: str) -> str:
    assert old in SMALL
    return SMALL.replace(old, new, 1)


MALFORMED = {
    "empty": ("", 1),
    "no header": ("ENTRY main {\n  p = f32[] parameter(0)\n}\n", 1),
    "truncated": (SMALL[: SMALL.index("  ROOT out")], 14),
    "unknown opcode": (_broken("multiply(p, bc)", "multiplyy(p, bc)"), 13),
    "undefined operand": (_broken("add(ar, p)", "add(ar, q)"), 15),
    "mismatched braces": (_broken("replica_groups={{0,1,2,3}}", "replica_groups={{0,1,2,3}"), 14),
    "bad shape": (_broken("f32[4]{0} multiply", "f32[4,x]{0} multiply"), 13),
    "unknown type": (_broken("f32[4]{0} multiply", "f33[4]{0} multiply"), 13),
    "missing equals": (_broken("m = f32[4]{0} multiply", "m f32[4]{0} multiply"), 13),
    "bad parameter": (_broken("parameter(0)\n  c", "parameter(x)\n  c"), 10),
    "unterminated string": (_broken('source_line=3}', 'source_line=3'), 15),
    "duplicate name": (_broken("  c = f32[] constant(2)", "  p = f32[] constant(2)"), 11),
    "unknown computation": (_broken("to_apply=add_f32", "to_apply=nope"), 14),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_raises_with_line(name):
    text, line = MALFORMED[name]
    with pytest.raises(HloParseError) as info:
        parse(text, source="bad.hlo")
    assert info.value.line == line, str(info.value)
    assert f"bad.hlo:{line}:" in str(info.value)


def test_error_message_names_what_was_expected():
    with pytest.raises(HloParseError, match=r"expected a shape like"):
        parse(_broken("f32[4]{0} multiply", "[4]{0} multiply"))


_REAL = [p.read_text() for p in FIXTURES if p.name.startswith(("shard_map", "scan", "cond"))]


def _mutated(text: str, cuts: list[tuple[int, int, str]]) -> str:
    """``text`` with each ``(position, length, insert)`` cut replaced by its insert."""
    for pos, length, insert in cuts:
        pos %= max(len(text), 1)
        text = text[:pos] + insert + text[pos + length:]
    return text


def _cuts(alphabet: str) -> st.SearchStrategy:
    """1 to 4 ``(position, length, insert)`` cuts for :func:`_mutated`."""
    return st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 40),
                              st.text(alphabet=alphabet, max_size=6)), min_size=1, max_size=4)


_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(which=st.integers(0, len(_REAL) - 1), cuts=_cuts("{}()[],=%\"\n abfx0123.-"))
def test_fuzz_parser_raises_only_parse_errors(which, cuts):
    text = _mutated(_REAL[which], cuts)
    try:
        module = parse(text)
    except HloParseError:
        return
    printed = to_text(module)
    assert to_text(parse(printed)) == printed


def test_public_api_exports():
    for name in hlo_tools.__all__:
        assert hasattr(hlo_tools, name), name


# --- the fast mode (tried first by parse) gives exactly what the exact mode gives ---------

def _parse_mode(text: str, fast: bool):
    """The module from one parser mode, or the exception it raised."""
    from hlo_tools.parser import _Parser

    try:
        return _Parser(text, None, fast=fast).module()
    except Exception as e:  # noqa: BLE001 - compared below
        return e


def _snapshot(module) -> tuple:
    """Everything the parser decides, including the lazy parts left unsplit."""
    comps = tuple(
        (c.name, c.root_name, c.is_entry, c.suffix,
         tuple((i.name, i.opcode, i.shape, tuple(i.operands), i.payload, i.attr_text,
                i._attrs, tuple(i.called_computations)) for i in c.instructions))
        for c in module.computations)
    return (module.name, module.header_attrs, module.sections, module.percent_names, comps)


def _assert_modes_agree(text: str) -> None:
    exact = _parse_mode(text, fast=False)
    fast = _parse_mode(text, fast=True)
    if isinstance(exact, Exception):
        assert isinstance(exact, HloParseError), exact
        assert isinstance(fast, Exception), "fast mode accepted what exact mode rejects"
        with pytest.raises(HloParseError) as info:
            parse(text)
        assert str(info.value) == str(exact)
        return
    if not isinstance(fast, Exception):  # else parse() falls back to the exact mode
        assert _snapshot(fast) == _snapshot(exact)
    assert _snapshot(parse(text)) == _snapshot(exact)


@pytest.mark.parametrize("path", FIXTURES + [SMALL], ids=lambda p: getattr(p, "name", "SMALL"))
def test_fast_mode_equals_exact_mode_on_fixtures(path):
    text = path if isinstance(path, str) else path.read_text()
    exact = _parse_mode(text, fast=False)
    fast = _parse_mode(text, fast=True)
    assert not isinstance(fast, Exception), fast  # valid XLA output never needs a retry
    assert _snapshot(fast) == _snapshot(exact)


def test_fast_path_builds_every_fixture_line_like_the_exact_path():
    from hlo_tools.parser import _CANONICAL_INSTR, _parse_instruction

    checked = 0
    for path in FIXTURES:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            m = _CANONICAL_INSTR.match(line)
            if m is None or "/*" in line:
                continue
            instr, is_root = _parse_instruction(line, lineno)
            root, name, _, opcode, inner, text = m.groups()
            assert (bool(root), name, opcode, text or "") == (
                is_root, instr.name, instr.opcode, instr.attr_text), line
            if opcode not in ("constant", "parameter") and inner:
                assert inner.replace("%", "").split(", ") == instr.operands, line
            checked += 1
    assert checked > 1000


@pytest.mark.parametrize("old,new", [
    ("multiply(p, bc)", "multiply(p,bc)"),          # operands not "a, b": exact mode decides
    ("multiply(p, bc)", "multiply( p , bc )"),
    ("multiply(p, bc)", "multiply(%p, bc)"),
    ("add(ar, p)", "add(ar, c)"),
    ("to_apply=add_f32", "to_apply=%add_f32"),
    ("to_apply=add_f32", "to_apply={add_f32}"),
    ("dimensions={}", 'dimensions={}, x="a(\\"b"'),   # escaped quote: split to check
    ("dimensions={}", 'dimensions={}, x="a(b"'),      # unbalanced inside a string: fine
    ("dimensions={}", "dimensions={}, x=(}"),          # really unbalanced: an error
    ("dimensions={}", "dimensions={} , y=1"),
    ("dimensions={}", "dimensions={},y=1"),
    ("dimensions={}", "dimensions={}, y=1 "),
    ("dimensions={}", "dimensions={}, y"),
    ("  c = f32[] constant(2)", "  ar = f32[] constant(2)"),   # duplicate of a later name
    ("  c = f32[] constant(2)", "  a = f32[] constant(2)"),    # same name in another comp
    ("  c = f32[] constant(2)", "  c = f32[] parameter(x)"),
    ("  c = f32[] constant(2)", "  ROOT c = f32[] constant(2)"),  # second ROOT
    ("bc = f32[4]{0} broadcast", "bc = f32[4]{0:T(2)} broadcast"),
    ("bc = f32[4]{0} broadcast", "bc = f32[4]{0} broadcastt"),
    ("f32[4]{0} multiply", "f32[4,x]{0} multiply"),
    ("ENTRY main {", "ENTRY main (p: f32[4]) -> f32[4] {"),
])
def test_fast_mode_equals_exact_mode_on_edits(old, new):
    assert old in SMALL
    _assert_modes_agree(SMALL.replace(old, new, 1))


@_FUZZ
@given(which=st.integers(0, len(_REAL) - 1), cuts=_cuts("{}()[],=%\"\\\n abfx0123.-"))
def test_fuzz_fast_mode_equals_exact_mode(which, cuts):
    _assert_modes_agree(_mutated(_REAL[which], cuts))


# --- the C kernel (the fast mode's hot loop) gives exactly what the Python loop gives ----

def _kernel():
    """The parser's C kernel, or a skip when it cannot be built here."""
    from hlo_tools.parser import _load_kernel

    kernel = _load_kernel()
    if kernel is None:
        pytest.skip("no C kernel (no C compiler or Python headers)")
    return kernel


def _assert_kernel_reads_like_the_regex(kernel, line: str) -> None:
    """The kernel's groups are the regex's, and it leaves a canonical line to Python only
    where the line is not ASCII or holds a newline (which parsed lines never do)."""
    from hlo_tools.parser import _CANONICAL_INSTR

    m = _CANONICAL_INSTR.match(line)
    groups = kernel.groups(line)
    if groups is not None or (line.isascii() and "\n" not in line):
        assert groups == (m.groups("") if m else None), line


def test_kernel_reads_every_fixture_line_like_the_regex():
    kernel = _kernel()
    lines = [line for path in FIXTURES for line in path.read_text().splitlines()]
    lines += SMALL.splitlines()
    for line in lines:
        _assert_kernel_reads_like_the_regex(kernel, line)
    assert sum(kernel.groups(line) is not None for line in lines) > 1000


_LINE_PIECES = list(" %=,(){}[]\"*.-_\\\t\x1c\x00\nR") + [
    "ROOT ", " = ", "f32[4]{0}", "f32[]", "s32[2,<=3]", " add", "parameter", "constant",
    "(a, b)", "(%a, %b)", ", x=", ", calls=", "1", "é"]


@_FUZZ
@given(which=st.integers(0, len(_REAL) - 1), start=st.integers(0, 10**6),
       edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3),
                                st.sampled_from(_LINE_PIECES)), max_size=4))
def test_fuzz_kernel_reads_lines_like_the_regex(which, start, edits):
    lines = _REAL[which].splitlines()
    line = lines[start % len(lines)]
    for pos, length, piece in edits:
        line = line[:pos] + piece + line[pos + length:]
    _assert_kernel_reads_like_the_regex(_kernel(), line)


def _parse_with(backend: str, text: str, monkeypatch):
    """``_parse_mode(text, fast=True)`` with the parser backend ``backend``, starting from
    an empty shape cache (so that the kernel meets shapes it leaves to Python)."""
    from hlo_tools.parser import _SHAPE_CACHE

    monkeypatch.setenv("DISCO_PARSE_BACKEND", backend)
    _SHAPE_CACHE.clear()
    return _parse_mode(text, fast=True)


@pytest.mark.parametrize("path", FIXTURES + [SMALL], ids=lambda p: getattr(p, "name", "SMALL"))
def test_kernel_builds_like_the_python_loop(path, monkeypatch):
    _kernel()
    text = path if isinstance(path, str) else path.read_text()
    with_kernel = _parse_with("c", text, monkeypatch)
    without = _parse_with("python", text, monkeypatch)
    assert not isinstance(with_kernel, Exception), with_kernel
    assert _snapshot(with_kernel) == _snapshot(without)
    assert to_text(with_kernel) == to_text(without)


@pytest.mark.parametrize("old,new", [
    ("c = f32[] constant(2)", "c = f32[] constant( 2 )"),
    ("c = f32[] constant(2)", "c = f32[] constant(%2)"),
    ("b = f32[] parameter(1)", "b = f32[] parameter( 1)"),
    ("b = f32[] parameter(1)", "b = f32[] parameter(1x)"),
    ("multiply(p, bc)", "multiply(%p, %bc)"),
    ("multiply(p, bc)", "multiply(p,, bc)"),
    ("multiply(p, bc)", "multiply(%)"),
    ("multiply(p, bc)", "multiply()"),
    ("bc = f32[4]{0} broadcast", "bc = f64[4]{0} broadcast"),
    ("bc = f32[4]{0} broadcast", "bc = f32[4]{0} broadcastt"),
    ("bc = f32[4]{0} broadcast", "bé = f32[4]{0} broadcast"),       # not ASCII
    ("dimensions={}", "dimensions={}, x=\"a\\\"b\""),
    ("dimensions={}", "dimensions={}, calls=add_f32"),
    ("dimensions={}", "dimensions={}, calls=nope"),
    ("dimensions={}", "dimensions={}, x=(}"),
    ("  m = f32[4]{0}", "  ROOT m = f32[4]{0}"),
    ("  m = f32[4]{0}", "  ROOT = f32[4]{0}"),
    ("ENTRY main {\n", "ENTRY main {\n\n"),
])
def test_kernel_and_python_loop_agree_on_edits(old, new, monkeypatch):
    _kernel()
    assert old in SMALL
    text = SMALL.replace(old, new, 1)
    with_kernel = _parse_with("c", text, monkeypatch)
    without = _parse_with("python", text, monkeypatch)
    if isinstance(without, Exception):
        assert type(with_kernel) is type(without) and str(with_kernel) == str(without)
    else:
        assert _snapshot(with_kernel) == _snapshot(without)
    monkeypatch.setenv("DISCO_PARSE_BACKEND", "c")
    _assert_modes_agree(text)


@_FUZZ
@given(which=st.integers(0, len(_REAL) - 1), cuts=_cuts("{}()[],=%\"\\\n abfx0123.-*"))
def test_fuzz_fast_mode_equals_exact_mode_without_kernel(which, cuts):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("DISCO_PARSE_BACKEND", "python")
        _assert_modes_agree(_mutated(_REAL[which], cuts))


def test_async_short_forms_of_compiled_gpu_modules() -> None:
    """XLA:GPU's compiled modules print an op run asynchronously as ``<op>-start`` /
    ``<op>-done`` (sugar for async-start/-done wrapping it): they parse, name their
    called computation, and count as async wrappers; an unknown op's forms still fail."""
    from hlo_tools.opcodes import ASYNC_WRAPPER_OPCODES

    text = """HloModule m, is_scheduled=true

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %e = f32[8]{0} exponential(%p)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %fs = ((f32[8]{0}), f32[8]{0}, s32[]) fusion-start(%a), kind=kLoop, calls=%fused
  ROOT %fd = f32[8]{0} fusion-done(%fs)
}
"""
    entry = parse(text).entry
    assert [i.opcode for i in entry.instructions] == ["parameter", "fusion-start", "fusion-done"]
    assert entry.instructions[1].called_computations == ["fused"]
    assert {"fusion-start", "fusion-done"} <= ASYNC_WRAPPER_OPCODES
    with pytest.raises(HloParseError, match="unknown opcode 'frob-start'"):
        parse(text.replace("fusion-start(", "frob-start("))
