"""The synchronous engine: validate requests, then loop schedule -> runner step -> update.

In: prompts (strings or token-id lists) with `SamplingParams`, inputs with `PoolingParams`.
Out: `RequestOutput`s / `EmbeddingOutput`s (or an `[N, d]` array from `embed`) in input
order. Everything a request could fail on is checked before any step runs, so a bad input
raises at once and the engine stays usable. One thread; the scheduler runs on the host between
device steps. Generation and embedding requests share the same steps (`run`); `add`/`step`
expose the loop to `AsyncEngine`.
"""
from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from hetero_jax import checkpoint
from hetero_jax.config import EngineConfig
from hetero_jax.encoder_runner import SeparateEncoder
from hetero_jax.models import llama, lora
from hetero_jax.models.config import ModelConfig
from hetero_jax.models.loading import load_hf_model
from hetero_jax.models.presets import preset_config
from hetero_jax.params import (POOLING_KINDS, EmbedKnobs, GenKnobs, PoolingParams,
                               SamplingParams, default_seed)
from hetero_jax.runner import Runner
from hetero_jax.sched import EMBED, Request, Scheduler, SchedulerConfig
from hetero_jax.tokenizer import ByteTokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    prompt: str | list
    params: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class EmbedRequest:
    input: str | list
    params: PoolingParams = PoolingParams()


@dataclasses.dataclass
class EmbeddingOutput:
    request_id: int
    prompt_token_ids: list
    embedding: np.ndarray  # [d]
    finish_reason: str
    metrics: dict  # arrival_time, finish_time, latency_s


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list
    token_ids: list  # generated ids only
    text: str | None
    finish_reason: str
    logprobs: list | None  # per token: {"logprob", "top": [(token_id, logprob), ...]}
    metrics: dict  # arrival_time, first_token_time, finish_time, ttft_s, latency_s, preemptions


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    scheduled_tokens: int = 0
    generated_tokens: int = 0
    step_time_s: float = 0.0
    preemptions: int = 0
    compiles: int = 0
    compile_s: float = 0.0  # part of step_time_s spent compiling new variants


