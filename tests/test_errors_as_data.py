"""Errors as data and the one synchronous drive, without an engine (no jax, milliseconds).

A refused request's `RequestError` is renamed from its parts (`at`, `alone`), never from its
message, and keeps them across a pipe; `drive.Drive` hands every tag back exactly once as a
`RequestResult`: refused at admission, finished by a step, or aborted.
"""
import pickle
from types import SimpleNamespace

import pytest

from hetero_jax.outputs import RequestError, RequestResult
from hetero_jax.serving.drive import Drive


def test_a_named_error_is_renamed_from_its_parts():
    e = RequestError.naming("prompt", 0, ": token id 9999 outside [0, 512)")
    assert str(e) == "prompt 0: token id 9999 outside [0, 512)" and e.field == "prompt"
    moved = e.at(7)
    assert (str(moved), moved.index, moved.field) == (
        "prompt 7: token id 9999 outside [0, 512)", 7, "prompt")
    assert moved.alone() == "the prompt: token id 9999 outside [0, 512)"
    assert RequestError.naming("input", 2, " is empty").alone() == "the input is empty"


def test_an_unnamed_error_keeps_its_reason():
    e = RequestError(0, "params", "request 0 is a str; expected GenerateRequest or EmbedRequest")
    assert e.at(3).reason == e.reason and e.at(3).index == 3 and e.alone() == e.reason


def test_an_error_crosses_a_pipe_with_its_parts():
    e = pickle.loads(pickle.dumps(RequestError.naming("input", 4, " is empty", "input")))
    assert (type(e), str(e), e.index, e.field, e.at(1).reason) == (
        RequestError, "input 4 is empty", 4, "input", "input 1 is empty")


class FakeEngine:
    """Requests are ints: a negative one is refused, n finishes after n steps."""

    def __init__(self):
        self.ids, self.queued, self.aborted = iter(range(100)), {}, []

    def prepare(self, requests):
        (r,) = requests
        if isinstance(r, str):
            raise TypeError(f"request 0 is a {type(r).__name__}")
        if r < 0:
            raise RequestError.naming("prompt", 0, " is empty")
        return [SimpleNamespace(request_id=next(self.ids), left=r)]

    def enqueue(self, reqs):
        self.queued.update((req.request_id, req) for req in reqs)

    def has_work(self):
        return bool(self.queued)

    def step(self):
        for req in self.queued.values():
            req.left -= 1
        done = [req for req in self.queued.values() if req.left <= 0]
        for req in done:
            del self.queued[req.request_id]
        return SimpleNamespace(finished=done, progressed=[])  # as Engine.step's StepOutput

    def output(self, req):
        return f"out {req.request_id}"

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.queued.pop(request_id, None)


def test_the_drive_hands_back_every_tag_once():
    engine = FakeEngine()
    drive = Drive(engine)
    refused = drive.admit([("a", 2), ("b", -1), ("c", "x"), ("d", 1)])
    assert [(tag, r.error.field) for tag, r in refused] == [("b", "prompt"), ("c", "params")]
    assert len(drive) == 2
    assert drive.step() == [("d", RequestResult("out 1"))]
    assert drive.step() == [("a", RequestResult("out 0"))]
    assert drive.step() == [] and len(drive) == 0
    (f, refused), e = drive.run([("e", 3), ("f", -5)])
    assert f == "f" and str(refused.error) == "prompt 0 is empty" and refused.output is None
    assert e == ("e", RequestResult("out 2")) and len(drive) == 0


def test_the_drive_aborts_by_tag():
    engine = FakeEngine()
    drive = Drive(engine)
    drive.admit([("a", 5), ("b", 5), ("c", 5)])
    drive.abort(["b", "unknown"])
    assert engine.aborted == [1] and len(drive) == 2
    assert sorted(drive.abort_all()) == ["a", "c"] and not engine.queued and len(drive) == 0


def test_an_idle_engine_with_requests_in_flight_is_a_bug():
    engine = FakeEngine()
    drive = Drive(engine)
    drive.admit([("a", 1)])
    engine.queued.clear()
    with pytest.raises(AssertionError, match="1 requests in flight"):
        drive.step()


def test_the_drive_serves_commands_between_steps_and_reports_each_step():
    """`serve` applies every waiting command before a step, blocks only while idle, reports
    each step, and a step that raises with no request to blame aborts its requests, reports
    them as one failure and goes on."""
    engine, log = FakeEngine(), []
    drive = Drive(engine)
    commands = [("add", [("a", 2), ("b", 1)]), None, None, ("add", [("c", 1), ("d", -1)]),
                ("boom", None), None, ("add", [("e", 1)]), None, ("stop", None)]
    waits = []

    def take(wait):
        waits.append(wait)
        return commands.pop(0)

    def handle(command):
        cmd, arg = command
        if cmd == "stop":
            return False
        if cmd == "boom":
            engine.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
        else:
            log.append(("refused", [(tag, str(r.error)) for tag, r in drive.admit(arg)]))
        return True

    def report(deltas, finished, failure):
        log.append((deltas, finished, failure and (failure[0], str(failure[1]))))
        if failure:
            del engine.step  # the class's step again

    drive.serve(take, handle, report)
    assert log == [
        ("refused", []), ([], [("b", RequestResult("out 1"))], None),
        ([], [("a", RequestResult("out 0"))], None),
        ("refused", [("d", "prompt 0 is empty")]),
        ([], [], (["c"], "device lost")), ("refused", []),
        ([], [("e", RequestResult("out 3"))], None)]
    assert waits == [True, False, False, True, False, False, True, False, True]
    assert engine.aborted == [2] and len(drive) == 0


def test_the_scheduler_s_refusal_is_a_request_error_and_queues_nothing():
    engine = FakeEngine()
    engine.enqueue = lambda reqs: (_ for _ in ()).throw(ValueError("request 0 has no tokens"))
    drive = Drive(engine)
    (req,) = engine.prepare([3])
    req.is_embed = True
    [(tag, result)] = drive.queue([("a", req)])
    assert (tag, result.error.field, str(result.error)) == ("a", "input",
                                                             "request 0 has no tokens")
    assert len(drive) == 0
