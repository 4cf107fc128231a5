"""One process of a 2-process gloo job for ``tests/test_layouts_gloo.py``: a small
``shard_map`` MLP train step under ``disco_jax.jit`` (``ENABLE_SEARCH=1``, set by the caller)
beside ``jax.jit``, once per way of building the arguments that ``jax.distributed`` allows.

``python tests/layouts_gloo_worker.py --coordinator HOST:PORT --process-id I --out OUT.json
--constructions device_put,host_local,...`` writes one row per construction: the first
call's ``last_run_info``, its seconds, the ``DiscoFallbackWarning`` messages, and the losses
of 3 steps of both (state fed back). ``--fail-search 1`` makes process 1's search raise
when it compiles the candidates (process 0 is then in an exchange with it): both
processes must fall back, at once.

Constructions (the parameters and the momentum replicated, the batch split over ``dp``):

* ``device_put``: ``jax.device_put(tree, NamedSharding(mesh, spec))`` of numpy arrays;
* ``device_put_jax``: the same of jax arrays (a replicated one then has, with one device
  per process, a local buffer that carries the whole mesh's sharding);
* ``host_local``: parameters as ``device_put_jax``, the batch from this process's rows
  with ``multihost_utils.host_local_array_to_global_array`` (the layout of issue 47);
* ``single_device_arrays``: ``jax.make_array_from_single_device_arrays`` of per-device
  buffers;
* ``callback``: ``jax.make_array_from_callback``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONSTRUCTIONS = ("device_put", "device_put_jax", "host_local", "single_device_arrays",
                 "callback")
#: What the tests search with: small, so the step takes seconds.
QUICK = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
         "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}
STEPS = 3


def _values(seed: int) -> tuple[dict, dict, dict]:
    """The global values of parameters, momentum and batch (the same in every process)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    params = {"w1": rng.normal(size=(16, 64)).astype(np.float32) * 0.3,
              "w2": rng.normal(size=(64, 64)).astype(np.float32) * 0.2,
              "w3": rng.normal(size=(64, 4)).astype(np.float32) * 0.2}
    momentum = {"count": np.zeros((), np.int32),
                **{k: np.zeros_like(v) for k, v in params.items()}}
    batch = {"x": rng.normal(size=(32, 16)).astype(np.float32),
             "y": rng.normal(size=(32, 4)).astype(np.float32)}
    return params, momentum, batch


def _step(mesh, lr: float, gspmd: bool = False):
    """A 3-layer MLP data-parallel step with momentum and a step count: ``step(params,
    state, batch) -> (params, state, loss)`` (``lr`` differs per construction: one program
    each). A ``shard_map`` step with ``pmean``, or with ``gspmd`` a plain function whose
    all-reduces jax's partitioner places."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def update(params, state, batch, mean):
        def loss_fn(p):
            h = jnp.tanh(batch["x"] @ p["w1"])
            h = jnp.tanh(h @ p["w2"])
            return jnp.mean((h @ p["w3"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads, loss = mean(grads), mean(loss)
        count = state["count"] + 1
        moved = {k: 0.9 * state[k] + g for k, g in grads.items()}
        scale = lr / (1.0 + 0.01 * count.astype(jnp.float32))
        params = {k: p - scale * moved[k] for k, p in params.items()}
        return params, {"count": count, **moved}, loss

    if gspmd:
        return partial(update, mean=lambda x: x)
    return jax.shard_map(partial(update, mean=partial(jax.lax.pmean, axis_name="dp")),
                         mesh=mesh, in_specs=(P(), P(), P("dp")), out_specs=(P(), P(), P()),
                         check_vma=False)


def _place(construction: str, mesh, params, momentum, batch):
    """The step's arguments built as ``construction`` says."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    if construction == "device_put":
        return (jax.device_put(params, rep), jax.device_put(momentum, rep),
                jax.device_put(batch, dat))
    if construction in ("device_put_jax", "host_local"):  # from jax arrays, one device
        params, momentum = jax.tree.map(jax.numpy.asarray, (params, momentum))
    if construction == "device_put_jax":
        return (jax.device_put(params, rep), jax.device_put(momentum, rep),
                jax.device_put(jax.tree.map(jax.numpy.asarray, batch), dat))
    if construction == "host_local":
        n, me = jax.process_count(), jax.process_index()
        rows = {k: np.split(v, n)[me] for k, v in batch.items()}
        return (jax.device_put(params, rep), jax.device_put(momentum, rep),
                multihost_utils.host_local_array_to_global_array(rows, mesh, P("dp")))
    if construction == "single_device_arrays":
        def make(x, sharding):
            index = sharding.addressable_devices_indices_map(x.shape)
            return jax.make_array_from_single_device_arrays(
                x.shape, sharding, [jax.device_put(x[index[d]], d) for d in index])
        return (jax.tree.map(partial(make, sharding=rep), params),
                jax.tree.map(partial(make, sharding=rep), momentum),
                jax.tree.map(partial(make, sharding=dat), batch))
    if construction == "callback":
        def make(x, sharding):
            return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])
        return (jax.tree.map(partial(make, sharding=rep), params),
                jax.tree.map(partial(make, sharding=rep), momentum),
                jax.tree.map(partial(make, sharding=dat), batch))
    raise ValueError(f"unknown construction {construction!r}")


