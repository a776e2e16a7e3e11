"""Tokens → text deltas: UTF-8 pieces joined across token boundaries, stop strings held back until decided."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from ..native.vocab import Vocabulary


class TextDeltas:
    """Feeds tokens, returns the text that is safe to show; `stopped` once a stop string completed.

    Each character remembers the source of the token that completed it ("draft" or "target"); `take_runs()` gives
    the released text's sources as runs [(n_chars, source), ...], so a view can mark what the draft wrote."""

    def __init__(self, vocab: Vocabulary, stop: Sequence[str] = ()) -> None:
        self._vocab = vocab
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""
        self._pending_sources: list[str] = []
        self._runs: list[tuple[int, str]] = []
        self.text = ""
        self.stopped = False

    def feed(self, token: int, source: str = "target") -> str:
        if self.stopped:
            return ""
        piece = self._decoder.decode(self._vocab.piece(token))
        self._pending += piece
        self._pending_sources += [source] * len(piece)
        return self._release(final=False)

    def take_runs(self) -> list[tuple[int, str]]:
        """Sources of the text released since the last call, as runs of (character count, source)."""
        runs, self._runs = self._runs, []
        return runs

    def finish(self) -> str:
        if self.stopped:
            return ""
        tail = self._decoder.decode(b"", final=True)
        self._pending += tail
        self._pending_sources += ["target"] * len(tail)  # an incomplete UTF-8 sequence's replacement character
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            n, self.stopped = cut, True
        elif final or not self._stop:
            n = len(self._pending)
        else:
            n = len(self._pending) - self._holdback()  # keep back a tail that could still become a stop string
        out, sources = self._pending[:n], self._pending_sources[:n]
        self._pending, self._pending_sources = self._pending[n:], self._pending_sources[n:]
        if self.stopped:
            self._pending, self._pending_sources = "", []
        for source in sources:
            if self._runs and self._runs[-1][1] == source:
                self._runs[-1] = (self._runs[-1][0] + 1, source)
            else:
                self._runs.append((1, source))
        self.text += out
        return out

    def _holdback(self) -> int:
        tail = self._pending[-self._hold:] if self._hold else ""
        for n in range(len(tail), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self._stop):
                return n
        return 0
