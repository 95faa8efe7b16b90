"""Simulated workloads: the request mix, lengths, token ids and the arrival process.

In: a `WorkloadConfig`. Out: `RequestSpec`s (kind, input token ids, output length) in issue
order and, for open arrivals, their arrival times. Closed loops (N clients, each issuing its
next request when the previous one finishes) get their times from the simulator.
Two workloads: `mixed` (independent requests, lengths from the length specs below) and
`shared-prefix` (groups of requests sharing a prompt prefix, or with `shared=False` the
control with nothing shared). Token ids are random below `vocab_size`, so requests share KV
pages only where the workload shares tokens. The bench builds its engine requests from these
same specs (`bench/workloads.py`), so the bench and `hetero-jax sim` run the same tokens.
Length specs: `128` (fixed), `96,224` (uniform choice), `96:0.55,224:0.45` (weighted choice),
`64-256` (uniform integer range). Imports no jax.
"""
from __future__ import annotations

import dataclasses
import random

from hetero_jax.sched.request import EMBED, GENERATE

ARRIVALS = ("poisson", "closed", "burst")
ORDERS = ("mixed", "gen-first", "embed-first")
WORKLOADS = ("mixed", "shared-prefix")


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
    name: str = "mixed"  # mixed | shared-prefix
    num_requests: int = 200  # mixed (shared-prefix runs groups x prompts_per_group)
    embed_frac: float = 0.2  # of the requests (shared-prefix: of each group's)
    gen_prompt: LengthDist = LengthDist((128,))  # mixed
    gen_output: LengthDist = LengthDist((256,))
    embed_len: LengthDist = LengthDist((96, 224), (0.55, 0.45))  # mixed
    arrival: str = "poisson"  # poisson | closed | burst (everything at time 0)
    rate: float = 10.0  # requests per second, poisson
    clients: int = 32  # closed loop
    order: str = "mixed"  # mixed (shuffled) | gen-first | embed-first
    seed: int = 0
    groups: int = 8  # shared-prefix: groups of requests that share a prefix
    prompts_per_group: int = 16
    prefix_len: int = 512
    suffix_len: int = 32
    shared: bool = True  # False: the control, the same lengths with every prefix its own
    vocab_size: int = 32000  # token ids are drawn below this

    def __post_init__(self):
        if self.name not in WORKLOADS:
            raise ValueError(f"name={self.name!r}; expected one of {WORKLOADS}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival={self.arrival!r}; expected one of {ARRIVALS}")
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r}; expected one of {ORDERS}")
        if not 0 <= self.embed_frac <= 1:
            raise ValueError(f"embed_frac={self.embed_frac} must be in [0, 1]")
        if self.num_requests < 1 or self.rate <= 0 or self.clients < 1:
            raise ValueError("num_requests, rate and clients must be positive")
        if min(self.groups, self.prompts_per_group, self.suffix_len, self.vocab_size) < 1 or \
                self.prefix_len < 0:
            raise ValueError(f"groups={self.groups}, prompts_per_group="
                             f"{self.prompts_per_group}, suffix_len={self.suffix_len} and "
                             f"vocab_size={self.vocab_size} must be >= 1, prefix_len="
                             f"{self.prefix_len} >= 0")

    @property
    def size(self) -> int:
        """Requests in the run."""
        if self.name == "shared-prefix":
            return self.groups * self.prompts_per_group
        return self.num_requests

    @property
    def num_embed(self) -> int:
        """Embedding requests in the run (shared-prefix: the same number in every group)."""
        if self.name == "shared-prefix":
            return self.groups * round(self.prompts_per_group * self.embed_frac)
        return round(self.num_requests * self.embed_frac)


def ratio_workload(ratio: tuple, num: int, embed_len: int, prompt_len: int, output_len: int,
                   seed: int = 0, vocab_size: int = 256, **kw) -> WorkloadConfig:
    """The bench's mixed workload at `ratio` (embed, gen): `num` requests of fixed lengths,
    round(num * e / (e + g)) of them embeddings, shuffled (`kw`: arrivals, clients)."""
    e, g = ratio
    return WorkloadConfig(num_requests=num, embed_frac=e / (e + g),
                          gen_prompt=LengthDist((prompt_len,)), gen_output=LengthDist((output_len,)),
                          embed_len=LengthDist((embed_len,)), order="mixed", seed=seed,
                          vocab_size=vocab_size, **kw)


