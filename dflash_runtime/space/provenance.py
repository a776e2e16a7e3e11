"""Who wrote a reply: runs of (n_chars, "draft" | "target") over its text, accumulated chunk by chunk. Gradio-free;
the engine host sends them, the web process's reply keeps them, the page shows them.

The engine host sends, with each chunk, the runs of the text that chunk adds; a reply keeps them in one list (never a
source per token, never the runs again per chunk).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
