"""Host-side scheduling (pure Python, imports no jax): requests, allocators, policies, the step."""
from hetero_jax.sched.allocators import SCRATCH_PAGE, PagePool, SlotAllocator
from hetero_jax.sched.batching import BATCHING, FeatherConfig
from hetero_jax.sched.output import (DECODE, ITEM_KINDS, KIND_ORDER, PREFILL, RunnerOutput,
                                     SampledToken, ScheduledItem, SchedulerOutput)
from hetero_jax.sched.policies import POLICIES, Credits, Plan, Policy, make_policy
from hetero_jax.sched.request import (EMBED, GENERATE, REQUEST_KINDS, EmbedKnobs, GenKnobs,
                                      Request, Status)
from hetero_jax.sched.scheduler import Scheduler, SchedulerConfig

__all__ = ["SCRATCH_PAGE", "PagePool", "SlotAllocator", "Request", "Status", "EMBED",
           "GENERATE", "REQUEST_KINDS", "GenKnobs", "EmbedKnobs", "DECODE", "PREFILL",
           "ITEM_KINDS", "KIND_ORDER", "RunnerOutput", "SampledToken", "ScheduledItem",
           "Scheduler", "SchedulerConfig", "SchedulerOutput", "POLICIES", "Credits", "Plan",
           "Policy", "make_policy", "BATCHING", "FeatherConfig"]
