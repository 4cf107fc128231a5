"""One process of a 2-process job for ``tests/test_user_jobs.py``, started by
``disco launch``: a zoo train step whose arguments are built the ways a user builds them
in a multi-process job, under ``disco_jax.jit`` and ``jax.jit`` side by side.

``disco launch -n 2 --devices-per-process N -- python tests/user_job_worker.py --out DIR
--inputs HOW`` with ``ENABLE_SEARCH`` and ``DISCO_STORE_<pid>`` set by the caller.
``--inputs``: how the batch is built from this process's part of it
(``device_put`` of the whole batch, ``process_local``:
``jax.make_array_from_process_local_data``, ``host_local``:
``multihost_utils.host_local_array_to_global_array``, ``single_device``:
``jax.make_array_from_single_device_arrays``). Writes ``DIR/p<pid>.json``: the mode and
reason of ``last_run_info``, the fallback warnings, and whether every output of 2 steps
equals ``jax.jit``'s (rtol 1e-5) on this process's shards.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--inputs", default="device_put",
                choices=["device_put", "process_local", "host_local", "single_device"])
ap.add_argument("--model", default="vgg")
ARGS = ap.parse_args()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disco_jax.activator import initialize_from_env  # noqa: E402

initialize_from_env()
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import disco_jax  # noqa: E402
from disco_jax import zoo  # noqa: E402
from disco_jax.jit import DiscoFallbackWarning  # noqa: E402
from hlo_tools.jax_bridge import fresh_function  # noqa: E402

QUICK = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
         "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}


def _local_part(a: jax.Array) -> np.ndarray:
    """This process's rows of a batch leaf sharded along its first axis."""
    shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def _rebuilt(a: jax.Array, how: str) -> jax.Array:
    """The batch leaf ``a`` built again from this process's part, the ``how`` way."""
    sharding = a.sharding
    assert isinstance(sharding, NamedSharding)
    local = _local_part(a)
    if how == "device_put":
        return a
    if how == "process_local":
        return jax.make_array_from_process_local_data(sharding, local)
    if how == "host_local":
        return multihost_utils.host_local_array_to_global_array(local, sharding.mesh,
                                                                sharding.spec)
    per = len(local) // jax.local_device_count()
    devices = sorted(jax.local_devices(), key=lambda d: d.id)
    return jax.make_array_from_single_device_arrays(
        a.shape, sharding, [jax.device_put(local[i * per:(i + 1) * per], d)
                            for i, d in enumerate(devices)])


def _same(got, want) -> bool:
    """Every output equal on this process's shards (rtol 1e-5)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        for sa, sb in zip(sorted(a.addressable_shards, key=lambda s: s.device.id),
                          sorted(b.addressable_shards, key=lambda s: s.device.id),
                          strict=True):
            if not np.allclose(np.asarray(sa.data), np.asarray(sb.data), rtol=1e-5,
                               atol=1e-6):
                return False
    return True


def main() -> None:
    step, (params, opt_state, batch) = zoo.get(ARGS.model)(jax.device_count(), "tiny")
    batch = jax.tree.map(lambda a: _rebuilt(a, ARGS.inputs), batch)
    ref = jax.jit(fresh_function(step))
    wrapped = disco_jax.jit(step, search_options=QUICK)
    same = True
    p_dj, o_dj, p_ref, o_ref = params, opt_state, params, opt_state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiscoFallbackWarning)
        for _ in range(2):
            got = wrapped(p_dj, o_dj, batch)
            want = ref(p_ref, o_ref, batch)
            same = same and _same(got, want)
            (p_dj, o_dj, _), (p_ref, o_ref, _) = got, want
    info = wrapped.last_run_info
    row = {"mode": info.mode, "reason": info.reason, "choice": info.choice, "same": same,
           "devices": jax.device_count(), "local": jax.local_device_count(),
           "warnings": [str(w.message) for w in caught
                        if issubclass(w.category, DiscoFallbackWarning)]}
    Path(ARGS.out, f"p{jax.process_index()}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main()
