"""vLLM's sampling knobs (penalties, n, stop strings) against references, and encode/chat."""
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hetero_jax import Engine, EngineConfig, PoolingParams, SamplingParams
from hetero_jax.models import llama
from hetero_jax.models.presets import preset_config
from hetero_jax.requests import GenerateRequest
from hetero_jax.runner.sampler import penalize, token_counts
from hetero_jax.serving.output_processor import delta
from tests.hf_models import save_byte_tokenizer
from tests.model_runs import full_logits
from tests.test_sampler import knobs

# one page bucket (16 pages of 16): the 200-step sequence crosses no bucket, a variant fewer
SMALL = EngineConfig(token_budget=64, max_model_len=256, token_buckets=(16, 64),
                     page_buckets=(16,))
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", config=SMALL)


def penalized64(logits, prompt, out, presence, frequency, repetition):
    """vLLM's penalties in float64 numpy: [V] logits of the next token after prompt + out."""
    x = logits.astype(np.float64)
    seen = np.zeros(x.shape, bool)
    seen[list(prompt) + list(out)] = True
    x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
    counts = np.bincount(np.asarray(out, int), minlength=x.shape[0])[:x.shape[0]]
    return x - frequency * counts - presence * (counts > 0)


def test_greedy_with_penalties_equals_a_float64_reference_over_200_steps(engine):
    """Each of 200 greedy tokens is the argmax of the float64 penalized logits of the model's
    full forward over the sequence so far (a float32 near-tie, gap < 1e-4, may go either way)."""
    prompt = "the cat sat on the mat. the cat sat on the mat."
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, **PENALTIES)
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    plain = engine.generate([prompt], SamplingParams(max_tokens=200, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids != plain.token_ids, "the penalties changed nothing: a weak test"
    ids = out.prompt_token_ids + out.token_ids
    logits = full_logits(preset_config("tiny"), llama.init_params(preset_config("tiny"), 0), ids)
    n = len(out.prompt_token_ids)
    assert len(out.token_ids) == 200
    for t, token in enumerate(out.token_ids):
        ref = penalized64(logits[n + t - 1], out.prompt_token_ids, out.token_ids[:t],
                          PENALTIES["presence_penalty"], PENALTIES["frequency_penalty"],
                          PENALTIES["repetition_penalty"])
        best = int(np.argmax(ref))
        assert token == best or ref[best] - ref[token] < 1e-4, f"step {t}: {token=} {best=}"


def test_penalties_compile_no_step_variant(engine):
    """The penalties are per-row arrays: a penalized run of the same shapes as a greedy one
    builds no step variant, only the small re-samplers its steps ask for (a greedy run asks
    for none)."""
    prompts = ["abc", "hello there"]
    resamplers = engine.runner.resampler.builds
    engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    before = engine.stats.compiles
    assert engine.runner.resampler.builds == resamplers
    engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.7, seed=1,
                                            **PENALTIES), use_tqdm=False)
    assert engine.stats.compiles == before
    assert engine.runner.resampler.builds > resamplers


def test_n_samples_are_reproducible_and_each_is_its_seeded_request(engine):
    prompt = "a prompt that spans more than one page of sixteen tokens"
    params = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=8)
    first = engine.generate([prompt, "x"], params, use_tqdm=False)
    again = engine.generate([prompt, "x"], params, use_tqdm=False)
    assert len(first) == 8  # n outputs per prompt, prompt-major
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first[:4]}) > 1
    alone = engine.generate([prompt], SamplingParams(seed=9, temperature=1.0, max_tokens=8),
                            use_tqdm=False)[0]
    assert alone.token_ids == first[2].token_ids  # sample 2 samples with seed 7 + 2
    assert all(o.prompt_token_ids == first[0].prompt_token_ids for o in first[:4])


def test_n_samples_share_the_prompt_pages(engine):
    """With prefix caching the samples after the first find the prompt's full pages cached."""
    engine.reset_prefix_cache()
    prompt = "z" * 40  # two full pages of 16 and a tail
    outs = engine.run([GenerateRequest(prompt, SamplingParams(n=3, max_tokens=2))],
                      use_tqdm=False)
    assert sorted(o.metrics["cached_tokens"] for o in outs)[1:] == [32, 32]


def test_n_is_one_per_stream(engine):
    with pytest.raises(ValueError, match=r"^prompt 0: n=2 is served by generate\(\) and run\(\)"):
        engine.prepare([GenerateRequest("x", SamplingParams(n=2))])


