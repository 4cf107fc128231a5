"""``disco train-estimator``: train the GNN fused-op estimator on measured fused ops.

The samples are fusion groups measured as standalone fused ops
(:mod:`disco_estimator.gnn.dataset`): read from ``--dataset`` (a dataset file, or a directory
holding one file per backend fingerprint; default: the cache's ``gnn`` directory), or
first added to it with ``--generate``, which draws groups from the zoo models
``--models`` at ``--size`` -- of the ``--kinds`` ``plan`` (groups of random plans of the
pre-optimization HLO) and ``xla`` (XLA's own fusions, from the module XLA compiles) --
and times up to ``--per-module`` new ones per model and kind (samples already stored are
never timed again, so a stopped run resumes). ``--generate-only`` stops there.

Training (:func:`disco_estimator.gnn.train.train`): Adam on the squared error of log time,
``--epochs`` passes' worth of minibatch steps (``epochs * ceil(n / batch)``), progress on
stderr. ``--held-out MODEL`` keeps that model's samples out of training. The trained
model is written to ``--out`` (:func:`disco_estimator.gnn.checkpoint.save`, atomically) with
the dataset's backend fingerprint and the training notes.

``--local`` fine-tunes ``--base`` (default: the shipped checkpoint) on the user's local
dataset of this backend (:mod:`disco_estimator.gnn.local`: fused ops timed in context),
holds out :data:`LOCAL_HELD_OUT` of it (:func:`~disco_estimator.gnn.local.held_out_split`)
and writes the result to :func:`~disco_estimator.gnn.local.local_checkpoint_path` -- where
``--fused-estimator gnn`` finds it (:mod:`disco_estimator.costs.fused_choice`) -- only when its
held-out mean squared log error is below the base's.

The report compares the GNN with the fallback rule
(:func:`disco_estimator.interface.fallback_fused_time`, with the ``--hardware`` file's launch and
memory costs) on the held-out samples (else on the training samples): their number,
the fraction predicted within 10% and 14% of the measured time, and the median relative
error ``|predicted - measured| / measured``.

This module holds the subcommand's parser (:func:`register`), :func:`resolve_dataset`,
the zoo modules ``--generate`` measures (:func:`zoo_modules`) and the run itself
(:func:`run`); the evaluation's pure pieces (:func:`split_samples`,
:func:`fallback_time`, :func:`accuracy`) live in :mod:`disco_estimator.gnn.evaluate` and are
re-exported here.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from disco_estimator.gnn.evaluate import accuracy, fallback_time, split_samples
from disco_jax.cli import UserError

__all__ = [
    "DEFAULT_KINDS",
    "DEFAULT_MODELS",
    "accuracy",
    "fallback_time",
    "register",
    "resolve_dataset",
    "run",
    "split_samples",
    "zoo_modules",
]

#: What ``disco train-estimator --help`` says (the module docstring is for developers).
HELP = """Train the GNN fused-op estimator on measured fused ops.

