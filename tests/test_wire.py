"""The step's batch over the wire: two host arrays in, the same batch out inside a jitted
function, for plain, chunked and cascade variants; a leaf of the wrong shape is named."""
import jax
import numpy as np
import pytest

from hetero_jax.config import EngineConfig
from hetero_jax.models.presets import preset_config
from hetero_jax.runner.batch import batch_spec, is_cascade
from hetero_jax.runner.wire import from_wire, to_wire, wire_sizes, wire_spec

CFG = EngineConfig(max_model_len=256, token_budget=64, chunk_size=32, max_num_seqs=8,
                   max_chunk_seqs=2, token_buckets=(16, 64), seq_buckets=(8,),
                   page_buckets=(4, 16)).resolve(
    preset_config("tiny").max_position_embeddings, 1024)


def random_leaf(rng, s: jax.ShapeDtypeStruct) -> np.ndarray:
    if s.dtype == np.bool_:
        return rng.random(s.shape) < 0.5
    if s.dtype == np.float32:
        return rng.standard_normal(s.shape).astype(np.float32)
    info = np.iinfo(s.dtype)  # the whole range: uint32 seeds above 2**31 too
    return rng.integers(info.min, info.max, s.shape, dtype=np.int64).astype(s.dtype)


PALLAS = EngineConfig(max_model_len=256, token_budget=64, chunk_size=32, max_num_seqs=8,
                      max_chunk_seqs=2, token_buckets=(16, 64), seq_buckets=(8,),
                      attention_impl="pallas").resolve(
    preset_config("tiny").max_position_embeddings, 1024)
KEYS = [(CFG, next(k for k in CFG.variants() if test(k))) for test in (
    lambda k: k[2] == 0 and not is_cascade(k),  # decode only
    is_cascade,
    lambda k: k[2] > 0)] + [  # chunk slots: the pooler's bool leaves are not empty
    (PALLAS, next(k for k in PALLAS.variants() if k[2] > 0))]  # a TileList in every step


@pytest.mark.parametrize("cfg,key", KEYS)
def test_a_batch_comes_back_whole_from_its_wire(cfg, key):
    spec = batch_spec(cfg, *key)
    assert cfg is CFG or spec.meta.cascade.tile_starts.shape == (key[1] // 2 + 1,)
    batch = jax.tree.map(lambda s: random_leaf(np.random.default_rng(len(s.shape)), s), spec)
    ints, floats = to_wire(batch, spec)
    assert (ints.size, floats.size) == wire_sizes(spec)
    assert [(w.shape, w.dtype) for w in wire_spec(spec)] == [(ints.shape, ints.dtype),
                                                             (floats.shape, floats.dtype)]
    back = jax.jit(lambda i, f: from_wire(spec, i, f))(ints, floats)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(batch)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_leaf_of_the_wrong_dtype_is_named():
    key = CFG.variants()[0]
    spec = batch_spec(CFG, *key)
    batch = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)
    batch = batch.replace(tokens=batch.tokens.astype(np.int64))
    with pytest.raises(ValueError, match=r"int64\[16\], the variant expects int32\[16\]"):
        to_wire(batch, spec)
