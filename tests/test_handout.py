"""serve/handout.py against a plain per-row reference: which rows of a decode call are the common
case (`Handout.special`), and what `Handout.give` hands out (tokens, events, gaps, positions)."""
import queue

import numpy as np
import pytest

from preft_jax.sampling import SamplingParams
from serve.handout import Handout
from serve.request import Request
from serve.scheduler import DECODE, PREFILL, Sequence


def _rows(rng, n, shared_stops: bool, k: int):
    seqs = []
    for i in range(n):
        stops = (7, 11) if shared_stops else tuple(int(t) for t in rng.choice(40, size=rng.integers(0, 4), replace=False))
        req = Request(f"r{i}", [1, 2, 3], None, SamplingParams(max_new_tokens=50), stops, ())
        req.first_token_at = req.last_token_at = float(rng.uniform(0, 1))
        req.tokens = [int(t) for t in rng.integers(0, 40, size=rng.integers(1, 5))]
        s = Sequence(req, [1, 2, 3] + list(req.tokens), 3, status=DECODE)
        s.num_computed = len(s.tokens) - 1
        seqs.append(s)
    return seqs


def _special_ref(seqs, tokens, k):
    out = []
    for s, toks in zip(seqs, tokens.reshape(len(seqs), -1).tolist()):
        req = s.req
        out.append(any(t in req.stop_token_ids for t in toks) or req.finished
                   or req.first_token_at is None or s.status != DECODE)
    return np.array(out)


@pytest.mark.parametrize("shared_stops", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_special_rows_match_a_per_row_reference(shared_stops, k):
    rng = np.random.default_rng(k + 10 * shared_stops)
    seen = np.zeros(3, int)                             # common rows, special rows, rows special by a stop token only
    for trial in range(20):
        n = int(rng.integers(1, 40))
        seqs = _rows(rng, n, shared_stops, k)
        if trial % 2:                                   # the rare flags, on some rows
            for s in rng.choice(seqs, size=min(n, 3), replace=False):
                flag = rng.integers(3)
                if flag == 0:
                    s.req.finished = True
                elif flag == 1:
                    s.req.first_token_at = None
                else:
                    s.status = PREFILL
        tokens = rng.integers(0, 40, size=(n,) if k == 1 else (n, k))
        got = Handout(seqs).special(tokens, k)
        want = _special_ref(seqs, tokens, k)
        assert got.dtype == bool and got.tolist() == want.tolist()
        by_stop = want if trial % 2 == 0 else want & False
        seen += [(~want).sum(), want.sum(), by_stop.sum()]
    assert (seen > 2).all(), seen                       # every kind of row occurred (the test can fail)


class _Broken:
    def put(self, event):
        raise RuntimeError("the consumer is gone")


@pytest.mark.parametrize("k", [1, 4])
def test_give_hands_out_tokens_events_and_gaps(k):
    rng = np.random.default_rng(3 + k)
    seqs = _rows(rng, 9, False, k)
    seqs[3].req.events = _Broken()                      # ignored, as Request.emit does
    seqs[6].req.events = object()                       # no put at all: ignored too
    before = [(list(s.tokens), list(s.req.tokens), s.num_computed, s.req.last_token_at) for s in seqs]
    common = [i % 3 != 1 for i in range(9)]
    hand = Handout(seqs)
    tokens = rng.integers(0, 40, size=(9,) if k == 1 else (9, k)).tolist()
    gaps = hand.give(tokens, k, 5.0, common)
    want_gaps = []
    for i, (s, (st, rt, nc, last)) in enumerate(zip(seqs, before)):
        toks = [tokens[i]] if k == 1 else tokens[i]
        if not common[i]:
            assert (s.tokens, s.req.tokens, s.num_computed, s.req.last_token_at) == (st, rt, nc, last)
            assert s.req.events.empty()
            continue
        want_gaps.append(5.0 - last)
        assert s.tokens == st + toks and s.req.tokens == rt + toks
        assert s.num_computed == nc + k and s.req.last_token_at == 5.0
        if i not in (3, 6):
            assert s.req.events.get_nowait() == ("tokens", toks)
            with pytest.raises(queue.Empty):
                s.req.events.get_nowait()
    assert sorted(gaps) == sorted(want_gaps)
    assert hand.give([], k, 6.0, [False] * 9) == []     # no common row: nothing handed out


def test_special_sees_a_preemption_and_a_first_token_between_calls():
    """A chain's Handout is reused call after call: a row preempted since (Scheduler.preempt moves
    `Scheduler.preemptions`, the engine passes it) or a request whose first token arrives since
    is seen at the next call."""
    rng = np.random.default_rng(5)
    seqs = _rows(rng, 6, True, 1)
    seqs[4].req.first_token_at = None
    hand = Handout(seqs)
    toks = np.full(6, 3)
    assert hand.special(toks, 1, 0).tolist() == [i == 4 for i in range(6)]
    seqs[4].req.first_token_at = 1.0
    assert not hand.special(toks, 1, 0).any()
    seqs[2].status = PREFILL                            # preempted (status WAITING there; any non-decode)
    assert hand.special(toks, 1, 1).tolist() == [i == 2 for i in range(6)]
    assert hand.special(toks, 1, 1).tolist() == [i == 2 for i in range(6)]   # still, until it decodes
    seqs[2].status = DECODE
    assert not hand.special(toks, 1, 1).any()


def test_ended_scans_again_once_the_engines_count_moves():
    """`ended` (and `special`) skip the flag scans while the engine's count of ended or cancelled
    requests has not moved since a scan found none; a cancel or finish moves it (Engine.cancel,
    Engine._terminate) and the next call sees the row."""
    rng = np.random.default_rng(6)
    seqs = _rows(rng, 5, True, 1)
    hand = Handout(seqs)
    assert not hand.ended(3) and not hand.ended(3)
    seqs[1].req.cancelled = True
    assert hand.ended(4) and hand.ended(None)
    assert hand.ended_rows().tolist() == [i == 1 for i in range(5)]
    seqs[1].req.cancelled = False
    seqs[3].req.finished = True
    assert hand.special(np.full(5, 2), 1, 0, 5).tolist() == [i == 3 for i in range(5)]
