"""The model runner: packs a SchedulerOutput into bucketed arrays and runs one jitted step.

In: `SchedulerOutput` (host data). Out: `RunnerOutput` with one sampled token per generation
item that ends at its request's last token, and one pooled vector per embedding request whose
last chunk ran. The step is `(params, state, batch) -> (state, packed)`; the state (KV cache
and pooler sums) is donated, so XLA updates it in place; `packed` is the only device->host copy.

Token layout of a step (sorted by kind): embedding chunks, prefill chunks, decode tokens,
padding. Embedding requests hold a pooler slot from their first chunk to their last.
Padding tokens write their K/V to the scratch page 0 and padding sequences have kv_len 0.
Executables are compiled ahead of time per bucket variant `(T, S, Sc, pages_per_seq)` and
kept in a dict, so `compiles` is exact and `warmup()` can build every variant.
"""
from __future__ import annotations

import functools
import time
import warnings

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.config import EngineConfig, pad_to_bucket
from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig
from hetero_jax.ops import ragged_paged_attention
from hetero_jax.sampler import SamplingKnobs, sample
from hetero_jax import pooler
from hetero_jax.compile_cache import CompileCache
from hetero_jax.params import GenKnobs
from hetero_jax.sched import DECODE, EMBED, RunnerOutput, SampledToken, SchedulerOutput


@flax.struct.dataclass
class StepBatch:
    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slots: jax.Array  # [T] int32: page * page_size + offset where the token's K/V goes
    meta: llama.AttnMeta  # kv_lens [S], page_indices [S, P], cu_q_lens [S+1], num_seqs []
    sample_rows: jax.Array  # [S] int32: the token row whose logits each sequence samples
    knobs: SamplingKnobs  # [S] each
    pool: pooler.PoolBatch  # token_slot [T]; per embedding item [Sc]
    adapter_ids: jax.Array  # [T] int32: each token's LoRA adapter, 0 = base model


@flax.struct.dataclass
class DeviceState:
    """Everything the step replaces: donated, so XLA updates it in place."""

    kv: llama.KVCache
    pool: pooler.PoolerState


def step(params, state: DeviceState, batch: StepBatch, *, model_cfg: ModelConfig, max_q_len: int,
         num_chunk_seqs: int, num_logprobs: int, impl: str, interpret: bool, head=None):
    """One mixed forward pass -> (state, packed f32 [S * (2 + 2K) + Sc * d]).

    The LM head runs only on the S sampled rows; the pooler only when the step has chunk rows.
    """
    attn_fn = functools.partial(ragged_paged_attention, impl=impl, max_q_len=max_q_len,
                                num_multi_query_seqs=num_chunk_seqs, interpret=interpret)
    hidden, kv = llama.forward(params, model_cfg, batch.tokens, batch.positions, batch.slots,
                               state.kv, batch.meta, attn_fn, batch.adapter_ids)
    logits = llama.lm_logits(params, model_cfg, hidden[batch.sample_rows])  # [S, V]
    sampled = sample(logits, batch.knobs, num_logprobs)  # [S, 2 + 2K]
    pool, vectors = state.pool, jnp.zeros((0,), jnp.float32)
    if num_chunk_seqs:
        pool, vectors = pooler.update(state.pool, hidden, batch.positions, batch.pool, head)
    return DeviceState(kv, pool), jnp.concatenate([sampled.reshape(-1), vectors.reshape(-1)])


