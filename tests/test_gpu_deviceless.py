"""Plans written for XLA:GPU compile for an H100 without one and keep every planned fusion.

XLA:GPU's PJRT plugin compiles for a described H100 with no GPU present
(:func:`hlo_tools.jax_bridge.pjrt.compile_deviceless`), with the options of
``xla_passes.toml``'s ``[gpu]`` table alone (:func:`hlo_tools.jax_bridge.exact_compiler_options`,
what the exact route compiles plans with). Two kinds of plan:

* random plans (:func:`hlo_tools.random_plan`, 200 moves) of every zoo model at ``tiny`` on
  ONE device (a 1-device ``"data"`` mesh: what a single GPU runs), written with
  ``apply_plan(backend="gpu")``;
* the plan ``disco optimize --hardware gpu_nvlink8`` searches and writes, for a step
  written here (not the zoo's): a 2-layer MLP with a layernorm and plain SGD, its
  gradients ``pmean``-ed over a 1-device mesh.

A planned fusion counts as kept as :func:`hlo_tools.gpu_legal.fusions_kept` says (multi-op
fusions; equal fusions merged by XLA's CSE count as merged, not lost). Skipped, with the
reason, where the CUDA plugin or ``ptxas`` is not installed. Seed 1 of the random plans,
and seed 0 of the models other than vgg and bert (convolutions; attention and the
reduction that once aborted XLA:GPU), run under ``-m slow``.
"""

from __future__ import annotations

import json
from functools import partial

import pytest

import hlo_tools
from hlo_tools.jax_bridge import pjrt

REASON = pjrt.unavailable_reason()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)

from hlo_tools.gpu_legal import fusions_kept  # noqa: E402
from hlo_tools.jax_bridge import exact_compiler_options  # noqa: E402

MODELS = ("vgg", "resnet", "transformer", "bert", "rnnlm", "rnnlm_unrolled", "reformer")
TIMEOUT_S = 300


def _compile(module) -> hlo_tools.HloModule:
    """XLA:GPU's optimized module of ``module`` as written, compiled for an H100."""
    out = pjrt.compile_deviceless(hlo_tools.to_text(module), exact_compiler_options("cuda"),
                                  timeout_s=TIMEOUT_S)
    return hlo_tools.parse(out.optimized_text)


@pytest.fixture(scope="module")
def one_device_module():
    """Each zoo model's pre-optimization module at ``tiny`` on one device, parsed once."""
    from step_helpers import zoo_modules

    return zoo_modules(1)


FAST_MODELS = ("vgg", "bert")


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("model", [pytest.param(m, marks=[] if m in FAST_MODELS else
                                                [pytest.mark.slow]) for m in MODELS])
def test_a_random_zoo_plan_compiles_for_an_h100_and_keeps_its_fusions(
        one_device_module, model, seed):
    module = one_device_module(model)
    plan = hlo_tools.random_plan(module, seed, 200)
    written = hlo_tools.apply_plan(module, plan, backend="gpu")
    kept = fusions_kept(written, _compile(written))
    assert kept.planned > 0, (model, seed)
    assert kept.lost == (), (model, seed, kept)
    assert kept.kept + kept.merged == kept.planned


def _mlp_step():
    """``(step, args)``: a 2-layer MLP with a layernorm, plain SGD, gradients ``pmean``-ed
    over a 1-device ``"data"`` mesh in ``shard_map``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from disco_jax.zoo.common import make_mesh

    mesh = make_mesh(1)

    def local_step(params, batch, lr):
        def loss_fn(p):
            h = batch["x"] @ p["w1"] + p["b1"]
            mu = jnp.mean(h, axis=-1, keepdims=True)
            var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
            h = (h - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"]
            out = jnp.tanh(h) @ p["w2"]
            return jnp.mean((out - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "data")
        new = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return new, jax.lax.pmean(loss, "data")

    def step(params, batch):
        return jax.shard_map(partial(local_step, lr=0.1), mesh=mesh,
                             in_specs=(P(), P("data")), out_specs=(P(), P()),
                             check_vma=False)(params, batch)

    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(16, 64)), "b1": np.zeros(64), "scale": np.ones(64),
              "w2": rng.normal(size=(64, 8))}
    batch = {"x": rng.normal(size=(32, 16)), "y": rng.normal(size=(32, 8))}
    as_f32 = partial(jax.tree.map, lambda a: jnp.asarray(a, jnp.float32))
    return step, (as_f32(params), as_f32(batch))


def test_the_searched_gpu_plan_compiles_for_an_h100_and_keeps_its_fusions(tmp_path, capsys):
    from disco_jax.cli import main

    step, args = _mlp_step()
    src, out = tmp_path / "mlp.hlo", tmp_path / "mlp.opt.hlo"
    src.write_text(hlo_tools.extract(step, *args))
    code = main(["optimize", str(src), "-o", str(out), "--hardware", "gpu_nvlink8",
                 "--no-bench", "--no-in-context", "--time-budget", "3", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["route"]["name"] == "exact"
    assert report["plan"]["fusions"] > 0, report["plan"]
    # disco optimize's own check (the plugin is installed), then ours of OUT.hlo as written
    assert report["gpu_compile"]["checked"] and report["gpu_compile"]["lost"] == []
    written = hlo_tools.parse(out.read_text())
    kept = fusions_kept(written, _compile(written))
    assert kept.planned > 0 and kept.lost == (), kept
    assert kept.kept + kept.merged == kept.planned
    assert [report["gpu_compile"][k] for k in ("planned", "kept", "merged")] == list(kept[:3])
