"""Step-time cost models: how long one scheduled step takes on a device (the simulator's,
`hetero_jax/sim`, and the engine's cost-aware IBS: one jax-free module that both import).

In: a `StepShape` (token counts by item kind, sequences, cached context read, attention
query-key pairs, sampled rows), computed from a `SchedulerOutput`. Out: seconds. Imports no jax.

Attention is charged by the KV actually read: every sequence reads its whole context, except
that under cascade attention (`from_output(..., cascade=...)`, `tiles.py`: decode-only steps,
or any step's decodes with `CascadeSettings.mixed`) the pages a tile of sequences shares are
read once for the tile
(`shared_kv_tokens` are the reads saved). Both cost models read `kv_read_tokens` (the linear
model as its `context_tokens` feature).

- `RooflineCostModel` (b): max(FLOPs / (peak * mfu), bytes / (bandwidth * mbu)) + a fixed
  per-step overhead, from a `ModelSpec` (layer shapes) and a `Hardware` (A100-40GB, H200).
- `LinearCostModel` (a): an intercept plus a coefficient per step feature, read from JSON:
  `{"type": "linear", "intercept_s": 1e-3, "coef_s": {"tokens": 2e-5, "context_tokens": 1e-8},
  "token_buckets": [16, 32, 64, 128, 256]}`; with `token_buckets` the `tokens` feature is
  padded to its bucket, as the engine pads a step. `scripts/calibrate.py` fits it to the
  engine's step times measured on this machine (extra keys such as `fit` are ignored).

`StepCost` wraps either as the plain `SchedulerOutput -> seconds` callable that the
scheduler's cost-aware IBS takes (`SchedulerConfig.step_cost`, `EngineConfig.cost_model`).
`known_cost_model` is the one the engine knows for its model and device (a GPU's roofline, the
shipped CPU fit), and `engine_budget` the token budget it derives from it (`ridge_budget`,
capped), as the simulator derives its own.
"""
from __future__ import annotations

import dataclasses
import json
import os

from hetero_jax.sched.output import DECODE, EMBED, PREFILL, SchedulerOutput
from hetero_jax.sched.tiles import CascadeSettings, kv_pages_saved

FEATURES = ("tokens", "embed_tokens", "prefill_tokens", "decode_tokens", "seqs",
            "context_tokens", "attn_pairs", "sampled")


@dataclasses.dataclass(frozen=True)
class StepShape:
    embed_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seqs: int = 0
    context_tokens: int = 0  # sum over sequences of the KV length read (cached + new)
    attn_pairs: int = 0  # causal query-key pairs: sum of n * start + n * (n + 1) / 2
    sampled: int = 0  # rows that go through the LM head
    shared_kv_tokens: int = 0  # context reads cascade attention saves (shared pages read once)

    @property
    def tokens(self) -> int:
        return self.embed_tokens + self.prefill_tokens + self.decode_tokens

    @property
    def kv_read_tokens(self) -> int:
        """KV tokens the attention reads (per sequence, less what a cascade tile shares)."""
        return self.context_tokens - self.shared_kv_tokens

    @classmethod
    def from_output(cls, out: SchedulerOutput, page_size: int = 16,
                    cascade: CascadeSettings | None = None) -> "StepShape":
        """The shape of a step; with `cascade`, the shared pages of the decodes it plans
        count once per tile (as the engine reads them)."""
        by_kind = {EMBED: 0, PREFILL: 0, DECODE: 0}
        context = pairs = sampled = 0
        for it in out.items:
            n, s = it.num_tokens, it.start
            by_kind[it.kind] += n
            context += s + n
            pairs += n * s + n * (n + 1) // 2
            sampled += it.samples
        saved = page_size * kv_pages_saved(out.items, page_size, cascade)
        return cls(by_kind[EMBED], by_kind[PREFILL], by_kind[DECODE], len(out.items), context,
                   pairs, sampled, saved)

    def features(self) -> dict:
        return {"tokens": self.tokens, "embed_tokens": self.embed_tokens,
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                "seqs": self.seqs, "context_tokens": self.kv_read_tokens,
                "attn_pairs": self.attn_pairs, "sampled": self.sampled}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shapes that set a decoder's FLOPs and bytes per step (LLaMA/Mistral layout)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    bytes_per_param: int = 2  # bf16

    @property
    def layer_params(self) -> int:
        d, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.num_layers * (2 * d * q + 2 * d * kv + 3 * d * self.intermediate_size)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    @classmethod
    def from_config(cls, cfg, name: str = "custom", bytes_per_param: int = 2) -> "ModelSpec":
        """From any object with the fields of `hetero_jax.models.config.ModelConfig`."""
        return cls(name, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                   cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, bytes_per_param)


