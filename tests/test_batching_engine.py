"""Batching policies change the order, never the results: on the tiny preset every policy gives
fcfs's greedy tokens (and log-probs, fp32 1e-5) and embeddings, for groups of prompts sharing
prefixes mixed with embeddings under IBS; `engine.stats.batching` reports the bandit's arm."""
import dataclasses
import json

import numpy as np

from hetero_jax import EmbedRequest, Engine, EngineConfig, GenerateRequest, SamplingParams
from hetero_jax.outputs import EngineStats
from hetero_jax.sched import BATCHING, FeatherConfig, Scheduler

RNG = np.random.default_rng(11)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
# the keys `EngineStats.batching` documents for feather-bandit
BANDIT_KEYS = {"batching", "arm", "floor", "rounds", "plays", "mean_reward", "best_arm",
               "best_mean_reward"}


def requests():
    out = []
    for g in range(2):
        prefix = RNG.integers(3, 250, 40).tolist()
        out += [GenerateRequest(prefix + RNG.integers(3, 250, 3 + i).tolist(), GREEDY)
                for i in range(3)]
        out.append(EmbedRequest(prefix + RNG.integers(3, 250, 5).tolist()))
    order = RNG.permutation(len(out))
    return [out[i] for i in order]


def test_every_batching_policy_gives_the_tokens_and_embeddings_of_fcfs():
    cfg = EngineConfig(token_budget=64, chunk_size=32, page_size=8, max_num_seqs=4,
                       max_model_len=128, token_buckets=(64,), page_buckets=(16,),
                       seq_buckets=(8,), chunk_seq_buckets=(4,), cascade_rows=0,
                       scheduler="ibs", batching="feather-bandit",
                       feather=FeatherConfig(chunk_pages=1, loss_limit=0, floor=2,
                                             aging_steps=8, arms=((0, 4), (None, None)),
                                             window=4, round_steps=2, margin=None))
    engine = Engine.from_preset("tiny", config=cfg)  # plain UCB: its first round plays (0, 4)
    assert engine.scheduler.batching.name == "feather-bandit"
    assert "batching" in {f.name for f in dataclasses.fields(EngineStats)}  # a declared field
    fresh = engine.stats.batching  # before any step: the first arm, nothing played yet
    assert set(fresh) == BANDIT_KEYS and fresh["rounds"] == fresh["plays"] == 0, fresh
    assert fresh["mean_reward"] is None and fresh["arm"] == "loss<=0,cap=4", fresh
    reqs = requests()
    outs = {}
    for name in ("fcfs",) + tuple(b for b in BATCHING if b != "fcfs"):
        # the same engine (and compiled steps), its scheduler rebuilt with each policy; the
        # paper's IBS (thin_batch=0): with the thin-batch lead these 8 requests start in one
        # order under every batching, and the check below wants a policy to change it
        engine.scheduler = Scheduler(dataclasses.replace(engine.scheduler.cfg, batching=name,
                                                         thin_batch=0))
        outs[name] = engine.run(reqs, use_tqdm=False)
        assert engine.stats.batching["batching"] == name
    stats = engine.stats.batching
    assert set(stats) == BANDIT_KEYS and json.loads(json.dumps(stats)) == stats  # plain data
    assert stats["arm"] in ("loss<=0,cap=4", "loss<=any,cap=max") and stats["rounds"] >= 1
    assert stats["best_arm"] in ("loss<=0,cap=4", "loss<=any,cap=max"), stats
    assert stats["best_mean_reward"] > 0  # tokens per second of its rounds
    def order(outs):  # generation requests by the time of their first token
        gens = [i for i, o in enumerate(outs) if hasattr(o, "token_ids")]
        return sorted(gens, key=lambda i: outs[i].metrics["first_token_time"])
    assert any(order(got) != order(outs["fcfs"]) for got in outs.values()), "order never changed"
    for name, got in outs.items():
        for a, b in zip(outs["fcfs"], got):
            assert a.finish_reason == b.finish_reason != "error", name
            if hasattr(a, "token_ids"):  # a generation
                assert a.token_ids == b.token_ids, f"{name}: request {a.request_id}"
                np.testing.assert_allclose([t["logprob"] for t in a.logprobs],
                                           [t["logprob"] for t in b.logprobs], rtol=1e-5,
                                           atol=1e-5)
            else:
                np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-5, atol=1e-5)
