"""Measuring programs side by side and choosing by measurement: :func:`measure` runs them
interleaved (rounds in a shared seeded order, every sample ``K`` calls, each waited for;
in a job a barrier before every sample and per sample the minimum over processes), and
:func:`choose` climbs tiers (:func:`decide`, :func:`choice_tiers`): XLA's default, then
hand bucketing, then DisCo's programs, each replacing the choice so far only when it wins
most rounds against it."""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from disco_jax.pipeline.sync import SOLO, Sync

__all__ = [
    "CHALLENGER_WIN_SHARE",
    "Choice",
    "choice_tiers",
    "choose",
    "decide",
    "measure",
    "summarize_samples",
]


def _timed(run: Callable[..., Any], args: Sequence[Any], k: int) -> float:
    """Seconds per iteration of ``k`` calls, each waited for.

    Each call is waited for before the next is dispatched: XLA:CPU (jax 0.10.2) can
    deadlock when several calls of a program with in-process collectives are queued on
    the host devices of one process -- some devices' threads wait in a rendezvous for a
    device whose execution never starts, and after 40 s XLA aborts the process (seen
    with 4 host devices on 2 cores, programs of a few milliseconds called back to back).
    """
    import jax

    t0 = time.perf_counter()
    for _ in range(k):
        jax.block_until_ready(run(*args))
    return (time.perf_counter() - t0) / k


