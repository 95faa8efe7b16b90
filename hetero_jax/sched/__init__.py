"""Host-side scheduling (pure Python, imports no jax): requests, KV pages, policies, the step."""
from hetero_jax.sched.output import (DECODE, ITEM_KINDS, PREFILL, RunnerOutput, SampledToken,
                                     ScheduledItem, SchedulerOutput)
from hetero_jax.sched.pages import SCRATCH_PAGE, PageAllocator
from hetero_jax.sched.policies import POLICIES, Credits, Plan, Policy, make_policy
from hetero_jax.sched.request import EMBED, GENERATE, REQUEST_KINDS, Request, Status
from hetero_jax.sched.scheduler import Scheduler, SchedulerConfig

__all__ = ["SCRATCH_PAGE", "PageAllocator", "Request", "Status", "EMBED", "GENERATE",
           "REQUEST_KINDS", "DECODE", "PREFILL", "ITEM_KINDS", "RunnerOutput", "SampledToken",
           "ScheduledItem", "Scheduler", "SchedulerConfig", "SchedulerOutput", "POLICIES",
           "Credits", "Plan", "Policy", "make_policy"]
