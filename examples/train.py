"""Train a Flax model data-parallel, timing ``jax.jit`` and ``disco_jax.jit`` side by side.

A complete script to copy: a Flax model, an Optax optimizer, and a train step written
with ``jax.shard_map`` and ``lax.pmean`` (one all-reduce per gradient, which DisCo fuses
and buckets). The only DisCo line is ``disco_jax.jit(train_step)``.

Run it twice::

    ENABLE_SEARCH=1 DISCO_TIME_BUDGET=30 python examples/train.py   # search, store, train
    ENABLE_SEARCH=0 python examples/train.py                        # train with the stored plan

The first run profiles the step where it runs, searches, measures the best plans against
XLA's default and hand bucketing, all within 15 s more than ``jax.jit``'s first call
(``DISCO_TIME_BUDGET``; without it nothing is cut short), stores the winner (``disco
store list``) and trains with it. The second loads it. Both print the per-step time of
``jax.jit`` and of ``disco_jax.jit`` (medians of interleaved steps) and what DisCo ran
(``last_run_info``).

Without ``XLA_FLAGS`` the script gives itself 4 host CPU devices. The same script runs as
a multi-process job (process 0 searches or reads the store and broadcasts the program)::

    ENABLE_SEARCH=1 DISCO_TIME_BUDGET=30 disco launch -n 2 -- python examples/train.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import disco_jax  # noqa: E402
import disco_jax.activator  # noqa: E402


class MLP(nn.Module):
    """A classifier: ``depth`` dense layers of ``width`` with LayerNorm and GELU."""

    width: int = 512
    depth: int = 4
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = nn.gelu(nn.LayerNorm()(nn.Dense(self.width)(x)))
        return nn.Dense(self.classes)(x)


def make_train_step(model, optimizer, mesh):
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def local_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "data")  # data parallel: average the gradients
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

    # check_vma=False: each gradient gets exactly one all-reduce (the pmean above)
    return jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(), P("data")),
                         out_specs=(P(), P(), P()), check_vma=False)


def setup(batch: int = 256, width: int = 512):
    """The step and its arguments on a mesh of every device of the job:
    ``(train_step, (params, opt_state, batch))``."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    model, optimizer = MLP(width=width), optax.adam(1e-3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=(batch,)).astype(np.int32)
    params = model.init(jax.random.key(0), x[:1])["params"]
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    data = jax.device_put({"x": x, "y": y}, sharded)
    return make_train_step(model, optimizer, mesh), (params, opt_state, data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each (default 20)")
    ap.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    ap.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    args = ap.parse_args()
    # a no-op alone; under `disco launch -n N` it joins the N-process job (gloo on CPU)
    disco_jax.activator.initialize_from_env()

    n = len(jax.devices())
    train_step, (params, opt_state, batch) = setup(args.batch, args.width)
    with_jax = jax.jit(train_step)
    with_disco = disco_jax.jit(train_step)  # <- the one line DisCo needs

    flag = os.environ.get("ENABLE_SEARCH", "unset")
    print(f"{n} devices, ENABLE_SEARCH={flag}; first calls (compile; search if =1) ...",
          flush=True)
    state = {"jax": (params, opt_state), "disco": (params, opt_state)}
    steps = {"jax": with_jax, "disco": with_disco}
    for name in ("jax", "disco"):
        t0 = time.perf_counter()
        p, o, loss = steps[name](*state[name], batch)
        jax.block_until_ready(loss)
        state[name] = (p, o)
        print(f"  {name + '.jit':<11} first call {time.perf_counter() - t0:8.2f} s, "
              f"loss {float(loss):.4f}")
    info = with_disco.last_run_info
    print(f"disco_jax.jit ran: {info.mode} {info.choice or ''}"
          + (f" ({info.reason})" if info.reason else ""))

    times: dict[str, list[float]] = {"jax": [], "disco": []}
    losses: dict[str, float] = {}
    for _ in range(args.steps):  # interleaved, so both see the same machine
        for name in ("jax", "disco"):
            t0 = time.perf_counter()
            p, o, loss = steps[name](*state[name], batch)
            jax.block_until_ready(loss)
            times[name].append(time.perf_counter() - t0)
            state[name], losses[name] = (p, o), float(loss)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\n{'':<15}{'ms/step':>9}{'final loss':>12}")
    for name in ("jax", "disco"):
        print(f"{name + '.jit':<15}{med[name]:9.2f}{losses[name]:12.5f}")
    print(f"speed-up of disco_jax.jit: {med['jax'] / med['disco']:.2f}x "
          f"(median of {args.steps} interleaved steps)")
    if info.mode != "fallback":
        where = info.store_path or "process 0's store"  # in a job, process 0 stores
        said = [f"predicted {info.predicted_s * 1e3:.2f} ms"] if info.predicted_s else []
        if info.measured_s:
            said.append(f"measured in the search {info.measured_s * 1e3:.2f} ms")
        print("; ".join([*said, f"stored in {where}"]))

if __name__ == "__main__":
    main()
