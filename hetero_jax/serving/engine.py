"""The engine: validate requests, then loop schedule -> runner step -> update.

In: `GenerateRequest`s / `EmbedRequest`s (or `generate`/`embed` arguments, `batch_api`).
Out: `RequestOutput`s / `EmbeddingOutput`s (or an `[N, d]` array from `embed`) in input order.
One thread. A request goes down once: `input_processor` checks and tokenizes it (a bad one
raises before anything is queued), the host `sched.Scheduler` queues it and decides each
step, `runner.DecoderRunner` (and a separate encoder's `runner.EncoderRunner`) run the
step's plain-data items on the device, `Scheduler.advance`/`settle` move the requests on, and
`output_processor` formats the finished ones. Generation and embedding requests share the
same steps (`run`, which steps through a `drive.Drive` as every caller does);
`prepare`/`enqueue`/`step`/`abort`/`output` are what a `Drive` calls. Each
`step` returns a `StepOutput`: the requests it finished and those it gave a token and that go
on, so a front streams per-step deltas from host state the step already copied back. With
`EngineConfig.async_scheduling` the next step is scheduled and dispatched before a step's
outputs are processed (`overlap.StepPipeline`), so the host's work overlaps the device's.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from hetero_jax.config import EngineConfig, config_or_default
from hetero_jax.models import llama, lora
from hetero_jax.models.config import ModelConfig
from hetero_jax.models.formats.hf_llama import load_params, read_model_config
from hetero_jax.models.formats.peft import load_adapter
from hetero_jax.models.layers import row_major_mlp, stack_layers
from hetero_jax.models.presets import preset_config, preset_dir, require_local_dir
from hetero_jax.models.tokenizer import ByteTokenizer, load_tokenizer
from hetero_jax.outputs import EngineStats
from hetero_jax.runner.compile_progress import BarClock
from hetero_jax.runner.decoder import DecoderRunner
from hetero_jax.runner.memory import check_memory
from hetero_jax.runner.sharding import ShardedDecoderRunner, check_tensor_parallel, \
    restore_targets, unexpand_kv_heads
from hetero_jax.sched import Scheduler
from hetero_jax.sched.hashing import chain_seed
from hetero_jax.serving import checkpoint
from hetero_jax.serving.batch_api import BatchAPI
from hetero_jax.serving.drive import Drive
from hetero_jax.serving.encoder import SeparateEncoder
from hetero_jax.serving.input_processor import EmbeddingModel, InputProcessor, expand_samples
from hetero_jax.serving.output_processor import delta as make_delta
from hetero_jax.serving.output_processor import error_output, make_output
from hetero_jax.serving.overlap import StepOutput, StepPipeline
from hetero_jax.warn import warn


class Engine(BatchAPI):
    def __init__(self, model_cfg: ModelConfig, params, tokenizer, config: EngineConfig | None = None,
                 encoder: SeparateEncoder | None = None, adapters: dict | None = None):
        """`adapters` maps LoRA adapter names to loaded `lora.LoraAdapter`s (embedding only);
        `encoder`, when given, embeds every embedding request instead of the decoder. With
        `config.tensor_parallel=N > 1` the decoder is split over the first N devices
        (`runner.sharding`), checked against the model before any params are placed."""
        config = config_or_default(config)
        _check_tensor_parallel(model_cfg, config)
        dtype = _dtype(config)
        self.config = c = _resolved(model_cfg, config)  # the sizes checked against memory
        self.model_cfg, self.tokenizer, self.encoder = model_cfg, tokenizer, encoder
        # With tensor_parallel the weights stay on the host, or as sharded as they came (an
        # engine checkpoint restored into its shardings): the sharded runner places the rest.
        params = jax.tree.map(lambda x: _as_dtype(x, dtype, c.tensor_parallel > 1), params)
        adapter_ids = {name: i + 1 for i, name in enumerate(adapters or {})}  # 0 = base
        if adapters:
            stacked = lora.stack_adapters(list(adapters.values()), model_cfg, dtype,
                                          on_host=c.tensor_parallel > 1)
            params = dict(params, layers=lora.merge_lora_layers(params["layers"], stacked))
        if c.max_logprobs > model_cfg.vocab_size:
            raise ValueError(f"max_logprobs={c.max_logprobs} exceeds the vocabulary of "
                             f"{model_cfg.vocab_size} tokens")
        self.scheduler = Scheduler(c.scheduler_config(  # first: a bad policy name fails here
            model_cfg, encoder.runner.batch_buckets[-1] if encoder else 0))
        if encoder and c.prefix_caching:
            warn("prefix caching serves generation only here: the separate encoder "
                 "embeds every input whole (a bidirectional encoder has no prefix "
                 "cache)")
        self.runner = (ShardedDecoderRunner(model_cfg, c, params, c.tensor_parallel)
                       if c.tensor_parallel > 1 else DecoderRunner(model_cfg, c, params))
        embedding = EmbeddingModel(encoder.tokenizer, encoder.runner.cfg.vocab_size,
                                   encoder.max_len, encoder.pooling, encoder.normalize,
                                   on_decoder=False) if encoder else EmbeddingModel(
            tokenizer, model_cfg.vocab_size, c.max_model_len, "mean", True, on_decoder=True)
        self.inputs = InputProcessor(
            model_cfg, c, tokenizer, embedding, adapter_ids,
            cache_identity=_cache_identity(model_cfg, c) if c.prefix_caching else None,
            adapter_digests={adapter_ids[n]: _adapter_digest(a) for n, a in (adapters or {}).items()})
        self.stats = EngineStats(batching=self.scheduler.batching.stats())
        self.pipeline = StepPipeline(self)
        self._ids = itertools.count()  # request ids; next() is atomic across threads
        self._lock = threading.RLock()  # one step (or one `run`) at a time

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, seed: int = 0, config: EngineConfig | None = None,
                    embed_model: str | None = None) -> "Engine":
        """An embedded model (random weights from `seed`, or a preset shipped trained, with its
        embedding adapter); `embed_model` as in from_pretrained."""
        shipped, config = preset_dir(name), config_or_default(config)
        if shipped is not None:
            adapter = None if embed_model else os.path.join(shipped, "adapter")
            return cls.from_pretrained(shipped, config, embed_model, adapter)
        cfg = preset_config(name)
        _check_tensor_parallel(cfg, config)
        _resolved(cfg, config)  # sizes against memory, before the weights are made
        dtype = _dtype(config)
        encoder = SeparateEncoder.from_pretrained(embed_model, dtype) if embed_model else None
        on_host = config.tensor_parallel > 1  # the runner places shards
        return cls(cfg, llama.init_params(cfg, seed, on_host=on_host), ByteTokenizer(), config,
                   encoder)

    @classmethod
    def from_source(cls, source, config: EngineConfig | None = None) -> "Engine":
        """The whole engine a `processes.ModelSource` names (what a worker process builds)."""
        if source.preset is not None:
            return cls.from_preset(source.preset, source.seed, config)
        return cls.from_pretrained(source.path, config, source.embed_model, source.embed_adapter)

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig | None = None,
                        embed_model: str | None = None,
                        embed_adapter: str | dict | None = None) -> "Engine":
        """A decoder from a local Hugging Face directory.

        `embed_model` names a separate BERT-family encoder directory that then serves every
        embedding request. `embed_adapter` names a PEFT LoRA directory (or a dict name ->
        directory) whose adapter embedding tokens use on the shared backbone, in the same pass
        as generation tokens on the base weights; the first one is the default.
        """
        config = config_or_default(config)
        dtype = _dtype(config)
        model_cfg = read_model_config(require_local_dir(path))
        _check_tensor_parallel(model_cfg, config)  # before the weights are read
        _resolved(model_cfg, config)  # and the sizes against memory
        params = load_params(path, model_cfg, dtype, on_host=config.tensor_parallel > 1)
        encoder = SeparateEncoder.from_pretrained(embed_model, dtype) if embed_model else None
        dirs = {"default": embed_adapter} if isinstance(embed_adapter, str) else embed_adapter
        adapters = {name: load_adapter(require_local_dir(d, "adapter"), model_cfg, dtype)
                    for name, d in (dirs or {}).items()}
        return cls(model_cfg, params, load_tokenizer(path, model_cfg.eos_token_ids,
                                                       model_cfg.vocab_size), config,
                   encoder, adapters)

    def save(self, path: str) -> None:
        """An engine-native checkpoint (orbax): the base params, model config and tokenizer.
        LoRA adapters are not saved: load them again from their PEFT directories."""
        params = stack_layers(unexpand_kv_heads(self.model_cfg,
                                                row_major_mlp(self.runner.params)))
        layers = {k: v for k, v in params["layers"].items() if not k.startswith("lora_")}
        checkpoint.save(path, self.model_cfg, dict(params, layers=layers), self.tokenizer)

    @classmethod
    def load(cls, path: str, config: EngineConfig | None = None) -> "Engine":
        """An engine checkpoint (`save`). With tensor_parallel=N > 1 orbax restores each param
        straight into its shards on the N devices (`runner.sharding.restore_targets`)."""
        config = config_or_default(config)
        targets = functools.partial(restore_targets, n=config.tensor_parallel, dtype=_dtype(
            config)) if config.tensor_parallel > 1 else None
        model_cfg, params, tokenizer = checkpoint.load(path, targets)
        return cls(model_cfg, params, tokenizer, config)

    # -- serving -----------------------------------------------------------------------------
    def warmup(self) -> int:
        """Make the step variants `config.warmup` names (every one, or none where it is lazy:
        the default on a CPU) and every encoder bucket ready: compiled in this process, or, with
        the persistent compilation cache on, already on disk from an earlier process of the same
        configuration (then the first step of that variant loads it, ~0.5 s for the small
        preset, and compiles nothing). Returns how many variants this call built."""
        built = self.runner.warmup(self.config.warmup_variants())
        if self.encoder:
            built += self.encoder.runner.warmup()
        self.count_compiles()
        return built

    def run(self, requests: list, use_tqdm: bool = True) -> list:
        """Serve a mix of GenerateRequest and EmbedRequest together in heterogeneous steps;
        outputs (RequestOutput / EmbeddingOutput) come back in input order, `n` of them in a
        row for a GenerateRequest with `SamplingParams(n=...)`.

        Calls from several threads take turns (one batch at a time). A request the engine
        fails after validation comes back with `finish_reason="error"` and its `error`; the
        others are unaffected. An error that belongs to no single request is raised.
        """
        with self._lock:
            if self.scheduler.has_work():
                raise RuntimeError("the engine is serving other requests (an AsyncEngine's, or "
                                   "a step-wise caller's): use that front, or wait for them")
            reqs = self.prepare(expand_samples(requests))  # all checked before any is queued
            drive = Drive(self)
            refused = drive.queue(enumerate(reqs))
            bar = tqdm(total=len(reqs), desc="requests", unit="req", disable=not use_tqdm)
            clock = BarClock(bar, lambda: self.stats.compile_s, time.perf_counter)
            tokens0, results = self.stats.generated_tokens, {}
            try:
                for index, result in refused[:1]:  # the scheduler's own limits
                    raise result.error.at(index)
                for finished in drive.steps():
                    clock.update(len(finished))  # compiling left out of its times
                    results.update(finished)
                    rate = (self.stats.generated_tokens - tokens0) / max(clock.serving_s(), 1e-9)
                    bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)
            finally:
                bar.close()
                drive.abort_all()  # what a raising step left in flight
            return [results[i].output for i in range(len(reqs))]

    # -- step-wise interface (a `drive.Drive` calls it) ----------------------------------------
    def add(self, requests: list) -> list:
        """Validate every request, then queue them all; returns their `Request` handles.

        A bad request raises before anything is queued, so the others are not half-added.
        """
        return self.enqueue(self.prepare(requests))

    def prepare(self, requests: list) -> list:
        """Validate and tokenize requests into `Request` handles without queueing them (no
        lock: the engine's state is not touched, so a front may prepare during a step)."""
        return [self.inputs.process(i, r, next(self._ids)) for i, r in enumerate(requests)]

    def enqueue(self, reqs: list) -> list:
        """Queue prepared handles (between steps); returns them."""
        with self._lock:
            for req in reqs:
                self.scheduler.add(req)
        return reqs

    def has_work(self) -> bool:
        """Whether requests are queued or running, or a step is in flight."""
        return self.pipeline.has_work()

    def step(self, drain: bool = False) -> StepOutput:
        """One device step's outputs: the requests it finished (or failed) and those that
        sampled a token and go on. With `config.async_scheduling` (the default) the next step
        is scheduled, packed and dispatched before this one's outputs are processed, so the
        call returns with a step in flight (`has_work` holds until it is drained); results
        are the same either way (`overlap.StepPipeline`).

        When packing a step raises, the items whose own data cannot be packed are failed
        alone (`finish_reason="error"`, pages and slots freed) and the others run next step;
        when no item is to blame, the error is raised. A request whose sampled token or
        embedding comes back NaN or Inf fails alone the same way.

        `drain=True` runs this one step without the overlap: it returns with nothing in
        flight, so nothing of this engine runs on the device until the next call (the bench's
        time slices hand the machine to another engine then: `bench.timeshare`).
        """
        with self._lock:
            return self.pipeline.step(drain)

    def queue_counts(self) -> tuple[dict, dict]:
        """(waiting, running): request counts by kind ("generate", "embed"); callable from
        another thread while a step runs (it reads copies)."""
        waiting = {kind: len(q) for kind, q in list(self.scheduler.waiting.items())}
        running = dict.fromkeys(waiting, 0)
        for req in list(self.scheduler.running):
            running[req.kind] = running.get(req.kind, 0) + 1
        return waiting, running

    def abort(self, request_id) -> None:
        """Drop a request wherever it is; the scheduler frees its pages and pooler slot."""
        with self._lock:
            self.scheduler.abort(request_id)

    def fail(self, request_id, error: Exception) -> None:
        """Fail one request alone between steps (pages and slot freed; its output has `error`)."""
        with self._lock:
            req = self.scheduler.requests.get(request_id)
            if req is not None:
                self.pipeline.fail(req, error)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix. Safe while requests run: their pages stay theirs, later
        requests just no longer find them (caching resumes with the next page computed)."""
        with self._lock:
            self.scheduler.reset_prefix_cache()

    def output(self, req):
        """The user-facing output of a finished request handle; a request the engine failed,
        or whose output cannot be built, gets an output with `finish_reason="error"`."""
        if req.error is None:
            try:
                return make_output(req, self.tokenizer)
            except Exception as e:  # noqa: BLE001 - this request's data: fail it alone
                req.error = e
        return error_output(req)

    def delta(self, req, num_sent: int, read: int, request_id) -> tuple:
        """`output_processor.delta`: a running generation's new ids since `num_sent`."""
        return make_delta(req, num_sent, read, self.tokenizer, request_id)

    @property
    def worker_stats(self) -> dict:
        """{worker: EngineStats}, as every engine gives them (one worker here)."""
        return {"engine": self.stats}

    @property
    def embedding_dim(self) -> int:
        """The length of the vectors `embed` returns."""
        return (self.encoder.runner.cfg if self.encoder else self.model_cfg).hidden_size

    def record_step(self, out, runner_out) -> None:
        """Add a step (its `SchedulerOutput` and `RunnerOutput`) to `stats`."""
        s = self.stats
        s.steps += 1
        s.scheduled_tokens += out.num_tokens
        s.generated_tokens += len(runner_out.sampled)
        s.step_time_s += runner_out.step_time
        s.preemptions += len(out.preempted)
        cache, ps = self.scheduler.cache_stats(), self.config.page_size
        s.cache_queries, s.cache_evictions = cache.queries, cache.evictions
        s.cache_query_tokens, s.cache_hit_tokens = cache.query_pages * ps, cache.hit_pages * ps
        s.cascade_steps = self.runner.cascade_steps
        s.batching = self.scheduler.batching.stats()
        self.count_compiles()

    def count_compiles(self) -> None:
        """Bring `stats`' compile counts up to date with the runners' executable caches (done
        every step; a bench whose engines share one cache calls it before it reads them)."""
        runners = [self.runner] + ([self.encoder.runner] if self.encoder else [])
        self.stats.compiles = sum(r.compiles for r in runners)
        self.stats.compile_loads = self.runner.compile_loads
        self.stats.compile_s = sum(r.compile_s for r in runners)


def _as_dtype(x, dtype, keep_placement: bool):
    """A param in `dtype`: on the default device, or (`keep_placement`) where it is, a
    numpy array on the host and a jax array on its devices."""
    if not keep_placement:
        return jnp.asarray(x, dtype)
    return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x, dtype)


