"""`/metrics`: the front's `FrontStats` and the server's counters as Prometheus text.

In: `EngineClient.stats` (engine counters, waiting and running requests by kind, the step
time histogram) and `Counters` (responses by route and status, disconnects). Out: the text
exposition format, version 0.0.4: requests waiting and running by type, generated tokens and
tokens/s over the engine's step time, the prefix cache hit rate, a histogram of step seconds,
step variants compiled, and responses by status. Plain Python: imports no jax.
"""
from __future__ import annotations

import collections
import dataclasses

from hetero_jax.serving.client import STEP_BUCKETS

PREFIX = "hetero_jax"


@dataclasses.dataclass
class Counters:
    responses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    disconnects: int = 0  # requests whose client went away first (their requests aborted)

    def count(self, route: str, status: int) -> None:
        self.responses[(route, status)] += 1


def _metric(name: str, kind: str, help_: str, samples: list) -> list:
    """[(labels dict, value)] -> the lines of one metric family."""
    lines = [f"# HELP {PREFIX}_{name} {help_}", f"# TYPE {PREFIX}_{name} {kind}"]
    for labels, value in samples:
        text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{PREFIX}_{name}{{{text}}} {value}" if text else
                     f"{PREFIX}_{name} {value}")
    return lines


def _histogram(steps) -> list:
    lines = [f"# HELP {PREFIX}_step_seconds Wall time of the engine steps this front drove.",
             f"# TYPE {PREFIX}_step_seconds histogram"]
    total = 0
    for bound, count in zip(list(STEP_BUCKETS) + ["+Inf"], steps.counts):
        total += count
        lines.append(f'{PREFIX}_step_seconds_bucket{{le="{bound}"}} {total}')
    lines += [f"{PREFIX}_step_seconds_sum {steps.total_s}",
              f"{PREFIX}_step_seconds_count {total}"]
    return lines


def prometheus_text(stats, counters: Counters) -> str:
    e = stats.engine
    kinds = sorted(set(stats.waiting) | set(stats.running) | {"generate", "embed"})
    lines = _metric("requests_waiting", "gauge", "Requests queued, not yet admitted.",
                    [({"type": k}, stats.waiting.get(k, 0)) for k in kinds])
    lines += _metric("requests_running", "gauge", "Requests admitted and not finished.",
                     [({"type": k}, stats.running.get(k, 0)) for k in kinds])
    lines += _metric("generated_tokens_total", "counter", "Tokens generated.",
                     [({}, e.generated_tokens)])
    lines += _metric("tokens_per_second", "gauge", "Generated tokens over the engine's step "
                     "time (compiling left out).",
                     [({}, e.generated_tokens / e.step_time_s if e.step_time_s else 0.0)])
    lines += _metric("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix "
                     "cache over those looked up.", [({}, e.cache_hit_rate)])
    lines += _metric("steps_total", "counter", "Engine steps.", [({}, e.steps)])
    lines += _histogram(stats.steps)
    lines += _metric("compiles_total", "counter", "Step variants built (compiled or loaded).",
                     [({}, e.compiles)])
    lines += _metric("compile_seconds_total", "counter", "Seconds spent compiling.",
                     [({}, e.compile_s)])
    lines += _metric("responses_total", "counter", "HTTP responses by route and status.",
                     [({"route": r, "status": s}, n)
                      for (r, s), n in sorted(counters.responses.items())])
    lines += _metric("client_disconnects_total", "counter", "Requests aborted because their "
                     "client went away.", [({}, counters.disconnects)])
    return "\n".join(lines) + "\n"
