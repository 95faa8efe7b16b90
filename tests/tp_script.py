"""Run by test_tensor_parallel in a subprocess with two host devices: the same requests on
one engine at TP=1 and at TP=2 (EngineConfig(tensor_parallel=2)), and a few on TP=2 with the
Pallas kernel per shard (interpret mode: slow, so few tokens); prints the results as JSON,
with what the TP=2 runner was given (host arrays?), whether its placed params equal the TP=1
engine's, and how far the kernel under shard_map is from the unsharded kernel (with and
without a cascade plan); then the TP=1 engine saved and loaded at TP=2 and its model made as a
preset at TP=1 and TP=2 (`restored_and_preset`). argv: the model directory, a scratch path."""
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hetero_jax import EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams, \
    SamplingParams
from hetero_jax.models.layers import row_major_mlp
from hetero_jax.models.presets import preset_config
from hetero_jax.ops import ragged_paged_attention
from hetero_jax.ops.cascade import tile_list_arrays
from hetero_jax.runner import sharding
from hetero_jax.serving import engine as engine_module

CONFIG = EngineConfig(token_budget=64, chunk_size=32, max_num_seqs=8, max_model_len=256,
                      token_buckets=(64,), chunk_seq_buckets=(4,), page_buckets=(16,),
                      cascade_rows=0, warmup="all")


def requests():
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    return [GenerateRequest([1, 5, 9, 13], greedy), EmbedRequest(list(range(3, 60))),
            GenerateRequest(list(range(20, 70)), greedy),
            EmbedRequest([7, 8, 9], PoolingParams("last")),
            GenerateRequest([1, 2], SamplingParams(max_tokens=6, seed=4, temperature=0.7))]


def few():
    """Two items for the interpret-mode kernel: a chunk then decode tokens, and an embedding."""
    return [GenerateRequest([1, 5, 9, 13], SamplingParams(max_tokens=3, temperature=0,
                                                          logprobs=2)),
            EmbedRequest(list(range(3, 40)))]


def results(engine, batch=None) -> list:
    out = []
    for o in engine.run(requests() if batch is None else batch, use_tqdm=False):
        if hasattr(o, "token_ids"):
            out.append(dict(tokens=o.token_ids, logprobs=[t["logprob"] for t in o.logprobs or []]))
        else:
            out.append(dict(embedding=np.asarray(o.embedding).tolist()))
    return out


class RecordingRunner(sharding.ShardedDecoderRunner):
    """The sharded runner, recording the types of the weights the Engine hands it, which
    leaves come on the host, and whether the others already lie over both devices as the
    table says."""

    given: set = set()
    host_leaves: list = []
    given_laid_out: bool = False

    def __init__(self, model_cfg, cfg, params, *args, **kw):
        leaves = jax.tree_util.tree_leaves_with_path(params)
        RecordingRunner.given = {type(x).__name__ for _, x in leaves}
        RecordingRunner.host_leaves = [sharding._path(p) for p, x in leaves
                                       if isinstance(x, np.ndarray)]
        RecordingRunner.given_laid_out = laid_out(params, np.ndarray)
        super().__init__(model_cfg, cfg, params, *args, **kw)


def laid_out(params, *also) -> bool:
    """Every leaf (not of the types `also`) split over both devices as the table says."""
    return all(
        isinstance(x, also) or (x.sharding.spec == sharding.leaf_spec(sharding._path(p), x.shape, 2)
                                and len(x.sharding.device_set) == 2)
        for p, x in jax.tree_util.tree_leaves_with_path(params))


def placed_params(one, two) -> dict:
    """Whether TP=2's params equal TP=1's (its repeated KV heads undone; TP=1's MLP back in the
    row-major layout the sharded runner keeps) and every leaf is laid out as the partition
    table says, over both devices."""
    plain = jax.tree_util.tree_leaves_with_path(row_major_mlp(one.runner.params))
    placed = jax.tree.leaves(sharding.unexpand_kv_heads(two.model_cfg, two.runner.params))
    equal = all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), b in zip(plain, placed))
    return dict(params_equal=equal and len(plain) == len(placed),
                laid_out=laid_out(two.runner.params), given=sorted(RecordingRunner.given))


