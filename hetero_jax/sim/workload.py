"""Simulated workloads: the request mix, length distributions and the arrival process.

In: a `WorkloadConfig`. Out: `RequestSpec`s (kind, input length, output length) in issue
order and, for open arrivals, their arrival times. Closed loops (N clients, each issuing its
next request when the previous one finishes) get their times from the simulator.
Length specs: `128` (fixed), `96,224` (uniform choice), `96:0.55,224:0.45` (weighted choice),
`64-256` (uniform integer range).
"""
from __future__ import annotations

import dataclasses
import random

from hetero_jax.sched.request import EMBED, GENERATE

ARRIVALS = ("poisson", "closed", "burst")
ORDERS = ("mixed", "gen-first", "embed-first")


@dataclasses.dataclass(frozen=True)
class LengthDist:
    values: tuple = (128,)
    weights: tuple = ()  # empty: uniform over values
    span: tuple = ()  # (lo, hi): uniform integer range instead of values

    @classmethod
    def parse(cls, spec: str | int) -> "LengthDist":
        spec = str(spec).replace(" ", "")
        try:
            if "-" in spec:
                lo, hi = (int(x) for x in spec.split("-"))
                dist = cls(span=(lo, hi))
            elif ":" in spec:
                pairs = [p.split(":") for p in spec.split(",")]
                dist = cls(tuple(int(v) for v, _ in pairs), tuple(float(w) for _, w in pairs))
            else:
                dist = cls(tuple(int(v) for v in spec.split(",")))
        except ValueError as e:
            raise ValueError(f"bad length spec {spec!r}: {e}") from None
        lows = dist.span[:1] or dist.values
        if min(lows) < 1 or (dist.span and dist.span[1] < dist.span[0]):
            raise ValueError(f"bad length spec {spec!r}: lengths must be >= 1 and lo <= hi")
        return dist

    def sample(self, rng: random.Random) -> int:
        if self.span:
            return rng.randint(*self.span)
        if self.weights:
            return rng.choices(self.values, self.weights)[0]
        return rng.choice(self.values)

    @property
    def mean(self) -> float:
        if self.span:
            return sum(self.span) / 2
        weights = self.weights or (1.0,) * len(self.values)
        return sum(v * w for v, w in zip(self.values, weights)) / sum(weights)


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 200
    embed_frac: float = 0.2
    gen_prompt: LengthDist = LengthDist((128,))
    gen_output: LengthDist = LengthDist((256,))
    embed_len: LengthDist = LengthDist((96, 224), (0.55, 0.45))
    arrival: str = "poisson"  # poisson | closed | burst (everything at time 0)
    rate: float = 10.0  # requests per second, poisson
    clients: int = 32  # closed loop
    order: str = "mixed"  # mixed (shuffled) | gen-first | embed-first
    seed: int = 0

    def __post_init__(self):
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival={self.arrival!r}; expected one of {ARRIVALS}")
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r}; expected one of {ORDERS}")
        if not 0 <= self.embed_frac <= 1:
            raise ValueError(f"embed_frac={self.embed_frac} must be in [0, 1]")
        if self.num_requests < 1 or self.rate <= 0 or self.clients < 1:
            raise ValueError("num_requests, rate and clients must be positive")


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    kind: str  # EMBED | GENERATE
    input_len: int
    max_tokens: int  # 0 for an embedding


def request_specs(cfg: WorkloadConfig) -> list:
    """The requests in issue order: `round(n * embed_frac)` embeddings, placed by `order`."""
    rng = random.Random(cfg.seed)
    n_embed = round(cfg.num_requests * cfg.embed_frac)
    kinds = [GENERATE] * (cfg.num_requests - n_embed) + [EMBED] * n_embed
    if cfg.order == "mixed":
        rng.shuffle(kinds)
    elif cfg.order == "embed-first":
        kinds.reverse()
    return [RequestSpec(EMBED, cfg.embed_len.sample(rng), 0) if k == EMBED else
            RequestSpec(GENERATE, cfg.gen_prompt.sample(rng), cfg.gen_output.sample(rng))
            for k in kinds]


def arrival_times(cfg: WorkloadConfig) -> list:
    """Arrival time of each request for open arrivals (poisson, burst); closed loops: []."""
    if cfg.arrival == "burst":
        return [0.0] * cfg.num_requests
    if cfg.arrival == "closed":
        return []
    rng, t, out = random.Random(cfg.seed + 1), 0.0, []
    for _ in range(cfg.num_requests):
        out.append(t)
        t += rng.expovariate(cfg.rate)
    return out
