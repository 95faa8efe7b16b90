"""Engine configuration (static, hashable): the knobs, checked, and what is derived from them.

Every jitted step sees shapes from the bucket lists here: total tokens T, sequences S,
multi-token sequences Sc, and pages per sequence, padded by the one step-shape rule
(`sched/shapes.py`). `variants()` enumerates every reachable combination, so
`Engine.warmup()` can compile every one up front (`warmup="all"`; on a CPU it is lazy by
default: each step compiles the variant it meets). The token budget, unless given, comes from
the step-cost model the engine knows (`cost_model`, `step_model`; `resolve()` sizes it).
`scheduler_config()` is the host scheduler's share of a resolved config, built in one place.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hetero_jax.requests import INT32_MAX, require_bool, require_int, require_real
from hetero_jax.sched.batching import FeatherConfig, check_batching
from hetero_jax.sched.costmodel import StepCost, engine_budget, engine_cost_model, \
    known_cost_model
from hetero_jax.sched.scheduler import SchedulerConfig
from hetero_jax.sched.shapes import Buckets, default_seq_buckets, powers_of_two
from hetero_jax.sched.tiles import CascadeSettings, kernel_block_rows

_DTYPES = ("auto", "float32", "bfloat16")
# The smallest default token bucket on a jax backend (else 16). XLA:CPU's few-row matmuls cost
# in proportion to their rows past about 4 (a 768 x 3072 weight: 22.6 GB/s at 8 rows, 17.6 at
# 16), so a decode step of up to 8 sequences runs at 8 rows there; a GPU's tensor-core tiles
# are 16 rows, where 8 would only add variants. docs/results.md, "Token bucket 8 on a CPU".
SMALLEST_TOKEN_BUCKET = {"cpu": 8}
_ITEMSIZE = {"float32": 4, "bfloat16": 2}  # bytes per weight and KV element of each dtype


def size_relation(token_budget: int, chunk_size: int, max_num_seqs: int,
                  max_chunk_seqs: int) -> tuple | None:
    """(the field at fault, why) for the first broken relation between a step's sizes, or
    None; the one check `EngineConfig` and the bench's flags share."""
    if chunk_size > token_budget:
        return "chunk_size", f"chunk_size={chunk_size} exceeds token_budget={token_budget}"
    if max_chunk_seqs > max_num_seqs:
        return "max_chunk_seqs", (f"max_chunk_seqs={max_chunk_seqs} exceeds "
                                  f"max_num_seqs={max_num_seqs}")
    return None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # None: from the step-cost model the engine knows (`cost_model`; `sched.costmodel.
    # engine_budget`: the model's ridge budget, at most 512), else 256
    token_budget: int | None = None
    chunk_size: int | None = None  # None: min(64, token_budget), or a quarter of a larger one
    max_num_seqs: int = 32
    max_chunk_seqs: int | None = None  # None: min(4, max_num_seqs)
    page_size: int = 16
    num_pages: int | None = None  # None: enough for max_num_seqs sequences, capped by kv_cache_gib
    kv_cache_gib: float = 2.0
    max_model_len: int | None = None  # None: min(model's max positions, 2048)
    # Weights and KV cache: "auto" is bfloat16 on GPUs (tensor cores, half the bytes) and
    # float32 elsewhere (XLA:CPU runs 16-bit gathers through float32 copies). float32 on a GPU
    # runs matmuls as TF32 unless jax's default matmul precision asks for "highest".
    dtype: str = "auto"
    max_logprobs: int = 5
    scheduler: str = "fcfs"
    # Which generation requests are admitted and decode together (sched/batching.py), apart
    # from `scheduler` (embedding vs generation tokens): fcfs | lpm | feather | feather-bandit.
    batching: str = "fcfs"
    feather: FeatherConfig = FeatherConfig()  # chunk_pages, loss limit, cap, aging, bandit arms
    # A step-cost model: a cost model JSON path as scripts/calibrate.py writes,
    # "roofline:<a100-40gb|h200>" of this model, an object with step_time(StepShape), "auto"
    # (the one the engine knows: `sched.costmodel.known_cost_model`, the roofline of this model
    # on an A100-40GB or H200, the shipped fit of the small preset on a CPU) or None. It sizes
    # the default token budget and, with scheduler="ibs", turns on the cost-aware IBS: a mixed
    # step runs as two when the model says two cost less.
    cost_model: object = "auto"
    attention_impl: str = "auto"  # auto | xla | pallas
    layer_loop: str = "auto"  # auto (unrolled: scan copies each layer's weights) | scan | unrolled
    # Devices the decoder is split over (Megatron layout on a one-axis mesh, runner/sharding.py;
    # the XLA attention): 1 runs on the default device. The model must divide by it.
    tensor_parallel: int = 1
    # None: powers of two up to token_budget from 8 on a CPU, 16 elsewhere (`resolve`)
    token_buckets: tuple | None = None
    seq_buckets: tuple | None = None  # None: powers of two from 8 up to max_num_seqs
    # The default bucket lists keep the variants few (111 on a CPU, each ~2 s of compile
    # there; 106 elsewhere): pages in powers of four from 8 (128 tokens) up, and chunk slots 0
    # (a decode-only step) or all of them (one chunk pads to max_chunk_seqs, which costs a
    # fresh chunk's few keys, where a third Sc bucket would add a third of the variants).
    page_buckets: tuple | None = None  # None: powers of four from 8 up to max_model_len pages
    chunk_seq_buckets: tuple | None = None  # None: (0, max_chunk_seqs)
    seed: int = 0
    prefix_caching: bool = True  # reuse the K/V (and pooler sums) of cached prompt prefixes
    # Schedule and pack step N+1 while step N runs on the device, as vLLM's async scheduling
    # (serving/overlap.py); the results are the same, False runs every step in sequence.
    async_scheduling: bool = True
    # Cascade attention: decode sequences sharing pages are cut into tiles that read the shared
    # pages once; a step uses it when the tiles save at least `cascade_min_pages` page reads.
    # XLA: decode-only steps, tiles of `cascade_rows`. Pallas: any step, tiles as long as the
    # sharing runs (their size is data, not a variant). cascade_rows=0 turns it off.
    cascade_rows: int = 8
    cascade_min_pages: int = 16
    # What `Engine.warmup()` compiles: "all" (every variant of `variants()`), "lazy" (none: each
    # step compiles its variant when a run first meets it, announced "compiling step variant
    # k/N"), or "auto": lazy on a CPU, all elsewhere. XLA:CPU spends 3-9 CPU-s on each of the
    # small preset's 111 variants (5-16 minutes of warm-up on 2 cores), of which a run meets a
    # few (the main job 7, the bench's three mixed ratios 9 of its 60: docs/results.md).
    warmup: str = "auto"
    # JAX's persistent compilation cache (process-wide; the first directory set holds):
    # "auto" keeps the one already set, else $XDG_CACHE_HOME/hetero-jax/xla (~/.cache/...);
    # a directory; or None to leave jax as it is. A second process of the same configuration
    # then compiles nothing in warmup().
    compile_cache: str | None = "auto"
    # buffered_head(hidden [max_model_len, d], length) -> [d]: a jittable function of all of an
    # embedding input's hidden states (rows past `length` are stale), for PoolingParams(
    # pooling="buffered"). Enabling it keeps max_num_seqs x max_model_len x d floats on device.
    buffered_head: Callable | None = None

    def __post_init__(self):
        if self.max_chunk_seqs is None:  # a default never conflicts with a knob set
            object.__setattr__(self, "max_chunk_seqs", min(4, require_int(
                "max_num_seqs", self.max_num_seqs, 1, INT32_MAX)))
        if self.token_budget is not None:
            self._fill_chunk_size()
        for name, lo in (("max_num_seqs", 1), ("max_chunk_seqs", 1), ("page_size", 1),
                         ("max_logprobs", 0), ("cascade_rows", 0), ("cascade_min_pages", 1),
                         ("tensor_parallel", 1)):
            object.__setattr__(self, name, require_int(name, getattr(self, name), lo, INT32_MAX))
        for name, lo in (("token_budget", 1), ("chunk_size", 1), ("num_pages", 2),
                         ("max_model_len", 1)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, require_int(name, getattr(self, name), lo,
                                                           INT32_MAX))
        object.__setattr__(self, "seed", require_int("seed", self.seed, 0, 2**32 - 1))
        if require_real("kv_cache_gib", self.kv_cache_gib) <= 0:
            raise ValueError(f"kv_cache_gib={self.kv_cache_gib!r} must be > 0")
        for name in ("token_buckets", "seq_buckets", "page_buckets", "chunk_seq_buckets"):
            buckets = getattr(self, name)
            if buckets is not None:
                if isinstance(buckets, (str, bytes)) or not isinstance(buckets, (list, tuple)):
                    raise ValueError(f"{name}={buckets!r} must be a tuple of integers")
                if not buckets:
                    raise ValueError(f"{name}={buckets!r} must hold at least one size (None: "
                                     "the defaults)")
                lo = 0 if name == "chunk_seq_buckets" else 1
                object.__setattr__(self, name, tuple(require_int(f"{name}[{i}]", b, lo, INT32_MAX)
                                                     for i, b in enumerate(buckets)))
        for name, choices in (("dtype", _DTYPES), ("layer_loop", ("auto", "scan", "unrolled")),
                              ("warmup", ("auto", "all", "lazy")),
                              ("attention_impl", ("auto", "xla", "pallas"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {choices}")
        require_bool("prefix_caching", self.prefix_caching)
        require_bool("async_scheduling", self.async_scheduling)
        if self.compile_cache is not None and (not isinstance(self.compile_cache, str)
                                               or not self.compile_cache):
            raise ValueError(f"compile_cache={self.compile_cache!r} must be 'auto', a directory "
                             "or None")
        if not isinstance(self.scheduler, str):
            raise ValueError(f"scheduler={self.scheduler!r} must be a policy name (a string)")
        check_batching(self.batching)
        self._check_sizes()
        if not isinstance(self.feather, FeatherConfig):
            raise ValueError(f"feather={self.feather!r} must be a sched.FeatherConfig")
        if self.buffered_head is not None and not callable(self.buffered_head):
            raise ValueError(f"buffered_head={self.buffered_head!r} must be a function or None")
        if self.cost_model is not None and not (
                (isinstance(self.cost_model, str) and self.cost_model)
                or callable(getattr(self.cost_model, "step_time", None))):
            raise ValueError(f"cost_model={self.cost_model!r} must be 'auto', None, a cost model "
                             "JSON path, 'roofline:<hardware>' or an object with "
                             "step_time(StepShape)")

    def _fill_chunk_size(self) -> None:
        """chunk_size, when None, from the budget: 64 (at most the budget), or a quarter of a
        budget above 256 (the simulator's rule)."""
        if self.chunk_size is None:
            budget = require_int("token_budget", self.token_budget, 1, INT32_MAX)
            object.__setattr__(self, "chunk_size", max(min(64, budget), budget // 4))

    def _check_sizes(self) -> None:
        """The sizes' relations; with the budget still None (resolve() fills it, at least the
        chunk), those not about the budget."""
        chunk = self.chunk_size or 1
        relation = size_relation(chunk if self.token_budget is None else self.token_budget,
                                 chunk, self.max_num_seqs, self.max_chunk_seqs)
        if relation:
            raise ValueError(relation[1])

    def step_model(self, model_cfg, backend: str, device_kind: str):
        """The step-cost model of `cost_model` for `model_cfg` on a device (jax `backend`,
        `device_kind`; `dtype` concrete), as an object with step_time(StepShape), or None."""
        assert self.dtype in _ITEMSIZE, f"{self.dtype=}: the cost model needs it concrete"
        if self.cost_model == "auto":
            return known_cost_model(model_cfg, backend, device_kind, _ITEMSIZE[self.dtype])
        if self.cost_model is None:
            return None
        return engine_cost_model(self.cost_model, model_cfg, _ITEMSIZE[self.dtype])

    def dtype_on(self, backend: str) -> str:
        """The concrete dtype on a jax `backend` ("cpu", "gpu", "tpu"): `dtype` unless "auto"."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if backend in ("gpu", "cuda", "rocm") else "float32"

    def impl_on(self, backend: str) -> str:
        """The attention on a jax `backend`: `attention_impl` unless "auto" (the Pallas kernel
        on GPUs, XLA elsewhere)."""
        if self.attention_impl != "auto":
            return self.attention_impl
        return "pallas" if backend in ("gpu", "cuda", "rocm") else "xla"

    def warmup_on(self, backend: str) -> str:
        """What warm-up compiles on a jax `backend`: `warmup` unless "auto" (lazy on a CPU,
        whose compiles are slow and whose bucket lists are long; all elsewhere)."""
        if self.warmup != "auto":
            return self.warmup
        return "lazy" if backend == "cpu" else "all"

    def warmup_variants(self) -> list:
        """The variants `Engine.warmup()` builds with a resolved `warmup` ("all": every one of
        `variants()`; "lazy": none, the steps build what they meet)."""
        assert self.warmup != "auto", "warmup_variants() of an unresolved config: warmup_on()"
        return self.variants() if self.warmup == "all" else []

    def resolve(self, model_max_len: int, kv_bytes_per_token: int,
                backend: str | None = None) -> "EngineConfig":
        """Fill every None from the model: token_budget (`engine_budget` of `cost_model` where
        the engine made it a model, `step_model`; at least chunk_size), max_model_len,
        num_pages and the bucket lists (the token buckets from `SMALLEST_TOKEN_BUCKET` of the
        jax `backend` the engine runs on; None: 16). With
        attention_impl="pallas" the default page buckets are one (pages_per_seq): the kernel
        loops over each sequence's pages, so a page table's width costs it nothing and a
        bucket per width would only multiply the variants (17 instead of 106 by default)."""
        if self.token_budget is None:
            known = self.cost_model if hasattr(self.cost_model, "step_time") else None
            budget = max(engine_budget(known), self.chunk_size or 1)
            return dataclasses.replace(self, token_budget=budget).resolve(
                model_max_len, kv_bytes_per_token, backend)
        max_len = min(model_max_len, 2048) if self.max_model_len is None else self.max_model_len
        if max_len > model_max_len:
            raise ValueError(f"max_model_len={max_len} exceeds the model's {model_max_len}")
        pages_per_seq = -(-max_len // self.page_size)
        num_pages = self.num_pages
        if num_pages is None:
            cap = int(self.kv_cache_gib * 2**30 // (kv_bytes_per_token * self.page_size))
            num_pages = max(min(self.max_num_seqs * pages_per_seq, cap), pages_per_seq) + 1
        if num_pages <= pages_per_seq:
            raise ValueError(f"num_pages={num_pages} must exceed the {pages_per_seq} pages "
                             f"of one max_model_len={max_len} sequence (page 0 is scratch)")
        smallest = min(SMALLEST_TOKEN_BUCKET.get(backend, 16), self.token_budget)
        tokens = self.token_buckets or powers_of_two(smallest, self.token_budget)
        cfg = dataclasses.replace(
            self, max_model_len=max_len, num_pages=num_pages,
            token_buckets=tuple(sorted(tokens)),
            seq_buckets=tuple(sorted(self.seq_buckets or default_seq_buckets(self.max_num_seqs))),
            page_buckets=tuple(sorted(self.page_buckets or (
                (pages_per_seq,) if self.attention_impl == "pallas" else powers_of_two(
                    min(8, pages_per_seq), pages_per_seq, factor=4)))),
            chunk_seq_buckets=tuple(sorted(self.chunk_seq_buckets or {0, self.max_chunk_seqs})))
        for name, need in (("token_buckets", self.token_budget), ("seq_buckets", self.max_num_seqs),
                           ("page_buckets", pages_per_seq),
                           ("chunk_seq_buckets", self.max_chunk_seqs)):
            if getattr(cfg, name)[-1] < need:
                raise ValueError(f"{name}={getattr(cfg, name)} must reach {need}")
        return cfg

    def buckets(self) -> Buckets:
        """The bucket lists of a resolved config, for the step-shape rule (`sched/shapes.py`)."""
        assert self.token_buckets is not None, "buckets() of an unresolved config: resolve() it"
        return Buckets(self.token_buckets, self.seq_buckets, self.page_buckets,
                       self.chunk_seq_buckets)

    def tiles_as_data(self) -> bool:
        """Whether every step carries its cascade tiles as arrays (`ops.cascade.TileList`: the
        Pallas kernel, tiles planned in any step) rather than a cascade step being a variant
        of its own (XLA: decode-only steps)."""
        return self.attention_impl == "pallas" and self.cascade_rows > 0

    def cascade_settings(self, model_cfg=None) -> CascadeSettings:
        """The cascade knobs with this config's sequence buckets (unresolved and unset: the
        default buckets of max_num_seqs, as resolve() would fill them); with `model_cfg` on
        the Pallas kernel, the tile members one program serves (what a read saves)."""
        data = self.tiles_as_data()
        block = kernel_block_rows(model_cfg.num_heads, model_cfg.num_kv_heads) if (
            data and model_cfg is not None) else 0
        return CascadeSettings(self.cascade_rows, self.cascade_min_pages, self.max_num_seqs,
                               self.seq_buckets, planned=data, mixed=data, block_rows=block)

    def cascade_tiles(self, s: int) -> tuple:
        """(tiles G, rows M) of a cascade step with S sequence slots."""
        return self.cascade_settings().tiles(s)

    def variants(self) -> list:
        """Every reachable (T, S, Sc, pages_per_seq, second_pages), and no other
        (`sched.shapes.Buckets.variants`; the chunk group's own page bucket adds 28 variants
        for the defaults, where every bucket below pages_per_seq would add 42)."""
        return self.buckets().variants(self.token_budget, self.chunk_size, self.max_num_seqs,
                                       self.max_chunk_seqs,
                                       self.cascade_rows > 0 and not self.tiles_as_data())

    def scheduler_config(self, model_cfg=None, encoder_max_seqs: int = 0) -> SchedulerConfig:
        """The host scheduler's settings of a resolved config: its sizes, policies, cascade
        planning and, with scheduler="ibs" and a `cost_model` ("auto" counts as none here: the
        engine makes it concrete, `step_model`), the step cost of `model_cfg` (a `ModelConfig`,
        for "roofline:<hardware>"; then `dtype` must be concrete, `dtype_on`).
        `encoder_max_seqs` > 0: a separate encoder's rows per step."""
        assert self.num_pages is not None, "scheduler_config() of an unresolved config"
        cascade, step_cost = self.cascade_settings(model_cfg), None
        if self.cost_model not in (None, "auto") and self.scheduler == "ibs":
            model = self.step_model(model_cfg, "", "")
            step_cost = StepCost(model, self.page_size, cascade)
        return SchedulerConfig(
            token_budget=self.token_budget, chunk_size=self.chunk_size,
            max_num_seqs=self.max_num_seqs, max_chunk_seqs=self.max_chunk_seqs,
            page_size=self.page_size, num_pages=self.num_pages, max_model_len=self.max_model_len,
            policy=self.scheduler, encoder_max_seqs=encoder_max_seqs,
            prefix_caching=self.prefix_caching, batching=self.batching, feather=self.feather,
            cascade=cascade if self.cascade_rows else None, step_cost=step_cost)


def config_or_default(config: EngineConfig | None) -> EngineConfig:
    """`config`, or `EngineConfig()` when None: the one place a missing config is defaulted."""
    return EngineConfig() if config is None else config
