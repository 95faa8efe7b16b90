"""The model runner: packs a SchedulerOutput into bucketed arrays and runs one jitted step.

In: `SchedulerOutput` (host data). Out: `RunnerOutput` with one sampled token per item that
ends at its request's last token. The step is `(params, kv, batch) -> (kv, packed)`; the KV
cache is donated, so XLA updates it in place; `packed` is the only device->host copy.

Token layout of a step (sorted by kind): prefill chunks, then decode tokens, then padding.
Padding tokens write their K/V to the scratch page 0 and padding sequences have kv_len 0.
Executables are compiled ahead of time per bucket variant `(T, S, Sc, pages_per_seq)` and
kept in a dict, so `compiles` is exact and `warmup()` can build every variant.
"""
from __future__ import annotations

import functools
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.config import EngineConfig, pad_to_bucket
from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig
from hetero_jax.ops import ragged_paged_attention
from hetero_jax.sampler import SamplingKnobs, sample
from hetero_jax.sched import DECODE, RunnerOutput, SampledToken, SchedulerOutput


@flax.struct.dataclass
class StepBatch:
    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slots: jax.Array  # [T] int32: page * page_size + offset where the token's K/V goes
    meta: llama.AttnMeta  # kv_lens [S], page_indices [S, P], cu_q_lens [S+1], num_seqs []
    sample_rows: jax.Array  # [S] int32: the token row whose logits each sequence samples
    knobs: SamplingKnobs  # [S] each


def step(params, kv: llama.KVCache, batch: StepBatch, *, model_cfg: ModelConfig, max_q_len: int,
         num_chunk_seqs: int, num_logprobs: int, impl: str, interpret: bool):
    """One mixed forward pass; the LM head runs only on the S sampled rows."""
    attn_fn = functools.partial(ragged_paged_attention, impl=impl, max_q_len=max_q_len,
                                num_multi_query_seqs=num_chunk_seqs, interpret=interpret)
    hidden, kv = llama.forward(params, model_cfg, batch.tokens, batch.positions, batch.slots,
                               kv, batch.meta, attn_fn)
    logits = llama.lm_logits(params, model_cfg, hidden[batch.sample_rows])  # [S, V]
    return kv, sample(logits, batch.knobs, num_logprobs)


def batch_spec(t: int, s: int, p: int) -> StepBatch:
    """Shape/dtype structs of a StepBatch variant, for ahead-of-time lowering."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return StepBatch(
        tokens=i32(t), positions=i32(t), slots=i32(t),
        meta=llama.AttnMeta(kv_lens=i32(s), page_indices=i32(s, p), cu_q_lens=i32(s + 1),
                            num_seqs=i32()),
        sample_rows=i32(s),
        knobs=SamplingKnobs(temperature=f32(s), top_k=i32(s), top_p=f32(s),
                            seed=jax.ShapeDtypeStruct((s,), jnp.uint32), step=i32(s)))


def pack_batch(out: SchedulerOutput, cfg: EngineConfig) -> tuple[tuple, StepBatch]:
    """Host arrays for one step and its variant key (T, S, Sc, pages_per_seq)."""
    items = out.items
    n_tok = out.num_tokens
    t = pad_to_bucket(n_tok, cfg.token_buckets)
    s = pad_to_bucket(len(items), cfg.seq_buckets)
    sc = min(pad_to_bucket(sum(it.kind != DECODE for it in items), cfg.chunk_seq_buckets), s)
    p = pad_to_bucket(max(len(it.request.pages) for it in items), cfg.page_buckets)
    tokens, positions, slots = (np.zeros(t, np.int32) for _ in range(3))
    kv_lens, sample_rows, top_k, step_idx = (np.zeros(s, np.int32) for _ in range(4))
    temperature, top_p = np.zeros(s, np.float32), np.ones(s, np.float32)
    seed = np.zeros(s, np.uint32)
    page_indices = np.zeros((s, p), np.int32)
    cu = np.full(s + 1, n_tok, np.int32)
    cu[0] = 0
    row = 0
    for i, it in enumerate(items):
        req, lo, hi = it.request, row, row + it.num_tokens
        pos = np.arange(it.start, it.start + it.num_tokens)
        tokens[lo:hi] = req.token_ids(it.start, it.num_tokens)
        positions[lo:hi] = pos
        pages = np.asarray(req.pages, np.int32)
        slots[lo:hi] = pages[pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size
        page_indices[i, :len(pages)] = pages
        kv_lens[i], cu[i + 1], sample_rows[i] = it.start + it.num_tokens, hi, hi - 1
        knobs = req.payload  # engine.RequestKnobs
        temperature[i], top_k[i], top_p[i] = knobs.temperature, knobs.top_k, knobs.top_p
        seed[i], step_idx[i] = knobs.seed, len(req.output_token_ids)
        row = hi
    batch = StepBatch(
        tokens=tokens, positions=positions, slots=slots,
        meta=llama.AttnMeta(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu,
                            num_seqs=np.int32(len(items))),
        sample_rows=sample_rows,
        knobs=SamplingKnobs(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            step=step_idx))
    return (t, s, sc, p), batch


class Runner:
    """Owns params and the KV cache on the device; runs steps; counts compiles."""

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, params):
        backend = jax.default_backend()
        loop = cfg.layer_loop if cfg.layer_loop != "auto" else (
            "unrolled" if backend == "cpu" else "scan")
        self.model_cfg, self.cfg = model_cfg, cfg
        self.params = llama.split_layers(params) if loop == "unrolled" else params
        dtype = jnp.dtype(cfg.dtype)
        self.kv = llama.KVCache.zeros(model_cfg, cfg.num_pages, cfg.page_size, dtype)
        impl = cfg.attention_impl
        self.impl = ("pallas" if backend == "gpu" else "xla") if impl == "auto" else impl
        self.interpret = self.impl == "pallas" and backend != "gpu"  # Pallas off-GPU: interpret
        self._executables: dict = {}
        self.compile_s = 0.0

    @property
    def compiles(self) -> int:
        return len(self._executables)

    def executable(self, key: tuple):
        if key not in self._executables:
            start = time.perf_counter()
            t, s, sc, p = key
            fn = jax.jit(functools.partial(
                step, model_cfg=self.model_cfg, max_q_len=min(self.cfg.chunk_size, t),
                num_chunk_seqs=sc, num_logprobs=self.cfg.max_logprobs, impl=self.impl,
                interpret=self.interpret),
                donate_argnums=(1,))
            self._executables[key] = fn.lower(self.params, self.kv, batch_spec(t, s, p)).compile()
            self.compile_s += time.perf_counter() - start
        return self._executables[key]

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        key, batch = pack_batch(out, self.cfg)
        self.kv, packed = self.executable(key)(self.params, self.kv, batch)
        packed = np.asarray(packed)
        k = self.cfg.max_logprobs
        sampled = {}
        for i, it in enumerate(out.items):
            if it.samples:
                row = packed[i]
                sampled[it.request.request_id] = SampledToken(
                    int(row[0]), float(row[1]), tuple(int(x) for x in row[2:2 + k]),
                    tuple(float(x) for x in row[2 + k:]))
        return RunnerOutput(sampled, time.perf_counter() - t0)