def restored_and_preset(one, tmp: str) -> dict:
    """`one` (TP=1) saved and restored at TP=2 (`Engine.load`), and its model made as a preset
    (random weights) at TP=1 and at TP=2, with greedy results and what each TP=2 runner was
    given; and whether the tiny preset's restore targets (four KV heads, none repeated) put
    every leaf in its shards. One model and config throughout: every step variant is in the
    persistent compilation cache already."""
    tp2 = dataclasses.replace(CONFIG, tensor_parallel=2)
    one.save(tmp)
    loaded = Engine.load(tmp, config=tp2)
    restored = dict(host_leaves=RecordingRunner.host_leaves,
                    given_laid_out=RecordingRunner.given_laid_out,
                    laid_out=laid_out(loaded.runner.params), results=results(loaded, greedy()))
    engine_module.preset_config = lambda name: one.model_cfg
    preset_one = Engine.from_preset("test", seed=1, config=CONFIG)
    preset_two = Engine.from_preset("test", seed=1, config=tp2)
    preset = dict(given=sorted(RecordingRunner.given), laid_out=laid_out(
        preset_two.runner.params), results=results(preset_two, greedy()))
    targets = jax.tree_util.tree_leaves_with_path(
        sharding.restore_targets(preset_config("tiny"), 2, jnp.float32))
    return dict(restored=restored, preset=preset, base_greedy=results(one, greedy()),
                preset_base=results(preset_one, greedy()), tiny_targets_sharded=all(
                    isinstance(t, jax.ShapeDtypeStruct) and len(t.sharding.device_set) == 2
                    and t.sharding.spec == sharding.leaf_spec(sharding._path(p), t.shape, 2)
                    for p, t in targets))


def greedy() -> list:
    """The greedy requests of `requests()` (the log-probs to compare)."""
    return [r for r in requests() if isinstance(r, GenerateRequest) and r.params.temperature == 0]


def kernel_per_shard() -> list:
    """Max |difference| of the Pallas kernel under `shard_attention` on both devices from the
    kernel on one: 1 chunk and 2 decode sequences over random pages, without and with a
    cascade plan (the decode sequences share their first page), and layer 1 of a stacked
    two-layer cache."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((16, 4, 8), (12, 4, 2, 8), (12, 4, 2, 8)))  # Hq=4, Hkv=2, ps=4
    kv_lens, cu = jnp.array([9, 5, 7], jnp.int32), jnp.array([0, 7, 8, 9], jnp.int32)
    pages = jnp.array([[0, 1, 2], [3, 4, 0], [3, 5, 0]], jnp.int32)
    plan = jax.tree.map(jnp.asarray, tile_list_arrays(([([1, 2], 1)], [0, 1, 1]), 3, 4))
    attn = functools.partial(ragged_paged_attention, impl="pallas", interpret=True, max_q_len=8,
                             num_multi_query_seqs=1)
    sharded = jax.jit(sharding.shard_attention(attn, Mesh(np.array(jax.devices()), ("tp",))))
    args = (q, k, v, kv_lens, pages, cu, jnp.int32(3))
    diffs = [float(jnp.abs(sharded(*args, cascade=c) - attn(*args, cascade=c)).max())
             for c in (None, plan)]
    stacked = (q, jnp.stack([v, k]), jnp.stack([k, v])) + args[3:]  # layer 1 is (k, v)
    return diffs + [float(jnp.abs(sharded(*stacked, layer=1) - attn(*args)).max())]


def main(path: str, tmp: str) -> None:
    assert len(jax.devices()) == 2, jax.devices()
    one = Engine.from_pretrained(path, config=CONFIG)
    base = results(one)
    engine_module.ShardedDecoderRunner = RecordingRunner
    two = Engine.from_pretrained(path, config=dataclasses.replace(CONFIG, tensor_parallel=2))
    assert isinstance(two.runner, RecordingRunner), type(two.runner)
    placed = placed_params(one, two)
    warm = two.warmup()
    sharded = results(two)
    pallas = Engine.from_pretrained(path, config=dataclasses.replace(
        CONFIG, tensor_parallel=2, attention_impl="pallas"))
    assert pallas.runner.impl == "pallas" and pallas.runner.interpret, pallas.runner.impl
    kv, wq = two.runner.state.kv.k, two.runner.params["layers"]["0"]["wq"]
    print(json.dumps(dict(base=base, sharded=sharded, warm=warm, after=two.stats.compiles,
                          **placed, few_base=results(one, few()),
                          few_pallas=results(pallas, few()), kernel_diff=kernel_per_shard(),
                          kv_heads=int(kv.shape[3]),
                          kv_shard=list(kv.addressable_shards[0].data.shape),
                          wq_shard=list(wq.addressable_shards[0].data.shape),
                          **restored_and_preset(one, tmp))))


if __name__ == "__main__":
    main(*sys.argv[1:])
