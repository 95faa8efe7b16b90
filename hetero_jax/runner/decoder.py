"""The decoder runner: one jitted mixed step over the paged KV cache, per scheduled step.

In: the decoder's `ScheduledItem`s of one step (plain host data from the scheduler). Out:
`RunnerOutput` with one sampled token per item that ends at its request's last token, and
one pooled vector per embedding request whose last chunk ran. The step is
`(params, state, ints, floats) -> (state, packed, logits)`: the batch comes as its two-array
wire (`wire.py`: two host->device copies, not one per array); the state (KV cache, pooler
sums, and each row's last sampled token, which the next step's linked tokens read:
`batch.link_tokens`) is donated, so XLA updates it in place; `packed` (layout:
`packed.PackedLayout`) is the only device->host copy, started as soon as the step is
dispatched. The step samples greedily;
a step with a penalty, a temperature or top log-probs is re-sampled from its `logits` by a
second, small executable, chosen on the host (`sampler.needs`), so no step holds a
`lax.cond`, which a GPU would run from the host, waiting for the kernels before it. Token
layout of a step (sorted by kind): embedding chunks, prefill chunks, decode tokens, padding
(`batch.pack_batch`). Executables are compiled ahead of time per bucket
variant `(T, S, Sc, pages_per_seq, second_pages)` (`batch.py`) and kept in an
`ExecutableCache` (bounded by the process's memory mappings), so `compiles` is exact and
`warmup(keys)` can build every variant (each build is announced on stderr, "compiling step
variant k/N": `compile_progress.CompileNotice`); with the persistent compilation cache on
(`EngineConfig.compile_cache`), a `WarmManifest` lets a second process of the same
configuration skip the variants already on disk. The runner allocates nothing: pages and
pooler slots come from the scheduler inside the items.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hetero_jax.config import EngineConfig
from hetero_jax.models import llama
from hetero_jax.models.config import ModelConfig
from hetero_jax.models.layers import feature_major_mlp, for_layer_loop, is_feature_major, \
    is_unrolled
from hetero_jax.ops import ragged_paged_attention
from hetero_jax.ops.pallas_attention import default_block_q, plan_work
from hetero_jax.runner import pooler
from hetero_jax.runner.batch import StepBatch, batch_spec, pack_batch, uses_cascade
from hetero_jax.runner.compile_progress import CompileNotice
from hetero_jax.runner.executables import ExecutableCache, WarmManifest, compile_options, \
    enable_compile_cache
from hetero_jax.runner.packed import PackedLayout
from hetero_jax.runner.sampler import Needs, needs, sample
from hetero_jax.runner.wire import from_wire, to_wire, wire_spec
from hetero_jax.sched import EMBED, RunnerOutput, SchedulerOutput
from hetero_jax.warn import warn


@flax.struct.dataclass
class DeviceState:
    """Everything the step replaces: donated, so XLA updates it in place."""

    kv: llama.KVCache
    pool: pooler.PoolerState
    sidecar: pooler.PageSidecar | None  # with prefix caching: pooler sums per KV page
    tokens: jax.Array  # [num_pages * page_size] int32: each KV slot's token id (penalties)
    sampled: jax.Array  # [largest seq bucket] int32: the last step's token of each row


@dataclasses.dataclass
class Launched:
    """A step dispatched to the device whose results are not read yet."""

    items: list  # the step's ScheduledItems
    key: tuple  # its variant
    packed: jax.Array  # f32 [layout.size], being computed
    t0: float  # perf_counter at dispatch
    compile_s: float  # the runner's compile seconds at dispatch


def step(params, state: DeviceState, ints, floats, *, spec: StepBatch, model_cfg: ModelConfig,
         layout: PackedLayout, max_q_len: int, chunk_pages: int | None, impl: str,
         interpret: bool, page_size: int, head=None, wrap_attention=None,
         decode_block_pages: int | None = None):
    """One mixed forward pass over the batch of shape structs `spec`, sent as its wire
    (`ints`, `floats`) -> (state, packed f32 [layout.size], logits f32 [S, V]).

    The LM head runs only on the S sampled rows; the pooler only when the step has chunk rows.
    The packed rows hold greedy tokens (`resample` replaces them where the host asks).
    `wrap_attention(attn_fn) -> attn_fn`, when given, places the attention (the sharded
    runner's `shard_map` of the Pallas kernel). `decode_block_pages`: the XLA attention's
    decode keys read that many pages at a time (`ragged_paged_attention`; the CPU's choice).
    """
    batch = from_wire(spec, ints, floats)
    batch = batch.replace(tokens=jnp.where(  # tokens the step before sampled: read here
        batch.prev_rows >= 0, state.sampled[jnp.maximum(batch.prev_rows, 0)], batch.tokens))
    attn_fn = functools.partial(ragged_paged_attention, impl=impl, max_q_len=max_q_len,
                                num_multi_query_seqs=layout.num_chunk_seqs,
                                chunk_pages=chunk_pages, interpret=interpret,
                                decode_block_pages=decode_block_pages)
    attn_fn = attn_fn if wrap_attention is None else wrap_attention(attn_fn)
    model = llama.LlamaModel(model_cfg, attn_fn, unrolled=is_unrolled(params),
                             feature_mlp=is_feature_major(params))
    meta = batch.meta
    if impl == "pallas":  # the kernel's work list, once per step rather than once per layer
        meta = meta.replace(plan=plan_work(
            meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs,
            batch.tokens.shape[0], page_size, cascade=meta.cascade,
            block_q=default_block_q(model_cfg.num_heads, model_cfg.num_kv_heads,
                                    decode_only=layout.num_chunk_seqs == 0),
            tile_block_q=default_block_q(model_cfg.num_heads, model_cfg.num_kv_heads,
                                         decode_only=False)))
    hidden, kv = model.apply({"params": params}, batch.tokens, batch.positions, batch.slots,
                             state.kv, meta, batch.adapter_ids)  # [T, d]
    logits = model.apply({"params": params}, hidden[batch.sample_rows],
                         method=llama.LlamaModel.logits)  # [S, V]
    tokens = state.tokens.at[batch.slots].set(batch.tokens)
    rows = sample(logits, batch.knobs, layout.num_logprobs, tokens, batch.meta.page_indices,
                  page_size, penalized=False, filtered=False, ranked=False)  # [S, 2 + 2K]
    pool, vectors, side = state.pool, None, state.sidecar
    if layout.num_chunk_seqs:
        pool, vectors = pooler.update(
            state.pool, hidden, batch.positions, batch.pool, head, side,
            batch.meta.page_indices[:layout.num_chunk_seqs], page_size)
    if side is not None:
        side = pooler.write_sidecar(side, hidden, batch.positions, batch.slots, page_size)
    return (DeviceState(kv, pool, side, tokens, _keep_sampled(state.sampled, rows)),
            layout.pack(rows, vectors), logits)


def _keep_sampled(sampled, rows):
    """The last-token buffer with a step's sampled rows [S, 2 + 2K] written at its front."""
    return jax.lax.dynamic_update_slice(sampled, rows[:, 0].astype(jnp.int32), (0,))


def resample(logits, table, sampled, ints, floats, packed, *, spec: StepBatch,
             layout: PackedLayout, page_size: int, needs: Needs):
    """A step's sampled rows again, from its `logits` with what its rows ask past greedy
    (`needs`: penalties, temperatures, top log-probs; the knobs from its batch `spec`, sent as
    `ints`, `floats`), over the greedy rows of its `packed` output; `table`: the token table
    after the step -> (packed, the state's last-token buffer `sampled` with these rows)."""
    batch = from_wire(spec, ints, floats)
    rows = sample(logits, batch.knobs, layout.num_logprobs, table, batch.meta.page_indices,
                  page_size, penalized=needs.penalized, filtered=needs.filtered,
                  ranked=needs.ranked)
    return (jax.lax.dynamic_update_slice(packed, rows.reshape(-1), (0,)),
            _keep_sampled(sampled, rows))


def zero_state(model_cfg: ModelConfig, cfg: EngineConfig) -> DeviceState:
    """A fresh KV cache and pooler state of a resolved `cfg` (`jax.eval_shape` of it gives the
    shapes without allocating)."""
    return DeviceState(
        kv=llama.KVCache.zeros(model_cfg, cfg.num_pages, cfg.page_size, jnp.dtype(cfg.dtype)),
        pool=pooler.PoolerState.zeros(cfg.max_num_seqs, model_cfg.hidden_size,
                                      cfg.max_model_len if cfg.buffered_head else 1),
        sidecar=pooler.PageSidecar.zeros(cfg.num_pages, model_cfg.hidden_size)
        if cfg.prefix_caching else None,
        tokens=jnp.zeros(cfg.num_pages * cfg.page_size, jnp.int32),
        sampled=jnp.zeros(cfg.seq_buckets[-1], jnp.int32))


def layout_of(model_cfg: ModelConfig, cfg: EngineConfig, key: tuple) -> PackedLayout:
    """The packed device->host layout of variant `key`."""
    _, s, sc, _, _ = key
    return PackedLayout(s, cfg.max_logprobs, sc, model_cfg.hidden_size)


def bind_step(model_cfg: ModelConfig, cfg: EngineConfig, key: tuple, *, impl: str,
              interpret: bool, **kw):
    """`step` with the static arguments of variant `key` of a resolved `cfg` bound (`kw`: more
    of them, e.g. `wrap_attention`)."""
    t, _, sc, _, second = key
    return functools.partial(
        step, spec=batch_spec(cfg, *key), model_cfg=model_cfg,
        layout=layout_of(model_cfg, cfg, key),
        max_q_len=min(cfg.chunk_size, t), chunk_pages=second if sc else None, impl=impl,
        interpret=interpret, page_size=cfg.page_size, head=cfg.buffered_head, **kw)


# The CPU's decode keys per block, and the keys a variant's decode rows must hold in their page
# bucket before the loop pays (docs/results.md: 1-2 rows at 512 keys 1.1-1.3x slower, 4 rows
# even, 8-32 rows at 130-380 tokens 0.71-0.90x the step time).
DECODE_BLOCK_TOKENS = 128
DECODE_BLOCK_MIN_KEYS = 2048


def decode_block_pages(impl: str, backend: str, page_size: int, key: tuple) -> int | None:
    """Pages per block of the XLA attention's decode keys in variant `key`: on a CPU,
    `DECODE_BLOCK_TOKENS`' worth, so that a decode step reads its keys up to its longest
    sequence rather than copying the whole page bucket, where that bucket spans more than one
    block and its rows hold at least `DECODE_BLOCK_MIN_KEYS` keys; else None (one gather). A
    GPU's XLA path keeps the gather: a data-dependent loop's test would wait for the device."""
    _, seqs, chunk_seqs, pages, _ = key
    block = max(1, DECODE_BLOCK_TOKENS // page_size)
    if (impl, backend) != ("xla", "cpu") or pages <= block \
            or (seqs - chunk_seqs) * pages * page_size < DECODE_BLOCK_MIN_KEYS:
        return None
    return block


def _written_to_disk() -> bool:
    """Whether jax writes every compiled executable to the persistent cache (its size and
    compile-time thresholds are off, as `enable_compile_cache` sets them)."""
    return (jax.config.jax_persistent_cache_min_compile_time_secs <= 0
            and jax.config.jax_persistent_cache_min_entry_size_bytes <= 0)


class DecoderRunner:
    """Owns the params and the device state (KV cache, pooler); runs steps; counts compiles."""

    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, params):
        backend = jax.default_backend()
        cfg = dataclasses.replace(cfg, dtype=cfg.dtype_on(backend))
        if backend == "cpu" and jnp.dtype(cfg.dtype).itemsize == 2:
            warn(f"dtype={cfg.dtype!r} on the CPU backend is slow: XLA:CPU runs 16-bit "
                 "scatters, gathers and element-wise ops through float32 copies (the "
                 "small preset's 16-token decode step: 4.9 s in bfloat16 vs 28 ms in "
                 "float32); use float32 on a CPU")
        self.model_cfg, self.cfg = model_cfg, cfg
        self.params = self.layout_params(params, backend)
        self.state = self.zero_state()
        self.impl = cfg.impl_on(backend)
        self.interpret = self.impl == "pallas" and backend != "gpu"  # Pallas off-GPU: interpret
        self.backend = backend
        self.notice = CompileNotice(len(cfg.variants()))
        self.executable = ExecutableCache(self._build, on_build=self._announce)
        self.resampler = ExecutableCache(self._compile_resample)  # (key, Needs)
        self.specs: dict = {}  # variant key -> its batch_spec
        self.compile_cache = enable_compile_cache(cfg.compile_cache)
        self.cascade_steps = 0

    def layout_params(self, params, backend: str) -> dict:
        """`params` laid out for this runner: for `cfg.layer_loop`, and on a CPU with the MLP's
        weights transposed (`layers.feature_major_mlp`: 1.1-1.2x faster decode steps there)."""
        params = for_layer_loop(params, self.cfg.layer_loop)
        return feature_major_mlp(params) if backend == "cpu" else params

    def zero_state(self) -> DeviceState:
        """A fresh KV cache and pooler state (the sharded runner builds it on its mesh)."""
        return zero_state(self.model_cfg, self.cfg)

    @property
    def compiles(self) -> int:
        return self.executable.builds

    @property
    def compile_loads(self) -> int:
        return self.executable.loads

    def manifest(self) -> WarmManifest | None:
        """The record of this configuration's variants on disk (None: no persistent cache, or
        a `buffered_head`, whose code the fingerprint cannot see)."""
        if not self.compile_cache or self.cfg.buffered_head is not None:
            return None
        shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), self.params)
        return WarmManifest(self.compile_cache, WarmManifest.fingerprint(
            type(self).__name__, self.model_cfg, dataclasses.replace(self.cfg, warmup="all"),
            shapes, self.impl, self.interpret,
            repr(getattr(self, "mesh", None))))

    def warmup(self, keys: list) -> int:
        """Build every variant of `keys` that is neither held nor recorded on disk; returns how
        many were built (compiled, or loaded from the persistent cache)."""
        manifest = self.manifest()
        on_disk = manifest.keys() if manifest else set()
        todo = [key for key in keys if key not in self.executable and key not in on_disk]
        if todo:  # "compiling step variant k/len(todo)"; else the steps' k/N stays
            self.notice.expect(len(todo))
        for key in todo:
            self.executable(key)
        return len(todo)

    @property
    def compile_s(self) -> float:
        return self.executable.seconds + self.resampler.seconds

    def spec(self, key: tuple) -> StepBatch:
        """The batch shape structs of variant `key`."""
        if key not in self.specs:
            self.specs[key] = batch_spec(self.cfg, *key)
        return self.specs[key]

    def layout(self, key: tuple) -> PackedLayout:
        return layout_of(self.model_cfg, self.cfg, key)

    def step_fn(self, key: tuple, **kw):
        """`step` with the static arguments of variant `key` bound (`kw`: more of them)."""
        blocks = decode_block_pages(self.impl, self.backend, self.cfg.page_size, key)
        return bind_step(self.model_cfg, self.cfg, key, **dict(
            dict(impl=self.impl, interpret=self.interpret, decode_block_pages=blocks), **kw))

    def _announce(self, key: tuple) -> None:
        """The cache's `on_build`: "compiling step variant k/N", or "loading" when the warm
        manifest says the persistent cache holds it."""
        manifest = self.manifest()
        self.notice(key, loading=bool(manifest) and key in manifest.keys())

    def _build(self, key: tuple):
        """The cache's build: compile `key` (or load it from the persistent cache), and record
        it in the warm manifest once jax has written it there."""
        executable = self._compile(key)
        manifest = self.manifest()
        if manifest and _written_to_disk():
            manifest.add([key])
        return executable

    def _compile(self, key: tuple):
        fn = jax.jit(self.step_fn(key), donate_argnums=(1,))
        return fn.lower(self.params, self.state, *wire_spec(self.spec(key))).compile(
            compiler_options=compile_options(jax.default_backend()) or None)

    def _compile_resample(self, how: tuple):
        """The re-sampler of `how` = (variant key, `Needs`)."""
        key, what = how
        layout = self.layout(key)
        fn = jax.jit(functools.partial(
            resample, spec=self.spec(key), layout=layout, page_size=self.cfg.page_size,
            needs=what), donate_argnums=(5,))
        f32 = lambda *shape: jax.ShapeDtypeStruct(  # noqa: E731
            shape, jnp.float32, sharding=self.replicated())
        ints, floats = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.replicated())
                        for x in wire_spec(self.spec(key)))
        return fn.lower(f32(key[1], self.model_cfg.vocab_size), self.state.tokens,
                        self.state.sampled, ints, floats, f32(layout.size)).compile(
            compiler_options=compile_options(jax.default_backend()) or None)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the decoder's share of one step: `out.items` (sorted by kind, at least one)
        under the scheduler's cascade plan `out.cascade`. Its `step_time` leaves out the
        seconds spent compiling (or loading) a new variant, which `compile_s` counts."""
        return self.collect(self.launch(out.items, *self.pack(out)))

    def pack(self, out: SchedulerOutput) -> tuple:
        """(variant key, StepBatch of host arrays) of the step's decoder items."""
        return pack_batch(out.items, self.cfg, out.cascade)

    def launch(self, items: list, key: tuple, batch) -> Launched:
        """Dispatch a packed step (`batch.pack_batch` of `items`) without waiting for it: jax
        runs it asynchronously (the re-sampler after it where a sampled row has a penalty, a
        temperature or asks for log-probs, and the copy of its output to the host), and
        `collect` blocks on its results. The wire goes as numpy: the executable's own copy
        costs the host less than a `jax.device_put` first."""
        t0, compile0 = time.perf_counter(), self.compile_s
        wire = to_wire(batch, self.spec(key))
        self.state, packed, logits = self.executable(key)(self.params, self.state, *wire)
        what = needs([it.knobs for it in items if it.samples])
        if any(what):
            packed, sampled = self.resampler((key, what))(
                logits, self.state.tokens, self.state.sampled, *wire, packed)
            self.state = self.state.replace(sampled=sampled)
        packed.copy_to_host_async()
        self.cascade_steps += uses_cascade(batch)
        return Launched(items, key, packed, t0, compile0)

    def replicated(self) -> jax.sharding.Sharding | None:
        """Where the batch and the step's outputs live: the default device (None) here, every
        device of the mesh in the sharded runner."""
        return None

    def collect(self, launched: Launched) -> RunnerOutput:
        """Wait for a launched step -> its `RunnerOutput` (the one device->host copy)."""
        layout = self.layout(launched.key)
        rows, vectors = layout.unpack(np.asarray(launched.packed))
        rows = rows[:len(launched.items)].tolist()  # Python floats: one conversion, not S * K
        result = RunnerOutput()
        for i, it in enumerate(launched.items):
            if it.samples:
                result.sampled[it.request_id] = layout.sampled_token(  # top-K only if asked
                    rows[i], None if it.knobs.logprobs else 0)
            elif it.kind == EMBED and it.ends:
                result.embeddings[it.request_id] = vectors[i].copy()
        result.step_time = (time.perf_counter() - launched.t0
                            - (self.compile_s - launched.compile_s))
        return result
