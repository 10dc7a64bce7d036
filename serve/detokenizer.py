"""Token ids -> text, outside the engine's step: incremental detokenization, stop strings and
UTF-8 hold-back, in time linear in the output length.

`IncrementalDetokenizer.add(ids)` returns the text that is now safe to show: it decodes only a
small window of recent tokens (a prefix offset keeps the tokenizer's merging/spacing context), holds
back a partial UTF-8 character (U+FFFD at the end) and any suffix that could be the start of a stop
string, and reports a stop string when the text reaches one (the text is cut before it).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

_REPLACEMENT = "\ufffd"
_WINDOW = 6          # tokens of left context decoded with new ones (as vLLM's incremental detokenizer)


@dataclasses.dataclass
class DetokenizerOutput:
    text: str                   # newly safe text
    stopped: bool = False       # a stop string was reached (text is cut before it)
    n_tokens: int = 0           # tokens consumed so far when the stop string completed (else all)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = tuple(s for s in stop_strings if s)
        self.hold = max((len(s) - 1 for s in self.stop), default=0)
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0          # ids[prefix_offset:read_offset] were decoded already (context)
        self.read_offset = 0
        self.text = ""                  # all decoded text so far (settled)
        self.emitted = 0                # characters of `text` already returned
        self.stopped = False

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, ids: Sequence[int]) -> DetokenizerOutput:
        if self.stopped:
            return DetokenizerOutput("", True, len(self.ids))
        for i, t in enumerate(ids):
            self.ids.append(int(t))
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
                new = full[len(prefix):]
                self.prefix_offset = max(self.read_offset, len(self.ids) - _WINDOW)
                self.read_offset = len(self.ids)
                start = max(0, len(self.text) - self.hold)
                self.text += new
                if self._cut_at_stop(start):
                    return DetokenizerOutput(self._take(), True, len(self.ids))
        safe = len(self.text) - self.hold
        out = ""
        if safe > self.emitted:
            out = self.text[self.emitted:safe]
            self.emitted = safe
        return DetokenizerOutput(out, False, len(self.ids))

    def flush(self) -> DetokenizerOutput:
        """The held-back text at the end of generation (a dangling partial character included), cut
        before a stop string it completes: `stopped` says so (every token is consumed either way)."""
        if not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            start = max(0, len(self.text) - self.hold)
            self.text += full[len(prefix):]
            self.read_offset = len(self.ids)
            if self._cut_at_stop(start):
                return DetokenizerOutput(self._take(), True, len(self.ids))
        return DetokenizerOutput(self._take(), False, len(self.ids))

    def _cut_at_stop(self, start: int) -> bool:
        """Cuts `text` before the first stop string found from character `start` (where the text
        could first hold one it did not before); True when one was found."""
        if not self.stop:
            return False
        hit = min((j for j in (self.text.find(s, start) for s in self.stop) if j >= 0), default=-1)
        if hit < 0:
            return False
        self.text = self.text[:hit]
        self.stopped = True
        return True

    def _take(self) -> str:
        """All of `text` not yet returned."""
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out