def run_size(ratio: tuple, requests: int, min_gens: int) -> int:
    """Requests in a bench run at `ratio`: `requests`, raised so that it holds at least
    `min_gens` generations (a few long generations would otherwise set the whole run's time by
    their decode chains, and a 9:1 run of 48 requests holds only 5)."""
    e, g = ratio
    return max(requests, -(-min_gens * (e + g) // g)) if g else requests


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    kind: str  # EMBED | GENERATE
    token_ids: tuple  # the prompt, or the input to embed
    max_tokens: int  # 0 for an embedding

    @property
    def input_len(self) -> int:
        return len(self.token_ids)


def request_specs(cfg: WorkloadConfig) -> list:
    """The requests in issue order: `cfg.num_embed` embeddings, placed by `order`, with token
    ids drawn uniformly below `vocab_size` (so no two requests share a page by chance)."""
    if cfg.name == "shared-prefix":
        return _shared_prefix_specs(cfg)
    rng = random.Random(cfg.seed)
    n_embed = cfg.num_embed
    kinds = [GENERATE] * (cfg.num_requests - n_embed) + [EMBED] * n_embed
    kinds = [kinds[i] for i in _issue_order(kinds, cfg.order, rng)]
    lengths = [(cfg.embed_len.sample(rng), 0) if k == EMBED else
               (cfg.gen_prompt.sample(rng), cfg.gen_output.sample(rng)) for k in kinds]
    tokens = random.Random(cfg.seed + 1)
    return [RequestSpec(k, _draw(tokens, n, cfg.vocab_size), m)
            for k, (n, m) in zip(kinds, lengths)]


def _shared_prefix_specs(cfg: WorkloadConfig) -> list:
    """`groups` x `prompts_per_group` requests (after SGLang's generated-shared-prefix
    benchmark): the requests of a group share a random `prefix_len`-token prefix (the control,
    `shared=False`: each its own), then each has its own `suffix_len`-token suffix. The first
    round(prompts_per_group * embed_frac) of each group are embeddings, the rest generations;
    then the list is placed by `order`. The order and the output lengths come from
    `Random(seed)`, the token ids from `Random(seed + 2)`, so the control issues the same
    kinds and lengths in the same order: only the sharing differs."""
    tokens, vocab = random.Random(cfg.seed + 2), cfg.vocab_size
    n_embed = round(cfg.prompts_per_group * cfg.embed_frac)
    kinds, inputs = [], []
    for _ in range(cfg.groups):
        prefix = _draw(tokens, cfg.prefix_len, vocab)
        for i in range(cfg.prompts_per_group):
            kinds.append(EMBED if i < n_embed else GENERATE)
            inputs.append((prefix if cfg.shared else _draw(tokens, cfg.prefix_len, vocab))
                          + _draw(tokens, cfg.suffix_len, vocab))
    rng = random.Random(cfg.seed)
    return [RequestSpec(kinds[i], inputs[i], 0 if kinds[i] == EMBED else cfg.gen_output.sample(rng))
            for i in _issue_order(kinds, cfg.order, rng)]


def _issue_order(kinds: list, order: str, rng: random.Random) -> list:
    """Indices into `kinds` in issue order: shuffled (mixed), or one type first, stably."""
    idx = list(range(len(kinds)))
    if order == "mixed":
        rng.shuffle(idx)
    else:
        first = GENERATE if order == "gen-first" else EMBED
        idx.sort(key=lambda i: kinds[i] != first)
    return idx


def _draw(rng: random.Random, n: int, vocab: int) -> tuple:
    return tuple(rng.randrange(vocab) for _ in range(n))


def arrival_times(cfg: WorkloadConfig) -> list:
    """Arrival time of each request for open arrivals (poisson, burst); closed loops: []."""
    if cfg.arrival == "burst":
        return [0.0] * cfg.size
    if cfg.arrival == "closed":
        return []
    rng, t, out = random.Random(cfg.seed + 1), 0.0, []
    for _ in range(cfg.size):
        out.append(t)
        t += rng.expovariate(cfg.rate)
    return out