def batch_spec(t: int, s: int, sc: int, p: int) -> StepBatch:
    """Shape/dtype structs of a StepBatch variant, for ahead-of-time lowering."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    bool_ = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bool_)  # noqa: E731
    return StepBatch(
        tokens=i32(t), positions=i32(t), slots=i32(t),
        meta=llama.AttnMeta(kv_lens=i32(s), page_indices=i32(s, p), cu_q_lens=i32(s + 1),
                            num_seqs=i32()),
        sample_rows=i32(s),
        knobs=SamplingKnobs(temperature=f32(s), top_k=i32(s), top_p=f32(s),
                            seed=jax.ShapeDtypeStruct((s,), jnp.uint32), step=i32(s)),
        pool=pooler.PoolBatch(token_slot=i32(t), item_slot=i32(sc), item_last_row=i32(sc),
                              item_first_chunk=bool_(sc), kind=i32(sc), normalize=bool_(sc),
                              item_length=i32(sc)),
        adapter_ids=i32(t))


def _pack_sampling(items: list, s: int) -> SamplingKnobs:
    temperature, top_p = np.zeros(s, np.float32), np.ones(s, np.float32)
    top_k, step_idx, seed = np.zeros(s, np.int32), np.zeros(s, np.int32), np.zeros(s, np.uint32)
    for i, it in enumerate(items):
        knobs = it.request.payload
        if isinstance(knobs, GenKnobs):
            temperature[i], top_k[i], top_p[i] = knobs.temperature, knobs.top_k, knobs.top_p
            seed[i], step_idx[i] = knobs.seed, len(it.request.output_token_ids)
    return SamplingKnobs(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         step=step_idx)


def _pack_pooling(items: list, rows: list, t: int, sc: int, slot_of: dict,
                  dummy: int) -> pooler.PoolBatch:
    """Pool arrays for the embedding items (the first ones of the step, in order)."""
    token_slot = np.full(t, dummy, np.int32)
    item_slot, last_row = np.full(sc, dummy, np.int32), np.zeros(sc, np.int32)
    first, normalize = np.zeros(sc, bool), np.zeros(sc, bool)
    kind, length = np.zeros(sc, np.int32), np.zeros(sc, np.int32)
    for i, it in enumerate(it for it in items if it.kind == EMBED):
        lo, hi = rows[i]
        slot = slot_of[it.request.request_id]
        token_slot[lo:hi], item_slot[i], last_row[i] = slot, slot, hi - 1
        first[i], length[i] = it.start == 0, it.start + it.num_tokens
        kind[i], normalize[i] = it.request.payload.kind, it.request.payload.normalize
    return pooler.PoolBatch(token_slot=token_slot, item_slot=item_slot, item_last_row=last_row,
                            item_first_chunk=first, kind=kind, normalize=normalize,
                            item_length=length)


def pack_batch(out: SchedulerOutput, cfg: EngineConfig, slot_of: dict,
               dummy_slot: int) -> tuple[tuple, StepBatch]:
    """Host arrays for one step and its variant key (T, S, Sc, pages_per_seq).

    `slot_of` maps each embedding request of the step to its pooler slot.
    """
    items, n_tok, ps = out.items, out.num_tokens, cfg.page_size
    t = pad_to_bucket(n_tok, cfg.token_buckets)
    s = pad_to_bucket(len(items), cfg.seq_buckets)
    sc = min(pad_to_bucket(sum(it.kind != DECODE for it in items), cfg.chunk_seq_buckets), s)
    p = pad_to_bucket(max(-(-(it.start + it.num_tokens) // ps) for it in items), cfg.page_buckets)
    tokens, positions, slots, adapter_ids = (np.zeros(t, np.int32) for _ in range(4))
    kv_lens, sample_rows = np.zeros(s, np.int32), np.zeros(s, np.int32)
    page_indices = np.zeros((s, p), np.int32)
    cu = np.full(s + 1, n_tok, np.int32)
    cu[0] = 0
    rows = []
    for i, it in enumerate(items):
        lo = int(cu[i])
        hi = lo + it.num_tokens
        pos = np.arange(it.start, it.start + it.num_tokens)
        pages = np.asarray(it.request.pages[:p], np.int32)
        tokens[lo:hi], positions[lo:hi] = it.request.token_ids(it.start, it.num_tokens), pos
        slots[lo:hi] = pages[pos // ps] * ps + pos % ps
        page_indices[i, :len(pages)] = pages
        kv_lens[i], cu[i + 1], sample_rows[i] = it.start + it.num_tokens, hi, hi - 1
        adapter_ids[lo:hi] = getattr(it.request.payload, "adapter_id", 0)
        rows.append((lo, hi))
    batch = StepBatch(
        tokens=tokens, positions=positions, slots=slots,
        meta=llama.AttnMeta(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu,
                            num_seqs=np.int32(len(items))),
        sample_rows=sample_rows, knobs=_pack_sampling(items, s),
        pool=_pack_pooling(items, rows, t, sc, slot_of, dummy_slot), adapter_ids=adapter_ids)
    return (t, s, sc, p), batch


class Runner:
    """Owns params and the device state (KV cache, pooler); runs steps; counts compiles."""

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, params):
        backend = jax.default_backend()
        if backend == "cpu" and jnp.dtype(cfg.dtype).itemsize == 2:
            warnings.warn(f"dtype={cfg.dtype!r} on the CPU backend is slow: XLA:CPU runs 16-bit "
                          "scatters, gathers and element-wise ops through float32 copies (the "
                          "small preset's 16-token decode step: 4.9 s in bfloat16 vs 28 ms in "
                          "float32); use float32 on a CPU", stacklevel=3)
        self.model_cfg, self.cfg = model_cfg, cfg
        self.params = llama.for_layer_loop(params, cfg.layer_loop)
        dtype = jnp.dtype(cfg.dtype)
        self.state = DeviceState(
            kv=llama.KVCache.zeros(model_cfg, cfg.num_pages, cfg.page_size, dtype),
            pool=pooler.PoolerState.zeros(cfg.max_num_seqs, model_cfg.hidden_size,
                                          cfg.max_model_len if cfg.buffered_head else 1))
        self._free_slots = list(range(cfg.max_num_seqs))
        self._slot_of: dict = {}  # embedding request id -> pooler slot, while it runs
        impl = cfg.attention_impl
        self.impl = ("pallas" if backend == "gpu" else "xla") if impl == "auto" else impl
        self.interpret = self.impl == "pallas" and backend != "gpu"  # Pallas off-GPU: interpret
        self.executable = CompileCache(self._compile)

    @property
    def compiles(self) -> int:
        return len(self.executable)

    @property
    def compile_s(self) -> float:
        return self.executable.seconds

    def _compile(self, key: tuple):
        t, s, sc, p = key
        fn = jax.jit(functools.partial(
            step, model_cfg=self.model_cfg, max_q_len=min(self.cfg.chunk_size, t),
            num_chunk_seqs=sc, num_logprobs=self.cfg.max_logprobs, impl=self.impl,
            interpret=self.interpret, head=self.cfg.buffered_head), donate_argnums=(1,))
        return fn.lower(self.params, self.state, batch_spec(t, s, sc, p)).compile()

    def release(self, request_id) -> None:
        """Free the pooler slot of an embedding request (finished or aborted)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        for it in out.items:
            if it.kind == EMBED and it.request.request_id not in self._slot_of:
                self._slot_of[it.request.request_id] = self._free_slots.pop()
        key, batch = pack_batch(out, self.cfg, self._slot_of, self.cfg.max_num_seqs)
        self.state, packed = self.executable(key)(self.params, self.state, batch)
        packed = np.asarray(packed)
        _, s, sc, _ = key
        k = self.cfg.max_logprobs
        samples = packed[:s * (2 + 2 * k)].reshape(s, 2 + 2 * k)
        vectors = packed[s * (2 + 2 * k):].reshape(sc, self.model_cfg.hidden_size)
        result = RunnerOutput({}, 0.0)
        for i, it in enumerate(out.items):
            rid = it.request.request_id
            if it.samples:
                row = samples[i]
                result.sampled[rid] = SampledToken(
                    int(row[0]), float(row[1]), tuple(int(x) for x in row[2:2 + k]),
                    tuple(float(x) for x in row[2 + k:]))
            elif it.kind == EMBED and it.ends:
                result.embeddings[rid] = vectors[i].copy()
                self.release(rid)
        result.step_time = time.perf_counter() - t0
        return result
