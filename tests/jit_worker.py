"""A fresh process for ``tests/test_jit.py``: runs zoo steps under ``disco_jax.jit`` and
``jax.jit`` side by side and writes what happened as JSON.

``python tests/jit_worker.py --models vgg,rnnlm --store DIR --out OUT.json`` (with
``ENABLE_SEARCH`` set by the caller; ``--stores A,B`` runs every model once per store).
For every model and store: 5 steps of both (each feeding its own new parameters and
optimizer state back), the largest difference of every output of every step, the
``last_run_info`` of the first and last call, the fallback warnings, and how many XLA
compilations the calls after the first caused (jax's ``backend_compile`` events).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import disco_jax  # noqa: E402
from disco_jax import zoo  # noqa: E402
from disco_jax.jit import DiscoFallbackWarning  # noqa: E402
from hlo_tools.jax_bridge import fresh_function  # noqa: E402

#: What the tests search with: small, so a tiny model takes seconds.
QUICK = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
         "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: list[str] = []


def _on_event(event: str, duration_s: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
        _compiles.append(event)


def _local(x):
    return np.asarray(x.addressable_data(0)) if hasattr(x, "addressable_data") else \
        np.asarray(x)


def _diff(got, want) -> tuple[float, bool]:
    """Largest |got - want| over the leaves, and whether all are close (rtol 1e-5)."""
    worst, close = 0.0, True
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = _local(a).astype(np.float64), _local(b).astype(np.float64)
        worst = max(worst, float(np.max(np.abs(a - b), initial=0.0)))
        close = close and bool(np.allclose(a, b, rtol=1e-5, atol=1e-7))
    return worst, close


def run_model(model: str, store: str, steps: int) -> dict:
    step, (params, opt_state, batch) = zoo.get(model)(4, "tiny")
    ref = jax.jit(fresh_function(step))
    wrapped = disco_jax.jit(step, store=store, search_options=QUICK)
    out = {"model": model, "store": store, "max_abs_diff": 0.0, "close": True}
    p_ref, o_ref, p_dj, o_dj = params, opt_state, params, opt_state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiscoFallbackWarning)
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        for i in range(steps):
            _compiles.clear()
            got = wrapped(p_dj, o_dj, batch)
            if i == 0:
                out["first_info"] = wrapped.last_run_info._asdict()
                out["compiles_first"] = len(_compiles)
                out["compiles_after_first"] = 0
            else:
                out["compiles_after_first"] += len(_compiles)
            want = ref(p_ref, o_ref, batch)
            worst, close = _diff(got, want)
            out["max_abs_diff"] = max(out["max_abs_diff"], worst)
            out["close"] = out["close"] and close
            p_dj, o_dj, _ = got
            p_ref, o_ref, _ = want
    out["last_info"] = wrapped.last_run_info._asdict()
    out["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, DiscoFallbackWarning)]
    out["lower_ok"] = "all_reduce" in wrapped.lower(params, opt_state, batch).as_text()
    jax.monitoring.unregister_event_duration_listener(_on_event)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--stores", required=True, help="store directories, comma-separated")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = [run_model(m, s, a.steps) for s in a.stores.split(",")
            for m in a.models.split(",")]
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
