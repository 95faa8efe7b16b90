"""The contrastive loss of the embedding adapter (recall@k, which judges it, is
`offline.recall.recall_at_k`).

`contrastive_loss(q [B, d], p [B, d])`: rows L2-normalised, pair i's passage is the positive
of query i and every other passage of the batch a negative (in-batch negatives, InfoNCE);
the cross-entropy is averaged over both directions (query -> passage and back). Pairs that
share a passage are masked out of each other's negatives.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def contrastive_loss(q, p, passage_ids, temperature: float):
    """q, p [B, d] L2-normalised; passage_ids [B] int32 (equal ids: the same passage) -> []."""
    scores = q @ p.T / temperature  # [B, B]
    same = passage_ids[:, None] == passage_ids[None, :]
    eye = jnp.eye(q.shape[0], dtype=bool)
    scores = jnp.where(same & ~eye, -1e9, scores)  # a duplicate positive is no negative
    labels = jnp.arange(q.shape[0])
    q_to_p = -jnp.take_along_axis(jax.nn.log_softmax(scores, 1), labels[:, None], 1)
    p_to_q = -jnp.take_along_axis(jax.nn.log_softmax(scores, 0), labels[None, :], 0)
    return 0.5 * (q_to_p.mean() + p_to_q.mean())
