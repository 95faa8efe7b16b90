"""Our own model run outside the engine, for tests that compare the engine with it."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.models import llama
from hetero_jax.ops import ragged_paged_attention


def full_logits(cfg, params, ids, page_size=8):
    """Run one sequence as a single prefill over fresh pages; [n] ids -> [n, V] logits."""
    n = len(ids)
    pages = -(-n // page_size)
    kv = llama.KVCache.zeros(cfg, pages + 1, page_size, params["embed"].dtype)
    pos = np.arange(n, dtype=np.int32)
    meta = llama.AttnMeta(kv_lens=np.array([n], np.int32),
                          page_indices=np.arange(1, pages + 1, dtype=np.int32)[None],
                          cu_q_lens=np.array([0, n], np.int32), num_seqs=np.int32(1))
    return np.asarray(forward_logits(params, cfg, jnp.asarray(ids, jnp.int32), pos,
                                     pos + page_size, kv, meta))


@functools.partial(jax.jit, static_argnames="cfg")
def forward_logits(params, cfg, tokens, positions, slots, kv, meta, adapter_ids=None):
    """`llama.forward` with the XLA attention, then the LM head: [T] tokens -> [T, V] logits.
    Jitted: one compile per shape, a third of the CPU time of running it op by op."""
    hidden, _ = llama.forward(params, cfg, tokens, positions, slots, kv, meta,
                              ragged_paged_attention, adapter_ids)
    return llama.lm_logits(params, cfg, hidden)
