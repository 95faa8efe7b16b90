"""A fake runner and request builders for the host-only scheduler tests (no jax)."""
from __future__ import annotations

from hetero_jax.sched import (EMBED, GENERATE, Request, RunnerOutput, SampledToken, Scheduler,
                              SchedulerConfig, SchedulerOutput)


def fake_token(request_id: int, num_output_tokens: int) -> int:
    """The token a fake model samples: a deterministic function of the request and position."""
    return 3 + (request_id * 7919 + num_output_tokens * 31) % 997


def fake_runner(out: SchedulerOutput) -> RunnerOutput:
    sampled = {it.request_id: SampledToken(fake_token(it.request_id, it.num_output_tokens), -1.0)
               for it in out.items if it.samples}
    embeddings = {it.request_id: ("vec", it.request_id)
                  for it in out.items + out.encoder_items if it.kind == EMBED and it.ends}
    return RunnerOutput(sampled, 0.0, embeddings)


def gen(rid: int, prompt_len: int, max_tokens: int, stop=frozenset()) -> Request:
    return Request(rid, [1 + (rid + i) % 200 for i in range(prompt_len)], max_tokens,
                   stop_token_ids=frozenset(stop), kind=GENERATE)


def emb(rid: int, length: int) -> Request:
    return Request(rid, [1 + (rid * 3 + i) % 200 for i in range(length)], kind=EMBED)


def expected_tokens(req: Request) -> list:
    """What the fake runner produces for a generation request run to its max_tokens."""
    out = []
    for _ in range(req.max_tokens):
        tok = fake_token(req.request_id, len(out))
        out.append(tok)
        if tok in req.stop_token_ids:
            break
    return out


def drive(sched: Scheduler, arrivals: dict, max_steps: int = 100_000, on_step=None) -> list:
    """Run until all work is done. `arrivals`: step -> [Request] added before that step.

    Returns the list of (step, SchedulerOutput, finished requests).
    """
    trace, step, last_arrival = [], 0, max(arrivals, default=0)
    while sched.has_work() or step <= last_arrival:
        for req in arrivals.get(step, ()):
            sched.add(req)
        if sched.has_work():
            out = sched.schedule()
            assert out.items or out.encoder_items, f"empty step {step} with work pending"
            finished = sched.update(out, fake_runner(out))
            trace.append((step, out, finished))
            if on_step is not None:
                on_step(step, out, finished)
        step += 1
        assert step < max_steps, "did not finish"
    return trace


def config(**kw) -> SchedulerConfig:
    return SchedulerConfig(**kw)
