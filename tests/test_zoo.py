"""Tests of the model zoo (needs 4 CPU devices; tests/conftest.py sets XLA_FLAGS).

Each tiny model is lowered and compiled once per session (``_run``); the tests share
that result. The whole file takes about a minute on 2 CPU cores.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from disco_jax import zoo
from disco_jax.zoo import common

N = 4
STEPS = 3

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < N, reason=f"needs {N} devices (XLA_FLAGS device count)"
)


@functools.cache
def _run(name: str):
    """Builds, lowers, compiles and runs ``STEPS`` steps of a tiny model on N devices.

    Returns:
        ``(example_args, pre-opt HLO text, compiled, outputs of step 1, losses)``.
    """
    step, args = zoo.get(name)(N)
    lowered = jax.jit(step).lower(*args)
    compiled = lowered.compile()
    first = compiled(*args)
    out, losses = first, [float(first[2])]
    for _ in range(STEPS - 1):
        out = compiled(out[0], out[1], args[2])
        losses.append(float(out[2]))
    return args, lowered.as_text(dialect="hlo"), compiled, first, losses


def _max_diff(a, b) -> float:
    """Largest absolute elementwise difference of two pytrees of arrays."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_step_runs_and_loss_decreases(name):
    args, _, _, first, losses = _run(name)
    assert first[2].dtype == np.float32 and first[2].shape == ()
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert jax.tree.structure(first[0]) == jax.tree.structure(args[0])
    assert jax.tree.structure(first[1]) == jax.tree.structure(args[1])


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_one_allreduce_per_param_leaf_plus_loss(name):
    args, text, _, _, _ = _run(name)
    assert text.count("all-reduce(") == len(jax.tree.leaves(args[0])) + 1


@pytest.mark.parametrize("name", list(zoo.MODELS))
def test_args_placed_and_deterministic(name):
    _, (params, opt_state, batch) = zoo.get(name)(N)
    _, again = zoo.get(name)(N)
    assert _max_diff((params, opt_state, batch), again) == 0.0
    assert common.count_params(params) > 0
    for leaf in jax.tree.leaves(batch):
        assert leaf.sharding.spec == jax.sharding.PartitionSpec("data")
        assert leaf.shape[0] % N == 0
    for leaf in jax.tree.leaves((params, opt_state)):
        assert leaf.sharding.is_fully_replicated
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params))


def test_four_devices_equal_one_device_with_full_batch():
    args, _, _, first, _ = _run("vgg")
    step1, _ = zoo.get("vgg")(1)
    host_args = jax.device_get(args)
    out1 = jax.jit(step1)(*host_args)
    np.testing.assert_allclose(float(out1[2]), float(first[2]), rtol=1e-5)
    assert _max_diff(out1[0], first[0]) < 1e-5
    assert _max_diff(out1[1], first[1]) < 1e-5
    assert _max_diff(out1[0], host_args[0]) > 1e-3  # the step did move the params


def test_rnnlm_scan_and_unrolled_agree():
    args, _, _, scan_out, scan_losses = _run("rnnlm")
    args_u, _, _, unrolled_out, unrolled_losses = _run("rnnlm_unrolled")
    assert _max_diff(args[0], args_u[0]) == 0.0
    np.testing.assert_allclose(scan_losses, unrolled_losses, rtol=1e-5)
    assert _max_diff(scan_out[0], unrolled_out[0]) < 1e-5


def test_unrolled_rnnlm_has_no_loop():
    _, scan_text, _, _, _ = _run("rnnlm")
    _, unrolled_text, _, _, _ = _run("rnnlm_unrolled")
    assert " while(" in scan_text
    assert " while(" not in unrolled_text


def test_auto_sharded_gets_allreduces_only_from_the_partitioner():
    step, args = zoo.get(zoo.AUTO_SHARDED)(N)
    lowered = jax.jit(step).lower(*args)
    assert "all-reduce" not in lowered.as_text(dialect="hlo")
    compiled = lowered.compile()
    assert "all-reduce(" in compiled.as_text()
    losses = []
    out = (args[0], args[1])
    for _ in range(STEPS):
        out = compiled(out[0], out[1], args[2])
        losses.append(float(out[2]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(out[0]))


def test_registry():
    assert set(zoo.MODELS) == {
        "vgg",
        "resnet",
        "transformer",
        "rnnlm",
        "rnnlm_unrolled",
        "bert",
        "reformer",
    }
    assert zoo.AUTO_SHARDED not in zoo.MODELS
    assert zoo.get(zoo.AUTO_SHARDED) is not None
    assert zoo.get("vgg") is zoo.MODELS["vgg"]
    with pytest.raises(ValueError, match="valid names: .*vgg.*auto_sharded"):
        zoo.get("nope")
    with pytest.raises(ValueError, match="valid sizes"):
        zoo.get("vgg")(1, "huge")