class Engine:
    def __init__(self, model_cfg: ModelConfig, params, tokenizer, config: EngineConfig | None = None,
                 encoder: SeparateEncoder | None = None, adapters: dict | None = None):
        """`adapters` maps LoRA adapter names to loaded `lora.LoraAdapter`s (embedding only)."""
        dtype = jnp.dtype((config or EngineConfig()).dtype)
        kv_bytes = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * dtype.itemsize
        # Sliding-window attention is not implemented: within the window it equals full attention.
        max_len = min(model_cfg.max_position_embeddings, model_cfg.sliding_window or 2**31)
        self.config = (config or EngineConfig()).resolve(max_len, kv_bytes)
        self.model_cfg, self.tokenizer = model_cfg, tokenizer
        params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
        self.adapter_ids = {name: i + 1 for i, name in enumerate(adapters or {})}  # 0 = base
        if adapters:
            stacked = lora.stack_adapters(list(adapters.values()), model_cfg, dtype)
            params = dict(params, layers=lora.merge_lora_layers(params["layers"], stacked))
        self.runner = Runner(model_cfg, self.config, params)
        c = self.config
        self.scheduler = Scheduler(SchedulerConfig(
            token_budget=c.token_budget, chunk_size=c.chunk_size, max_num_seqs=c.max_num_seqs,
            max_chunk_seqs=c.max_chunk_seqs, page_size=c.page_size, num_pages=c.num_pages,
            max_model_len=c.max_model_len, policy=c.scheduler))
        self.stats = EngineStats()
        self.encoder = encoder  # a separate embedding model, or None: embed on the decoder
        self._encoder_queue: collections.deque = collections.deque()
        self._next_id = 0

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, seed: int = 0, config: EngineConfig | None = None,
                    embed_model: str | None = None) -> "Engine":
        """An embedded model (random weights from `seed`); `embed_model` as in from_pretrained."""
        cfg = preset_config(name)
        dtype = jnp.dtype((config or EngineConfig()).dtype)
        encoder = SeparateEncoder.from_pretrained(embed_model, dtype) if embed_model else None
        return cls(cfg, llama.init_params(cfg, seed), ByteTokenizer(), config, encoder)

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
        dtype = jnp.dtype((config or EngineConfig()).dtype)
        model_cfg, params = load_hf_model(path, dtype)
        encoder = SeparateEncoder.from_pretrained(embed_model, dtype) if embed_model else None
        dirs = {"default": embed_adapter} if isinstance(embed_adapter, str) else embed_adapter
        adapters = {name: lora.load_adapter(d, model_cfg, dtype) for name, d in (dirs or {}).items()}
        return cls(model_cfg, params, load_tokenizer(path, model_cfg.eos_token_ids), config,
                   encoder, adapters)

    def save(self, path: str) -> None:
        """An engine-native checkpoint (orbax): params, model config and tokenizer."""
        checkpoint.save(path, self.model_cfg, llama.stack_layers(self.runner.params),
                        self.tokenizer)

    @classmethod
    def load(cls, path: str, config: EngineConfig | None = None) -> "Engine":
        model_cfg, params, tokenizer = checkpoint.load(path)
        return cls(model_cfg, params, tokenizer, config)

    # -- serving -----------------------------------------------------------------------------
    def warmup(self) -> int:
        """Compile every step variant; returns how many were compiled."""
        for key in self.config.variants():
            self.runner.executable(key)
        self.stats.compiles = self.runner.compiles
        return self.runner.compiles

    def generate(self, prompts, params: SamplingParams | list | None = None,
                 use_tqdm: bool = True) -> list:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return self.run([GenerateRequest(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def embed(self, inputs, params: PoolingParams | list | None = None,
              use_tqdm: bool = True) -> np.ndarray:
        """Embed strings or token-id lists; returns `[N, d]` in input order."""
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        if params is None or isinstance(params, PoolingParams):
            params = [params or PoolingParams()] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError(f"got {len(params)} PoolingParams for {len(inputs)} inputs")
        outs = self.run([EmbedRequest(x, p) for x, p in zip(inputs, params)], use_tqdm)
        return np.stack([o.embedding for o in outs])

    def run(self, requests: list, use_tqdm: bool = True) -> list:
        """Serve a mix of GenerateRequest and EmbedRequest together in heterogeneous steps;
        outputs (RequestOutput / EmbeddingOutput) come back in input order."""
        reqs = self.add(requests)
        bar = tqdm(total=len(reqs), desc="requests", unit="req", disable=not use_tqdm)
        start, tokens0 = time.perf_counter(), self.stats.generated_tokens
        try:
            while self.has_work():
                bar.update(len(self.step()))
                rate = (self.stats.generated_tokens - tokens0) / (time.perf_counter() - start)
                bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)
        finally:
            bar.close()
            for req in reqs:
                self.abort(req.request_id)  # no-op for finished ones
        return [self.output(req) for req in reqs]

    # -- step-wise interface (AsyncEngine drives it) -----------------------------------------
    def add(self, requests: list) -> list:
        """Validate every request, then queue them all; returns their `Request` handles.

        A bad request raises before anything is queued, so the others are not half-added.
        """
        return self.enqueue(self.prepare(requests))

    def prepare(self, requests: list) -> list:
        """Validate and tokenize requests into `Request` handles without queueing them."""
        return [self._make_request(i, r) for i, r in enumerate(requests)]

    def enqueue(self, reqs: list) -> list:
        """Queue prepared handles (between steps); returns them."""
        for req in reqs:
            if req.is_embed and self.encoder:
                self._encoder_queue.append(req)
            else:
                self.scheduler.add(req)
        return reqs

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._encoder_queue)

    def step(self) -> list:
        """One separate-encoder batch (if any is queued) and one decoder step (if any work);
        returns the requests that finished."""
        finished = self._encoder_batch() if self._encoder_queue else []
        if self.scheduler.has_work():
            finished += self._decoder_step()
        return finished

    def abort(self, request_id) -> None:
        """Drop a request wherever it is, freeing its pages and pooler slot."""
        self._encoder_queue = collections.deque(
            r for r in self._encoder_queue if r.request_id != request_id)
        self.scheduler.abort(request_id)
        self.runner.release(request_id)

    def _decoder_step(self) -> list:
        """One scheduled step on the decoder; returns the requests that finished."""
        out = self.scheduler.schedule()
        assert out.items, "scheduler produced an empty step while requests are pending"
        runner_out = self.runner.execute(out)
        now = time.perf_counter()
        for rid in list(runner_out.sampled) + list(runner_out.embeddings):
            req = self.scheduler.requests[rid]
            req.first_token_time = req.first_token_time or now
        finished = self.scheduler.update(out, runner_out)
        for req in finished:
            req.finish_time = now
        self._account(out, runner_out)
        return finished

    def _encoder_batch(self) -> list:
        """One batch of queued embedding requests on the separate encoder."""
        n = min(len(self._encoder_queue), self.encoder.runner.batch_buckets[-1])
        reqs = [self._encoder_queue.popleft() for _ in range(n)]
        vectors = self.encoder.runner.embed(
            [r.prompt_token_ids for r in reqs], [POOLING_KINDS[r.payload.kind] for r in reqs],
            [r.payload.normalize for r in reqs])
        now = time.perf_counter()
        for req, vec in zip(reqs, vectors):
            req.embedding, req.finish_reason, req.finish_time = vec, "embedded", now
        return reqs

    def _account(self, out, runner_out) -> None:
        s = self.stats
        s.steps += 1
        s.scheduled_tokens += out.num_tokens
        s.generated_tokens += len(runner_out.sampled)
        s.step_time_s += runner_out.step_time
        s.preemptions += len(out.preempted)
        s.compiles, s.compile_s = self.runner.compiles, self.runner.compile_s

    # -- requests ----------------------------------------------------------------------------
    @staticmethod
    def _tokenize(index: int, text, tokenizer, vocab: int, kind: str) -> list:
        """A string or token-id list -> checked token ids; `kind` names it in errors."""
        if isinstance(text, str):
            if tokenizer is None:
                raise ValueError(f"{kind} {index} is a string but the model has no tokenizer; "
                                 "pass token ids")
            ids = tokenizer.encode(text) if text else []
        else:
            ids = [int(t) for t in text]
        if not ids:
            raise ValueError(f"{kind} {index} is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{kind} {index}: token id {bad[0]} outside [0, {vocab})")
        return ids

    def _make_request(self, index: int, r) -> Request:
        rid, self._next_id = self._next_id, self._next_id + 1
        if isinstance(r, EmbedRequest):
            return self._make_embed_request(index, rid, r)
        if not isinstance(r, GenerateRequest):
            raise ValueError(f"request {index} is a {type(r).__name__}; expected "
                             "GenerateRequest or EmbedRequest")
        sp = r.params
        if sp.logprobs is not None and sp.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={sp.logprobs} exceeds max_logprobs={self.config.max_logprobs}")
        ids = self._tokenize(index, r.prompt, self.tokenizer, self.model_cfg.vocab_size, "prompt")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; max_model_len="
                             f"{self.config.max_model_len} leaves no room to generate")
        eos = () if sp.ignore_eos else self.model_cfg.eos_token_ids
        seed = sp.seed if sp.seed is not None else default_seed(self.config.seed, rid)
        return Request(request_id=rid, prompt_token_ids=ids, max_tokens=sp.max_tokens,
                       stop_token_ids=frozenset(sp.stop_token_ids) | frozenset(eos),
                       arrival_time=time.perf_counter(),
                       payload=GenKnobs(sp.temperature, sp.top_k, sp.top_p, seed, sp.logprobs))

    def _make_embed_request(self, index: int, rid: int, r: EmbedRequest) -> Request:
        pp = r.params
        if self.encoder:
            tokenizer, limit = self.encoder.tokenizer, self.encoder.runner.max_len
            vocab = self.encoder.runner.cfg.vocab_size
            pooling, normalize = self.encoder.pooling, self.encoder.normalize
        else:
            tokenizer, limit = self.tokenizer, self.config.max_model_len
            vocab = self.model_cfg.vocab_size
            pooling, normalize = "mean", True
        ids = self._tokenize(index, r.input, tokenizer, vocab, "input")
        if len(ids) > limit:
            if not pp.truncate:
                raise ValueError(f"input {index} has {len(ids)} tokens > the embedding limit "
                                 f"{limit} (PoolingParams(truncate=True) keeps the first ones)")
            ids = ids[:limit]
        pooling = pp.pooling or pooling
        normalize = normalize if pp.normalize is None else pp.normalize
        if pooling == "buffered" and (self.encoder or self.config.buffered_head is None):
            raise ValueError(f"input {index}: pooling='buffered' needs "
                             "EngineConfig(buffered_head=...) and the decoder as embedding model")
        return Request(request_id=rid, prompt_token_ids=ids, kind=EMBED,
                       arrival_time=time.perf_counter(),
                       payload=EmbedKnobs(POOLING_KINDS.index(pooling), normalize,
                                          self._adapter_id(index, pp.adapter)))

    def _adapter_id(self, index: int, name: str | None) -> int:
        """The adapter id of an embedding request: its named adapter, else the first one."""
        if name is None:
            return 1 if self.adapter_ids else 0
        if name not in self.adapter_ids:
            raise ValueError(f"input {index}: unknown adapter {name!r}; loaded: "
                             f"{sorted(self.adapter_ids) or 'none'}")
        return self.adapter_ids[name]

    def output(self, req: Request):
        """The user-facing output of a (finished) request handle."""
        if req.is_embed:
            latency = None if req.finish_time is None else req.finish_time - req.arrival_time
            return EmbeddingOutput(req.request_id, req.prompt_token_ids, req.embedding,
                                   req.finish_reason, dict(arrival_time=req.arrival_time,
                                                           finish_time=req.finish_time,
                                                           latency_s=latency))
        k = req.payload.logprobs
        logprobs = None if k is None else [
            {"logprob": t.logprob, "top": list(zip(t.top_token_ids[:k], t.top_logprobs[:k]))}
            for t in req.output_logprobs]
        text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer else None
        ftt, fin = req.first_token_time, req.finish_time
        metrics = dict(arrival_time=req.arrival_time, first_token_time=ftt, finish_time=fin,
                       ttft_s=None if ftt is None else ftt - req.arrival_time,
                       latency_s=None if fin is None else fin - req.arrival_time,
                       preemptions=req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                             text, req.finish_reason, logprobs, metrics)
