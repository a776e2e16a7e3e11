"""What a request returns: stream events and the final result."""

from __future__ import annotations

from dataclasses import dataclass, field

from .stats import Stats

FINISH_REASONS = ("stop", "length", "cancelled")
TOKEN_SOURCES = ("draft", "target")  # an accepted draft token, or the target's own sample


@dataclass
class StreamEvent:
    delta: str                              # text added since the previous event
    tokens: list[int]                       # tokens added since the previous event
    stats: Stats                            # snapshot after this step
    finish_reason: str | None = None        # set on the last event only
    finish_detail: str = ""
    token_sources: list[str] = field(default_factory=list)  # one per token: "draft" or "target"
    delta_sources: list[tuple[int, str]] = field(default_factory=list)  # `delta` as runs of (n_chars, source)


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str
    stats: Stats
    finish_detail: str = ""
    token_sources: list[str] = field(default_factory=list)  # one per token: "draft" or "target"
