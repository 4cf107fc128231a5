"""Round trips of every zoo train step through ``hlo_tools`` against real XLA:CPU.

Needs 4 host devices (tests/conftest.py). For each tiny zoo model (``MODELS`` and
``auto_sharded``):

* golden text round trip: ``to_text(parse(text))`` of the pre-optimization (``extract``)
  and post-optimization (``compile().as_text()``) HLO is accepted by XLA's parser, printing
  is a fixed point of parse∘print, and XLA's canonical print of our text equals XLA's
  canonical print of the original (our text differs only cosmetically: computation
  signatures, ``/*index=N*/`` comments and blank lines are dropped);
* execution round trip: our re-printed pre-optimization text compiled with
  ``compile_module`` (``exact=False/True``) gives the same outputs as XLA compiling jax's
  own lowering, and (with one documented exception) as ``jax.jit(step)``;
* the parsed post-optimization HLO holds fusions and all-reduces, so XLA's own plan can be
  simulated as a baseline.

The default run takes vgg, transformer (text round trips only), rnnlm and
``auto_sharded``; the rest under ``-m slow``. Every model is lowered and compiled once
for the reference, once per ``exact`` for our text and once more with ``exact=True``
for jax's own lowering; results are cached (``functools.cache``) and shared by the
tests. Run with ``-s`` to see which execution round trips are bitwise identical
(against the same options: always, on jax 0.10.2 CPU). All of them take about 3
minutes wall (125 s CPU) on 2 shared CPU cores.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import pytest

from disco_jax import zoo
from hlo_tools import parse, to_text
from hlo_tools.jax_bridge import (
    CompileOptions,
    InPlaceOf,
    compile_module,
    extract,
    xla_canonical_text,
    xla_parse_ok,
)

N = 4
SIZE = "tiny"
NAMES = [*zoo.MODELS, zoo.AUTO_SHARDED]
#: In the default run: convolutions, attention, a scan and jit-partitioned sharding; the
#: other models under ``-m slow``.
FAST_NAMES = ("vgg", "transformer", "rnnlm", zoo.AUTO_SHARDED)
#: The execution round trips in the default run: transformer's attention is in the
#: default run's text round trips; its compiles for execution (15-25 s) under ``slow``.
FAST_EXEC_NAMES = tuple(n for n in FAST_NAMES if n != "transformer")


def _params(fast: tuple[str, ...]) -> list:
    """Every model as a parameter, those not in ``fast`` under ``slow``."""
    return [pytest.param(n, marks=[] if n in fast else [pytest.mark.slow]) for n in NAMES]


NAME_PARAMS = _params(FAST_NAMES)
EXEC_PARAMS = _params(FAST_EXEC_NAMES)

# Outputs are float32 after one optimizer step. exact=True disables XLA's fusion passes, so
# ops run unfused in a different association order: a few float32 ulps (~1e-7 relative)
# per op, amplified a little by the backward pass, hence rtol 1e-5. atol 1e-6 covers
# leaves that are ~0 (fresh biases, batch-norm means) where a relative bound is
# meaningless. Adam-type models (transformer, rnnlm*, bert, reformer) use eps=1e-3 in the
# zoo: with the usual eps=1e-8 the update lr * m / (sqrt(v) + eps) of a parameter whose
# gradient is at rounding-noise level is ~ +-lr = 1e-3 with an arbitrary sign, so two
# correct compilations could differ by 2e-3 in such a parameter. eps=1e-3 makes the update
# a smooth function of the gradient, so rounding noise stays rounding noise.
RTOL, ATOL = 1e-5, 1e-6

# XLA:CPU (jaxlib 0.10.2) itself computes ResNet's gradients ~3e-3 relative off when
# "fusion" and "dot-library-rewriter" are both disabled and the mesh has >= 2 devices
# (6.8e-5 absolute on the momentum trace; the float64 result agrees with the default
# compile to 1e-7). Compiling jax's own lowering with exact=True gives the same, bitwise:
# it is not a round-trip error, which test_execution_round_trip checks. It depends on the
# CPU: on an AMD EPYC VM XLA's exact compile matched jax.jit (1.2e-7).
XLA_EXACT_DEVIATES = {"resnet"}

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < N, reason=f"needs {N} devices (XLA_FLAGS device count)"
)


@dataclass(frozen=True)
class Model:
    """A zoo train step with its HLO texts and the reference outputs of ``jax.jit``."""

    jitted: Any
    args: tuple
    pre: str
    post: str
    expected: Any


@functools.cache
def _model(name: str) -> Model:
    """Builds, lowers, compiles (XLA's default plan) and runs one tiny zoo model.

    ``jax.jit(step).lower(*args).compile()(*args)`` is the program ``jax.jit(step)(*args)``
    runs; calling it directly avoids compiling the same program twice.
    """
    step, args = zoo.get(name)(N, SIZE)
    jitted = jax.jit(step)
    compiled = jitted.lower(*args).compile()
    return Model(jitted, args, extract(jitted, *args), compiled.as_text(), compiled(*args))


@functools.cache
def _ours(name: str, exact: bool) -> Any:
    """Outputs of our re-printed pre-optimization text compiled with ``compile_module``."""
    m = _model(name)
    run = compile_module(to_text(parse(m.pre)), InPlaceOf(m.jitted, m.args),
                         CompileOptions(exact=exact))
    return run(*m.args)


@functools.cache
def _xla_own(name: str, exact: bool) -> Any:
    """Outputs of jax's own lowering compiled with the same options (no text swapped in)."""
    m = _model(name)
    if not exact:
        return m.expected
    return compile_module(None, InPlaceOf(m.jitted, m.args), CompileOptions(exact=True))(*m.args)


def _leaves(got: Any, want: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """Leaf pairs of two pytrees, asserting the same structure."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    return [(np.asarray(g), np.asarray(w)) for g, w in pairs]


def _assert_close(got: Any, want: Any) -> tuple[bool, float]:
    """Asserts every leaf is within RTOL/ATOL; returns (bitwise identical, max abs diff)."""
    pairs = _leaves(got, want)
    for i, (g, w) in enumerate(pairs):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"leaf {i}")
    bitwise = all(np.array_equal(g, w) for g, w in pairs)
    diff = max(float(np.max(np.abs(g - w), initial=0.0)) for g, w in pairs)
    return bitwise, diff


def _canonical(text: str) -> str:
    """XLA's own print of HLO text after parsing it with XLA's parser."""
    return xla_canonical_text(text)


@pytest.mark.parametrize("stage", ["pre", "post"])
@pytest.mark.parametrize("name", NAME_PARAMS)
def test_golden_round_trip(name, stage):
    """parse∘print is accepted by XLA, idempotent, and canonically equal to the original.

    Post-optimization text from ``as_text()`` has all constants printed in full on
    jax 0.10.2 (no ``{...}``), so the canonical comparison holds for it as well.
    """
    text = getattr(_model(name), stage)
    ours = to_text(parse(text))
    xla_parse_ok(ours)
    assert to_text(parse(ours)) == ours
    assert "{...}" not in text, "elided constant: canonical prints can no longer be compared"
    assert _canonical(ours) == _canonical(text)


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
@pytest.mark.parametrize("name", EXEC_PARAMS)
def test_execution_round_trip(name, exact, record_property):
    """Our text compiles to the outputs of jax's own lowering under the same options."""
    bitwise, diff = _assert_close(_ours(name, exact), _xla_own(name, exact))
    record_property("bitwise", bitwise)
    print(f"\n{name} exact={exact}: bitwise={bitwise} max|diff|={diff:.3g} (vs same options)")


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
@pytest.mark.parametrize("name", EXEC_PARAMS)
def test_execution_matches_jit(name, exact, record_property):
    """Our text compiled with ``compile_module`` gives ``jax.jit(step)``'s outputs.

    Where XLA's own exact-mode compile of the unchanged step already deviates from
    ``jax.jit`` on this CPU (``XLA_EXACT_DEVIATES``), the case is an xfail: ours then
    matches that compile instead (``test_execution_round_trip``)."""
    want = _model(name).expected
    if exact and name in XLA_EXACT_DEVIATES and not _all_close(_xla_own(name, True), want):
        pytest.xfail("XLA:CPU's exact-mode numerics on this CPU (see XLA_EXACT_DEVIATES), "
                     "not a round-trip error")
    bitwise, diff = _assert_close(_ours(name, exact), want)
    record_property("bitwise", bitwise)
    print(f"\n{name} exact={exact}: bitwise={bitwise} max|diff|={diff:.3g} (vs jax.jit)")


def _all_close(got: Any, want: Any) -> bool:
    return all(np.allclose(g, w, rtol=RTOL, atol=ATOL) for g, w in _leaves(got, want))


@pytest.mark.parametrize("name", NAME_PARAMS)
def test_post_opt_has_fusions_and_all_reduces(name):
    """XLA's default plan, parsed, shows its fusions and all-reduces (a simulable baseline)."""
    opcodes = [instr.opcode for _, instr in parse(_model(name).post).instructions()]
    assert opcodes.count("fusion") > 0
    assert opcodes.count("all-reduce") + opcodes.count("all-reduce-start") > 0