def measure(runs: Mapping[str, Callable[..., Any]], args: Sequence[Any], *,
            rounds: int = 10, min_sample_s: float = 0.1, warmup: int = 2, max_k: int = 50,
            seed: int = 0, sync: Sync = SOLO, tag: str = "measure",
            progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Per-iteration seconds of each program, measured interleaved.

    Args:
        runs: the programs by name; each is called as ``run(*args)``.
        args: their arguments.
        rounds: samples per program; each round runs every program once, in an order
            shuffled per round (seeded, the same on every process).
        min_sample_s: a sample is ``K`` calls (each waited for) lasting about this long
            (``K`` per program from the warm-up, at most ``max_k``).
        warmup: untimed calls per program first.
        max_k: the most calls in one sample.
        seed: seeds the round order.
        sync: the job's :class:`Sync` (default: one process).
        tag: keeps the barriers and keys of separate measurements apart.
        progress: called with a line after the warm-up and every few rounds.

    Returns:
        ``{name: [seconds per iteration, one per round]}``; in a multi-process job the
        same on every process (per sample the minimum over processes).
    """
    names = sorted(runs)
    warm: dict[str, float] = {}
    for name in names:
        sync.barrier(f"{tag}_warm")
        warm[name] = min(_timed(runs[name], args, 1) for _ in range(max(1, warmup)))
    ks = {n: max(1, min(max_k, round(min_sample_s / max(t, 1e-6)))) for n, t in warm.items()}
    ks = sync.share(f"{tag}_k", ks)
    if progress is not None:
        progress("warm: " + ", ".join(f"{n} {warm[n] * 1e3:.1f} ms" for n in names))
    rng = random.Random(f"{seed}/{tag}")
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = list(names)
        rng.shuffle(order)
        for name in order:
            sync.barrier(tag)
            samples[name].append(_timed(runs[name], args, ks[name]))
        if progress is not None and (r == 0 or (r + 1) % 5 == 0 or r + 1 == rounds):
            progress(f"round {r + 1}/{rounds}")
    everyone = sync.gather(f"{tag}_samples", samples)
    samples = {n: [min(p[n][i] for p in everyone) for i in range(rounds)] for n in names}
    return samples


def summarize_samples(samples: Sequence[float]) -> dict[str, float]:
    """``{"median_s", "p25_s", "p75_s"}`` of per-iteration samples."""
    if len(samples) == 1:
        return {"median_s": samples[0], "p25_s": samples[0], "p75_s": samples[0]}
    q = statistics.quantiles(samples, n=4)
    return {"median_s": statistics.median(samples), "p25_s": q[0], "p75_s": q[2]}


#: a challenger replaces the current choice (first XLA's default, then the hand bucketing
#: that beat it) only when it is faster in at least this share of the rounds, paired
#: within a round (3 of 3, 4 of 4, 4 of 5, 6 of 7): a one-sided sign test at about 6% for
#: 4 rounds. On the 2-core VM a bucketed program 1-2% faster by the median of 4 rounds was
#: 4% slower over 14 rounds (transformer-medium, inproc4; it won 4 of them), and with a
#: share of 0.75 bert-medium's 4 MiB buckets won 3 of 4 choice rounds and then lost the
#: fresh rounds by 16% (bimodal: p25 126 ms, median 139 ms against XLA's 120 ms). Lesser
#: wins are not worth a program the user did not have; real ones (hand bucketing on gloo,
#: 3x) win every round.
CHALLENGER_WIN_SHARE = 0.8


class Choice(NamedTuple):
    """The outcome of :func:`choose`.

    Attributes:
        name: the chosen program.
        medians_s: median seconds per iteration of every candidate.
        samples_s: the samples behind them.
        incumbent: the first tier's program, kept unless a challenger beats it (None:
            no tiers were named, the lowest median won).
        wins: per challenger, the rounds it was faster than the program it challenged in
            (empty without tiers).
        against: per challenger, the program it challenged: the choice of the tiers
            before its own (empty without tiers).
    """

    name: str
    medians_s: dict[str, float]
    samples_s: dict[str, list[float]]
    incumbent: str | None = None
    wins: dict[str, int] = {}
    against: dict[str, str] = {}


def decide(samples: Mapping[str, Sequence[float]],
           tiers: Sequence[Sequence[str]] | None = None, *,
           win_share: float = CHALLENGER_WIN_SHARE) -> Choice:
    """The choice from interleaved samples (:func:`measure`'s output).

    Without tiers the lowest median wins. With them, the choice climbs a ladder: the
    first tier's lowest median (``["xla_default"]``: what the user runs without DisCo) is
    the incumbent; each later tier (hand bucketing, then DisCo's own programs) challenges
    the choice so far, and a challenger is eligible when it was faster than that choice in
    at least ``win_share`` of the rounds (samples of one round compared) and has a lower
    median; the eligible one with the lowest median becomes the choice. A program of a
    later tier must so beat the best of the earlier ones, not merely XLA's default:
    a plan that ties with hand bucketing stays out. Programs in no tier form a last one.
    Ties go to the name first in sorted order, so every process of a job (which sees the
    same samples) chooses the same program.

    Args:
        samples: ``{name: [seconds per iteration, one per round]}``, rounds aligned.
        tiers: groups of program names, the incumbent's first, or None.
        win_share: the share of rounds a challenger must win, in ``(0, 1]``.

    Raises:
        ValueError: no samples, a tier naming a program that was not measured (or an
            empty first tier), or a bad share.
    """
    if not samples:
        raise ValueError("nothing to choose from")
    if not 0 < win_share <= 1:
        raise ValueError(f"win_share must be in (0, 1], got {win_share}")
    medians = {n: statistics.median(s) for n, s in samples.items()}
    copied = {n: list(s) for n, s in samples.items()}
    if tiers is None:
        return Choice(min(sorted(medians), key=medians.__getitem__), medians, copied)
    named = [n for tier in tiers for n in tier]
    missing = sorted(set(named) - set(samples))
    if missing or not tiers or not tiers[0]:
        raise ValueError(f"the tiers name programs that were not measured: {missing}"
                         if missing else "the first tier (the incumbent) is empty")
    rest = sorted(set(samples) - set(named))
    ladder = [sorted(t) for t in tiers] + ([rest] if rest else [])
    name = min(ladder[0], key=medians.__getitem__)
    incumbent, wins, against = name, {}, {}
    need = math.ceil(win_share * len(samples[name]) - 1e-9)
    for tier in ladder[1:]:
        base = samples[name]
        for n in tier:
            wins[n] = sum(a < b for a, b in zip(samples[n], base))
            against[n] = name
        eligible = [n for n in tier if wins[n] >= need and medians[n] < medians[name]]
        if eligible:
            name = min(eligible, key=medians.__getitem__)
    return Choice(name, medians, copied, incumbent, wins, against)


def choice_tiers(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """The product's tiers for :func:`decide` among the named programs: XLA's default
    (the incumbent), then what a user sets by hand: bucketing (``bucketed_*``,
    :func:`hlo_tools.plan.bucketed_name`), XLA's combiner at another threshold
    (``xla_combine_*``, :func:`hlo_tools.baselines.combine_threshold_name`) or XLA's
    fusion with no combining at all (``op_fusion``: each gradient's all-reduce on its
    own, which a program with spare pool threads can run beside the backward pass) or
    its combiner with no fusion (``allreduce_fusion``); every
    other program -- DisCo's plans and staged programs -- is in no tier, so forms the last
    one."""
    return ["xla_default"], sorted(n for n in names
                                   if n.startswith(("bucketed_", "xla_combine_"))
                                   or n in ("op_fusion", "allreduce_fusion"))


def choose(runs: Mapping[str, Callable[..., Any]], args: Sequence[Any], *, rounds: int = 5,
           tiers: Sequence[Sequence[str]] | None = None,
           win_share: float = CHALLENGER_WIN_SHARE, **kwargs: Any) -> Choice:
    """Measures the candidates side by side (:func:`measure`) and decides
    (:func:`decide`): the fastest, or with ``tiers`` the climb from the first tier's
    program, each later tier's best replacing the choice only when it beats it in
    ``win_share`` of the rounds."""
    return decide(measure(runs, args, rounds=rounds, **kwargs), tiers, win_share=win_share)
