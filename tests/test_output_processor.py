"""Streamed deltas: the incremental text of `text_delta` adds up to the full decode, and
`merge_deltas` joins two deltas of one stream."""
import pytest

from hetero_jax.models.detokenize import text_delta
from hetero_jax.models.tokenizer import ByteTokenizer
from hetero_jax.outputs import GenerateDelta, RequestOutput
from hetero_jax.serving.output_processor import merge_deltas


@pytest.mark.parametrize("text", ["plain ascii", "héllo ✓ 日本語 🙂 done", "🙂" * 5])
def test_deltas_add_up_to_the_full_text_one_id_at_a_time(text):
    """Byte ids, so multi-byte characters arrive over several steps: no delta holds half a
    character (U+FFFD), and the deltas join to the whole decode."""
    tok = ByteTokenizer()
    ids = tok.encode(text)[1:]  # without the BOS
    out, read = [], 0
    for n in range(1, len(ids) + 1):
        piece, read = text_delta(tok, ids[:n], read)
        assert "\ufffd" not in piece, (n, piece)
        out.append(piece)
    assert read == len(ids) and "".join(out) == tok.decode(ids) == text


def test_merged_deltas_hold_both_and_the_later_end():
    """What a consumer behind the steps gets: ids, text and log-probs of both, in order, and
    the later one's end and output."""
    lp = lambda x: {"logprob": x, "top": []}  # noqa: E731
    out = RequestOutput(3, [9, 9], [1, 2, 3], "abc", "length", [lp(-1), lp(-2), lp(-3)], {})
    first = GenerateDelta("r", [1], "a", [lp(-1)], prompt_tokens=2)
    later = GenerateDelta("r", [2, 3], "bc", [lp(-2), lp(-3)], True, out, 2)
    both = merge_deltas(first, later)
    assert both == GenerateDelta("r", [1, 2, 3], "abc", out.logprobs, True, out, 2)
    plain = merge_deltas(GenerateDelta("r", [1], "a", None), GenerateDelta("r", [2], "b", None))
    assert (plain.token_ids, plain.text, plain.logprobs, plain.finished) == ([1, 2], "ab", None,
                                                                             False)