def test_encode_is_embed(engine):
    np.testing.assert_array_equal(engine.encode(["abc", "de"], use_tqdm=False),
                                  engine.embed(["abc", "de"], use_tqdm=False))


def test_chat_renders_the_default_template_for_a_preset(engine):
    greedy = SamplingParams(max_tokens=4, temperature=0)
    messages = [{"role": "user", "content": "hi"}]
    out = engine.chat(messages, greedy, use_tqdm=False)[0]
    ref = engine.generate(["<|user|>\nhi\n<|assistant|>\n"], greedy, use_tqdm=False)[0]
    assert out.prompt_token_ids == ref.prompt_token_ids and out.token_ids == ref.token_ids
    two = engine.chat([messages, messages], sampling_params=greedy, use_tqdm=False)
    assert [o.token_ids for o in two] == [ref.token_ids] * 2


TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def hf_pair(hf_model, tmp_path_factory):
    """(engine, torch model, transformers tokenizer) of one tiny Llama with a byte tokenizer
    whose chat template prints the bos token."""
    src, model = hf_model("llama3")
    path = tmp_path_factory.mktemp("llama3_tok")
    shutil.copytree(src, path, dirs_exist_ok=True)
    tok = save_byte_tokenizer(str(path), TEMPLATE)
    return Engine.from_pretrained(str(path), SMALL), model, tok


def test_stop_strings_end_the_text_where_transformers_does(hf_pair):
    """Greedy on one model and tokenizer: the engine's ids equal transformers'
    `generate(stop_strings=..., tokenizer=...)`, and its text is theirs without the stop
    string. The stop string spans two tokens and is taken from the unstopped output."""
    engine, model, tok = hf_pair
    greedy = dict(max_tokens=40, temperature=0, ignore_eos=True)
    full = engine.generate(["hello world"], SamplingParams(**greedy), use_tqdm=False)[0]
    stop = re.search(r"[ -~]{2}", full.text[3:]).group(0)  # two one-byte tokens
    out = engine.generate(["hello world"], SamplingParams(**greedy, stop=[stop, "never"]),
                          use_tqdm=False)[0]
    ids = torch.tensor([full.prompt_token_ids])
    ref = model.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop, "never"],
                         tokenizer=tok)[0, len(full.prompt_token_ids):].tolist()
    assert out.token_ids == ref and len(ref) < 40
    assert out.text + stop == tok.decode(ref) and out.finish_reason == "stop"
    assert stop not in out.text


def test_streamed_text_with_stop_strings_is_a_prefix_of_the_final(hf_pair):
    """Step by step, the text a front may send never holds the start of a stop string."""
    engine, _, _ = hf_pair
    full = engine.generate(["hello world"], SamplingParams(max_tokens=40, temperature=0,
                                                           ignore_eos=True), use_tqdm=False)[0]
    stop = re.search(r"[ -~]{2}", full.text[3:]).group(0)
    (req,) = engine.add([GenerateRequest("hello world", SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, stop=stop))])
    sent, read = "", 0
    while engine.has_work():
        for r in engine.step().progressed:
            d, read = delta(r, 0, read, engine.tokenizer, 0)
            sent += d.text
    out = engine.output(req)
    assert sent and out.text.startswith(sent) and full.text.startswith(out.text + stop)
    assert out.finish_reason == "stop"


