"""Streamed text: the incremental deltas of `text_delta` add up to the full decode."""
import pytest

from hetero_jax.models.tokenizer import ByteTokenizer
from hetero_jax.models.detokenize import text_delta


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
