"""The list of hostile inputs of `scripts/hostile_pass.py`, by the defect class of issue 30."""
from __future__ import annotations

import numpy as np

from scripts.hostile_cases import (GREEDY, Case, batch, cli_refused, config,
                                   errors_aliasing_output, good, help_complete, kill_replicas,
                                   locked_errors, loads, outputs, raises,
                                   special_output, symlink_to, unix_socket)
from hetero_jax import EmbedRequest, GenerateRequest, PoolingParams, SamplingParams

G = [good(i) for i in range(1, 5)]


def row(text: str) -> list:
    """A hostile line between good rows: it is line 2."""
    return [G[0], text, G[1]]


def _set(value, index=None):
    def edit(arr):
        arr.reshape(-1)[arr.size // 3 if index is None else index] = value
        return arr
    return edit


def json_row(kind: str, text: str) -> str:
    import json
    return json.dumps({"id": "x", kind: text})


def fifo(ctx) -> str:
    import os
    path = ctx.path("fifo-out")
    os.mkfifo(path)
    return path


PIPES = [
    ("rows from a pipe (/dev/fd/N)", batch(G, [], kind="pipe")),
    ("rows and a bad row from a FIFO", batch(G[:2] + ["not json"] + G[2:], [3], kind="fifo")),
    ("a pipe whose line 1 has a BOM", batch(["\ufeff" + G[0]] + G[1:], [], kind="pipe")),
    ("an empty pipe", batch([], [], kind="pipe")),
    ("a pipe of text, no JSON object", batch(["hello", "world"], [], kind="pipe",
                                             refused="is not JSONL")),
    ("a pipe holding Parquet bytes", batch([b"PAR1\x00\x01binary"], [], kind="pipe",
                                           refused="Parquet")),
    ("a pipe of CRLF lines and blank lines", batch([G[0] + "\r", "", "  ", G[1] + "\r"], [],
                                                   kind="pipe")),
    ("a FIFO whose first 3 lines are not objects", batch(["[]", "1", '"x"'] + G, [1, 2, 3],
                                                         kind="fifo")),
    ("a pipe with a duplicate id", batch([G[0], G[0], G[1]], [2], kind="pipe")),
    ("a FIFO with a torn last line (no newline)", batch(G[:2] + ['{"id": "t", "embe'], [3],
                                                        kind="fifo")),
]

DEEP = "[" * 999 + "1" + "]" * 999
ROWS = [
    ("embed nested 999 deep (parses)", batch(row('{"id": "x", "embed": ' + DEEP + "}"), [2])),
    ("a prompt of nested objects 3,000 deep", batch(row('{"id": "x", "prompt": ' + '{"a":' * 3000
                                                        + "1" + "}" * 3000 + "}"), [2])),
    ("an id nested 2,000 deep", batch(row('{"id": ' + "[" * 2000 + "]" * 2000 + "}"), [2])),
    ("a line of 17 MiB", batch(row('{"id": "x", "prompt": "' + "a" * (17 * 2**20) + '"}'),
                               [2])),
    ("a last line of 17 MiB, not JSON", batch(G[:2] + ["x" * (17 * 2**20)], [3])),
    ("a BOM on line 2", batch(row("\ufeff" + good(9)), [2])),
    ("two BOMs on line 1", batch(["\ufeff\ufeff" + G[0], G[1]], [1])),
    ("a UTF-16 line", batch(row('{"id": "u", "embed": "x"}'.encode("utf-16")), [2])),
    ("a raw NUL byte in a string", batch(row(b'{"id": "n", "embed": "a\x00b"}'), [2])),
    ("a 5,000-digit id", batch(row('{"id": ' + "1" * 5000 + ', "embed": "x"}'), [2])),
    ("max_tokens 1e999 (inf)", batch(row('{"id": "x", "prompt": "a", "max_tokens": 1e999}'),
                                     [2])),
    ("a lone surrogate in a prompt", batch(row('{"id": "x", "prompt": "a\\ud800"}'), [2])),
    ("an empty token list", batch(row('{"id": "x", "prompt": []}'), [2])),
    ("a token id past the vocabulary", batch(row('{"id": "x", "prompt": [1, 600]}'), [2])),
    ("a float token id", batch(row('{"id": "x", "embed": [1, 2.0]}'), [2])),
    ("a boolean token id", batch(row('{"id": "x", "prompt": [true, 1]}'), [2])),
    ("an object as embed", batch(row('{"id": "x", "embed": {"a": 1}}'), [2])),
    ("max_tokens as a string", batch(row('{"id": "x", "prompt": "a", "max_tokens": "5"}'),
                                     [2])),
    ("temperature -1", batch(row('{"id": "x", "prompt": "a", "temperature": -1}'), [2])),
    ("an unknown pooling", batch(row('{"id": "x", "embed": "a", "pooling": "max"}'), [2])),
    ("a number as the whole line", batch(row("123"), [2])),
    ("a prompt past max_model_len", batch(row(json_row("prompt", "a" * 200)), [2])),
    ("an embed input past the limit", batch(row(json_row("embed", "a" * 200)), [2])),
    ("logprobs 1000", batch(row('{"id": "x", "prompt": "a", "logprobs": 1000}'), [2])),
    ("a stop token id past the vocabulary", batch(row('{"id": "x", "prompt": "a", '
                                                      '"stop_token_ids": [99999]}'), [2])),
    ("seed -1", batch(row('{"id": "x", "prompt": "a", "seed": -1}'), [2])),
    ("an unknown adapter", batch(row('{"id": "x", "embed": "a", "adapter": "nope"}'), [2])),
    ("cache_salt as a number", batch(row('{"id": "x", "embed": "a", "cache_salt": 5}'), [2])),
    ("max_tokens nested in lists", batch(row('{"id": "x", "prompt": "a", "max_tokens": '
                                             '[[[1]]]}'), [2])),
    ("NaN as top_p", batch(row('{"id": "x", "prompt": "a", "top_p": NaN}'), [2])),
    ("an id of an empty object", batch(row('{"id": {}, "embed": "a"}'), [2])),
    ("the empty string as id works", batch([G[0], '{"id": "", "embed": "a"}'], [])),
]


OUTPUTS = [
    ("--output /dev/null", special_output(lambda c: "/dev/null", "is not a regular file")),
    ("--output /dev/zero", special_output(lambda c: "/dev/zero", "is not a regular file")),
    ("--output a unix socket", special_output(unix_socket, "is not a regular file")),
    ("--errors /dev/null", special_output(lambda c: "/dev/null", "is not a regular file",
                                          "--errors")),
    ("--errors a FIFO", special_output(fifo, "is not a regular file", "--errors")),
    ("--output a symlink to /dev/full", special_output(symlink_to("/dev/full"),
                                                       "is not a regular file")),
    ("--errors a file another job holds", special_output(locked_errors, "another batch job",
                                                         "--errors")),
    ("--output - (stdout, rows and a bad row)", batch(G[:2] + ["nope"], [3], output="-")),
    ("--output - --errors -", batch(G[:2] + ["[]"], [3], argv=["--errors", "-"], output="-")),
    ("--output '' (empty path)", special_output(lambda c: "", "--output")),
    ("--errors the output through a symlink", errors_aliasing_output),
]

SIZES = [
    ("page_size=2**24", config("page_size=16777216", page_size=2**24)),
    ("max_num_seqs=10**7", config("max_num_seqs=10000000", max_num_seqs=10**7)),
    ("seq_buckets up to 2**26", config("seq_buckets=", seq_buckets=(8, 2**26))),
    ("page_buckets=(10**8,)", config("page_buckets=", page_buckets=(10**8,))),
    ("chunk_seq_buckets up to 10**6", config("chunk_seq_buckets=", chunk_seq_buckets=(0, 10**6))),
    ("max_model_len past the model's", config("max_model_len=1000000", max_model_len=10**6)),
    ("token_budget=2**31", config("token_budget=2147483648", token_budget=2**31)),
    ("num_pages=2**31-1", config("num_pages=2147483647", num_pages=2**31 - 1)),
    ("max_logprobs=10**6", config("max_logprobs=1000000", max_logprobs=10**6)),
    ("config.json num_attention_heads=10**6", loads("num_attention_heads=1000000", config=dict(
        num_attention_heads=10**6, num_key_value_heads=10**6))),
    ("config.json vocab_size=2**40", loads("vocab_size=1099511627776",
                                           config=dict(vocab_size=2**40))),
    ("config.json head_dim=10**7", loads("bytes", config=dict(head_dim=10**7))),
    ("config.json intermediate_size=2**40", loads("intermediate_size=1099511627776",
                                                  config=dict(intermediate_size=2**40))),
    ("config.json num_hidden_layers=2**31", loads("num_hidden_layers=2147483648",
                                                  config=dict(num_hidden_layers=2**31))),
    ("config.json num_key_value_heads=10**8", loads("num_kv_heads=100000000", config=dict(
        num_key_value_heads=10**8))),
    ("config.json max_position_embeddings=10**12, max_model_len 10**10", loads(
        "max_model_len=10000000000", config=dict(max_position_embeddings=10**12),
        engine=dict(max_model_len=10**10))),
]


EMBED = "model.embed_tokens.weight"
FINITE = [
    ("NaN in the embedding table", loads(EMBED, tensors={EMBED: _set(np.nan)})),
    ("-Inf in a q_proj weight", loads("q_proj", tensors={
        "model.layers.0.self_attn.q_proj.weight": _set(-np.inf)})),
    ("Inf in the last element of lm_head", loads("lm_head", tensors={
        "lm_head.weight": _set(np.inf, -1)})),
    ("NaN in the first element of a layer norm", loads("input_layernorm", tensors={
        "model.layers.0.input_layernorm.weight": _set(np.nan, 0)})),
    ("3e25 in an o_proj (finite, its square overflows)", loads("o_proj", tensors={
        "model.layers.0.self_attn.o_proj.weight": _set(3e25)})),
    ("a NaN prompt among clean ones", outputs(
        lambda e: e.generate([[1, 2], [1, 100, 2], [3], [100]], GREEDY, use_tqdm=False),
        lambda o: [x.finish_reason for x in o] == ["length", "error", "length", "error"],
        engine="poisoned")),
    ("a NaN embedding (cls pooling) among clean ones", outputs(
        lambda e: e.run([EmbedRequest([100, 5], PoolingParams("cls")),
                         EmbedRequest([5, 6], PoolingParams("cls"))], use_tqdm=False),
        lambda o: [x.finish_reason for x in o] == ["error", "embedded"], engine="poisoned")),
    ("a clean prompt after a NaN one on its freed pages", outputs(
        lambda e: [e.generate([[100] * 30], GREEDY, use_tqdm=False)[0],
                   e.generate([[5] * 30], GREEDY, use_tqdm=False)[0]],
        lambda o: [x.finish_reason for x in o] == ["error", "length"], engine="poisoned")),
]


TOKENIZERS = [
    ("an empty tokenizer.json", loads("tokenizer.json: not valid JSON",
                                      files={"tokenizer.json": b""})),
    ("a truncated tokenizer.json", loads("tokenizer.json: not valid JSON",
                                         files={"tokenizer.json": b'{"version": "1.0", "mo'})),
    ("tokenizer.json 'model' a list", loads("'model' must be a JSON object", files={
        "tokenizer.json": b'{"model": [], "added_tokens": []}'})),
    ("tokenizer.json 'added_tokens' an object", loads("'added_tokens' must be a JSON list",
                                                     files={"tokenizer.json": b'{"model": {}, '
                                                            b'"added_tokens": {}}'})),
    ("tokenizer.json of an unknown model type", loads("tokenizer files", files={
        "tokenizer.json": b'{"model": {"type": "Nope"}, "added_tokens": []}'})),
    ("tokenizer_config.json random bytes", loads("tokenizer_config.json: not valid JSON",
                                                 files={"tokenizer_config.json":
                                                        bytes(range(256)) * 4})),
    ("tokenizer_config.json a list", loads("tokenizer_config.json: expected a JSON object",
                                           files={"tokenizer_config.json": b"[1]"})),
    ("tokenizer.json a directory", loads("tokenizer", files={"tokenizer.json": "dir"})),
    ("a vocabulary id past the model's", loads("more than the model's vocab_size", files={
        "tokenizer.json": b'{"version": "1.0", "truncation": null, "padding": null, '
                          b'"added_tokens": [], "normalizer": null, "pre_tokenizer": '
                          b'{"type": "Whitespace"}, "post_processor": null, "decoder": null, '
                          b'"model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "w": 5000}, '
                          b'"unk_token": "[UNK]"}}'})),
]

SPECIAL = [
    ("eos_token_id -1", loads("eos_token_id=-1", config=dict(eos_token_id=-1))),
    ("eos_token_id 1.5", loads("eos_token_id=1.5", config=dict(eos_token_id=1.5))),
    ("bos_token_id 10**9", loads("bos_token_id=1000000000", config=dict(bos_token_id=10**9))),
    ("eos_token_id true", loads("eos_token_id=True", config=dict(eos_token_id=True))),
    ('eos_token_id [2, "x"]', loads("eos_token_id=[2, 'x']", config=dict(eos_token_id=[2, "x"]))),
    ("eos_token_id = vocab_size", loads("eos_token_id=512", config=dict(eos_token_id=512))),
    ("bos_token_id a list", loads("bos_token_id=[1]", config=dict(bos_token_id=[1]))),
]


def _gen(prompts, params=None):
    return lambda e: e.generate(prompts, params, use_tqdm=False)


def _emb(inputs, params=None):
    return lambda e: e.embed(inputs, params, use_tqdm=False)


SHAPES = [
    ("a dict as prompts", raises(_gen({"prompt": "x"}), "prompts is a dict")),
    ("a float as prompts", raises(_gen(3.5), "prompts is a float (3.5)")),
    ("a bytearray as prompts", raises(_gen(bytearray(b"x")), "prompts is bytearray")),
    ("bytes inside the prompt list", raises(_gen(["y", b"x"]), "prompt 1 is bytes")),
    ("None inside the prompt list", raises(_gen(["y", None]), "prompt 1 is None")),
    ("None as a token id", raises(_gen([[1, None]]), "token 1 is None")),
    ("two params for one prompt", raises(_gen(["x"], [SamplingParams()] * 2),
                                         "got 2 SamplingParams for 1 prompts")),
    ("a list of dicts as params", raises(_gen(["x"], [{"max_tokens": 2}]), "params 0 is a dict")),
    ("a string as params", raises(_gen("x", "greedy"), "params is a str ('greedy')")),
    ("PoolingParams for generate", raises(_gen("x", PoolingParams()),
                                          "params is a PoolingParams")),
    ("SamplingParams for embed", raises(_emb("x", SamplingParams()), "params is a SamplingParams")),
    ("a float array as prompts", raises(_gen(np.array([1.5, 2.5])), "prompt 0 is a float64")),
    ("a dict as GenerateRequest params", raises(
        lambda e: e.run([GenerateRequest("x", {"max_tokens": 1})], use_tqdm=False),
        "GenerateRequest.params is a dict")),
    ("an empty token list among prompts", raises(_gen([[1], []]), "prompt 1 is empty")),
    ("SamplingParams(max_tokens='3')", raises(lambda e: SamplingParams(max_tokens="3"),
                                              "max_tokens")),
    ("a 2-D id array embeds each row", outputs(_emb(np.array([[1, 2], [3, 4]])),
                                                lambda o: o.shape == (2, 256))),
    ("a generator of strings embeds each", outputs(_emb(s for s in ["a", "b"]),
                                                   lambda o: o.shape == (2, 256))),
    ("an int id list is one prompt", outputs(_gen([1, 2, 3], GREEDY), lambda o: len(o) == 1)),
]

CONFIGS = [
    ("scheduler as a list", config("scheduler=['ibs']", build=False, scheduler=["ibs"])),
    ("dtype as a list", config("dtype=['float32']", build=False, dtype=["float32"])),
    ("token_buckets=(0,)", config("token_buckets[0]=0", build=False, token_buckets=(0,))),
    ("token_buckets as a string", config("token_buckets='16,32'", build=False,
                                         token_buckets="16,32")),
    ("a float bucket", config("token_buckets[1]=16.5", build=False, token_buckets=(16, 16.5))),
    ("a negative page bucket", config("page_buckets[1]=-1", build=False, page_buckets=(8, -1))),
    ("chunk_size=0", config("chunk_size=0", build=False, chunk_size=0)),
    ("max_chunk_seqs 5 > max_num_seqs 4", config("max_chunk_seqs=5 exceeds max_num_seqs=4",
                                                 build=False, max_chunk_seqs=5, max_num_seqs=4)),
    ("chunk_size 33 > token_budget 32", config("chunk_size=33 exceeds token_budget=32",
                                               build=False, chunk_size=33, token_budget=32)),
    ("feather as a dict", config("feather={}", build=False, feather={})),
    ("prefix_caching 'yes'", config("prefix_caching", build=False, prefix_caching="yes")),
    ("cascade_rows=-1", config("cascade_rows=-1", build=False, cascade_rows=-1)),
    ("batching=None", config("batching=None", build=False, batching=None)),
    ("batching='FCFS'", config("batching='FCFS'", build=False, batching="FCFS")),
    ("layer_loop=1", config("layer_loop=1", build=False, layer_loop=1)),
    ("seed=2**40", config("seed=1099511627776", build=False, seed=2**40)),
    ("token_budget=True", config("token_budget=True", build=False, token_budget=True)),
    ("num_pages=1", config("num_pages=1", build=False, num_pages=1)),
    ("compile_cache=''", config("compile_cache=''", build=False, compile_cache="")),
    ("bench --max-chunk-seqs 9 --max-num-seqs 8", cli_refused(
        ["bench", "--max-chunk-seqs", "9", "--max-num-seqs", "8"], "max_chunk_seqs=9 exceeds")),
    ("batch --chunk-size 300", lambda ctx: batch(G, [], argv=["--chunk-size", "300"],
                                                 refused="chunk_size=300 exceeds")(ctx)),
    ("generate --chunk-size 300", cli_refused(["generate", "--chunk-size", "300"],
                                              "chunk_size=300 exceeds token_budget=256")),
]

ROUTER = [
    ("one of two replicas killed idle", kill_replicas([1], expect_down=False)),
    ("both replicas killed idle", kill_replicas([0, 1], expect_down=True)),
]

HELP = [(f"every {c} flag has help", help_complete(c)) for c in ("batch", "bench", "sim",
                                                                   "generate")]

ALL_CASES = [Case(cls, name, fn) for cls, group in (
    ("1 pipes", PIPES), ("2 rows", ROWS), ("3 outputs", OUTPUTS), ("4 sizes", SIZES),
    ("5 non-finite", FINITE), ("6 tokenizer", TOKENIZERS), ("7 shapes", SHAPES),
    ("8 special ids", SPECIAL), ("9 config", CONFIGS), ("10 router", ROUTER), ("11 help", HELP))
    for name, fn in group]
