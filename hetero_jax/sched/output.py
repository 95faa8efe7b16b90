"""The data that crosses between the scheduler and the runners each step (plain Python).

`SchedulerOutput` goes host -> runners. `items` are the decoder's, sorted by kind (embedding
chunks, then prefill chunks, then decode tokens), so the pooler, the prefill handler and the
sampler each read one contiguous slice; `encoder_items` are whole embedding inputs for a
separate encoder model (empty when embeddings run on the decoder). Each `ScheduledItem` is a
snapshot of plain data (ids, token ids, positions, the page table, knobs, the pooler slot):
a runner never sees a live `Request`. `cascade` is the scheduler's cascade plan of the
step's decodes (`tiles.CascadeSettings.plan`: tiles over `items`' indices; decode-only steps
on XLA, any step on the Pallas kernel), which the runner lays out as it is; None runs plain
attention. `RunnerOutput` comes back: one sampled token per item
that samples and one pooled vector per embedding request whose last chunk (or whole input) ran.
"""
from __future__ import annotations

import dataclasses
import typing

from hetero_jax.sched.request import EMBED, EmbedKnobs, GenKnobs

PREFILL, DECODE = "prefill", "decode"
ITEM_KINDS = (EMBED, PREFILL, DECODE)
KIND_ORDER = {kind: i for i, kind in enumerate(ITEM_KINDS)}


class ScheduledItem(typing.NamedTuple):
    """One request's share of a step (a named tuple: the scheduler makes one per item per
    step, a third the host time of a frozen dataclass)."""

    request_id: int
    kind: str  # EMBED | PREFILL | DECODE
    start: int  # position of the item's first token
    num_tokens: int
    ends: bool  # the item reaches the request's last token (an embedding: its last chunk)
    token_ids: tuple = ()  # [num_tokens]
    pages: tuple = ()  # the request's page table (empty on a separate encoder)
    knobs: GenKnobs | EmbedKnobs | None = None
    num_output_tokens: int = 0  # generated before this item: the index of the one it samples
    pool_slot: int | None = None  # embedding chunks on the decoder
    num_cached_tokens: int = 0  # the request's tokens found in the prefix cache (whole pages)

    @property
    def first_chunk(self) -> bool:
        """The request's first computed item since admission (cached tokens come before it)."""
        return self.start == self.num_cached_tokens

    @property
    def samples(self) -> bool:
        """Whether a new token is sampled after this item (never for an embedding)."""
        return self.kind != EMBED and self.ends


@dataclasses.dataclass
class SchedulerOutput:
    items: list  # [ScheduledItem] for the decoder, sorted by kind
    preempted: list  # request ids preempted while scheduling this step
    encoder_items: list = dataclasses.field(default_factory=list)  # [ScheduledItem] (EMBED)
    cascade: tuple | None = None  # ([(member indices, shared pages)], rest offsets [len(items)])

    @property
    def num_tokens(self) -> int:
        return self.decoder_tokens + sum(it.num_tokens for it in self.encoder_items)

    @property
    def decoder_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)

    def tokens_of(self, kind: str) -> int:
        return sum(it.num_tokens for it in self.items + self.encoder_items if it.kind == kind)


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_token_ids: tuple = ()
    top_logprobs: tuple = ()


@dataclasses.dataclass
class RunnerOutput:
    sampled: dict = dataclasses.field(default_factory=dict)  # request_id -> SampledToken
    step_time: float = 0.0
    embeddings: dict = dataclasses.field(default_factory=dict)  # request_id -> vector [d]

    def merge(self, other: "RunnerOutput") -> "RunnerOutput":
        """Both runners' results of one step (a separate encoder's pass and the decoder's)."""
        return RunnerOutput({**self.sampled, **other.sampled}, self.step_time + other.step_time,
                            {**self.embeddings, **other.embeddings})
