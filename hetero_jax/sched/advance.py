"""A step's requests advanced in two halves: at schedule time (`advance`), then on its results
(`settle`), so that the next step can be scheduled while this one runs (async scheduling).

In: the `Scheduler`, a step's `SchedulerOutput`, later its `RunnerOutput`. Out: an `Ahead`
(what the step will produce, not yet known) from `advance`; the finished requests from
`settle`. Imports no jax.

`advance` does everything the runner's results are not needed for: each item's computed
tokens move on (`num_computed_tokens`, the prefix cache registers the full pages, whose tokens
are all known: a step's sampled token is never in a computed position of that step), an item
that samples appends a `PLACEHOLDER` output token (its id comes with the results), and a
request that ends whatever it samples (max_tokens, max_model_len, an embedding's last chunk)
finishes and frees its pages and slot. The next `schedule()` then sees every running decode
one token further on, as it would after the step: its decode item's token is the placeholder,
which the runner links to the row of the step that samples it (`runner.batch.link_tokens`: the
device reads it there).
`settle` writes the sampled tokens (and embeddings) in, finishes the requests that sampled a
stop token (their row in a step scheduled meanwhile is dead: its outputs are ignored), and
drops the placeholder of a request the engine failed in between (NaN output). `update` is
both halves at once (the synchronous step).
"""
from __future__ import annotations

import dataclasses

from hetero_jax.sched.output import DECODE, RunnerOutput, SchedulerOutput
from hetero_jax.sched.request import EMBED, Status

PLACEHOLDER = -1  # the id of an output token sampled by a step still running


@dataclasses.dataclass
class Ahead:
    """A step advanced at schedule time, waiting for its runner's results."""

    out: SchedulerOutput
    sampled: dict = dataclasses.field(default_factory=dict)  # request_id -> (Request, index)
    embedded: dict = dataclasses.field(default_factory=dict)  # request_id -> Request
    ended: list = dataclasses.field(default_factory=list)  # finished at advance, in item order

    def request(self, request_id):
        """The handle of a request this step samples for or embeds (None: neither)."""
        hit = self.sampled.get(request_id)
        return hit[0] if hit else self.embedded.get(request_id)


def advance(sched, out: SchedulerOutput) -> Ahead:
    """Move the step's requests on as if it had run; see the module docstring."""
    ahead = Ahead(out)
    requests, prefix, page_size = sched.requests, sched.prefix, sched.cfg.page_size
    for item in out.encoder_items + out.items:
        req = requests.get(item.request_id)
        if req is None or req.status is not Status.RUNNING:
            continue  # aborted after it was scheduled
        assert item.start == req.num_computed_tokens, (
            f"request {req.request_id}: {item.start=} != {req.num_computed_tokens=}")
        decode = item.kind == DECODE  # no pending input before it, none after it
        before = 0 if decode else req.num_pending
        req.num_computed_tokens = item.start + item.num_tokens
        if req.num_computed_tokens // page_size > req.num_registered:
            prefix.computed(req)  # a page filled
        reason = None
        if item.kind == EMBED:
            if item.ends:
                ahead.embedded[req.request_id], reason = req, "embedded"
        elif item.samples:
            ahead.sampled[req.request_id] = (req, len(req.output_token_ids))
            req.output_token_ids.append(PLACEHOLDER)
            req.output_logprobs.append(None)
            reason = _length_reached(req, sched.cfg.max_model_len)
        if not decode:
            sched.pending[req.kind] += req.num_pending - before
        if reason:
            sched._finish(req, reason)
            ahead.ended.append(req)
    return ahead


def settle(sched, ahead: Ahead, runner_out: RunnerOutput, now: float | None = None) -> list:
    """Write the step's results into its requests (stamping `now`); returns the requests that
    finished with this step, in item order (a request the engine failed meanwhile, `error`
    set, is left out: its caller reports it)."""
    stopped = []
    for rid, (req, index) in ahead.sampled.items():
        if req.error is not None:  # failed on this step's output: never sampled
            del req.output_token_ids[index:], req.output_logprobs[index:]
            continue
        tok = runner_out.sampled[rid]
        req.output_token_ids[index], req.output_logprobs[index] = tok.token_id, tok
        req.first_token_time = req.first_token_time or now
        if tok.token_id in req.stop_token_ids:
            if req.status is Status.FINISHED:
                req.finish_reason = "stop"  # its last token is a stop token too
            else:  # running, or preempted by a step scheduled meanwhile
                sched.abort(rid, "stop")
                stopped.append(req)
    for rid, req in ahead.embedded.items():
        if req.error is None:
            req.embedding, req.first_token_time = runner_out.embeddings.get(rid), now
    finished = [r for r in ahead.ended if r.error is None] + stopped
    for req in finished:
        req.finish_time = now
    order = {it.request_id: i for i, it in enumerate(ahead.out.encoder_items + ahead.out.items)}
    sched.batching.step_done(ahead.out, runner_out.step_time)
    return sorted(finished, key=lambda r: order[r.request_id])


def _length_reached(req, max_model_len: int) -> str | None:
    """"length" when the request may sample no more (its max_tokens or the model's length)."""
    if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None
