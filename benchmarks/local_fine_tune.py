"""Learning on the user's machine: ``disco train-estimator --local`` on one program's labels.

For each held-out step of the context dataset (``benchmarks/estimator_context.py
--steps ...``: programs the shipped checkpoint never saw), its labels go into a fresh local
dataset (a temporary cache directory, as a user's runs of that step would fill it) and
``disco train-estimator --local`` fine-tunes the shipped checkpoint on 80% of them and
scores both on the other 20% (held out by a hash of each fused op's key). Per step: the
held-out log loss, within-10% and median error of the shipped and of the fine-tuned
model, whether the command kept the fine-tuned one, and the fallback rule on the same
held-out labels.

Prints a table and writes ``benchmarks/results/local_fine_tune.json``. Run from the
repository root::

    python -m benchmarks.local_fine_tune [--epochs 30]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.estimator_context import context_dataset_path  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "local_fine_tune.json"


def fine_tune(samples: list, epochs: int) -> dict:
    """``disco train-estimator --local`` on ``samples`` in a fresh cache; its report."""
    from disco_estimator.gnn.local import add_local_samples
    from disco_estimator.ops import backend_fingerprint

    with tempfile.TemporaryDirectory(prefix="disco_local_") as cache:
        env = {**os.environ, "DISCO_CACHE_DIR": cache}
        os.environ["DISCO_CACHE_DIR"] = cache
        try:
            add_local_samples(samples, backend_fingerprint(1))
        finally:
            del os.environ["DISCO_CACHE_DIR"]
        out = subprocess.run([sys.executable, "-m", "disco_jax.cli", "train-estimator",
                              "--local", "--epochs", str(epochs)], env=env, text=True,
                             capture_output=True, check=True).stdout
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()
            if ln.split()[:1] in (["base"], ["fine-tuned"])}

    def row(name: str) -> dict:
        r = rows[name]
        return {"n": int(r[1]), "log_loss": float(r[2]), "within_10": float(r[3][:-1]) / 100,
                "median_rel_err": float(r[5][:-1]) / 100}

    return {"shipped": row("base"), "fine_tuned": row("fine-tuned"),
            "kept": "checkpoint written to" in out}


def fallback_on_held_out(samples: list, hardware: str) -> dict:
    """The fallback rule on the samples ``--local`` holds out (the same split)."""
    from disco_estimator.costs.cost_model import BackendConstants
    from disco_estimator.gnn.evaluate import accuracy, fallback_time
    from disco_estimator.gnn.local import held_out_split
    from disco_estimator.hardware import load_hardware
    from disco_jax.cli.train_estimator import LOCAL_HELD_OUT

    c = BackendConstants.from_hardware(load_hardware(hardware))
    _, held = held_out_split(samples, LOCAL_HELD_OUT)
    return accuracy([fallback_time(s.subgraph, c.kernel_launch_s, c.mem_s_per_byte)
                     for s in held], [s.time_s for s in held])


def main(argv: list[str] | None = None) -> int:
    from disco_estimator.gnn.dataset import load_samples

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", help="the context dataset (default: the cache's)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--hardware", default="inproc4", help="the fallback rule's constants")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    samples = load_samples(args.dataset or context_dataset_path())
    steps = sorted({s.source for s in samples if s.source.startswith("heldout:")})
    if not steps:
        print("error: no held-out steps' labels; run benchmarks/estimator_context.py --steps "
              "autoencoder,conv1d,mixer,gru first", file=sys.stderr)
        return 2
    rows = []
    for step in steps:
        print(f"{step}: fine-tuning ...", file=sys.stderr, flush=True)
        mine = [s for s in samples if s.source == step]
        got = fine_tune(mine, args.epochs)
        rows.append({"step": step.split(":", 1)[1], "samples": len(mine), **got,
                     "fallback": fallback_on_held_out(mine, args.hardware)})
    write_result(args.out, {"rows": rows, "epochs": args.epochs})
    print(f"{'step':12} {'n':>4} {'held out':>8} {'shipped loss':>12} {'tuned loss':>10} "
          f"{'shipped <10%':>12} {'tuned <10%':>10} {'shipped med':>11} {'tuned med':>9} "
          f"{'fallback <10%':>13} {'fallback med':>12} kept")
    for r in rows:
        s, t = r["shipped"], r["fine_tuned"]
        print(f"{r['step']:12} {r['samples']:4d} {s['n']:8d} {s['log_loss']:12.3f} "
              f"{t['log_loss']:10.3f} {s['within_10']:12.0%} {t['within_10']:10.0%} "
              f"{s['median_rel_err']:11.0%} {t['median_rel_err']:9.0%} "
              f"{r['fallback']['within_10']:13.0%} {r['fallback']['median_rel_err']:12.0%} "
              f"{'yes' if r['kept'] else 'no'}")
    print(json.dumps({"wrote": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
