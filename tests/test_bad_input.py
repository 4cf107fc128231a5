"""Bad HLO input: ``hlo_tools.parse`` and every ``disco`` command that reads an HLO file.

Each case of :data:`CASES` is a file content that is not a usable module. Through
:func:`hlo_tools.parse` (when the bytes are text at all) it raises
:class:`hlo_tools.HloParseError` with its line, or it parses and
:func:`hlo_tools.find_problems` names the problem. Through ``disco simulate``,
``disco estimate`` and ``disco optimize`` (in process, :func:`disco_jax.cli.main`) it
gives exit code 2 and one ``disco: error: FILE:LINE: ...`` message (two lines for
``simulate``: the message and the offending line, quoted), no traceback, nothing on
stdout, and no output file: neither ``optimize -o`` nor ``simulate --trace`` leaves one,
and an existing ``-o`` file keeps its content. The CLI cases add a missing file, a
directory, a device that never ends and a 100 MB file (refused by size before it is
read); ``hlo_tools.parse`` fails fast on 100 MB of garbage. Two real subprocesses show
that no traceback reaches the terminal.

The other commands (``demo``, ``bench``, ``calibrate``, ``train_estimator``) read no HLO
file.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

import hlo_tools
from disco_jax.cli import EXIT_USAGE, main
from disco_jax.cli.inputs import MAX_INPUT_ENV

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
BASE = (FIXTURES / "grad_mlp.pre.hlo").read_text()  # ENTRY main.1, 18 instructions


def _swap_lines(text: str, first: str, second: str) -> str:
    lines = text.split("\n")
    i = next(k for k, line in enumerate(lines) if line.lstrip().startswith(first))
    j = next(k for k, line in enumerate(lines) if line.lstrip().startswith(second))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines)


_FUSED = """HloModule m

fused {
  p0 = f32[4]{0} parameter(0)
  ROOT n = f32[4]{0} negate(p0)
}

ENTRY e {
  a = f32[4]{0} parameter(0)
  ROOT f = f32[8]{0} fusion(a), kind=kLoop, calls=fused
}
"""
_ALL_REDUCE = """HloModule m

add {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}

