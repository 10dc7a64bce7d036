"""Incremental detokenization == decoding everything at once; stop strings cut exactly like a full
search; partial UTF-8 characters and stop-string prefixes are held back, never emitted early."""
import numpy as np
import pytest

from serve.byte_tokenizer import ByteTokenizer
from serve.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! Ünïcödé ✓ 日本語 🎉🎉 end", "line one\nline two\n\n  indented\tTAB", "a" * 50 + "é" * 5]


def _feed(detok, ids, rng):
    out, i = [], 0
    while i < len(ids):
        n = int(rng.integers(1, 4))
        r = detok.add(ids[i:i + n])
        out.append(r.text)
        if r.stopped:
            return "".join(out), True, r.n_tokens
        i += n
    out.append(detok.flush())
    return "".join(out), False, len(ids)


def _check_all(tok, texts):
    rng = np.random.default_rng(0)
    for text in texts:
        ids = tok.encode(text)
        got, stopped, _ = _feed(IncrementalDetokenizer(tok), ids, rng)
        assert got == tok.decode(ids) and not stopped
        for stop in (text[7:10], text[-3:], "zzz-not-there"):
            d = IncrementalDetokenizer(tok, [stop, "qqqq"])
            got, stopped, n = _feed(d, ids, rng)
            full = tok.decode(ids)
            cut = full.find(stop)
            if cut >= 0:
                assert stopped and got == full[:cut]
                assert tok.decode(ids[:n]).find(stop) >= 0 and tok.decode(ids[:n - 1]).find(stop) < 0
            else:
                assert not stopped and got == full


def test_byte_tokenizer_multibyte_characters():
    tok = ByteTokenizer()
    _check_all(tok, TEXTS)
    d = IncrementalDetokenizer(tok)
    assert d.add(list("é".encode())[:1]).text == ""            # half a character is held back
    assert d.add(list("é".encode())[1:]).text == "é"


def test_stop_prefix_is_held_back():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, ["STOP"])
    assert d.add(tok.encode("abc ST")).text == "abc"
    r = d.add(tok.encode("OP more"))
    assert r.stopped and r.text == " "
    d = IncrementalDetokenizer(tok, ["STOP"])
    d.add(tok.encode("abc ST"))
    assert d.add(tok.encode("ay")).text == " S"               # "Tay" could still start "STOP"? no: held 3
    assert d.flush() == "Tay"


@pytest.mark.real_model
def test_real_tokenizer_matches_full_decode(default_model):
    tok = default_model[2]
    _check_all(tok, TEXTS + ["The capital of France is Paris.\n\nIt has 2,165,423 inhabitants."])


def test_linear_time():
    """The work per token stays bounded: decode is never called on the whole output."""
    calls = []

    class Counting(ByteTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = Counting()
    d = IncrementalDetokenizer(tok, ["xyz"])
    for t in tok.encode("abcdefgh" * 300):
        d.add([t])
    assert max(calls) <= 8
