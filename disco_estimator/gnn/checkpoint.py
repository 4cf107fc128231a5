"""Checkpoints of the fused-op GNN: one msgpack file (flax serialization), never pickle.

The file is ``flax.serialization.msgpack_serialize({"header": <JSON text>, "params":
<state dict of the parameters>})``. The header records what the parameters only make
sense with: :data:`CHECKPOINT_SCHEMA`, the feature version, both vocabularies, the model
sizes (:class:`~disco_estimator.gnn.model.GnnConfig`), the backend fingerprint of the times it
was trained on, and free-form training notes. :func:`load` refuses a file whose schema,
feature version or vocabularies differ from this code's.

A small trained model for the CPU backend ships with the package
(``disco_estimator/gnn/pretrained/cpu.msgpack``, package data); :func:`pretrained` finds it.
It was trained by ``disco train-estimator --dataset <context dataset> --epochs 300`` on the
1165 fused ops of the six zoo models timed in whole-program traces
(``benchmarks/estimator_context.py``: random plans and XLA's default of each step, small
size, 4 host devices of a 2-core x86 VM, jax 0.12), each weighted by how well its label
repeated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from flax import serialization

from disco_estimator.gnn.features import DTYPE_VOCAB, FEATURE_VERSION, OPCODE_VOCAB
from disco_estimator.gnn.model import GnnConfig
from hlo_tools.dirs import write_atomic

__all__ = ["CHECKPOINT_SCHEMA", "PRETRAINED_DIR", "Checkpoint", "load", "pretrained", "read",
           "save"]

CHECKPOINT_SCHEMA = 1

#: Where the shipped checkpoints live: ``<platform family>.msgpack``.
PRETRAINED_DIR = Path(__file__).parent / "pretrained"


def pretrained(platform: str = "cpu") -> Path | None:
    """The shipped checkpoint for a jax platform (``cpu``, ``cuda``, ...) or platform
    family (``cpu``, ``gpu``), None if there is none (only ``cpu`` ships; ``disco
    train-estimator`` builds one for a GPU)."""
    from hlo_tools.jax_bridge import platform_family

    path = PRETRAINED_DIR / f"{platform_family(platform) or platform}.msgpack"
    return path if path.is_file() else None


@dataclasses.dataclass
class Checkpoint:
    """A trained model and what it was trained for.

    Attributes:
        params: Flax parameters of :class:`~disco_estimator.gnn.model.FusedOpGnn`.
        config: the model sizes.
        fingerprint: backend fingerprint of the training times
            (:func:`disco_estimator.ops.backend_fingerprint`), ``{}`` if unknown.
        notes: anything JSON-ready (dataset size, loss, command).
    """

    params: Any
    config: GnnConfig
    fingerprint: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)


def _header(ckpt: Checkpoint) -> dict[str, Any]:
    return {"schema": CHECKPOINT_SCHEMA, "feature_version": FEATURE_VERSION,
            "opcode_vocab": list(OPCODE_VOCAB), "dtype_vocab": list(DTYPE_VOCAB),
            "config": ckpt.config.to_json(), "fingerprint": ckpt.fingerprint,
            "notes": ckpt.notes}


def save(path: str | os.PathLike, ckpt: Checkpoint) -> Path:
    """Writes ``ckpt`` atomically (temporary file + ``os.replace``); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = serialization.msgpack_serialize({
        "header": json.dumps(_header(ckpt), sort_keys=True),
        "params": serialization.to_state_dict(ckpt.params)})
    return write_atomic(path, data)


def load(path: str | os.PathLike) -> Checkpoint:
    """Reads a checkpoint written by :func:`save`.

    Raises:
        ValueError: not a checkpoint, or made for another schema, feature version or
            vocabulary.
    """
    return read(path)[0]


def read(path: str | os.PathLike) -> tuple[Checkpoint, str]:
    """:func:`load`, with the sha256 of the file's bytes (read once): what a record names
    the checkpoint by.

    Raises:
        ValueError: as :func:`load`.
        OSError: the file cannot be read.
    """
    data = Path(path).read_bytes()
    return _parse(path, data), hashlib.sha256(data).hexdigest()


def _parse(path: str | os.PathLike, data: bytes) -> Checkpoint:
    try:
        raw = serialization.msgpack_restore(data)
        header = json.loads(raw["header"])
        params = raw["params"]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a GNN estimator checkpoint ({err})") from err
    if header.get("schema") != CHECKPOINT_SCHEMA:
        raise ValueError(f"{path}: checkpoint schema {header.get('schema')}, "
                         f"expected {CHECKPOINT_SCHEMA}")
    if header.get("feature_version") != FEATURE_VERSION:
        raise ValueError(f"{path}: features v{header.get('feature_version')}, this code "
                         f"computes v{FEATURE_VERSION}; retrain (disco train-estimator)")
    if (tuple(header.get("opcode_vocab", ())) != OPCODE_VOCAB
            or tuple(header.get("dtype_vocab", ())) != DTYPE_VOCAB):
        raise ValueError(f"{path}: trained over another opcode/dtype vocabulary; retrain")
    return Checkpoint(params, GnnConfig.from_json(header["config"]),
                      dict(header.get("fingerprint") or {}), dict(header.get("notes") or {}))
