"""Who wrote a reply: runs of (n_chars, "draft" | "target") over its text, accumulated chunk by chunk, and the speed
and acceptance trace of the answer for the page's chart. Gradio-free.

The engine host sends, with each chunk, the runs of the text that chunk adds; a reply keeps them in one list (never a
source per token, never the runs again per chunk). The chart gets a point per stretch of generated tokens, so its
updates follow the work done, not the clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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


def fold_runs(skipped: Any, newer: Any) -> Any:
    """For a reply job that skips chunks a newer one replaced: the newer chunk also carries the skipped chunk's
    runs, so no text loses its source."""
    return replace(newer, source_runs=[*skipped.source_runs, *newer.source_runs])


# -- the chart ------------------------------------------------------------------------------------------------------

SPEED, ACCEPTANCE = "decode speed (tok/s)", "acceptance (%)"
SERIES_COLOURS = {SPEED: "#2563eb", ACCEPTANCE: "#f59e0b"}
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
        """Take a point from the statistics after a step; whether one was taken."""
        n = int(stats.get("n_generated") or 0)
        again = bool(self.points) and self.points[-1][0] == n
        if n <= 0 or (again and not final) or (n < self._next and not final):
            return False
        drafted, accepted = stats.get("drafted") or 0, stats.get("accepted") or 0
        acceptance = round(100.0 * accepted / drafted, 1) if drafted else None  # nothing drafted yet: no rate
        if again:  # the final statistics of a step already charted replace its point
            self.points.pop()
        self.points.append((n, round(float(stats.get("decode_tok_s") or 0.0), 1), acceptance))
        self._next = (n // self.every + 1) * self.every
        return True

    def rows(self) -> list[dict[str, Any]]:
        """The points as the line chart reads them: one row per point and series."""
        rows = []
        for tokens, speed, acceptance in self.points:
            rows.append({"tokens": tokens, "value": speed, "series": SPEED})
            if acceptance is not None:
                rows.append({"tokens": tokens, "value": acceptance, "series": ACCEPTANCE})
        return rows
