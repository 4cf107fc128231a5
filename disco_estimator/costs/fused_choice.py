"""Which fused-op estimator prices fusions: the one home of that choice.

Two estimators (:data:`FUSED_ESTIMATORS`): ``"gnn"``, the GNN of
:mod:`disco_estimator.gnn`, and ``"fallback"``, the rule of
:class:`disco_estimator.interface.FallbackFusedEstimator` (the cost model's default).
:func:`choose_fused_estimator` decides: an explicit name (e.g. ``--fused-estimator``),
else ``$DISCO_FUSED_ESTIMATOR``, else :data:`DEFAULT_FUSED_ESTIMATOR`; an explicit
checkpoint means the GNN. For the GNN without a checkpoint it takes the user's local one
(``disco train-estimator --local``: :func:`disco_estimator.gnn.local.local_checkpoint_path`)
when it loads and beat the shipped one on held-out local samples, else the shipped one
(:func:`disco_estimator.gnn.checkpoint.pretrained`), else the fallback rule.

The result (:class:`FusedChoice`) is bound into a cost model as ``--gnn`` does
(``costs.set_fused_estimator(choice.estimator.bind(costs))`` or
``in_context_costs(..., fused=choice.estimator)``), and its :meth:`FusedChoice.to_json`
goes into what a run records. The GNN (jax, flax) is imported only when it is chosen.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "DEFAULT_FUSED_ESTIMATOR",
    "FUSED_ESTIMATORS",
    "FUSED_ESTIMATOR_ENV",
    "FusedChoice",
    "choose_fused_estimator",
]

#: The environment variable that chooses the estimator when no name is given.
FUSED_ESTIMATOR_ENV = "DISCO_FUSED_ESTIMATOR"
#: The estimators there are.
FUSED_ESTIMATORS = ("gnn", "fallback")
#: The estimator chosen when neither a name nor the environment variable says.
DEFAULT_FUSED_ESTIMATOR = "fallback"


class FusedChoice(NamedTuple):
    """The chosen fused-op estimator.

    Attributes:
        name: ``"gnn"`` or ``"fallback"``.
        estimator: the :class:`~disco_estimator.gnn.estimator.GnnFusedEstimator` (no
            member-time source bound yet), or None for the fallback rule.
        checkpoint: path of the GNN's checkpoint file (None for the fallback rule).
        sha256: sha256 of the checkpoint file's bytes (None for the fallback rule).
        why: how it was chosen, a sentence.
    """

    name: str
    estimator: Any
    checkpoint: str | None
    sha256: str | None
    why: str

    def to_json(self) -> dict[str, str | None]:
        """``{"name", "checkpoint", "sha256"}``: what a record keeps."""
        return {"name": self.name, "checkpoint": self.checkpoint, "sha256": self.sha256}


def _fallback(why: str) -> FusedChoice:
    return FusedChoice("fallback", None, None, None, why)


def _gnn(path: Path, ck: Any, sha256: str, why: str) -> FusedChoice:
    from disco_estimator.gnn.estimator import GnnFusedEstimator

    return FusedChoice("gnn", GnnFusedEstimator(ck.params, ck.config), str(path), sha256, why)


def _local(fingerprint: dict[str, Any] | None, family: str, origin: str
           ) -> FusedChoice | None:
    """The GNN of the local checkpoint of ``fingerprint`` (default: this backend's) when
    it is for the platform ``family``, loads and beat the shipped one; else None."""
    from disco_estimator.gnn.local import local_checkpoint_path
    from disco_estimator.ops import backend_fingerprint
    from hlo_tools.jax_bridge import platform_family

    fingerprint = fingerprint if fingerprint is not None else backend_fingerprint(1)
    if platform_family(str(fingerprint.get("platform", ""))) != family:
        return None
    from disco_estimator.gnn import checkpoint as ckpt_io

    path = local_checkpoint_path(fingerprint)
    try:
        ck, sha256 = ckpt_io.read(path)
        if ck.notes.get("beats_shipped") is True:
            return _gnn(path, ck, sha256, f"{origin}: the local checkpoint beats the "
                                          "shipped one on held-out local samples")
    except Exception:  # noqa: BLE001 - a missing or corrupt local checkpoint is not used
        pass
    return None


def choose_fused_estimator(name: str | None = None, *, platform: str = "cpu",
                           checkpoint: str | os.PathLike | None = None,
                           fingerprint: dict[str, Any] | None = None,
                           origin: str | None = None) -> FusedChoice:
    """Chooses the fused-op estimator.

    Args:
        name: ``"gnn"`` or ``"fallback"`` (None: ``$DISCO_FUSED_ESTIMATOR``, else
            :data:`DEFAULT_FUSED_ESTIMATOR`).
        platform: the jax platform the costs are for (``cpu``, ``cuda``, ``gpu``...): the
            shipped and local checkpoints are per platform family.
        checkpoint: a GNN checkpoint to use (implies ``"gnn"``).
        fingerprint: backend fingerprint of the local checkpoint (default: this
            process's, :func:`disco_estimator.ops.backend_fingerprint` of one replica).
        origin: what gave an explicit ``name`` or ``checkpoint``, for
            :attr:`FusedChoice.why` (e.g. ``"--fused-estimator"``; default: "given").

    Returns:
        The :class:`FusedChoice`. A local checkpoint that does not load is ignored.

    Raises:
        ValueError: an unknown name (the environment variable's message starts with
            ``DISCO_FUSED_ESTIMATOR=``), ``"fallback"`` with a checkpoint, or an explicit
            checkpoint that is not one.
        OSError: an explicit checkpoint that cannot be read.
    """
    valid = ", ".join(FUSED_ESTIMATORS)
    if name is None and checkpoint is None:
        env = os.environ.get(FUSED_ESTIMATOR_ENV, "").strip()
        if env and env not in FUSED_ESTIMATORS:
            raise ValueError(f"{FUSED_ESTIMATOR_ENV}={env!r}: use one of {valid}")
        name, origin = (env, f"${FUSED_ESTIMATOR_ENV}") if env else \
            (DEFAULT_FUSED_ESTIMATOR, "default")
    origin = origin or "given"
    if name is None:  # a checkpoint alone
        name = "gnn"
    if name not in FUSED_ESTIMATORS:
        raise ValueError(f"unknown fused-op estimator {name!r}; valid: {valid}")
    if checkpoint is not None:
        if name != "gnn":
            raise ValueError(f"a checkpoint is for the gnn estimator, not {name!r}")
        from disco_estimator.gnn import checkpoint as ckpt_io

        path = Path(checkpoint)
        return _gnn(path, *ckpt_io.read(path), f"{origin}: the checkpoint given")
    if name == "fallback":
        return _fallback(f"{origin}: the fallback rule")
    from disco_estimator.gnn import checkpoint as ckpt_io
    from hlo_tools.jax_bridge import platform_family

    family = platform_family(platform) or platform
    local = _local(fingerprint, family, origin)
    if local is not None:
        return local
    shipped = ckpt_io.pretrained(family)
    if shipped is None:
        return _fallback(f"{origin}: gnn, but no checkpoint for {family}: the fallback rule")
    try:
        return _gnn(shipped, *ckpt_io.read(shipped), f"{origin}: the shipped checkpoint "
                                                    f"for {family}")
    except (OSError, ValueError) as err:
        return _fallback(f"{origin}: gnn, but the shipped checkpoint does not load ({err}): "
                         "the fallback rule")
