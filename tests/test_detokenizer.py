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
    r = detok.flush()
    out.append(r.text)
    return "".join(out), r.stopped, len(ids)


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
    r = d.flush()
    assert r.text == "Tay" and not r.stopped


class MergedBytes(ByteTokenizer):
    """Byte tokenizer plus tokens of several bytes (ids 256+), like a BPE vocabulary whose tokens
    hold a whole character and the first bytes of the next (SmolLM2's b' \\xe2\\x80')."""
    MERGED = [b" \xe2\x80", "о".encode() + b"\xd0", b"x\xe6\x97"]
    vocab_size = 256 + len(MERGED)

    def decode(self, ids, skip_special_tokens=True):
        ids = [int(i) for i in ids if not (skip_special_tokens and i in self.special_token_ids)]
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, i):
        return bytes([i]) if i < 256 else self.MERGED[i - 256]


def _reference_cut(tok, ids, stop):
    full = tok.decode(ids)
    return full[:full.find(stop)] if stop in full else full, stop in full


def test_stop_string_in_text_held_back_for_a_partial_character():
    """A token that completes a stop string and starts a character (the rest never generated: the
    request ends on max_tokens or EOS) still stops: the text is cut, `stopped` says so - against the
    cut of a full decode."""
    tok = MergedBytes()
    cases = [([ord("a"), 256], " "),                        # "a" + " \xe2\x80": stop " " in the held text
             ([ord("1"), 256, 0xB0, ord(" "), ord("7"), 256], "7 "),
             ([ord("q"), 257], "о"),
             ([ord("y"), 258], "yx"),
             ([ord("a"), 256], "zz")]                       # no stop: the partial character is flushed
    for ids, stop in cases:
        want, stops = _reference_cut(tok, ids, stop)
        for chunk in (1, 2, len(ids)):
            d = IncrementalDetokenizer(tok, [stop])
            got, stopped = "", False
            for i in range(0, len(ids), chunk):
                r = d.add(ids[i:i + chunk])
                got += r.text
                if r.stopped:
                    stopped = True
                    break
            if not stopped:
                r = d.flush()
                got, stopped = got + r.text, r.stopped
            assert (got, stopped) == (want, stops), (ids, stop, chunk)
    rng = np.random.default_rng(3)                          # random mixes against the reference
    for _ in range(300):
        ids = [int(x) for x in rng.choice([ord("a"), ord(" "), 0xB0, 0x97, 0xA5, 256, 257, 258], size=rng.integers(1, 8))]
        full = tok.decode(ids)
        i = int(rng.integers(0, len(full)))
        stop = full[i:i + int(rng.integers(1, 3))]
        if "\ufffd" in stop:
            continue
        got, stopped, _ = _feed(IncrementalDetokenizer(tok, [stop]), ids, rng)
        assert (got, stopped) == _reference_cut(tok, ids, stop), (ids, stop)


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


def test_request_output_finishes_as_stop_when_the_flush_completes_a_stop_string():
    """The consumer side: a request the engine ended on its length whose held-back text completes a
    stop string ends as "stop", with the cut text, every token and the tokens' usage."""
    from types import SimpleNamespace

    from serve.output import RequestOutput
    tok = MergedBytes()
    for reason, stop, want_text, want_reason in (("length", " ", "a", "stop"), ("length", "zz", "a \ufffd", "length"),
                                                 ("stop", " ", "a", "stop")):
        req = SimpleNamespace(stop_strings=(stop,), sampling=SimpleNamespace(logprobs=None), request_id="r",
                              adapter=None, prompt_ids=[1, 2], result=None)
        out = RequestOutput(req, tok)
        events = out.handle(("tokens", [ord("a"), 256]))
        if reason == "stop":                    # the engine names the stop token before it finishes
            events += out.handle(("stop_token", (2, None)))
        events += out.handle(("finished", reason))
        kind, result = events[-1]
        text = "".join(e[1][1] for e in events if e[0] == "delta")
        assert kind == "done" and (result.text, text, result.finish_reason) == (want_text, want_text, want_reason)
        assert result.tokens == [ord("a"), 256] and result.completion_tokens == 2 + (reason == "stop")
        assert result.stop_token_id == (2 if reason == "stop" else None)