def _resolved(model_cfg: ModelConfig, config: EngineConfig) -> EngineConfig:
    """The config on this process's backend (dtype, attention impl, warm-up and cost model
    "auto" made concrete, the cost model a model object or None), with every None filled from
    the model and its sizes checked against the memory they imply (`runner.memory.
    check_memory`: a ValueError naming the knob and the bytes)."""
    backend = jax.default_backend()
    config = dataclasses.replace(config, dtype=config.dtype_on(backend),
                                 attention_impl=config.impl_on(backend),
                                 warmup=config.warmup_on(backend))
    config = dataclasses.replace(config, cost_model=config.step_model(
        model_cfg, backend, jax.devices()[0].device_kind))  # "auto": the one the engine knows
    itemsize = jnp.dtype(config.dtype).itemsize
    kv_bytes = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * itemsize
    # Sliding-window attention is not implemented: within the window it equals full attention.
    max_len = min(model_cfg.max_position_embeddings, model_cfg.sliding_window or 2**31)
    resolved = config.resolve(max_len, kv_bytes, backend)
    check_memory(model_cfg, resolved, itemsize)
    return resolved


def _check_tensor_parallel(model_cfg: ModelConfig, config: EngineConfig) -> None:
    """ValueError naming the value when config.tensor_parallel cannot split this model over
    the devices jax sees (nothing to check at 1)."""
    n = config.tensor_parallel
    if n > 1:
        check_tensor_parallel(model_cfg, n, len(jax.devices()))


def _dtype(config: EngineConfig) -> jnp.dtype:
    """The weights' and KV cache's dtype of `config` on this process's backend ("auto": bf16
    on GPUs, fp32 elsewhere)."""
    return jnp.dtype(config.dtype_on(jax.default_backend()))


def _cache_identity(model_cfg: ModelConfig, config: EngineConfig) -> bytes:
    """What makes this engine's K/V what it is, as a chain seed: the model's configuration,
    the dtype and the page size (two engines of one configuration share digests, which is
    what a router's prefix affinity compares)."""
    return chain_seed("hetero-jax kv", repr(model_cfg), config.dtype, config.page_size)


def _adapter_digest(adapter: lora.LoraAdapter) -> bytes:
    """A digest of a LoRA adapter's weights and scale (its identity in cache seeds)."""
    h = hashlib.blake2b(repr((adapter.rank, adapter.scale)).encode(), digest_size=16)
    for name in sorted(adapter.weights):
        for w in adapter.weights[name]:
            h.update(name.encode())
            h.update(np.ascontiguousarray(np.asarray(w, np.float32)).tobytes())
    return h.digest()
