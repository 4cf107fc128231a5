"""Fuzzing the HLO reader: mutations of real HLO never crash it with a foreign exception.

The texts are real: the HLO of a tiny zoo train step (``vgg``, extracted once per module
with :func:`hlo_tools.extract`) and two checked-in fixtures. Each example applies one to
four seeded mutations -- delete, duplicate or swap lines, replace a character, truncate,
replace a token (an opcode, a shape, an instruction name) by another token of the text or
by junk, insert garbage -- and runs the result through the reader:

* :func:`hlo_tools.parse` either returns a module or raises
  :class:`hlo_tools.HloParseError` (a ``ValueError`` with the line and column): that is
  *our error type* for text. Any other exception fails the test.
* A parsed module goes through :func:`hlo_tools.find_problems`, which returns its
  structural problems as a list and must never raise, and through
  :func:`hlo_tools.to_text`.
* A module without problems goes through :func:`hlo_tools.device_graph`, which may refuse
  it only with a ``ValueError`` (what ``disco`` commands turn into a user error).

The budget is fixed and the examples derandomized, so every run tries the same inputs:
:data:`EXAMPLES` examples per text (1,500 in all), about ten seconds on one core. Longer
hunts with the same mutations (65,000 texts, with both parser back-ends) found one crash,
fixed: a ``get-tuple-element`` without an operand made the verifier raise IndexError.
"""

from __future__ import annotations

import os
import pathlib
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hlo_tools

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
#: Examples per text (three texts): the fuzz budget (``DISCO_FUZZ_EXAMPLES`` overrides it
#: for a longer hunt; the default is what CI runs).
EXAMPLES = int(os.environ.get("DISCO_FUZZ_EXAMPLES", "500"))

_TOKENS = {
    "opcode": re.compile(r"(?<= )[a-z][a-z0-9\-]*(?=\()"),
    "shape": re.compile(r"[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?"),
    "name": re.compile(r"%?[A-Za-z_][\w.\-]*\.\d+"),
}
_JUNK = ["", "(", ")", "{", "}", "[", "]", ",", "=", "%", "ROOT", "ENTRY", "f32[]",
         "f32[-1]", "f32[99999999999999999999]", "((((f32[]", "tuple", "parameter(x)",
         "\x00", "\ufeff", "é", "\u2028", "\r", "\"", "/*index=5*/", "index=-1", "¹"]

_MUTATION = st.tuples(
    st.sampled_from(["delete", "duplicate", "swap", "char", "truncate", "token", "insert"]),
    st.integers(0, 1 << 30), st.integers(0, 1 << 30),
    st.one_of(st.sampled_from(_JUNK), st.text(max_size=12)),
)


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    from disco_jax import zoo

    step, args = zoo.get("vgg")(4, "tiny")
    return {"vgg": hlo_tools.extract(step, *args),
            "shard_map_mlp": (FIXTURES / "shard_map_mlp.pre.hlo").read_text(),
            "sort_rng": (FIXTURES / "sort_rng.pre.hlo").read_text()}


def mutate(text: str, mutations: list[tuple[str, int, int, str]]) -> str:
    """``text`` after each mutation ``(kind, a, b, junk)``; ``a`` and ``b`` pick lines,
    positions or tokens (modulo their number), ``junk`` is what goes in."""
    for kind, a, b, junk in mutations:
        lines = text.split("\n")
        i, j = a % len(lines), b % len(lines)
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(j, lines[i])
        elif kind == "swap":
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "char" and text:
            p = a % len(text)
            text = text[:p] + (junk[:1] or chr(b % 0x110000 or 1)) + text[p + 1:]
            continue
        elif kind == "truncate":
            text = text[:a % (len(text) + 1)]
            continue
        elif kind == "token":
            pattern = list(_TOKENS.values())[b % len(_TOKENS)]
            found = list(pattern.finditer(text))
            if found:
                m = found[a % len(found)]
                other = found[b % len(found)].group() if junk == "" else junk
                text = text[:m.start()] + other + text[m.end():]
            continue
        elif kind == "insert":
            p = a % (len(text) + 1)
            text = text[:p] + junk + text[p:]
            continue
        text = "\n".join(lines)
    return text


def read(text: str) -> str:
    """Runs ``text`` through the reader; returns how far it got. Fails on any exception
    other than the documented ones."""
    try:
        module = hlo_tools.parse(text, source="fuzz.hlo")
    except hlo_tools.HloParseError as err:
        assert err.line >= 1 and str(err).startswith("fuzz.hlo:"), str(err)
        return "parse error"
    problems = hlo_tools.find_problems(module)
    assert isinstance(problems, list)
    hlo_tools.to_text(module)
    if problems:
        return "invalid"
    try:
        hlo_tools.device_graph(module)
    except ValueError:
        return "graph refused"
    return "ok"


@pytest.mark.parametrize("name", ["vgg", "shard_map_mlp", "sort_rng"])
def test_mutated_hlo_fails_only_with_our_errors(name, texts):
    text = texts[name]
    outcomes: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_MUTATION, min_size=1, max_size=4))
    def check(mutations):
        outcome = read(mutate(text, mutations))
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    check()
    assert read(text) == "ok"  # the unmutated text reads
    assert outcomes.get("parse error", 0) > 0  # the mutations do reach the errors
    print(f"{name}: {sum(outcomes.values())} examples: {outcomes}")