The samples are fusion groups timed as standalone fused ops, kept in a resumable dataset
(default: the cache directory's gnn/ folder). --generate first times new ones from the
zoo models (groups of random plans, and XLA's own fusions); --generate-only stops there.
Training shows progress, writes the model to --out and reports its accuracy beside the
fallback rule's (within 10% and 14%, median error), on --held-out MODEL if given.
--local fine-tunes the shipped model (or --base) on the fused ops this machine timed in
context (disco_jax.jit, disco optimize, disco simulate) and keeps it for --fused-estimator
gnn only if it beats the base on a held-out fifth of them."""

#: Examples, after the options in ``--help``.
EXAMPLES = """examples:
  disco train-estimator --generate --generate-only --size tiny --per-module 120
  disco train-estimator --held-out resnet --out gnn.msgpack
  disco train-estimator --local"""

#: Zoo models ``--generate`` draws from by default (all six, so that every model can be
#: held out).
DEFAULT_MODELS = ("vgg", "resnet", "transformer", "rnnlm", "bert", "reformer")
#: Sample kinds ``--generate`` adds by default (see :data:`disco_estimator.gnn.dataset.KINDS`).
DEFAULT_KINDS = ("plan", "xla")
#: Host devices the zoo models are built on (as ``disco demo`` does).
_DEVICES = 4
#: Local samples ``--local`` needs at least.
LOCAL_MIN_SAMPLES = 20
#: ``--epochs`` of ``--local`` when not given (it starts from a trained model).
LOCAL_EPOCHS = 30
#: Share of the local samples ``--local`` holds out
#: (:func:`disco_estimator.gnn.local.held_out_split`).
LOCAL_HELD_OUT = 0.2


def register(subparsers: Any) -> None:
    """Adds the ``train-estimator`` subcommand."""
    p = subparsers.add_parser(
        "train-estimator", help="train the GNN fused-op estimator on measured fused ops",
        description=HELP, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", metavar="PATH",
                   help="dataset file (.jsonl), or a directory of them (this backend's "
                        "file is used; default: the cache's gnn directory)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--generate", action="store_true",
                      help="first add samples of the --models to the dataset (resumable)")
    mode.add_argument("--local", action="store_true",
                      help="fine-tune --base on this machine's local samples (fused ops "
                           "timed in context by disco_jax.jit, disco optimize, disco "
                           "simulate); the model is kept, where --fused-estimator gnn finds "
                           "it, only if it beats --base on the held-out local samples")
    p.add_argument("--base", metavar="CHECKPOINT",
                   help="with --local: the checkpoint to start from (default: the one "
                        "shipped for this backend)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated zoo models for --generate (default: %(default)s)")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                   help="comma-separated sample kinds for --generate: plan (random plans' "
                        "groups), xla (XLA's own fusions) (default: %(default)s)")
    p.add_argument("--generate-only", action="store_true",
                   help="with --generate: add the samples and stop (no training)")
    p.add_argument("--size", default="tiny", choices=("tiny", "small", "medium"),
                   help="zoo size for --generate (default: tiny)")
    p.add_argument("--per-module", type=int, default=50, metavar="N",
                   help="new samples per model for --generate (default: 50)")
    p.add_argument("--repeats", type=int, default=15, metavar="N",
                   help="timed runs per fused op for --generate (default: 15)")
    p.add_argument("--no-pin", action="store_true",
                   help="--generate: time in this process, on all its CPUs (by default "
                        "ops are timed in a child process pinned to one CPU)")
    p.add_argument("--epochs", type=int,
                   help="passes over the training samples (default: 100; with --local: "
                        f"{LOCAL_EPOCHS})")
    p.add_argument("--batch-size", type=int, default=64, metavar="N",
                   help="fused ops per step (default: 64)")
    p.add_argument("--learning-rate", type=float, default=1e-3, metavar="LR",
                   help="Adam step size, cosine-decayed (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of initialisation, minibatches and --generate (default: 0)")
    p.add_argument("--held-out", metavar="MODEL",
                   help="keep this model's samples out of training and report on them")
    p.add_argument("--hardware", default="inproc4", metavar="NAME|PATH",
                   help="hardware file of the fallback rule's constants (default: inproc4)")
    p.add_argument("--out", metavar="CHECKPOINT.msgpack",
                   help="where to write the trained model (atomically)")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- pure parts


def resolve_dataset(spec: str | os.PathLike | None, fingerprint: dict[str, Any]) -> Path:
    """The dataset file ``--dataset`` names.

    Args:
        spec: a file, a directory (its file for ``fingerprint``), or None (the file for
            ``fingerprint`` in the default directory).
        fingerprint: the backend fingerprint (:func:`disco_estimator.ops.backend_fingerprint`).
    """
    from disco_estimator.gnn.dataset import dataset_path

    if spec is None:
        return dataset_path(fingerprint)
    path = Path(spec)
    return dataset_path(fingerprint, path) if path.is_dir() else path


# --------------------------------------------------------------------------- run


def _check_arguments(args: argparse.Namespace) -> list[str]:
    """The ``--models`` list; raises :class:`UserError` for bad option values."""
    if args.epochs is None:
        args.epochs = LOCAL_EPOCHS if args.local else 100
    if args.local:
        given = [opt for opt, value in (("--dataset", args.dataset),
                                        ("--held-out", args.held_out), ("--out", args.out))
                 if value is not None]
        if given:
            raise UserError(f"--local does not go with {', '.join(given)}: it reads this "
                            "backend's local dataset and holds out a share of it itself")
    elif args.base is not None:
        raise UserError("--base needs --local")
    for name in ("epochs", "batch_size", "per_module", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, "
                            f"got {getattr(args, name)}")
    if not args.learning_rate > 0:
        raise UserError(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.out is not None and Path(args.out).is_dir():
        raise UserError(f"--out {args.out}: is a directory, expected a file name")
    if args.generate and args.dataset is not None and (
            Path(args.dataset).is_file() or args.dataset.endswith(".jsonl")):
        raise UserError(f"--dataset {args.dataset}: --generate needs a directory (samples "
                        "go to its file for this backend), not a file")
    models = [m for m in args.models.split(",") if m]
    if args.generate and not models:
        raise UserError("--generate needs at least one model in --models")
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in DEFAULT_KINDS]
    if bad or (args.generate and not kinds):
        raise UserError(f"--kinds {args.kinds!r}: valid kinds are {', '.join(DEFAULT_KINDS)}")
    if args.generate_only and not args.generate:
        raise UserError("--generate-only needs --generate")
    return models


def _constants(spec: str) -> Any:
    """The fallback rule's backend constants of hardware file ``spec``."""
    from disco_estimator.costs.cost_model import BackendConstants
    from disco_estimator.hardware import HardwareError, load_hardware

    try:
        return BackendConstants.from_hardware(load_hardware(spec))
    except HardwareError as err:
        raise UserError(str(err)) from None
    except (KeyError, ValueError, TypeError) as err:
        raise UserError(f"hardware {spec!r}: invalid hardware file: {err}") from None


def zoo_modules(models: list[str], size: str, kinds: list[str], devices: int = _DEVICES
                ) -> dict[str, list[tuple[str, str]]]:
    """The HLO texts ``--generate`` draws samples from: per kind, ``(model, text)``.

    ``plan``: each model's pre-optimization HLO (:func:`hlo_tools.extract`); ``xla``: the
    module XLA compiles from it with its default passes
    (:func:`hlo_tools.baselines.compile_baseline`, ``"xla_default"``), whose fusions are
    XLA's own.

    Args:
        models: zoo model names.
        size: zoo size (``tiny``, ``small``, ``medium``).
        kinds: sample kinds (see :data:`DEFAULT_KINDS`).
        devices: host devices the models are built on.

    Raises:
        UserError: an unknown model, or fewer than ``devices`` devices.
    """
    import jax

    import hlo_tools
    from disco_jax import zoo
    from hlo_tools.baselines import compile_baseline

    for m in models:
        if m not in zoo.names():
            raise UserError(f"unknown model {m!r}; valid: {', '.join(zoo.names())}")
    if jax.local_device_count() < devices:
        raise UserError(f"--generate needs {devices} devices; set XLA_FLAGS="
                        f"--xla_force_host_platform_device_count={devices}")
    out: dict[str, list[tuple[str, str]]] = {k: [] for k in kinds}
    for m in models:
        print(f"extracting {m} ({size}, {devices} devices)", file=sys.stderr)
        step, example = zoo.get(m)(devices, size)
        if "plan" in out:
            out["plan"].append((m, hlo_tools.extract(step, *example)))
        if "xla" in out:
            out["xla"].append((m, compile_baseline(step, example, "xla_default").as_text()))
    return out


def _generate(args: argparse.Namespace, models: list[str]) -> None:
    """Adds samples of the zoo ``models`` to the ``--dataset`` directory."""
    from disco_estimator.gnn.dataset import generate

    kinds = [k for k in args.kinds.split(",") if k]
    for kind, modules in zoo_modules(models, args.size, kinds).items():
        path, added = generate(modules, kind=kind, per_module=args.per_module,
                               seed=args.seed, repeats=args.repeats, directory=args.dataset,
                               progress=True, pinned=False if args.no_pin else None)
        print(f"{path}: {added} samples of kind {kind} added", file=sys.stderr)


def _load(path: Path) -> list[Any]:
    """The samples of a dataset file with a positive time; raises :class:`UserError`."""
    from disco_estimator.gnn.dataset import load_samples

    if not path.is_file():
        raise UserError(f"{path}: no such dataset file (add samples with --generate)")
    try:
        samples = load_samples(path)
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{path}: not a fused-op dataset ({err})") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read: {err.strerror or err}") from None
    samples = [s for s in samples if s.time_s > 0]
    if not samples:
        raise UserError(f"{path}: no samples of this feature version "
                        "(add samples with --generate)")
    return samples


def _progress(steps: int) -> tuple[Callable[[dict[str, float]], None], Callable[[], None], int]:
    """``(callback, close, log_every)`` showing training progress on stderr: a ``rich``
    bar on a terminal, else a line about every 10% of the steps."""
    if not sys.stderr.isatty():
        def line(rec: dict[str, float]) -> None:
            print(f"step {int(rec['step']) + 1}/{steps}: loss {rec['loss']:.4g}",
                  file=sys.stderr)
        return line, lambda: None, max(1, steps // 10)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    bar = Progress(TextColumn("training: {task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                   transient=True)
    task = bar.add_task("starting", total=steps)
    bar.start()

    def update(rec: dict[str, float]) -> None:
        bar.update(task, completed=int(rec["step"]) + 1, description=f"loss {rec['loss']:.4g}")
    return update, bar.stop, max(1, steps // 200)


def _fmt_pct(x: float) -> str:
    return f"{x * 100:.1f}%" if math.isfinite(x) else "-"


def _print_report(r: dict[str, Any]) -> None:
    out = sys.stdout
    counts = ", ".join(f"{k} {v}" for k, v in r["sources"].items())
    kinds = ", ".join(f"{k} {v}" for k, v in r["kinds"].items())
    print(f"dataset {r['dataset']}: {r['samples']} samples ({counts}; kinds: {kinds})",
          file=out)
    t = r["training"]
    print(f"trained on {t['samples']} samples: {t['epochs']} epochs = {t['steps']} steps of "
          f"{t['batch_size']}, final loss {t['final_loss']:.4g} (mean squared log error), "
          f"{t['seconds']:.1f} s", file=out)
    print(f"checkpoint written to {r['out']}" if r["out"] else
          "checkpoint not written (no --out)", file=out)
    print(f"evaluation on {r['evaluated_on']}:", file=out)
    print(f"  {'estimator':10s} {'n':>6s} {'within 10%':>11s} {'within 14%':>11s} "
          f"{'median rel. err':>16s}", file=out)
    for name in ("gnn", "fallback"):
        m = r["evaluation"][name]
        print(f"  {name:10s} {m['n']:>6d} {_fmt_pct(m['within_10']):>11s} "
              f"{_fmt_pct(m['within_14']):>11s} {_fmt_pct(m['median_rel_err']):>16s}",
              file=out)


def _log_loss(predicted_s: Any, measured_s: Any) -> float:
    """Mean squared log error of predictions (the training loss)."""
    import numpy as np

    err = np.log(np.asarray(predicted_s, np.float64)) - np.log(np.asarray(measured_s,
                                                                          np.float64))
    return float(np.mean(err ** 2))


def _train(train_set: list[Any], args: argparse.Namespace, **model: Any) -> tuple[int, Any]:
    """Trains on ``train_set`` for ``--epochs`` (each label weighted by how well it
    repeated) with progress lines; ``model``: ``config`` and ``params`` to start from.
    Returns ``(steps, TrainResult)``; a diverged run is a :class:`UserError`."""
    from disco_estimator.gnn.context import repeat_weight
    from disco_estimator.gnn.train import train

    steps = args.epochs * math.ceil(len(train_set) / args.batch_size)
    callback, close, log_every = _progress(steps)
    try:
        return steps, train([s.subgraph for s in train_set], [s.time_s for s in train_set],
                            steps=steps, learning_rate=args.learning_rate,
                            batch_size=args.batch_size, seed=args.seed, log_every=log_every,
                            progress=callback, weights=[repeat_weight(s) for s in train_set],
                            **model)
    except FloatingPointError as err:
        raise UserError(f"training diverged: {err}; try a smaller --learning-rate") from None
    finally:
        close()


def _base_checkpoint(spec: str | None) -> tuple[Path, Any, str]:
    """``(path, checkpoint, sha256 of its bytes)`` of ``--base`` (default: the shipped
    checkpoint of this backend); raises :class:`UserError`."""
    import jax

    from disco_estimator.gnn import checkpoint as ckpt_io

    if spec is None:
        shipped = ckpt_io.pretrained(jax.default_backend())
        if shipped is None:
            raise UserError(f"--local: no checkpoint ships for {jax.default_backend()!r}; "
                            "give --base CHECKPOINT (e.g. one of disco train-estimator --out)")
        spec = str(shipped)
    path = Path(spec)
    try:
        ck, sha256 = ckpt_io.read(path)
    except FileNotFoundError:
        raise UserError(f"--base {spec}: no such file") from None
    except OSError as err:
        raise UserError(f"--base {spec}: cannot read: {err.strerror or err}") from None
    except ValueError as err:
        raise UserError(str(err)) from None
    return path, ck, sha256


def _run_local(args: argparse.Namespace) -> int:
    """``--local``: fine-tunes ``--base`` on the local samples of this backend and keeps
    the result only when it beats the base on the held-out ones."""
    from disco_estimator.gnn import checkpoint as ckpt_io
    from disco_estimator.gnn.estimator import GnnFusedEstimator
    from disco_estimator.gnn.local import (
        held_out_split,
        load_local_samples,
        local_checkpoint_path,
        local_dataset_path,
    )
    from disco_estimator.ops import backend_fingerprint

    fingerprint = backend_fingerprint(1)
    path = local_dataset_path(fingerprint)
    samples = [s for s in load_local_samples(fingerprint) if s.time_s > 0]
    if len(samples) < LOCAL_MIN_SAMPLES:
        raise UserError(f"--local: {len(samples)} local samples for this backend in {path}, "
                        f"{LOCAL_MIN_SAMPLES} needed; run train steps through disco_jax.jit "
                        "(ENABLE_SEARCH=1) or disco demo: their first call traces the final "
                        "choice's programs in context and adds their fused ops")
    train_set, held_out = held_out_split(samples, LOCAL_HELD_OUT)
    if not train_set or not held_out:
        raise UserError(f"--local: the {len(samples)} local samples in {path} leave "
                        f"{len(held_out)} held out and {len(train_set)} to train on; add "
                        "more (see disco train-estimator --help)")
    base_path, base, base_sha256 = _base_checkpoint(args.base)
    steps, result = _train(train_set, args, config=base.config, params=base.params)
    measured = [s.time_s for s in held_out]
    subs = [s.subgraph for s in held_out]
    base_pred = GnnFusedEstimator(base.params, base.config).predict_subgraphs(subs)
    tuned_pred = GnnFusedEstimator(result.params, result.config).predict_subgraphs(subs)
    loss, base_loss = _log_loss(tuned_pred, measured), _log_loss(base_pred, measured)
    out = local_checkpoint_path(fingerprint)
    kinds = dict(Counter(s.kind for s in samples))
    report = {
        "dataset": str(path), "samples": len(samples), "kinds": kinds,
        "base": str(base_path), "base_sha256": base_sha256,
        "training": {"samples": len(train_set), "epochs": args.epochs, "steps": steps,
                     "batch_size": min(args.batch_size, len(train_set)),
                     "learning_rate": args.learning_rate, "seed": args.seed,
                     "final_loss": result.history[-1]["loss"], "seconds": result.seconds},
        "held_out": len(held_out),
        "evaluation": {"base": {"loss": base_loss, **accuracy(base_pred, measured)},
                       "fine-tuned": {"loss": loss, **accuracy(tuned_pred, measured)}},
        "out": str(out) if loss < base_loss else None,
    }
    if loss < base_loss:
        notes = {"beats_shipped": True, "base_sha256": base_sha256, "held_out_loss": loss,
                 "base_held_out_loss": base_loss, "samples": len(samples),
                 **{k: report[k] for k in ("base", "held_out", "kinds", "training")}}
        try:
            ckpt_io.save(out, ckpt_io.Checkpoint(result.params, result.config, fingerprint,
                                                 notes))
        except OSError as err:
            raise UserError(f"{out}: cannot write: {err.strerror or err}") from None
    else:
        from disco_estimator.costs.fused_choice import choose_fused_estimator

        report["in_use"] = choose_fused_estimator(
            "gnn", platform=fingerprint["platform"], fingerprint=fingerprint).checkpoint
    _print_local_report(report)
    return 0


def _print_local_report(r: dict[str, Any]) -> None:
    out = sys.stdout
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))
    print(f"local dataset {r['dataset']}: {r['samples']} samples ({kinds})", file=out)
    t = r["training"]
    print(f"fine-tuned {r['base']} on {t['samples']} samples: {t['epochs']} epochs = "
          f"{t['steps']} steps of {t['batch_size']}, final loss {t['final_loss']:.4g} (mean "
          f"squared log error), {t['seconds']:.1f} s", file=out)
    print(f"evaluation on the {r['held_out']} held-out local samples:", file=out)
    print(f"  {'model':10s} {'n':>6s} {'log loss':>9s} {'within 10%':>11s} "
          f"{'within 14%':>11s} {'median rel. err':>16s}", file=out)
    for name, m in r["evaluation"].items():
        print(f"  {name:10s} {m['n']:>6d} {m['loss']:>9.4g} {_fmt_pct(m['within_10']):>11s} "
              f"{_fmt_pct(m['within_14']):>11s} {_fmt_pct(m['median_rel_err']):>16s}",
              file=out)
    if r["out"]:
        print(f"checkpoint written to {r['out']}: it beats the base on the held-out local "
              "samples, and --fused-estimator gnn uses it", file=out)
    else:
        in_use = r["in_use"] or "the fallback rule"
        print("checkpoint not written: the fine-tuned model does not beat the base on the "
              f"held-out local samples; --fused-estimator gnn keeps using {in_use}", file=out)


def run(args: argparse.Namespace) -> int:
    """Runs ``disco train-estimator``; returns the exit code."""
    models = _check_arguments(args)
    if args.local:
        return _run_local(args)
    if args.generate:  # the zoo models are built on 4 host devices (before jax starts)
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_DEVICES}")
    from disco_estimator.gnn import checkpoint as ckpt_io
    from disco_estimator.gnn.dataset import KINDS
    from disco_estimator.gnn.estimator import GnnFusedEstimator
    from disco_estimator.ops import backend_fingerprint

    constants = _constants(args.hardware)
    fingerprint = backend_fingerprint()
    if args.generate:
        _generate(args, models)
    path = resolve_dataset(args.dataset, fingerprint)
    if args.generate_only:
        print(f"{path}: {len(_load(path))} samples", file=sys.stdout)
        return 0
    samples = _load(path)
    train_set, test_set = split_samples(samples, args.held_out)
    sources = sorted({s.source for s in samples})
    if args.held_out is not None and not test_set:
        raise UserError(f"--held-out {args.held_out}: no samples of that model in {path} "
                        f"(models: {', '.join(sources)})")
    if not train_set:
        raise UserError(f"--held-out {args.held_out}: no samples left to train on in {path}")
    steps, result = _train(train_set, args)
    evaluated = test_set or train_set
    measured = [s.time_s for s in evaluated]
    gnn = GnnFusedEstimator(result.params, result.config).predict_subgraphs(
        [s.subgraph for s in evaluated])
    fallback = [fallback_time(s.subgraph, constants.kernel_launch_s, constants.mem_s_per_byte)
                for s in evaluated]
    report = {
        "dataset": str(path),
        "samples": len(samples),
        "sources": {src: sum(s.source == src for s in samples) for src in sources},
        "kinds": {k: n for k in KINDS if (n := sum(s.kind == k for s in samples))},
        "training": {"samples": len(train_set), "epochs": args.epochs, "steps": steps,
                     "batch_size": min(args.batch_size, len(train_set)),
                     "learning_rate": args.learning_rate, "seed": args.seed,
                     "final_loss": result.history[-1]["loss"], "seconds": result.seconds},
        "held_out": args.held_out,
        "evaluated_on": (f"{len(test_set)} held-out samples ({args.held_out})" if test_set
                         else f"the {len(train_set)} training samples"),
        "evaluation": {"gnn": accuracy(gnn, measured),
                       "fallback": accuracy(fallback, measured)},
        "hardware": args.hardware,
        "out": args.out,
    }
    if args.out is not None:
        own = path.name == resolve_dataset(path.parent, fingerprint).name
        notes = {k: v for k, v in report.items() if k != "out"}
        try:
            ckpt_io.save(args.out, ckpt_io.Checkpoint(
                result.params, result.config, fingerprint if own else {}, notes))
        except OSError as err:
            raise UserError(f"--out {args.out}: cannot write: {err.strerror or err}") from None
    _print_report(report)
    return 0
