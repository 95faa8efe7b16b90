"""Device kernels behind one signature each; the engine picks an implementation by backend."""
from hetero_jax.ops.attention import ragged_paged_attention, ragged_paged_attention_reference

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference"]
