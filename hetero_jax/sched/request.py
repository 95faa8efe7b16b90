"""Host-side request state (plain Python): what has been computed, which pages hold its KV.

`GenKnobs` / `EmbedKnobs` are the engine's copy of a request's knobs, checked and resolved
(seed, pooling kind, adapter id) by the serving layer; the scheduler carries them to the
runner in each `ScheduledItem` and never reads them.
"""
from __future__ import annotations

import dataclasses
import enum

GENERATE, EMBED = "generate", "embed"  # request kinds; EMBED is also the item kind of its chunks
REQUEST_KINDS = (EMBED, GENERATE)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class GenKnobs:
    """One generation request's sampling knobs; the runner packs them into per-row arrays."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int | None
    presence: float = 0.0  # vLLM's penalties (0, 0, 1: off)
    frequency: float = 0.0
    repetition: float = 1.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0)


@dataclasses.dataclass(frozen=True)
class EmbedKnobs:
    """One embedding request's pooling knobs."""

    kind: int  # index into requests.POOLING_KINDS
    normalize: bool
    adapter_id: int = 0  # 0 = base model


@dataclasses.dataclass
class Request:
    """One generation or embedding request. `num_computed_tokens` catches up with `num_tokens`.

    The tokens of the request are `prompt_token_ids + output_token_ids`; those below
    `num_computed_tokens` have their K/V in `pages`. A generation request is recomputed from
    token 0 after a preemption (prompt and output so far), so no token is lost. An embedding
    request (`kind="embed"`) has no output tokens and ignores `max_tokens`; on the decoder it
    runs as chunks, holding its pages and `pool_slot` until its last chunk; on a separate
    encoder it runs whole in one step. It ends with `embedding` set from the runner's output.
    """

    request_id: int
    prompt_token_ids: list
    max_tokens: int = 0
    stop_token_ids: frozenset = frozenset()
    kind: str = GENERATE
    knobs: GenKnobs | EmbedKnobs | None = None  # None only where no runner reads them (sim)
    output_token_ids: list = dataclasses.field(default_factory=list)
    output_logprobs: list = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list = dataclasses.field(default_factory=list)
    pool_slot: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None  # first sampled token, or the embedding
    finish_time: float | None = None
    embedding: object = None  # the pooled vector of a finished embedding request
    error: Exception | None = None  # why the engine failed it (finish_reason "error")
    # Stop strings (generation): checked by the engine on the text decoded so far, `text` of
    # the first `text_read` output ids; `stop_at` is where a stop string cut it (None: none).
    stop_strings: tuple = ()
    text: str = ""
    text_read: int = 0
    stop_at: int | None = None
    # Prefix caching: the chain seed (None: this request neither looks up nor registers pages),
    # the digests of its full pages so far, and how many of them are registered / were hit.
    cache_seed: bytes | None = None
    block_hashes: list = dataclasses.field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int = 0  # tokens its latest admission found in the cache

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_embed(self) -> bool:
        return self.kind == EMBED

    @property
    def is_decoding(self) -> bool:
        out = self.output_token_ids  # spelt out: the scheduler asks this of every running one
        return bool(out) and len(self.prompt_token_ids) + len(out) - self.num_computed_tokens == 1

    @property
    def num_pending(self) -> int:
        """Uncomputed input tokens: the work an IBS queue weighs (a decoding request has none)."""
        left = len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens
        return 0 if left == 1 and self.output_token_ids else left

    def token_ids(self, start: int, count: int) -> list:
        n = len(self.prompt_token_ids)
        all_ids = self.prompt_token_ids[start:start + count]
        if start + count > n:
            all_ids = all_ids + self.output_token_ids[max(start - n, 0):start + count - n]
        return all_ids