ENTRY e {
  a = f32[4]{0} parameter(0)
  b = f32[4]{0} parameter(1)
  ROOT r = (f32[4]{0}, f32[8]{0}) all-reduce(a, b), replica_groups={}, to_apply=add
}
"""

#: id -> (file content, "LINE" of the message or "" for none, what the message says)
CASES: dict[str, tuple[bytes, str, str]] = {
    "empty_file": (b"", "1", "empty file"),
    "whitespace_only": (b"  \n\t\n\n", "1", "empty file"),
    "binary_garbage": (bytes(range(256)) * 64, "2", "not UTF-8 text (byte 0x80)"),
    "control_characters": (bytes(range(1, 32)) * 20, "1:1", "missing module header"),
    "truncated_module": (BASE[:len(BASE) // 2].encode(), "12:1",
                         "unexpected end of input inside computation"),
    "truncated_header": (BASE[:30].encode(), "1:25", "bad attribute 'entry_'"),
    "unknown_opcode": (BASE.replace("tanh(", "frobnicate(").encode(), "7:27",
                       "unknown opcode 'frobnicate'"),
    "duplicate_instruction_names": (
        BASE.replace("mul.7 = ", "mul.6 = ").replace("(mul.6, mul.7)", "(mul.6, mul.6)")
        .encode(), "18:1", "duplicate instruction name 'mul.6'"),
    "operand_used_before_definition": (
        _swap_lines(BASE, "tanh.1 =", "mul.5 =").encode(), "7",
        "operand 'tanh.1' is used before definition"),
    "undefined_operand": (BASE.replace("tanh(dot_general.2)", "tanh(nope.1)").encode(),
                          "7:1", "operand 'nope.1' is not defined"),
    "cycle": (BASE.replace("tanh(dot_general.2)", "tanh(mul.7)").encode(), "7",
              "part of a cycle: tanh.1 -> mul.7 -> tanh.1"),
    "shape_mismatch_elementwise_add": (
        BASE.replace("add(mul.6, mul.7)", "add(mul.6, x.1)").encode(), "19",
        "elementwise add operand dims (16, 8) differ from result dims (16, 4)"),
    "shape_mismatch_fusion": (_FUSED.encode(), "10", "fusion result f32[8]"),
    "shape_mismatch_all_reduce": (_ALL_REDUCE.encode(), "12",
                                  "all-reduce result (f32[4]{0}, f32[8]{0}) does not match its "
                                  "operands (f32[4]{0}, f32[4]{0})"),
    "non_utf8_bytes": (BASE.replace("tanh.1 = ", "tanh\xff.1 = ").encode("latin-1"), "7",
                       "not UTF-8 text (byte 0xff)"),
    "nul_byte": (BASE.replace("tanh(", "ta\x00nh(").encode(), "7:26", "expected an opcode"),
    "no_entry_computation": (BASE.replace("ENTRY ", "").encode(), "23:1",
                             "exactly one ENTRY"),
    "tuple_shape_nested_too_deep": (
        ("HloModule m\n\nENTRY e {\n  ROOT p = " + "(" * 100_000 + "f32[] parameter(0)\n}\n")
        .encode(), "4:76", "tuple shape nested more than 64 deep"),
    "shape_too_large": (BASE.replace("f32[16,4]{1,0} tanh", "f32[99999999999999999999,4]"
                                     "{1,0} tanh").encode(), "7:12", "is too large"),
    "bad_get_tuple_element_index": (
        b"HloModule m\n\nENTRY e {\n  p = (f32[], f32[]) parameter(0)\n"
        b"  ROOT g = f32[] get-tuple-element(p), index=x\n}\n", "5",
        "get-tuple-element index 'x' is not a number"),
}
#: what hlo_tools.parse says where it differs from the CLI's reader
PARSE_SAYS = {"empty_file": "empty input", "whitespace_only": "empty input"}
COMMANDS = ("simulate", "estimate", "optimize")


def _argv(command: str, src: pathlib.Path, out: pathlib.Path) -> list[str]:
    extra = {"simulate": ["--no-in-context", "--trace", str(out)],
             "estimate": [],
             "optimize": ["--no-in-context", "-o", str(out), "--time-budget", "1"]}
    return [command, str(src), "--no-bench", *extra[command]]


def _run_bad(command: str, src: pathlib.Path, tmp_path: pathlib.Path, capsys,
             existing: bool = False) -> str:
    """Runs the command on ``src``; checks exit code, stderr, stdout and the output
    folder; returns stderr."""
    outdir = tmp_path / "out"
    outdir.mkdir()
    out = outdir / ("opt.hlo" if command == "optimize" else "trace.json")
    if existing:
        out.write_text("previous")
    code = main(_argv(command, src, out))
    captured = capsys.readouterr()
    err = captured.err
    assert code == EXIT_USAGE, err
    assert err.startswith("disco: error: "), err
    assert "Traceback" not in err and captured.out == ""
    assert len(err.strip().splitlines()) <= (2 if command == "simulate" else 1), err
    assert [p.name for p in outdir.iterdir()] == ([out.name] if existing else [])
    if existing:
        assert out.read_text() == "previous"
    return err


@pytest.mark.parametrize("case", list(CASES))
def test_parse_rejects(case):
    content, line, what = CASES[case]
    what = PARSE_SAYS.get(case, what)
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        pytest.skip("not text: only the CLI's reader sees these bytes")
    try:
        module = hlo_tools.parse(text, source="bad.hlo")
    except hlo_tools.HloParseError as err:
        assert str(err).startswith(f"bad.hlo:{err.line}:{err.column}: "), str(err)
        assert what in str(err), str(err)
        assert f"{err.line}:{err.column}".startswith(line)
        return
    problems = hlo_tools.find_problems(module)
    assert problems and what in problems[0], problems


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", list(CASES))
def test_command_rejects(case, command, tmp_path, capsys):
    content, line, what = CASES[case]
    src = tmp_path / "bad.hlo"
    src.write_bytes(content)
    err = _run_bad(command, src, tmp_path, capsys, existing=case == "cycle")
    where = f"{src}:{line}:" if line else f"{src}:"
    assert err.startswith(f"disco: error: {where}"), err
    assert what in err, err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", ["missing_file", "directory", "endless_device",
                                  "file_of_100_mb"])
def test_command_rejects_file(case, command, tmp_path, capsys, monkeypatch):
    if case == "missing_file":
        src, what = tmp_path / "missing.hlo", "no such file"
    elif case == "directory":
        src, what = tmp_path, "is a directory, expected an HLO text file"
    elif case == "endless_device":  # read up to the limit only
        monkeypatch.setenv(MAX_INPUT_ENV, "1")
        src, what = pathlib.Path("/dev/zero"), "more than the 1.0 MiB limit"
    else:
        src, what = tmp_path / "big.hlo", "100.0 MiB, larger than the 64.0 MiB limit"
        _write_100_mb(src)
    t0 = time.perf_counter()
    err = _run_bad(command, src, tmp_path, capsys)
    assert err.startswith(f"disco: error: {src}: ") and what in err, err
    assert time.perf_counter() - t0 < 5


def _write_100_mb(path: pathlib.Path) -> None:
    """A module header, then instruction lines up to 100 MiB."""
    line = b"  x = f32[16,4]{1,0} add(y, z)\n"
    with open(path, "wb") as fh:
        fh.write(b"HloModule big\n\nENTRY e {\n")
        fh.write(line * ((100 << 20) // len(line)))
    assert path.stat().st_size >= 100 << 20


def test_parse_of_100_mb_of_garbage_fails_fast():
    text = "HloModule m\n\nENTRY e {\n" + "  x = f32[] garbage(y), z={\n" * 3_800_000
    assert len(text) >= 100 << 20
    t0 = time.perf_counter()
    with pytest.raises(hlo_tools.HloParseError) as info:
        hlo_tools.parse(text, source="big.hlo")
    assert time.perf_counter() - t0 < 10
    assert str(info.value).startswith("big.hlo:4:25: unclosed bracket")


def test_input_limit_is_configurable(tmp_path, capsys, monkeypatch):
    src = tmp_path / "in.hlo"
    src.write_text(BASE)
    monkeypatch.setenv(MAX_INPUT_ENV, "0.0001")  # 104 bytes
    assert main(["simulate", str(src), "--no-bench", "--no-in-context"]) == EXIT_USAGE
    assert f"{len(BASE)} bytes, larger than the 104 bytes limit" in capsys.readouterr().err
    monkeypatch.setenv(MAX_INPUT_ENV, "lots")
    assert main(["simulate", str(src), "--no-bench", "--no-in-context"]) == EXIT_USAGE
    assert f"{MAX_INPUT_ENV}='lots': expected a positive number" in capsys.readouterr().err


def test_byte_order_mark_is_accepted(tmp_path, capsys):
    src = tmp_path / "bom.hlo"
    src.write_bytes(b"\xef\xbb\xbf" + BASE.encode())
    assert main(["simulate", str(src), "--no-bench", "--no-in-context", "--json"]) == 0
    assert '"iteration_s"' in capsys.readouterr().out


@pytest.mark.parametrize("case", ["binary_garbage", "cycle"])
def test_subprocess_prints_no_traceback(case, tmp_path):
    src = tmp_path / "bad.hlo"
    src.write_bytes(CASES[case][0])
    out = tmp_path / "opt.hlo"
    proc = subprocess.run(
        [sys.executable, "-m", "disco_jax", "optimize", str(src), "-o", str(out),
         "--no-bench"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.startswith(f"disco: error: {src}:") and CASES[case][2] in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.hlo"]
