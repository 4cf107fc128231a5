"""The GNN of the fused-op estimator (Flax linen on jraph primitives).

Section 4.3 of the DisCo paper:

* **op embeddings**, eq. (1): ``e_i = ||_{k=1..K} sigma(sum_{j in N_i} gamma_ij^k W^k e'_j)``
  -- :class:`GraphAttention`, a multi-head attention layer (GAT-style scores
  ``gamma_ij^k = softmax_j(leaky_relu(a_k . [W^k e_i || W^k e_j || edge_ij]))``, normalised
  over each receiver's incoming edges with ``jraph.segment_softmax``), stacked
  ``num_layers`` times with residual connections;
* **fused-op embedding**, eq. (2): ``y = sigma(sum_{i in N} W e_i)`` -- a sum readout per
  graph (``jax.ops.segment_sum`` over ``jraph``'s node-to-graph index);
* a **regression head**: fully connected layers with ReLU on ``[y || globals]``.

:class:`FusedOpGnn` returns the predicted ``log`` of the fused op's time in seconds, as a
correction added to ``globals["base"]`` (log of the sum of the member times): a model
that predicts 0 is the "no fusion gain" rule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph

from disco_estimator.gnn.features import DTYPE_VOCAB, OPCODE_VOCAB

__all__ = ["FusedOpGnn", "GnnConfig", "GraphAttention", "graph_index", "init_params"]


@dataclasses.dataclass(frozen=True)
class GnnConfig:
    """Sizes of :class:`FusedOpGnn` (stored in checkpoints).

    Attributes:
        opcode_embed: width of the opcode embedding.
        dtype_embed: width of the dtype embedding.
        hidden: node embedding width (``heads * head_dim``).
        heads: attention heads K of eq. (1).
        num_layers: attention layers.
        mlp: widths of the regression head's hidden layers.
        vocab_size: opcode vocabulary size.
        dtype_vocab_size: dtype vocabulary size.
    """

    opcode_embed: int = 16
    dtype_embed: int = 4
    hidden: int = 64
    heads: int = 4
    num_layers: int = 2
    mlp: tuple[int, ...] = (64, 32)
    vocab_size: int = len(OPCODE_VOCAB)
    dtype_vocab_size: int = len(DTYPE_VOCAB)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mlp"] = list(self.mlp)
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GnnConfig:
        return cls(**{**data, "mlp": tuple(data["mlp"])})


def graph_index(n_node: jnp.ndarray, total_nodes: int) -> jnp.ndarray:
    """``[total_nodes]`` int32: the graph of each node of a batch (``n_node``: ``[G]``)."""
    return jnp.repeat(jnp.arange(n_node.shape[0]), n_node, total_repeat_length=total_nodes)


class GraphAttention(nn.Module):
    """One multi-head attention message-passing layer, eq. (1).

    Attributes:
        heads: K.
        head_dim: width of each head's ``W^k e_j``.
    """

    heads: int
    head_dim: int

    @nn.compact
    def __call__(self, h: jnp.ndarray, edges: jnp.ndarray, senders: jnp.ndarray,
                 receivers: jnp.ndarray) -> jnp.ndarray:
        """Args: ``h`` ``[N, D]`` node embeddings, ``edges`` ``[E, F_e]`` edge features,
        ``senders``/``receivers`` ``[E]`` int32 (``N_i``: senders of edges into ``i``,
        self-loops included). Returns ``[N, heads * head_dim]``."""
        n = h.shape[0]
        wh = nn.Dense(self.heads * self.head_dim, use_bias=False, name="W")(h)
        wh = wh.reshape(n, self.heads, self.head_dim)
        a_src = nn.Dense(self.heads, use_bias=False, name="a_src")(wh.reshape(n, -1))
        a_dst = nn.Dense(self.heads, use_bias=False, name="a_dst")(wh.reshape(n, -1))
        a_edge = nn.Dense(self.heads, use_bias=False, name="a_edge")(edges)
        logits = nn.leaky_relu(a_src[senders] + a_dst[receivers] + a_edge, 0.2)  # [E, K]
        gamma = jraph.segment_softmax(logits, receivers, num_segments=n)         # [E, K]
        messages = wh[senders] * gamma[..., None]                                # [E, K, d]
        agg = jax.ops.segment_sum(messages, receivers, num_segments=n)           # [N, K, d]
        return nn.elu(agg).reshape(n, self.heads * self.head_dim)               # concat heads


class FusedOpGnn(nn.Module):
    """Predicts ``log`` seconds of each fused op of a (padded) batch.

    Attributes:
        config: the sizes.
    """

    config: GnnConfig = GnnConfig()

    @nn.compact
    def __call__(self, graph: jraph.GraphsTuple) -> jnp.ndarray:
        """Args: a batch from :func:`disco_estimator.gnn.features.batch` (padded or not).
        Returns: ``[G]`` float32 predicted log seconds (padding graphs included)."""
        cfg = self.config
        nodes, glob = graph.nodes, graph.globals
        total = nodes["x"].shape[0]
        opc = nn.Embed(cfg.vocab_size, cfg.opcode_embed, name="opcode_embed")(nodes["opcode"])
        dt = nn.Embed(cfg.dtype_vocab_size, cfg.dtype_embed, name="dtype_embed")(nodes["dtype"])
        h = nn.relu(nn.Dense(cfg.hidden, name="input")(
            jnp.concatenate([opc, dt, nodes["x"]], axis=-1)))
        for k in range(cfg.num_layers):
            h = h + GraphAttention(cfg.heads, cfg.hidden // cfg.heads, name=f"gat_{k}")(
                h, graph.edges, graph.senders, graph.receivers)
        seg = graph_index(graph.n_node, total)
        n_graph = graph.n_node.shape[0]
        y = nn.relu(jax.ops.segment_sum(nn.Dense(cfg.hidden, name="readout")(h), seg,
                                        num_segments=n_graph))                   # eq. (2)
        z = jnp.concatenate([y, glob["x"]], axis=-1)
        for k, width in enumerate(cfg.mlp):
            z = nn.relu(nn.Dense(width, name=f"fc_{k}")(z))
        out = nn.Dense(1, name="out", kernel_init=nn.initializers.zeros)(z)[:, 0]
        return glob["base"] + out


def init_params(config: GnnConfig, example: jraph.GraphsTuple, seed: int = 0) -> Any:
    """Parameters of :class:`FusedOpGnn` for ``config``, from an example batch."""
    return FusedOpGnn(config).init(jax.random.PRNGKey(seed), example)
