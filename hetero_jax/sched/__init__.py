"""Host-side scheduling (pure Python, imports no jax)."""
from hetero_jax.sched.pages import SCRATCH_PAGE, PageAllocator
from hetero_jax.sched.request import Request, Status
from hetero_jax.sched.scheduler import (DECODE, PREFILL, RunnerOutput, SampledToken, ScheduledItem,
                                        Scheduler, SchedulerConfig, SchedulerOutput)

__all__ = ["SCRATCH_PAGE", "PageAllocator", "Request", "Status", "DECODE", "PREFILL",
           "RunnerOutput", "SampledToken", "ScheduledItem", "Scheduler", "SchedulerConfig",
           "SchedulerOutput"]
