"""One process of a 2-process job for ``tests/test_activator.py``, started by
``disco launch``: runs the tiny vgg under ``disco_jax.jit`` and ``jax.jit`` side by side
and writes what happened as JSON.

``python tests/activator_worker.py --out DIR [--put-staged | --put-tampered]
[--vote-no-on 1]`` with
``DISCO_STORE`` (this process's store: the caller gives each process its own through
``DISCO_STORE_<pid>``) and ``ENABLE_SEARCH`` set by the caller. Writes
``DIR/p<pid>.json``: the losses of 5 steps of both, the ``last_run_info``, fallback
warnings, how many times this process ran the search, what the vote said, the scheduling
policies of its gloo event loops after the steps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disco_jax.activator import initialize_from_env  # noqa: E402

initialize_from_env()
import jax  # noqa: E402
import numpy as np  # noqa: E402

import disco_jax  # noqa: E402
from disco_jax import zoo  # noqa: E402
from disco_jax.jit import DiscoFallbackWarning  # noqa: E402
from hlo_tools.jax_bridge import fresh_function  # noqa: E402

QUICK = {"top_k": 1, "choice_rounds": 1, "bucket_thresholds": (1 << 20,),
         "profile_rounds": 2, "predict_baselines": False, "search_s": 0.5}
_searches: list[int] = []


def _count_searches() -> None:
    module = importlib.import_module("disco_jax.pipeline.search")  # the package exports a function
    real = module.search

    def counted(*a, **k):
        _searches.append(1)
        return real(*a, **k)

    module.search = counted


def _put_staged(step, args, store: str) -> str:
    """Process 0: a staged enactment of the step (two buckets) into its store."""
    import hlo_tools
    from disco_jax import store as st
    from disco_jax.enactment import Enactment
    from disco_jax.enactment.staged import staged_plan
    from hlo_tools.jax_bridge import lowered_text

    text = lowered_text(jax.jit(step).lower(*args))
    key = st.source_fingerprint(text)
    module = hlo_tools.parse(text)
    graph = hlo_tools.device_graph(module)
    grads = list(graph.gradient_allreduces)
    half = len(grads) // 2
    plan = staged_plan(module, [grads[:half], grads[half:]], graph)
    enactment = Enactment.of_stages("staged_test", plan)
    record = st.make_record(key, st.Setup.current(), enactment_fingerprint=enactment.fingerprint,
                            choice="staged_test", hardware="gloo2", hardware_sha256=None,
                            predicted_s={}, measured_s={}, search=None)
    st.write_entry(key, record, enactment, root=store)
    return enactment.fingerprint


def _put_tampered(step, args, store: str) -> str:
    """Process 0: jax's own program with the learning rate doubled (it compiles and runs,
    and computes other parameters from the first step on) into its store, never
    verified."""
    import re

    from disco_jax import store as st
    from disco_jax.enactment import Enactment
    from hlo_tools.jax_bridge import lowered_text

    text = lowered_text(jax.jit(step).lower(*args))
    key = st.source_fingerprint(text)
    tampered, count = re.subn(r"constant\(-0\.05\)", "constant(-0.1)", text)
    assert count >= 1, "no learning-rate constant in the program"
    enactment = Enactment.single("tampered_test", tampered, exact=False)
    record = st.make_record(key, st.Setup.current(), enactment_fingerprint=enactment.fingerprint,
                            choice="tampered_test", hardware="gloo2", hardware_sha256=None,
                            predicted_s={}, measured_s={}, search=None)
    st.write_entry(key, record, enactment, root=store)
    return enactment.fingerprint


def _loop_policies() -> list[int]:
    """Scheduling policies of this process's gloo event loops (found once idle)."""
    from disco_estimator.gloo import gloo_loop_threads

    return [os.sched_getscheduler(t) for t in gloo_loop_threads(attempts=50)]


