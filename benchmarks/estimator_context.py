"""The context dataset: fused ops of the zoo's train steps, timed in whole-program traces.

For each zoo model (4 host devices, ``--size``): the step's in-context profile and cost
model, then ``--plans`` seeded random plans enacted exactly and XLA's default
compilation, each traced twice (all first traces, then all second ones:
:func:`disco_jax.pipeline.labels.step_labels`). Every fused kernel of several ops becomes a
sample of kind ``"context"`` whose features carry the member times of the step's cost
model and whose label is the median over the traced iterations and devices; the second
trace's median is its ``retest_s``.

The ceiling per source is how often a label's second measurement agrees with the first
within 10% (:func:`disco_estimator.gnn.context.repeat_agreement`), overall and for ops of
10 us or more, per model; the standalone source's is in ``estimator_retest.json``.

Writes the samples to ``<cache>/gnn/context-v<dataset version>-<backend tag>.jsonl``
(``--dataset``; read by ``benchmarks/estimator_accuracy.py --kind context``), a small
fixture of one held-out step's labels with ``--fixture PATH`` (the tests' real labels of
a program no shipped model saw, as a user's local dataset holds), and the summary to
``benchmarks/results/estimator_context.json``. Run from the repository root::

    python -m benchmarks.estimator_context [--models vgg,resnet] [--size small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.estimator_accuracy import MODELS  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from disco_estimator.gnn.evaluate import SMALL_OP_S  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "estimator_context.json"


def context_dataset_path() -> Path:
    """This backend's context dataset in the cache."""
    from disco_estimator.gnn.dataset import dataset_path
    from disco_estimator.ops import backend_fingerprint

    return dataset_path(backend_fingerprint(1), name="context")


def ceiling(samples: list) -> dict:
    """Repeat agreement overall and by size."""
    from disco_estimator.gnn.context import repeat_agreement

    return {"all": repeat_agreement(samples),
            "over_10us": repeat_agreement([s for s in samples if s.time_s >= SMALL_OP_S]),
            "under_10us": repeat_agreement([s for s in samples if s.time_s < SMALL_OP_S])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="zoo models ('' for none)")
    p.add_argument("--steps", default="",
                   help="held-out steps of benchmarks/heldout_steps.py (their samples' source "
                        "is 'heldout:<step>'; they are never trained on)")
    p.add_argument("--size", default="small")
    p.add_argument("--plans", type=int, default=4, help="random plans per step")
    p.add_argument("--iterations", type=int, default=10, help="traced iterations per program")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", help="samples file (default: the cache's context dataset)")
    p.add_argument("--fixture", help="also write this many samples' JSON lines here",
                   metavar="PATH")
    p.add_argument("--fixture-size", type=int, default=80)
    p.add_argument("--fixture-step", default="gru", help="the held-out step of the fixture")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)

    from benchmarks import heldout_steps
    from disco_estimator.gnn.dataset import load_samples
    from disco_jax import zoo
    from disco_jax.pipeline.labels import step_labels
    from hlo_tools.dirs import write_atomic

    path = Path(args.dataset) if args.dataset else context_dataset_path()
    todo = [(m, lambda m=m: zoo.get(m)(4, args.size)) for m in args.models.split(",") if m]
    todo += [(f"heldout:{s}", lambda s=s: getattr(heldout_steps, s)(4, args.size))
             for s in args.steps.split(",") if s]
    # a run replaces the samples of the sources it measures and keeps the others
    kept = [s for s in load_samples(path) if s.source not in {name for name, _ in todo}]
    rows, everything = [], []
    for model, make in todo:
        print(f"{model}: profiling, {args.plans} random plans and XLA's default, traced "
              "twice ...", file=sys.stderr, flush=True)
        got = step_labels(*make(), model, plans=args.plans, seed=args.seed,
                          iterations=args.iterations)
        everything += got.samples
        row = {"model": model, "samples": len(got.samples), "programs": got.programs,
               "seconds": got.seconds, "ceiling": ceiling(got.samples),
               "frac_over_10us": sum(s.time_s >= SMALL_OP_S for s in got.samples)
               / max(len(got.samples), 1)}
        rows.append(row)
        c = row["ceiling"]
        print(f"{model}: {len(got.samples)} fused ops in {got.seconds:.0f} s; repeat within "
              f"10%: {c['all']['within']:.0%} (>= 10 us: {c['over_10us']['within']:.0%} of "
              f"{c['over_10us']['n']})", file=sys.stderr, flush=True)
    text = "".join(json.dumps(s.to_json()) + "\n" for s in [*kept, *everything])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    if args.fixture:  # one held-out step's labels: a user's program no shipped model saw
        pool = [s for s in [*kept, *everything] if s.source == f"heldout:{args.fixture_step}"]
        step = max(1, len(pool) // args.fixture_size)
        write_atomic(args.fixture, "".join(json.dumps(s.to_json()) + "\n"
                                           for s in pool[::step][:args.fixture_size]))
    old = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    rows = [r for r in old.get("rows", []) if r["model"] not in {n for n, _ in todo}] + rows
    report = {"rows": rows, "overall": ceiling([*kept, *everything]), "dataset": str(path),
              "settings": {"size": args.size, "plans": args.plans,
                           "iterations": args.iterations, "seed": args.seed, "devices": 4},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_result(args.out, report)
    print(f"\n{'model':12} {'ops':>5} {'repeat<=10%':>12} {'>=10us ops':>10} "
          f"{'repeat>=10us':>12}")
    for r in rows:
        c = r["ceiling"]
        print(f"{r['model']:12} {r['samples']:5d} {c['all']['within']:12.0%} "
              f"{c['over_10us']['n']:10d} {c['over_10us']['within']:12.0%}")
    o = report["overall"]
    print(f"{'all':12} {o['all']['n']:5d} {o['all']['within']:12.0%} "
          f"{o['over_10us']['n']:10d} {o['over_10us']['within']:12.0%}")
    print(f"samples: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