def _loss(x) -> float:
    import numpy as np

    return float(np.asarray(x.addressable_data(0)))


def run(construction: str, lr: float, store: str, gspmd: bool = False) -> dict:
    """Three steps of ``disco_jax.jit`` and of ``jax.jit`` on arguments built as
    ``construction`` says; what the first call ran and the losses."""
    import jax
    import numpy as np

    import disco_jax
    from disco_jax.jit import DiscoFallbackWarning
    from hlo_tools.jax_bridge import fresh_function

    mesh = jax.make_mesh((jax.device_count(),), ("dp",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    step = _step(mesh, lr, gspmd)
    values = _values(0)
    args = _place(construction, mesh, *values)
    wrapped = disco_jax.jit(step, store=store, search_options=QUICK)
    ref = jax.jit(fresh_function(step))
    row = {"construction": construction, "devices": jax.local_device_count()}
    got, want = args, _place(construction, mesh, *values)
    losses, ref_losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiscoFallbackWarning)
        for i in range(STEPS):
            t0 = time.monotonic()
            out = wrapped(*got)
            jax.block_until_ready(out)
            if i == 0:
                row["first_call_s"] = time.monotonic() - t0
                row["info"] = wrapped.last_run_info._asdict()
            ref_out = ref(*want)
            got, want = (out[0], out[1], args[2]), (ref_out[0], ref_out[1], args[2])
            losses.append(_loss(out[2]))
            ref_losses.append(_loss(ref_out[2]))
    row["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, DiscoFallbackWarning)]
    row["losses"], row["jit_losses"] = losses, ref_losses
    row["close"] = bool(np.allclose(losses, ref_losses, rtol=1e-5, atol=1e-7))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--constructions", default=",".join(CONSTRUCTIONS))
    ap.add_argument("--gspmd", action="store_true", help="the step without shard_map")
    ap.add_argument("--fail-search", type=int, default=None, metavar="PROCESS",
                    help="this process's search raises (the others must not wait for it)")
    a = ap.parse_args()
    import jax

    if a.fail_search == a.process_id:
        from disco_jax.pipeline import candidates

        def broken(*args, **kwargs):
            raise RuntimeError("injected failure of the candidates")

        candidates.build_candidates = broken

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(a.coordinator, num_processes=2, process_id=a.process_id,
                               initialization_timeout=60)
    rows = []
    for k, construction in enumerate(a.constructions.split(",")):
        try:
            rows.append(run(construction, 0.05 + 0.01 * k, a.store, a.gspmd))
        except Exception as err:  # noqa: BLE001 - reported to the test
            rows.append({"construction": construction, "error": f"{type(err).__name__}: {err}"})
    Path(a.out).write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
