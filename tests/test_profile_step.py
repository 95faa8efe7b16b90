"""scripts/profile_step.py's reading of optimised HLO: each fusion named by what it computes."""
import jax
import jax.numpy as jnp

from tests.script_loader import load_script


def test_fusions_are_named_by_the_gather_and_the_dot_they_hold():
    def attend(pages, idx, q):  # a page gather feeding a dot, as the decode attention does
        k = pages[idx].reshape(idx.shape[0], -1, pages.shape[-1])
        return jnp.einsum("sd,sld->sl", q, k)

    pages, idx, q = jnp.ones((32, 16, 8)), jnp.arange(8).reshape(4, 2), jnp.ones((4, 8))
    hlo = jax.jit(attend).lower(pages, idx, q).compile().as_text()
    kinds = load_script("profile_step").fusion_kinds(hlo)
    assert "gather" in kinds.values(), kinds
    assert set(kinds.values()) <= {"gather", "scatter", "dot", "batched dot", "reduce/exp",
                                   "transpose", "elementwise"}
