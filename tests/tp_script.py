"""Run by test_tensor_parallel in a subprocess with two host devices: the same requests on
one engine at TP=1 and at TP=2 (EngineConfig(tensor_parallel=2)); prints both results as
JSON, with what the TP=2 runner was given (host arrays?) and whether its placed params equal
the TP=1 engine's."""
import dataclasses
import json
import sys

import jax
import numpy as np

from hetero_jax import EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams, \
    SamplingParams
from hetero_jax.runner import sharding
from hetero_jax.serving import engine as engine_module

CONFIG = EngineConfig(token_budget=64, chunk_size=32, max_num_seqs=8, max_model_len=256,
                      token_buckets=(64,), chunk_seq_buckets=(4,), page_buckets=(16,),
                      cascade_rows=0)


def requests():
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    return [GenerateRequest([1, 5, 9, 13], greedy), EmbedRequest(list(range(3, 60))),
            GenerateRequest(list(range(20, 70)), greedy),
            EmbedRequest([7, 8, 9], PoolingParams("last")),
            GenerateRequest([1, 2], SamplingParams(max_tokens=6, seed=4, temperature=0.7))]


def results(engine) -> list:
    out = []
    for o in engine.run(requests(), use_tqdm=False):
        if hasattr(o, "token_ids"):
            out.append(dict(tokens=o.token_ids, logprobs=[t["logprob"] for t in o.logprobs or []]))
        else:
            out.append(dict(embedding=np.asarray(o.embedding).tolist()))
    return out


class RecordingRunner(sharding.ShardedDecoderRunner):
    """The sharded runner, recording the types of the weights the Engine hands it."""

    given: set = set()

    def __init__(self, model_cfg, cfg, params, *args, **kw):
        RecordingRunner.given = {type(x).__name__ for x in jax.tree.leaves(params)}
        super().__init__(model_cfg, cfg, params, *args, **kw)


def placed_params(one, two) -> dict:
    """Whether TP=2's params equal TP=1's (its repeated KV heads undone) and every leaf is laid
    out as the partition table says, over both devices."""
    plain = jax.tree_util.tree_leaves_with_path(one.runner.params)
    placed = jax.tree.leaves(sharding.unexpand_kv_heads(two.model_cfg, two.runner.params))
    equal = all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), b in zip(plain, placed))
    laid_out = all(
        x.sharding.spec == sharding.leaf_spec(sharding._path(p), x.shape, 2)
        and len(x.sharding.device_set) == 2
        for p, x in jax.tree_util.tree_leaves_with_path(two.runner.params))
    return dict(params_equal=equal and len(plain) == len(placed), laid_out=laid_out,
                given=sorted(RecordingRunner.given))


def main(path: str) -> None:
    assert len(jax.devices()) == 2, jax.devices()
    one = Engine.from_pretrained(path, config=CONFIG)
    base = results(one)
    engine_module.ShardedDecoderRunner = RecordingRunner
    two = Engine.from_pretrained(path, config=dataclasses.replace(CONFIG, tensor_parallel=2))
    assert isinstance(two.runner, RecordingRunner), type(two.runner)
    placed = placed_params(one, two)
    warm = two.warmup()
    sharded = results(two)
    kv, wq = two.runner.state.kv.k, two.runner.params["layers"]["0"]["wq"]
    print(json.dumps(dict(base=base, sharded=sharded, warm=warm, after=two.stats.compiles,
                          **placed,
                          kv_heads=int(kv.shape[3]),
                          kv_shard=list(kv.addressable_shards[0].data.shape),
                          wq_shard=list(wq.addressable_shards[0].data.shape))))


if __name__ == "__main__":
    main(sys.argv[1])
