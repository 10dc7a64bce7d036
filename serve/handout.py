"""Handing a decode call's tokens to its requests: the common case, with its per-row handles
gathered once per chain of calls.

A decode call returns each row's token (a fused call: k tokens per row). The engine hands them to
the row's sequence and request - `Sequence.tokens`, `Request.tokens`, one ("tokens", [...]) event
(serve/request.py) - and counts the gap since the request's previous token. Most rows of most calls
are the common case: no stop token among them, not the row's last tokens (its request's budget or
the context), no token hook and no log-probabilities, the request neither finished nor waiting for
its first token. `Handout.special` decides which rows are not, column-wise (numpy over the call's
tokens, and C-level scans of the requests' flags; the token budget is the engine's);
`Handout.give` hands out the others in one tight loop. The engine takes the special rows token by
token (`Engine._process_row`).

The handles - each row's request, its two token lists and its event sink's `put` - are read once
for a chain of pipelined calls over the same rows (`Engine._continue_decode` passes a chain's
`Handout` on while every row goes on), not once per call. A request's lists and sink are never
replaced while it runs (the engine sets the sink at submit), so a handle stays valid for the chain."""
from __future__ import annotations

import itertools
import operator

import numpy as np

from serve.scheduler import DECODE, Sequence

_REQ, _TOKENS, _STATUS = operator.attrgetter("req"), operator.attrgetter("tokens"), operator.attrgetter("status")
_FINISHED, _CANCELLED = operator.attrgetter("finished"), operator.attrgetter("cancelled")
_FIRST_AT = operator.attrgetter("first_token_at")
_STOPS = operator.attrgetter("stop_token_ids")
_DECODING = DECODE.__eq__


def _ignore(event) -> None:
    pass


def _put_of(req) -> object:
    """The request's sink's `put` (a sink without one drops its events, as `Request.emit` does)."""
    try:
        return req.events.put
    except Exception:  # noqa: BLE001 - a broken sink never reaches the engine
        return _ignore


class Handout:
    """The per-row handles of a decode call's sequences `seqs` (in row order of the call's output)."""
    __slots__ = ("seqs", "reqs", "seq_tokens", "req_tokens", "puts", "stops", "_started", "_preemptions", "_endings")

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs
        self.reqs = reqs = list(map(_REQ, seqs))
        self.seq_tokens = list(map(_TOKENS, seqs))
        self.req_tokens = list(map(_TOKENS, reqs))
        self.puts = list(map(_put_of, reqs))
        stops = set(map(_STOPS, reqs))
        if len(stops) == 1:                       # the usual case: one stop set (the model's EOS ids) for all
            self.stops = np.asarray(stops.pop(), np.int64).reshape(-1)
        else:                                     # per row, padded with -1 (never a token id)
            width = max(map(len, stops), default=0)
            table = np.full((len(reqs), max(width, 1)), -1, np.int64)
            for i, ids in enumerate(map(_STOPS, reqs)):
                table[i, :len(ids)] = ids
            self.stops = table
        self._started = False                     # every request has had its first token (never undone)
        self._preemptions = None                  # `Scheduler.preemptions` when every row was last seen decoding
        self._endings = None                      # the engine's count of ended requests when none of these was

    def ended(self, endings: int | None = None) -> bool:
        """Whether some row's request is finished or cancelled (two C-level scans). `endings`: the
        engine's count of requests ended or cancelled so far, read before this call (it moves
        after the flag is set): the scans are skipped while it equals the count at which they
        last found none (None: always scan)."""
        if endings is not None and endings == self._endings:
            return False
        reqs = self.reqs
        if any(map(_FINISHED, reqs)) or any(map(_CANCELLED, reqs)):
            return True
        self._endings = endings
        return False

    def ended_rows(self) -> np.ndarray:
        """Bool per row: its request is finished or cancelled."""
        return np.fromiter([r.finished or r.cancelled for r in self.reqs], bool, len(self.reqs))

    def special(self, tokens: np.ndarray, k: int, preemptions: int | None = None,
                endings: int | None = None) -> np.ndarray:
        """Bool per row: the row is not the common case - a stop token among its `tokens` ([n] or,
        fused, [n, k]), its request finished, its sequence not decoding, or its first token not
        handed out yet (whether the tokens are the row's last is the caller's: its token budget).
        `preemptions` (`Scheduler.preemptions`, the only way a decoding sequence stops decoding
        short of finishing): the rows' statuses are read again only when it moved since they were
        last all decoding (None: every call); `endings`: as for `ended`."""
        n, stops = len(self.reqs), self.stops
        if stops.ndim == 1:
            toks = tokens if tokens.ndim == 1 else tokens.reshape(n, -1)
            out = np.zeros(n, bool)
            for i, stop in enumerate(stops.tolist()):
                hit = toks == stop
                hit = hit if hit.ndim == 1 else hit.any(1)
                out = hit if i == 0 else out | hit
        else:
            out = (tokens.reshape(n, -1)[:, :, None] == self.stops[:, None, :]).any((1, 2))
        reqs = self.reqs
        check = self.ended(endings)
        if not self._started:
            self._started = None not in map(_FIRST_AT, reqs)
            check = check or not self._started
        if preemptions is None or preemptions != self._preemptions:
            decoding = all(map(_DECODING, map(_STATUS, self.seqs)))
            self._preemptions = preemptions if decoding else None
            check = check or not decoding
        if check:
            out |= np.fromiter([r.finished or r.first_token_at is None or s.status != DECODE
                                for s, r in zip(self.seqs, reqs)], bool, len(reqs))
        return out

    def give(self, tokens: list, k: int, now: float, common: list[bool] | None = None) -> list[float]:
        """Hands each row its `tokens` (`tokens[i]`: an id, or a fused call's k ids), every row or
        those where `common` holds: its sequence computed k more positions, the tokens appended
        to both lists, one event, `now` its last token time. A sink that raises is ignored (the
        consumer is gone: `Request.emit`). Returns the inter-token gaps to observe, one per row
        (a fused call's tokens arrive together: k - 1 more zero gaps per row, not listed)."""
        seqs, reqs, sts, rts, puts = self.seqs, self.reqs, self.seq_tokens, self.req_tokens, self.puts
        if common is not None:
            seqs, reqs, sts, rts, puts, tokens = (list(itertools.compress(x, common))
                                                  for x in (seqs, reqs, sts, rts, puts, tokens))
        gaps = [now - r.last_token_at for r in reqs]
        if k == 1:
            for s, r, st, rt, put, t in zip(seqs, reqs, sts, rts, puts, tokens):
                s.num_computed += 1
                r.last_token_at = now
                st.append(t)
                rt.append(t)
                try:
                    put(("tokens", [t]))
                except Exception:  # noqa: BLE001 - a broken sink never reaches the engine
                    pass
        else:
            for s, r, st, rt, put, t in zip(seqs, reqs, sts, rts, puts, tokens):
                s.num_computed += k
                r.last_token_at = now
                st.extend(t)
                rt.extend(t)
                try:
                    put(("tokens", t))
                except Exception:  # noqa: BLE001 - a broken sink never reaches the engine
                    pass
        return gaps
