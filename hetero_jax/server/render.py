"""A generation's pieces -> OpenAI stream chunks (as SSE events) or one whole body.

In: `(index, generation.Piece)` as `generation.merged` yields them, on the request's task. Out:
`event` -> one `data: {chunk}\\n\\n` event as bytes, `usage_chunk` and `whole` -> dicts in the
shapes of OpenAI's completion and chat completion (`openai_format.body`); usage is counted as
the pieces pass. `event` is paid once per streamed step: a chunk without log-probs (the
common one) is written from its few varying parts into a per-request template, the bytes
`sse_event(chunk(...))` gives (tested on random cases), without building and encoding its
dicts. Every chunk of a request carries the request's `created` time, as OpenAI's and vLLM's
do. Plain Python: imports no jax.
"""
from __future__ import annotations

import json
import time

from hetero_jax.server import openai_format as fmt


def sse_event(payload: dict) -> bytes:
    return b"data: %b\n\n" % json.dumps(payload, separators=(",", ":")).encode()


class Render:
    """One request's pieces -> chunks or its whole body (module docstring)."""

    def __init__(self, tokenizer, model: str, req, kind: str, rid: str, n_choices: int):
        self.tokenizer, self.model = tokenizer, model
        self.kind, self.rid, self.n = kind, rid, req.n
        self.chat = kind == "chat.completion"
        self.chunk_kind = "chat.completion.chunk" if self.chat else "text_completion"
        self.created = int(time.time())
        self.token_ids = req.return_token_ids
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.prompt_tokens, self.completion_tokens = 0, 0
        self.offsets = [0] * n_choices
        self.started = [False] * n_choices
        self.unfinished = n_choices
        self._head = (f'data: {{"id":{json.dumps(rid)},"object":"{self.chunk_kind}",'
                      f'"created":{self.created},"model":{json.dumps(model)},'
                      f'"choices":[{{"index":')  # + index, the choice's fields, its tail

    def _count(self, index: int, piece) -> None:
        self.completion_tokens += len(piece.token_ids)
        if piece.finish_reason is not None:
            self.unfinished -= 1
            if index % self.n == 0:
                self.prompt_tokens += piece.prompt_tokens  # each prompt once, not per choice

    def all_finished(self) -> bool:
        return self.unfinished == 0

    def _logprobs(self, index: int, piece):
        lps = fmt.with_ids(piece.logprobs, piece.token_ids)
        if self.chat:
            return fmt.chat_logprobs(self.tokenizer, lps)
        out = fmt.completion_logprobs(self.tokenizer, lps, self.offsets[index])
        self.offsets[index] += len(piece.text)
        return out

    def chunk(self, index: int, piece) -> dict:
        self._count(index, piece)
        choice = {"index": index, "logprobs": self._logprobs(index, piece),
                  "finish_reason": piece.finish_reason}
        if self.chat:
            delta = {"content": piece.text}
            if not self.started[index]:
                delta, self.started[index] = {"role": "assistant", **delta}, True
            choice["delta"] = delta
        else:
            choice["text"] = piece.text
        if self.token_ids:
            choice["token_ids"] = piece.token_ids
        return fmt.body(self.chunk_kind, self.rid, self.model, [choice], None, self.created)

    def event(self, index: int, piece) -> bytes:
        """`sse_event(self.chunk(index, piece))`, written straight where it has no log-probs."""
        if piece.logprobs is not None:
            return sse_event(self.chunk(index, piece))
        self._count(index, piece)
        text = json.dumps(piece.text)
        if not self.chat:
            body = f'"text":{text}'
            self.offsets[index] += len(piece.text)
        elif self.started[index]:
            body = f'"delta":{{"content":{text}}}'
        else:
            body, self.started[index] = f'"delta":{{"role":"assistant","content":{text}}}', True
        if self.token_ids:
            body += f',"token_ids":[{",".join(map(str, piece.token_ids))}]'
        reason = "null" if piece.finish_reason is None else json.dumps(piece.finish_reason)
        return (f'{self._head}{index},"logprobs":null,"finish_reason":{reason},{body}'
                '}],"usage":null}\n\n').encode()

    def usage_chunk(self) -> dict:
        return fmt.body(self.chunk_kind, self.rid, self.model, [],
                        fmt.usage(self.prompt_tokens, self.completion_tokens), self.created)

    async def whole(self, first, pieces) -> dict:
        texts, lps, reasons, ids = {}, {}, {}, {}
        item = first
        while item is not None:
            index, piece = item
            self._count(index, piece)
            texts[index] = texts.get(index, "") + piece.text
            ids[index] = ids.get(index, []) + piece.token_ids
            if piece.logprobs is not None:
                lps.setdefault(index, []).extend(fmt.with_ids(piece.logprobs, piece.token_ids))
            reasons[index] = piece.finish_reason
            item = await anext(pieces, None)
        choices = []
        for i in sorted(texts):
            lp = lps.get(i)
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant",
                                                        "content": texts[i]},
                                "logprobs": fmt.chat_logprobs(self.tokenizer, lp),
                                "finish_reason": reasons[i]})
            else:
                choices.append({"index": i, "text": texts[i], "finish_reason": reasons[i],
                                "logprobs": fmt.completion_logprobs(self.tokenizer, lp, 0)})
            if self.token_ids:
                choices[-1]["token_ids"] = ids[i]
        return fmt.body(self.kind, self.rid, self.model, choices,
                        fmt.usage(self.prompt_tokens, self.completion_tokens), self.created)
