"""Run by test_tensor_parallel in a subprocess with two host devices: the same requests on
one engine at TP=1 and at TP=2 (EngineConfig(tensor_parallel=2)); prints both results as
JSON."""
import dataclasses
import json
import sys

import jax
import numpy as np

from hetero_jax import EmbedRequest, Engine, EngineConfig, GenerateRequest, PoolingParams, \
    SamplingParams
from hetero_jax.runner.sharding import ShardedDecoderRunner

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


def main(path: str) -> None:
    assert len(jax.devices()) == 2, jax.devices()
    one = Engine.from_pretrained(path, config=CONFIG)
    base = results(one)
    two = Engine.from_pretrained(path, config=dataclasses.replace(CONFIG, tensor_parallel=2))
    assert isinstance(two.runner, ShardedDecoderRunner), type(two.runner)
    warm = two.warmup()
    sharded = results(two)
    kv, wq = two.runner.state.kv.k, two.runner.params["layers"]["0"]["wq"]
    print(json.dumps(dict(base=base, sharded=sharded, warm=warm, after=two.stats.compiles,
                          kv_heads=int(kv.shape[3]),
                          kv_shard=list(kv.addressable_shards[0].data.shape),
                          wq_shard=list(wq.addressable_shards[0].data.shape))))


if __name__ == "__main__":
    main(sys.argv[1])
