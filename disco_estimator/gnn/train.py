"""Training the fused-op GNN: a plain function over explicit arguments.

The loss is the mean squared error of ``log`` time (eq. (3) of the paper read as the
squared difference of the logs of predicted and measured time), optionally weighted per
sample (e.g. by how well its label repeats), minimised with Adam (optax). Each step draws
a minibatch, pads it to its static bucket
(:func:`disco_estimator.gnn.features.pad_to_bucket`) and masks the padding graph out, so a
run compiles once per bucket.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jraph
import numpy as np
import optax

from disco_estimator.gnn.features import FusedSubgraph, encode_batch
from disco_estimator.gnn.model import FusedOpGnn, GnnConfig, init_params

__all__ = ["TrainResult", "log_targets", "make_batch", "train"]


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns.

    Attributes:
        params: the trained Flax parameters.
        config: the model sizes.
        history: per step ``{"step", "loss", "lr"}`` (loss: mean squared log error of the
            step's minibatch), every ``log_every`` steps.
        seconds: wall time of the run.
    """

    params: Any
    config: GnnConfig
    history: list[dict[str, float]]
    seconds: float


def log_targets(times_s: Sequence[float]) -> np.ndarray:
    """``[B]`` float32 log seconds of measured times."""
    return np.log(np.asarray(times_s, np.float64)).astype(np.float32)


def make_batch(subgraphs: Sequence[FusedSubgraph], targets: np.ndarray | None = None,
               weights: np.ndarray | None = None
               ) -> tuple[jraph.GraphsTuple, np.ndarray, np.ndarray]:
    """A padded batch (:func:`~disco_estimator.gnn.features.encode_batch`), its ``[G_pad]``
    float32 targets (0 for padding) and ``[G_pad]`` float32 weights of the graphs (1, or
    ``weights``, for real graphs; 0 for padding)."""
    padded = encode_batch(subgraphs)
    g = padded.n_node.shape[0]
    mask = np.zeros(g, np.float32)
    mask[:len(subgraphs)] = 1.0 if weights is None else weights
    y = np.zeros(g, np.float32)
    if targets is not None:
        y[:len(subgraphs)] = targets
    return padded, y, mask


def train(subgraphs: Sequence[FusedSubgraph], times_s: Sequence[float], *,
          steps: int = 2000, learning_rate: float = 1e-3, batch_size: int = 64,
          seed: int = 0, config: GnnConfig | None = None, params: Any = None,
          log_every: int = 50, weights: Sequence[float] | None = None,
          progress: Callable[[dict[str, float]], None] | None = None) -> TrainResult:
    """Trains :class:`~disco_estimator.gnn.model.FusedOpGnn` on measured fused ops.

    Args:
        subgraphs: the fused ops (``B`` of them).
        times_s: ``[B]`` measured seconds of each.
        steps: optimizer steps.
        learning_rate: Adam's step size (cosine-decayed to 10% over ``steps``).
        batch_size: fused ops per step (all of them when ``B`` is smaller).
        seed: seed of initialisation and minibatch draws.
        config: model sizes (default :class:`GnnConfig`).
        params: start from these parameters instead of a fresh initialisation.
        log_every: record the loss every this many steps (and at the last).
        weights: ``[B]`` non-negative weight of each fused op in the loss (default: 1
            each), e.g. 0 for a label that did not repeat.
        progress: called with each history record.

    Returns:
        A :class:`TrainResult`.
    """
    if len(subgraphs) != len(times_s) or not subgraphs:
        raise ValueError("need as many times as subgraphs, and at least one")
    t0 = time.perf_counter()
    config = config or GnnConfig()
    y_all = log_targets(times_s)
    w_all = None if weights is None else np.asarray(weights, np.float32)
    if w_all is not None and (w_all.shape != (len(subgraphs),) or (w_all < 0).any()
                              or not w_all.any()):
        raise ValueError("weights: one non-negative weight per subgraph, not all zero")
    rng = np.random.default_rng(seed)
    bs = min(batch_size, len(subgraphs))
    model = FusedOpGnn(config)
    if params is None:
        example, _, _ = make_batch(subgraphs[:bs])
        params = init_params(config, example, seed)
    schedule = optax.cosine_decay_schedule(learning_rate, max(steps, 1), alpha=0.1)
    opt = optax.adam(schedule)
    opt_state = opt.init(params)

    def loss_fn(p: Any, graph: jraph.GraphsTuple, y: jnp.ndarray, mask: jnp.ndarray
                ) -> jnp.ndarray:
        err = jnp.where(mask > 0, model.apply(p, graph) - y, 0.0)
        return jnp.sum(mask * err ** 2) / jnp.maximum(jnp.sum(mask), 1e-6)

    @jax.jit
    def step_fn(p: Any, state: Any, graph: jraph.GraphsTuple, y: jnp.ndarray,
                mask: jnp.ndarray) -> tuple[Any, Any, jnp.ndarray]:
        loss, grads = jax.value_and_grad(loss_fn)(p, graph, y, mask)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    history: list[dict[str, float]] = []
    full = bs == len(subgraphs)
    fixed = make_batch(subgraphs, y_all, w_all) if full else None
    for k in range(steps):
        if fixed is not None:
            graph, y, mask = fixed
        else:
            pick = rng.choice(len(subgraphs), size=bs, replace=False)
            graph, y, mask = make_batch([subgraphs[i] for i in pick], y_all[pick],
                                        None if w_all is None else w_all[pick])
        params, opt_state, loss = step_fn(params, opt_state, graph, y, mask)
        if k % log_every == 0 or k == steps - 1:
            rec = {"step": float(k), "loss": float(loss), "lr": float(schedule(k))}
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"loss is {rec['loss']} at step {k}")
            history.append(rec)
            if progress is not None:
                progress(rec)
    return TrainResult(params, config, history, time.perf_counter() - t0)
