"""The parent's side of routing requests to replicas (imports no jax).

In: what a replica's engine reports about itself (`replica_worker.engine_info`: its resolved
config, model config, prefix-cache identity and adapters), the model source, the replica
count and a router choice. `Placement` tokenizes each request with the model's tokenizer
(an input that cannot be tokenized raises here, naming it, as `Engine` would), counts its
load (input tokens, plus `max_tokens` for a prompt), hashes its prompt's full pages under the
chain seed the engine's `InputProcessor` gives them (so the router compares the digests the
replicas' caches hold), and keeps each replica's outstanding load while its requests are in
flight: `key` -> `place` -> `release`. `seeded` gives a prompt without a seed the seed one
`Engine` would give it by its request id. Used by `ReplicaSet` (processes) and
`RayReplicaSet` (Ray actors).
"""
from __future__ import annotations

import dataclasses
import time

from hetero_jax.config import EngineConfig
from hetero_jax.models.tokenizer import ByteTokenizer, load_tokenizer
from hetero_jax.outputs import EmbeddingOutput, RequestOutput
from hetero_jax.requests import EmbedRequest
from hetero_jax.sched.hashing import chain_seed, page_hashes
from hetero_jax.sched.router import Router, RouterConfig
from hetero_jax.serving.input_processor import default_seed, tokenize


def router_policy(router: RouterConfig | str | None, config: EngineConfig) -> str:
    """The router's policy name (default: prefix-affinity when `config.prefix_caching`,
    else least-tokens); ValueError naming a bad one."""
    if isinstance(router, RouterConfig):
        policy = router.policy
    else:
        policy = router or ("prefix-affinity" if config.prefix_caching else "least-tokens")
        RouterConfig(policy=policy)  # an unknown name fails here
    if policy == "prefix-affinity" and not config.prefix_caching:
        raise ValueError("router='prefix-affinity' needs EngineConfig(prefix_caching=True)")
    return policy


def error_output(tag: int, request, start: float, why: str):
    """The output of a request that failed without an output of its own (its replica died,
    or failed a step)."""
    m = dict(arrival_time=start, finish_time=time.perf_counter())
    m["latency_s"] = m["finish_time"] - start
    if isinstance(request, EmbedRequest):
        return EmbeddingOutput(tag, [], None, "error", m, error=why)
    return RequestOutput(tag, [], [], None, "error", None, m, error=why)


class Placement:
    def __init__(self, spec, info: dict, num_replicas: int,
                 router: RouterConfig | str | None = None):
        """`spec`: the `ModelSource` (its tokenizer is loaded here); `info`: a replica's
        `engine_info`; `router` as in `router_policy` (a name gets an LRU of the pages of
        one replica's KV pool)."""
        self.info, self.config, self.model_cfg = info, info["config"], info["model_cfg"]
        self.tokenizer = ByteTokenizer() if spec.preset is not None else load_tokenizer(
            spec.path, self.model_cfg.eos_token_ids)
        policy = router_policy(router, self.config)
        self.router = Router(num_replicas, router if isinstance(router, RouterConfig) else
                             RouterConfig(policy, cache_pages=self.config.num_pages - 1))
        self.loads = [0] * num_replicas

    def key(self, index: int, r) -> tuple:
        """(the page digests the engine would give the request's prompt, its load in
        tokens); ValueError naming the request (`index`) when it cannot be tokenized."""
        embed = isinstance(r, EmbedRequest)
        text = r.input if embed else r.prompt
        if embed and self.info["encoder"]:  # another model's tokens, never cached
            ids = self.tokenizer.encode(text) if isinstance(text, str) and self.tokenizer \
                else text
            return [], len(ids)
        ids = tokenize(index, text, self.tokenizer, self.model_cfg.vocab_size,
                       "input" if embed else "prompt")[:self.config.max_model_len]
        cost = len(ids) + (0 if embed else r.params.max_tokens)
        seed = self._cache_seed(r)
        if seed is None:
            return [], cost
        ps = self.config.page_size
        return page_hashes(ids[:(len(ids) - 1) // ps * ps], ps, seed), cost

    def place(self, hashes: list, cost: int, live: list) -> int:
        """The router's replica among `live`; its load grows by `cost` until `release`."""
        replica = self.router.route(hashes, self.loads, live)
        self.loads[replica] += cost
        return replica

    def release(self, replica: int, cost: int) -> None:
        self.loads[replica] -= cost

    def forget(self, replica: int) -> None:
        """A replica is gone: no load, no cache."""
        self.loads[replica] = 0
        self.router.forget(replica)

    def seeded(self, tag: int, r):
        """The request with the seed one `Engine` gives it (its default depends on the id)."""
        if isinstance(r, EmbedRequest) or r.params.seed is not None:
            return r
        seed = default_seed(self.config.seed, tag)
        return dataclasses.replace(r, params=dataclasses.replace(r.params, seed=seed))

    def _cache_seed(self, r) -> bytes | None:
        """The chain seed `InputProcessor` gives the request's pages (None: not cached)."""
        info = self.info
        if info["cache_identity"] is None:
            return None
        name = None
        if isinstance(r, EmbedRequest):
            if r.params.pooling == "buffered":
                return None
            ids = info["adapter_ids"]
            name = r.params.adapter or next(iter(ids), None)
            if name is not None and name not in ids:
                return None  # an unknown adapter: the replica refuses it
        adapter = info["adapter_ids"].get(name, 0)
        return chain_seed(info["cache_identity"], name, info["adapter_digests"].get(adapter),
                          r.params.cache_salt)
