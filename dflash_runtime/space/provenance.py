"""Who wrote a reply: runs of (n_chars, "draft" | "target") over its text, accumulated chunk by chunk, and the speed
and acceptance trace of the answer for the page's chart. Gradio-free.

The engine host sends, with each chunk, the runs of the text that chunk adds; a reply keeps them in one list (never a
source per token, never the runs again per chunk). The chart gets a point per stretch of generated tokens, so its
updates follow the work done, not the clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DRAFT, TARGET = "draft", "target"
Run = tuple[int, str]


def join(out: list[Run], n: int, source: str) -> None:
    """Append a run to `out`, joined to the last one when it has the same source."""
    if out and out[-1][1] == source:
        out[-1] = (out[-1][0] + n, source)
    else:
        out.append((n, source))


def merged(runs: Iterable[Run]) -> list[Run]:
    """The runs with neighbours of one source joined and empty runs left out."""
    out: list[Run] = []
    for n, source in runs:
        if n > 0:
            join(out, n, source)
    return out


def draft_text(text: str, runs: Sequence[Run]) -> str:
    """The characters of `text` that the runs mark as written by the draft, in order."""
    parts, offset = [], 0
    for n, source in runs:
        if source == DRAFT:
            parts.append(text[offset : offset + n])
        offset += n
    return "".join(parts)


@dataclass
class SourceRuns:
    """The runs of one reply: `chunks` in arrival order (a view renders them as they came, so what it rendered before
    stays a prefix of what it renders next), `runs` joined (what the API returns)."""

    chunks: list[Run] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    n_chars: int = 0

    def add(self, runs: Iterable[Run]) -> None:
        for n, source in runs:
            if n <= 0:
                continue
            self.chunks.append((n, source))
            self.n_chars += n
            join(self.runs, n, source)

    def as_json(self) -> list[list[Any]]:
        """The joined runs as JSON lists, a new list each call (Gradio diffs what an endpoint yields against the
        previous item: a list it already sent must not change under it)."""
        return [[n, source] for n, source in self.runs]


# -- the chart ------------------------------------------------------------------------------------------------------

SPEED, ACCEPTANCE = "decode speed (tok/s)", "acceptance (%)"  # each series has a chart (and a y axis) of its own
MIN_POINT_EVERY = 4
POINTS_PER_ANSWER = 48


def point_every(max_tokens: int) -> int:
    """Tokens between two chart points: about POINTS_PER_ANSWER points for an answer of max_tokens."""
    return max(MIN_POINT_EVERY, max_tokens // POINTS_PER_ANSWER)


@dataclass
class SpeedTrace:
    """Decode speed and acceptance so far, a point each time `every` more tokens were generated, and at the end. The
    last point is what the statistics panel shows."""

    every: int
    points: list[tuple[int, float, float | None]] = field(default_factory=list)  # (tokens, tok/s, acceptance %)
    _next: int = 0

    def __post_init__(self) -> None:
        # The first point waits for a stretch of tokens: the speed of the first few (the first is the prefill's own
        # sample, timed at almost nothing) is meaningless and would set the chart's scale.
        self._next = self.every

    def add(self, stats: Mapping[str, Any], final: bool = False) -> bool:
        """Take a point from the statistics after a step (the API's: acceptance as the engine counted it, the decode
        speed of the steps so far, None before the first); whether one was taken."""
        n = int(stats.get("n_generated") or 0)
        speed = stats.get("decode_tok_s")
        again = bool(self.points) and self.points[-1][0] == n
        if n <= 0 or speed is None or (again and not final) or (n < self._next and not final):
            return False
        acceptance = round(100.0 * stats["acceptance_rate"], 1) if stats.get("drafted") else None  # none drafted
        if again:  # the final statistics of a step already charted replace its point
            self.points.pop()
        self.points.append((n, round(float(speed), 1), acceptance))
        self._next = (n // self.every + 1) * self.every
        return True

    def rows(self, series: str) -> list[dict[str, Any]]:
        """The points of one series (SPEED or ACCEPTANCE) as its line chart reads them."""
        column = 1 if series == SPEED else 2
        return [{"tokens": p[0], "value": p[column]} for p in self.points if p[column] is not None]
