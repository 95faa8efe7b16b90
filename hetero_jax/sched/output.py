"""The data that crosses between the scheduler and the runner each step (plain Python).

`SchedulerOutput` goes host -> runner: the step's items sorted by kind (embedding chunks, then
prefill chunks, then decode tokens), so the pooler, the prefill handler and the sampler each
read one contiguous slice. `RunnerOutput` comes back: one sampled token per item that samples
and one pooled vector per embedding request whose last chunk ran.
"""
from __future__ import annotations

import dataclasses

from hetero_jax.sched.request import EMBED, Request

PREFILL, DECODE = "prefill", "decode"
ITEM_KINDS = (EMBED, PREFILL, DECODE)
KIND_ORDER = {kind: i for i, kind in enumerate(ITEM_KINDS)}


@dataclasses.dataclass(frozen=True)
class ScheduledItem:
    request: Request
    kind: str  # EMBED | PREFILL | DECODE
    start: int  # first token position of this item
    num_tokens: int

    @property
    def ends(self) -> bool:
        """Whether this item reaches the request's last token (for an embedding: its last chunk)."""
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def samples(self) -> bool:
        """Whether a new token is sampled after this item (never for an embedding chunk)."""
        return self.kind != EMBED and self.ends


@dataclasses.dataclass
class SchedulerOutput:
    items: list  # [ScheduledItem], sorted by kind
    preempted: list  # request ids preempted while scheduling this step

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)

    def tokens_of(self, kind: str) -> int:
        return sum(it.num_tokens for it in self.items if it.kind == kind)


@dataclasses.dataclass
class SampledToken:
    token_id: int
    logprob: float
    top_token_ids: tuple = ()
    top_logprobs: tuple = ()


@dataclasses.dataclass
class RunnerOutput:
    sampled: dict  # request_id -> SampledToken, for every item that samples
    step_time: float = 0.0
    embeddings: dict = dataclasses.field(default_factory=dict)  # request_id -> vector [d]
