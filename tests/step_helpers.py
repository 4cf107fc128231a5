"""Train-step helpers shared by tests and their worker processes (imported as
``step_helpers``: pytest and ``python tests/<worker>.py`` both put ``tests/`` on the path).

* :func:`mlp_step`: a small ``shard_map`` data-parallel step on 4 devices.
* :func:`run_steps`: successive steps of a zoo-style step, state fed back.
* :func:`local`: a replicated array's local copy, as numpy.
* :func:`zoo_modules`: zoo steps' pre-optimization modules, parsed once each.
"""

from __future__ import annotations

from functools import cache, partial


def mlp_step():
    """A small shard_map data-parallel MLP step with a static learning rate.

    Returns:
        ``(step, params, batch)``: ``step(params, batch, lr) -> (params, loss)``;
        ``params()`` makes the same values at every call in fresh buffers (donation
        deletes them); ``batch`` holds ``x`` [32, 16] and ``y`` [32, 4] (float32), split
        over the 4 devices.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from disco_jax.zoo.common import make_mesh

    mesh = make_mesh(4)

    def local_step(params, batch, lr):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w1"])
            return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "data")
        new = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return new, jax.lax.pmean(loss, "data")

    def step(params, batch, lr):
        return jax.shard_map(partial(local_step, lr=lr), mesh=mesh,
                             in_specs=(P(), P("data")), out_specs=(P(), P()),
                             check_vma=False)(params, batch)

    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def params():
        rng = np.random.default_rng(0)
        return {"w1": jax.device_put(jnp.asarray(rng.normal(size=(16, 32)), jnp.float32), rep),
                "w2": jax.device_put(jnp.asarray(rng.normal(size=(32, 4)), jnp.float32), rep)}

    rng = np.random.default_rng(1)
    batch = {"x": jax.device_put(jnp.asarray(rng.normal(size=(32, 16)), jnp.float32), dat),
             "y": jax.device_put(jnp.asarray(rng.normal(size=(32, 4)), jnp.float32), dat)}
    return step, params, batch


def run_steps(fn, args, steps):
    """``steps`` successive calls of ``fn(params, opt_state, batch) -> (params, opt_state,
    loss)``, params and optimizer state fed back, the same batch; each call's outputs,
    waited for."""
    import jax

    outs, (params, opt_state, batch) = [], args
    for _ in range(steps):
        params, opt_state, loss = fn(params, opt_state, batch)
        jax.block_until_ready((params, opt_state, loss))
        outs.append((params, opt_state, loss))
    return outs


def local(x):
    """The first local shard of ``x`` as a numpy array (the whole value when replicated)."""
    import numpy as np

    return np.asarray(x.addressable_shards[0].data)


def zoo_modules(devices: int, size: str = "tiny"):
    """``get(model)``: the zoo step's pre-optimization module on ``devices`` devices at
    ``size``, extracted and parsed at the first ask for each model."""
    import hlo_tools
    from disco_jax import zoo

    @cache
    def get(model: str):
        step, args = zoo.get(model)(devices, size)
        return hlo_tools.parse(hlo_tools.extract(step, *args))

    return get