def _verdicts(store: str) -> list:
    """The ``verified`` field of every record in a store (None: never verified)."""
    return [json.loads(p.read_text()).get("verified")
            for p in sorted(Path(store).glob("*/record.json"))]


def _absent(a, pid: int, out: dict, step, args) -> None:
    """Process ``a.absent`` stays away; the others record the error they get."""
    from disco_jax.activator import ActivatorError

    if pid == a.absent:
        time.sleep(15)
    else:
        try:
            disco_jax.jit(step)(*args)
            out["error"] = None
        except ActivatorError as err:
            out["error"] = str(err)
    Path(a.out, f"p{pid}.json").write_text(json.dumps(out, indent=1))
    os._exit(0)  # no jax.distributed.shutdown: its barrier would wait for the absent one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--put-staged", action="store_true")
    ap.add_argument("--put-tampered", action="store_true")
    ap.add_argument("--vote-no-on", type=int, default=None)
    ap.add_argument("--absent", type=int, default=None,
                    help="this process never calls the step (the others must not hang)")
    a = ap.parse_args()
    pid, n = jax.process_index(), jax.process_count()
    store = os.environ[f"DISCO_STORE_{pid}"]
    os.environ["DISCO_STORE"] = store
    _count_searches()
    out: dict = {"pid": pid, "processes": n, "devices": len(jax.devices())}
    if a.vote_no_on is not None:
        from disco_jax.activator import unanimous

        out["vote"] = unanimous(pid != a.vote_no_on, f"process {pid} votes no")
    step, (params, opt_state, batch) = zoo.get("vgg")(n, "tiny")
    if a.put_staged and pid == 0:
        out["staged_fingerprint"] = _put_staged(step, (params, opt_state, batch), store)
    if a.put_tampered and pid == 0:
        out["tampered_fingerprint"] = _put_tampered(step, (params, opt_state, batch), store)
    if a.absent is not None:
        _absent(a, pid, out, step, (params, opt_state, batch))
    ref = jax.jit(fresh_function(step))
    wrapped = disco_jax.jit(step, search_options=QUICK)
    # each step of both programs on the same state (DisCo's): a rewrite must give jax.jit's
    # values within rtol 1e-5 per step; states fed back through Adam would compound the
    # rounding of near-zero gradients
    p_dj, o_dj = params, opt_state
    out["loss_jax"], out["loss_disco"], out["max_abs_diff"], out["close"] = [], [], 0.0, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DiscoFallbackWarning)
        for i in range(a.steps):
            got = wrapped(p_dj, o_dj, batch)
            if i == 0:
                out["first_info"] = wrapped.last_run_info._asdict()
            want = ref(p_dj, o_dj, batch)
            out["loss_disco"].append(float(np.asarray(got[2].addressable_data(0))))
            out["loss_jax"].append(float(np.asarray(want[2].addressable_data(0))))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                g = np.asarray(g.addressable_data(0), np.float64)
                w = np.asarray(w.addressable_data(0), np.float64)
                if g.size:
                    out["max_abs_diff"] = max(out["max_abs_diff"], float(np.max(np.abs(g - w))))
                out["close"] = out["close"] and bool(np.allclose(g, w, rtol=1e-5, atol=1e-6))
            p_dj, o_dj, _ = got
    out["info"] = wrapped.last_run_info._asdict()
    out["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, DiscoFallbackWarning)]
    out["searches"] = len(_searches)
    out["gloo_loop_policies"] = _loop_policies()
    out["verdicts"] = _verdicts(store)
    out["search_skipped"] = [(json.loads(p.read_text()).get("search") or {}).get("skipped")
                             for p in sorted(Path(store).glob("*/record.json"))]
    out["store_entries"] = sorted(p.name for p in Path(store).glob("*") if p.is_dir()
                                  and not p.name.startswith("."))
    Path(a.out, f"p{pid}.json").write_text(json.dumps(out, indent=1))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
