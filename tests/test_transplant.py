"""An executable compiled apart, run by jax under jax.jit's calling convention (transplant).

Real jax on the CPU: a shard_map train step on 4 devices compiled by ``jax.jit`` is the
template; the same step's text, with a random plan's hand-written fusions, compiled
exactly by ``compile_module`` gives the backend bytes. The transplanted ``Compiled`` must
run the exact program (its text, its fusions) with jit's pytrees and jit's numbers.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from step_helpers import mlp_step

import hlo_tools
from disco_jax.enactment.plan_check import distinct_fusions
from hlo_tools.jax_bridge import (
    CompileOptions,
    HloCompileError,
    InPlaceOf,
    compile_module,
    extract,
    internals,
)
from hlo_tools.jax_bridge.transplant import aliased_parameters, backend_bytes, transplant

LR = 0.1


@pytest.fixture(scope="module")
def step():
    """``(jitted step, fresh params, batch, the plain step)``; the learning rate is
    static."""
    fn, params, batch = mlp_step()
    return jax.jit(fn, static_argnums=2), params, batch, fn


@pytest.fixture(scope="module")
def planned(step):
    """``(template, exact compile of a planned text, the text)``."""
    fn, params, batch, _ = step
    args = (params(), batch, LR)
    module = hlo_tools.parse(extract(fn, *args))
    text = hlo_tools.to_text(hlo_tools.apply_plan(module, hlo_tools.random_plan(module, 0, 50)))
    run = compile_module(text, InPlaceOf(fn, args), CompileOptions(exact=True))
    return fn.lower(*args).compile(), run, text


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _program(compiled):
    """A compiled program's text without jax's source locations (op metadata and the
    stack frame tables), which a deserialized executable may number differently."""
    paragraphs = compiled.as_text().split("\n\n")
    kept = "\n\n".join(p for p in paragraphs if not p.lstrip().startswith(_TABLES))
    return re.sub(r", metadata=\{[^}]*\}", "", kept)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_serialized_executable_is_jax_metadata_then_backend_bytes(step, planned):
    _, params, batch, _ = step
    template, _, _ = planned
    prefix, rest = internals.split_serialized(template)
    length, width = internals._varint(prefix)
    assert width + length == len(prefix) and rest == backend_bytes(template)
    # jax's own bytes back under its own prefix: the same program and numbers
    again = internals.load_with_prefix(template, rest)
    assert isinstance(again, jax.stages.Compiled) and _program(again) == _program(template)
    for a, b in zip(_leaves(again(params(), batch)), _leaves(template(params(), batch)),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_transplanted_plan_runs_its_exact_program_with_jits_numbers(step, planned):
    _, params, batch, _ = step
    template, run, text = planned
    compiled = transplant(template, backend_bytes(run.compiled))
    assert isinstance(compiled, jax.stages.Compiled)
    assert compiled.in_tree == template.in_tree and compiled.out_tree == template.out_tree
    assert compiled.input_shardings == template.input_shardings
    # the exact program, with the plan's hand-written fusions, not XLA's own
    assert _program(compiled) == _program(run.compiled) != _program(template)
    assert distinct_fusions(hlo_tools.parse(compiled.as_text())) == \
        distinct_fusions(hlo_tools.parse(text)) > 0
    got = _leaves(compiled(params(), batch))
    for a, b in zip(got, _leaves(template(params(), batch)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, _leaves(run(params(), batch)), strict=True):
        np.testing.assert_array_equal(a, b)  # the same executable: the same bits


def test_donation_is_preserved(step):
    fn, params, batch, plain = step
    donating = jax.jit(plain, static_argnums=2, donate_argnums=0)
    args = (params(), batch, LR)
    template = donating.lower(*args).compile()
    # jax's lowering compiled exactly (no fusion pass): another program, donation kept
    # (extract's text loses buffer_donor on its way to MLIR in compile_module: no alias)
    run = compile_module(None, InPlaceOf(donating, args), CompileOptions(exact=True))
    compiled = transplant(template, backend_bytes(run.compiled))
    assert _program(compiled) == _program(run.compiled) != _program(template)
    assert aliased_parameters(compiled) == {0, 1}
    kept = params()
    want = _leaves(template(kept, batch))
    given = params()
    got = _leaves(compiled(given, batch))
    assert all(x.is_deleted() for x in jax.tree.leaves(given))
    assert all(x.is_deleted() for x in jax.tree.leaves(kept))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, _leaves(run(params(), batch)), strict=True):
        np.testing.assert_array_equal(a, b)
    # bytes that would delete arrays the template's callers keep are refused
    with pytest.raises(HloCompileError, match="does not donate"):
        transplant(fn.lower(*args).compile(), backend_bytes(template))


@pytest.mark.parametrize("corrupt", [
    lambda good, whole: b"",
    lambda good, whole: b"not an executable",
    lambda good, whole: good[:len(good) // 2],
    lambda good, whole: whole,  # jax's prefix already in front: it does not parse twice
], ids=["empty", "garbage", "truncated", "with-prefix"])
def test_corrupt_bytes_raise_hlo_compile_error(planned, corrupt):
    template, run, _ = planned
    good = backend_bytes(run.compiled)
    whole = b"".join(internals.split_serialized(run.compiled))
    with pytest.raises(HloCompileError, match="did not load|no executable"):
        transplant(template, corrupt(good, whole))


def test_bytes_of_another_program_are_refused(step, planned):
    fn, params, batch, _ = step
    _, run, _ = planned
    other = jax.jit(lambda p, b: jax.tree.map(lambda x: 2 * x, p)).lower(params(), batch)
    with pytest.raises(HloCompileError, match="entry signature"):
        transplant(other.compile(), backend_bytes(run.compiled))


def test_compile_options_proto_round_trips(step):
    fn, params, batch, _ = step
    lowered = fn.lower(params(), batch, LR)
    options = {"xla_disable_hlo_passes": "fusion", "xla_cpu_enable_fast_math": "false"}
    proto = internals.lowered_compile_options_proto(lowered, options)
    back = internals.parse_compile_options(proto)
    assert (back.num_replicas, back.num_partitions) == (1, 4)
    assert "Computation0{0} Computation1{1} Computation2{2} Computation3{3}" in \
        str(back.device_assignment)
    assert dict(back.env_option_overrides) == options
    build = back.executable_build_options
    assert build.use_spmd_partitioning
    assert not back.parameter_is_tupled_arguments
    assert list(build.allow_spmd_sharding_propagation_to_parameters) == [False] * 4
    assert list(build.allow_spmd_sharding_propagation_to_output) == [True] * 3
    assert back.SerializeAsString() == proto
