"""The workloads the benchmarks and the command line run: real requests for the engine.

- `MixedWorkload`: the bench's mixed embed:gen request lists, fixed lengths, exact counts.
- `synthetic_iter_retgen`: a corpus and Iter-RetGen `QueryPlan`s with the paper's lengths.
- `SharedPrefixWorkload`: groups of requests sharing a prompt prefix (after SGLang's
  generated-shared-prefix benchmark), or the same lengths with nothing shared (the control).
- `demo_prompts`: prompts of varied lengths for `hetero-jax generate`.
The request mix itself (kinds, lengths, order, token ids) comes from the simulator's
`sim.workload`, so the bench and `hetero-jax sim` run the same requests.
"""
from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

from hetero_jax.rag.iter_retgen import QueryPlan, build_prompt
from hetero_jax.requests import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams
from hetero_jax.sched import EMBED
from hetero_jax.sim.workload import (LengthDist, WorkloadConfig, ratio_workload, request_specs,
                                     run_size)


@dataclasses.dataclass(frozen=True)
class MixedWorkload:
    """Fixed lengths of the mixed workload; request lists are deterministic in the seed."""

    embed_len: int = 128
    prompt_len: int = 128
    output_len: int = 512
    seed: int = 0

    run_size = staticmethod(run_size)  # sim.workload's: requests at a ratio, >= min_gens gens

    def requests(self, ratio: tuple, num: int, vocab: int) -> list:
        """`num` requests at `ratio` (embed, gen): the simulator's mix and tokens
        (`sim.request_specs` of `sim.ratio_workload`: round(num * e / (e + g)) embeddings,
        shuffled, token ids drawn below min(vocab, 256), the bytes of the byte tokenizer)."""
        specs = request_specs(ratio_workload(ratio, num, self.embed_len, self.prompt_len,
                                             self.output_len, self.seed, min(vocab, 256)))
        return _engine_requests(specs, PoolingParams("mean", normalize=True))


@dataclasses.dataclass(frozen=True)
class SharedPrefixWorkload:
    """`groups` x `per_group` requests; the requests of a group share a random `prefix_len`-token
    prefix, each has its own `suffix_len`-token suffix. A group's requests are embeddings and
    generations at `ratio` (embed, gen), the whole list shuffled. `shared=False` is the
    control: the same lengths and kinds, every prefix its own. The layout and the token ids
    are the simulator's (`sim.request_specs` of the shared-prefix workload)."""

    groups: int = 8
    per_group: int = 16
    prefix_len: int = 512
    suffix_len: int = 32
    output_len: int = 32
    seed: int = 0

    def requests(self, ratio: tuple, vocab: int, shared: bool = True) -> list:
        e, g = ratio
        specs = request_specs(WorkloadConfig(
            name="shared-prefix", embed_frac=e / (e + g), gen_output=LengthDist((self.output_len,)),
            order="mixed", seed=self.seed, groups=self.groups, prompts_per_group=self.per_group,
            prefix_len=self.prefix_len, suffix_len=self.suffix_len, shared=shared,
            vocab_size=min(vocab, 256)))
        return _engine_requests(specs, PoolingParams("mean"))


def _engine_requests(specs: list, pooling: PoolingParams) -> list:
    """`RequestSpec`s as the engine's requests: greedy generations that never stop early."""
    return [EmbedRequest(list(s.token_ids), pooling) if s.kind == EMBED else
            GenerateRequest(list(s.token_ids), SamplingParams(
                max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True))
            for s in specs]


PAPER_STATS = dict(prompt_mean=500, prompt_max=2000, decode_mean=3000, decode_max=4000,
                   docs_min=1, docs_max=10)
_PROMPT_SIGMA = 0.6  # lognormal shape of the prompt length
_PROMPT_MIN = 100


def _words(rng: random.Random, n_chars: int, vocab: list[str]) -> str:
    """Pseudo-words joined by spaces, exactly `n_chars` characters."""
    out, size = [], 0
    while size < n_chars:
        out.append(rng.choice(vocab))
        size += len(out[-1]) + 1
    return " ".join(out)[:n_chars].rstrip() or vocab[0][:n_chars]


def synthetic_iter_retgen(num_queries: int, scale: float = 0.05, seed: int = 0,
                          num_docs: int | None = None,
                          instruction_len: int = 0) -> tuple[list[str], list[QueryPlan]]:
    """A corpus and `num_queries` `QueryPlan`s with the paper's Iter-RetGen statistics.

    Per query, in tokens of the byte-level tokenizer (one ASCII character each) before scaling:
    - documents retrieved k: uniform integer in [1, 10] (mean 5.5);
    - prompt length P (`prompt_budget`): lognormal with sigma 0.6 and mean 500, clipped to
      [100, 2000] (median 418, 99th percentile ~1650); then x scale, and at least the prompt
      with k four-character documents (so small scales raise the short prompts);
    - decode length (`max_tokens`, per generation): uniform integer in [2000, 4000]
      (mean 3000, max 4000), x scale, at least 1;
    - question: 8-24 characters of pseudo-words (not scaled);
    - with `instruction_len`, one instruction of that many characters starts every query and
      prompt (within the prompt length), the shared prefix of retrieval traffic.
    Documents (default 2 x num_queries, at least 32) are pseudo-words of 2000 x scale to
    2200 x scale characters, long enough that `fit_prompt` cuts the k retrieved ones to
    exactly P, whichever are retrieved. The engine needs max_model_len >= 6000 x scale + 1
    and an embedding limit >= 2200 x scale tokens (else build the index with truncate=True).
    """
    if num_queries < 1 or not 0 < scale <= 1:
        raise ValueError(f"num_queries={num_queries} must be >= 1 and scale={scale} in (0, 1]")
    rng = random.Random(seed)
    letters = "bcdfghjklmnprstvwz"
    vocab = sorted({"".join(rng.choice(letters) + rng.choice("aeiou")
                            for _ in range(rng.randint(1, 4))) for _ in range(400)})
    p_max = PAPER_STATS["prompt_max"]
    docs = [_words(rng, max(4, round(rng.uniform(p_max, 1.1 * p_max) * scale)), vocab)
            for _ in range(num_docs or max(32, 2 * num_queries))]
    mu = math.log(PAPER_STATS["prompt_mean"]) - _PROMPT_SIGMA**2 / 2
    instruction = _words(random.Random(seed + 3), instruction_len, vocab) + "\n" \
        if instruction_len else ""
    plans = []
    for _ in range(num_queries):
        k = rng.randint(PAPER_STATS["docs_min"], PAPER_STATS["docs_max"])
        question = _words(rng, rng.randint(8, 24), vocab)
        prompt = min(max(rng.lognormvariate(mu, _PROMPT_SIGMA), _PROMPT_MIN), p_max)
        floor = 1 + len(instruction + build_prompt(["x" * 4] * k, question))  # BOS + shortest
        decode = rng.randint(PAPER_STATS["decode_mean"] * 2 - PAPER_STATS["decode_max"],
                             PAPER_STATS["decode_max"])
        plans.append(QueryPlan(question, k, max(1, round(decode * scale)),
                               max(floor, round(prompt * scale)), instruction))
    return docs, plans


_TOPICS = ["the history of the printing press", "how a compiler turns code into machine code",
           "why the sky is blue", "a recipe for bread", "the rules of chess",
           "what a transformer model computes", "the water cycle", "how vaccines work"]


def demo_prompts(n: int, seed: int) -> list:
    """n prompts of varied lengths built from a few topics, deterministic in seed."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        out.append(f"Question {i}: explain {topic}. " * int(rng.integers(1, 6)) + "Answer:")
    return out