def test_chat_uses_the_tokenizer_template_as_transformers_renders_it(hf_pair):
    engine, _, tok = hf_pair
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = engine.chat(messages, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert out.prompt_token_ids[0] == tok.bos_token_id


# -- errors that name the mistake, with their exact messages ---------------------------------

@pytest.mark.parametrize("call,error,message", [
    (lambda e: e.embed(["x"], SamplingParams()), TypeError,
     "params is a SamplingParams, which is for generate(); embed() takes PoolingParams"),
    (lambda e: e.generate(["x"], PoolingParams()), TypeError,
     "params is a PoolingParams, which is for embed(); generate() takes SamplingParams"),
    (lambda e: e.generate(["x"], [SamplingParams(), PoolingParams()]), TypeError,
     "params 1 is a PoolingParams, which is for embed(); generate() takes SamplingParams"),
    (lambda e: e.generate(["x"], {"max_tokens": 8}), TypeError,
     "params is a dict ({'max_tokens': 8}); expected SamplingParams, a list of them or None "
     "(as in vLLM, a dict is not taken: SamplingParams(**params) builds one)"),
    (lambda e: SamplingParams(max_token=8), TypeError,
     "SamplingParams has no keyword 'max_token'; did you mean 'max_tokens'?"),
    (lambda e: PoolingParams(normalise=True), TypeError,
     "PoolingParams has no keyword 'normalise'; did you mean 'normalize'?"),
    (lambda e: e.embed(["x"], pooling="mean"), TypeError,
     "embed() has no keyword 'pooling': it is a field of PoolingParams; pass "
     "PoolingParams(pooling='mean')"),
    (lambda e: e.generate(["x"], temprature=0), TypeError,
     "generate() has no keyword 'temprature'; did you mean SamplingParams(temperature=...)?"),
    (lambda e: e.generate(["x"], use_tqmd=False), TypeError,
     "generate() has no keyword 'use_tqmd'; did you mean 'use_tqdm'?"),
    (lambda e: e.generate(["x"], SamplingParams(max_tokens=10**6)), ValueError,
     "prompt 0: max_tokens=1000000 exceeds max_model_len=256 (prompt and output together; "
     "at most 255)"),
    (lambda e: Engine.from_pretrained("org/name"), FileNotFoundError,
     "model directory 'org/name' does not exist. 'org/name' looks like a Hugging Face Hub id: "
     "hetero-jax fetches nothing at run time; download it first (huggingface-cli download "
     "org/name --local-dir DIR) and pass DIR"),
    (lambda e: Engine.from_preset("tiny", embed_model="sentence-transformers/all-MiniLM-L6-v2"),
     FileNotFoundError, "embedding model directory 'sentence-transformers/all-MiniLM-L6-v2' "
     "does not exist. 'sentence-transformers/all-MiniLM-L6-v2' looks like a Hugging Face Hub "
     "id: hetero-jax fetches nothing at run time; download it first (huggingface-cli download "
     "sentence-transformers/all-MiniLM-L6-v2 --local-dir DIR) and pass DIR"),
    (lambda e: Engine.from_preset("org/name"), ValueError,
     "unknown preset 'org/name'; available: mini, tiny, small, llama-8b-shape. 'org/name' looks "
     "like a Hugging Face Hub id: hetero-jax fetches nothing at run time; download it first "
     "(huggingface-cli download org/name --local-dir DIR) and pass DIR"),
    (lambda e: SamplingParams(stop=[""]), ValueError,
     "stop=[''] must be a string or a list of non-empty strings"),
    (lambda e: SamplingParams(presence_penalty=3), ValueError,
     "presence_penalty=3.0 must be in [-2, 2]"),
    (lambda e: SamplingParams(repetition_penalty=0), ValueError,
     "repetition_penalty=0.0 must be > 0 (1 is off)"),
])
def test_errors_name_the_mistake(engine, call, error, message):
    with pytest.raises(error) as info:
        call(engine)
    assert str(info.value) == message
    assert not engine.has_work()


def test_vllm_keyword_names_are_taken(engine):
    greedy = SamplingParams(max_tokens=3, temperature=0)
    assert [o.token_ids for o in engine.generate(["ab"], sampling_params=greedy,
                                                 use_tqdm=False)] == \
        [o.token_ids for o in engine.generate(["ab"], greedy, use_tqdm=False)]
    np.testing.assert_array_equal(
        engine.embed(["ab"], pooling_params=PoolingParams(pooling="last"), use_tqdm=False),
        engine.embed(["ab"], PoolingParams(pooling="last"), use_tqdm=False))


def test_penalties_hand_computed_from_a_paged_token_table():
    """Row 0's pages are [2, 1] (page size 2): positions 0-3 hold ids 0, 3 (prompt), 1, 1
    (generated); slot 0 (the scratch page) holds garbage that kv_len leaves out."""
    table = jnp.array([3, 3, 1, 1, 0, 3], jnp.int32)  # [3 pages * 2]
    k = knobs(1, temperature=0.0, presence=0.25, frequency=0.5, repetition=2.0, kv_len=4,
              prompt_len=2)
    counts, seen = token_counts(table, jnp.array([[2, 1, 0]], jnp.int32), k, 4, 2)
    assert counts.tolist() == [[0, 2, 0, 0]] and seen.tolist() == [[True, True, False, True]]
    logits = jnp.array([[2.0, -1.0, 0.5, 1.0]])
    got = penalize(logits, counts, seen, k)
    # 2 / 2; -1 * 2 - 0.5 * 2 - 0.25; untouched; 1 / 2
    np.testing.assert_allclose(got, [[1.0, -3.25, 0.5, 0.5]])
