"""The layout of a step's one device->host array, owned in one place.

A decoder step returns a single fp32 vector: `S` sampled rows of `2 + 2K` values (token id,
its log-prob, K top ids, K top log-probs; ids are exact in fp32 since V < 2**24), then `Sc`
pooled vectors of `d` values, one per multi-token item slot (embedding items first). The
device side builds it with `sample_rows` and `pack`; the host reads it with `unpack` and
`sampled_token`.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from hetero_jax.sched import SampledToken


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    num_seqs: int  # S
    num_logprobs: int  # K
    num_chunk_seqs: int  # Sc
    dim: int  # d

    @property
    def row_width(self) -> int:
        return 2 + 2 * self.num_logprobs

    @property
    def size(self) -> int:
        return self.num_seqs * self.row_width + self.num_chunk_seqs * self.dim

    @staticmethod
    def sample_rows(tokens, logprob, top_ids, top_logprobs):
        """tokens [S], logprob [S], top_ids/top_logprobs [S, K] -> rows [S, 2 + 2K] f32."""
        return jnp.concatenate([tokens[:, None].astype(jnp.float32), logprob[:, None],
                                top_ids.astype(jnp.float32), top_logprobs], axis=-1)

    def pack(self, rows, vectors):
        """rows [S, 2 + 2K], vectors [Sc, d] (or None when Sc = 0) -> f32 [size]."""
        parts = [rows.reshape(-1)] + ([] if vectors is None else
                                      [vectors.astype(jnp.float32).reshape(-1)])
        out = jnp.concatenate(parts)
        assert out.shape == (self.size,), f"{out.shape=} != ({self.size},)"
        return out

    def unpack(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """f32 [size] -> (rows [S, 2 + 2K], vectors [Sc, d])."""
        cut = self.num_seqs * self.row_width
        return (packed[:cut].reshape(self.num_seqs, self.row_width),
                packed[cut:].reshape(self.num_chunk_seqs, self.dim))

    def sampled_token(self, row, top: int | None = None) -> SampledToken:
        """One row (a numpy row, or its `tolist()`: cheaper to read per element) -> its token,
        with its first `top` top log-probs (None: all K; 0 for a request that asked for none,
        so the host builds no tuples for it)."""
        k = self.num_logprobs
        n = k if top is None else min(top, k)
        return SampledToken(int(row[0]), float(row[1]), tuple(map(int, row[2:2 + n])),
                            tuple(map(float, row[2 + k:2 + k + n])))