MODELS = {m.name: m for m in (
    ModelSpec("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32000),
    ModelSpec("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256),
    ModelSpec("small", 12, 768, 3072, 12, 4, 64, 512),  # the engine's `small` preset
)}


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    bandwidth: float  # HBM bytes/s
    memory_bytes: float
    mfu: float = 0.6  # achievable fraction of peak FLOP/s
    mbu: float = 0.8  # achievable fraction of peak bandwidth
    step_overhead_s: float = 2e-4  # launch, host and sampling overhead per step
    l2_bytes: float = 0.0  # the L2 cache (the simulator's locality what-if, `--l2-share`)


HARDWARE = {h.name: h for h in (
    Hardware("a100-40gb", 312e12, 1.555e12, 40e9, l2_bytes=40 * 2**20),
    Hardware("h200", 989e12, 4.8e12, 141e9, l2_bytes=50 * 2**20),
)}


@dataclasses.dataclass(frozen=True)
class RooflineCostModel:
    model: ModelSpec
    hardware: Hardware

    def flops(self, s: StepShape) -> float:
        m = self.model
        attn = 4 * m.num_layers * m.num_heads * m.head_dim * s.attn_pairs
        return 2 * m.layer_params * s.tokens + 2 * m.hidden_size * m.vocab_size * s.sampled + attn

    def bytes(self, s: StepShape) -> float:
        m = self.model
        weights = m.layer_params + (m.hidden_size * m.vocab_size if s.sampled else 0)
        return weights * m.bytes_per_param + m.kv_bytes_per_token * (s.kv_read_tokens + s.tokens)

    def step_time(self, s: StepShape) -> float:
        if s.tokens == 0:
            return 0.0
        hw = self.hardware
        compute = self.flops(s) / (hw.peak_flops * hw.mfu)
        memory = self.bytes(s) / (hw.bandwidth * hw.mbu)
        return max(compute, memory) + hw.step_overhead_s

    def describe(self) -> str:
        return f"roofline {self.hardware.name} / {self.model.name}"


@dataclasses.dataclass(frozen=True)
class LinearCostModel:
    intercept_s: float
    coef_s: tuple  # ((feature, seconds per unit), ...)
    token_buckets: tuple = ()
    source: str = ""

    def __post_init__(self):
        bad = [f for f, _ in self.coef_s if f not in FEATURES]
        if bad:
            raise ValueError(f"unknown cost features {bad}; expected some of {FEATURES}")

    def step_time(self, s: StepShape) -> float:
        if s.tokens == 0:
            return 0.0
        feats = s.features()
        if self.token_buckets:
            feats["tokens"] = next((b for b in self.token_buckets if b >= s.tokens), s.tokens)
        return self.intercept_s + sum(c * feats[f] for f, c in self.coef_s)

    @classmethod
    def from_dict(cls, d: dict) -> "LinearCostModel":
        return cls(float(d.get("intercept_s", 0.0)), tuple(sorted(d.get("coef_s", {}).items())),
                   tuple(sorted(d.get("token_buckets", ()))), str(d.get("source", "")))

    def to_dict(self) -> dict:
        return {"type": "linear", "intercept_s": self.intercept_s, "coef_s": dict(self.coef_s),
                "token_buckets": list(self.token_buckets), "source": self.source}

    def describe(self) -> str:
        return f"linear ({self.source or 'json'})"


def load_cost_model(spec: str, model: str = "mistral-7b"):
    """`roofline:<hardware>` (a100-40gb | h200) for `model`, or the path of a JSON file."""
    if spec.startswith("roofline:"):
        hw = spec.split(":", 1)[1]
        if hw not in HARDWARE:
            raise ValueError(f"unknown hardware {hw!r}; expected one of {', '.join(HARDWARE)}")
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; expected one of {', '.join(MODELS)}")
        return RooflineCostModel(MODELS[model], HARDWARE[hw])
    with open(spec) as f:
        d = json.load(f)
    if d.get("type") == "roofline":
        return load_cost_model(f"roofline:{d['hardware']}", d.get("model", model))
    if d.get("type") != "linear":
        raise ValueError(f"{spec}: cost model type {d.get('type')!r}; expected 'linear' or 'roofline'")
    return LinearCostModel.from_dict(d)


AMORTIZED = 1 / 8  # a full step's cost per token may exceed the marginal cost by this much


def ridge_budget(model, amortized: float = AMORTIZED, lo: int = 16, hi: int = 8192) -> int:
    """The token budget a cost model asks for: the smallest power of two in [lo, hi] at which
    a full step (prefill tokens, no context) costs at most (1 + `amortized`) x its tokens x
    the marginal cost of a token. Below it a step's fixed part (the weights read of a
    memory-bound step, a CPU step's intercept) is not yet paid off; above it, every token
    more only lengthens the step that each running decode waits for. A roofline reaches it
    at its ridge (about 150 tokens for a 7B bf16 model on an A100 or an H200: 256); a linear
    fit at ridge / `amortized`, its ridge being intercept / cost per token (about 17 tokens
    on this CPU: 256)."""
    def cost(n: int) -> float:
        return model.step_time(StepShape(prefill_tokens=n, seqs=1, context_tokens=n))
    marginal = (cost(2 * hi) - cost(hi)) / hi
    budget = lo
    while budget < hi and cost(budget) > (1 + amortized) * budget * marginal:
        budget *= 2
    return budget


DEFAULT_BUDGET = 256  # the engine's token budget where it knows no cost model
# The engine's largest budget from a cost model: its default buckets then give at most 24
# variants on a GPU (token buckets 16..512: 23 with the Pallas kernel), where the roofline of a
# small model asks for thousands (its per-step overhead is what such a step amortises).
MAX_ENGINE_BUDGET = 512
# The shipped CPU fit (scripts/calibrate.py): the small preset's shapes in float32 on this
# 2-core VM. Absent from an installed wheel, where the CPU then has no known cost model.
CPU_FIT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "calibration", "small-cpu.json")


def engine_budget(model) -> int:
    """The engine's default token budget: `ridge_budget` of the step-cost `model` it knows, at
    most `MAX_ENGINE_BUDGET`; `DEFAULT_BUDGET` where `model` is None."""
    return DEFAULT_BUDGET if model is None else min(ridge_budget(model), MAX_ENGINE_BUDGET)


def gpu_hardware(device_kind: str) -> str | None:
    """The `HARDWARE` name of a jax GPU `device_kind` ("NVIDIA H200", "NVIDIA A100-SXM4-40GB"),
    or None for one without a roofline here."""
    kind = device_kind.upper()
    if "H200" in kind:
        return "h200"
    return "a100-40gb" if "A100" in kind and "40GB" in kind else None


def _same_shapes(a: ModelSpec, b: ModelSpec) -> bool:
    return dataclasses.replace(a, name="", bytes_per_param=0) == dataclasses.replace(
        b, name="", bytes_per_param=0)


def known_cost_model(model_cfg, backend: str, device_kind: str, bytes_per_param: int):
    """The step-cost model the engine knows for `model_cfg` (a `ModelConfig`) on a device, or
    None: on a GPU of `HARDWARE`, the roofline of the model; on a CPU, the shipped fit
    (`CPU_FIT`) for a model of the small preset's shapes in float32."""
    spec = ModelSpec.from_config(model_cfg, "engine", bytes_per_param)
    if backend in ("gpu", "cuda", "rocm"):
        hw = gpu_hardware(device_kind)
        return RooflineCostModel(spec, HARDWARE[hw]) if hw else None
    if (backend == "cpu" and bytes_per_param == 4 and _same_shapes(spec, MODELS["small"])
            and os.path.isfile(CPU_FIT)):
        return load_cost_model(CPU_FIT)
    return None


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A cost model as the callable the scheduler's cost-aware IBS takes
    (`SchedulerConfig.step_cost`): a `SchedulerOutput` -> seconds of its decoder step."""

    model: object  # LinearCostModel | RooflineCostModel: anything with step_time(StepShape)
    page_size: int = 16
    cascade: CascadeSettings | None = None

    def __call__(self, out: SchedulerOutput) -> float:
        return self.model.step_time(StepShape.from_output(out, self.page_size, self.cascade))


def engine_cost_model(spec, model_cfg, bytes_per_param: int):
    """`EngineConfig.cost_model` other than "auto" as a model with `step_time(StepShape)`: such
    an object itself, the path of a cost model JSON file, or `roofline:<hardware>` of the
    engine's own model (`model_cfg`, weights of `bytes_per_param`)."""
    if not isinstance(spec, str):
        return spec
    if spec.startswith("roofline:"):
        hw = spec.split(":", 1)[1]
        if hw not in HARDWARE:
            raise ValueError(f"cost_model={spec!r}: unknown hardware {hw!r}; expected one of "
                             f"{', '.join(HARDWARE)}")
        return RooflineCostModel(ModelSpec.from_config(model_cfg, "engine", bytes_per_param),
                                 HARDWARE[hw])
    return load_cost_model(spec)
