"""What a request returns: stream events and the final result."""

from __future__ import annotations

from dataclasses import dataclass

from .stats import Stats

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass
class StreamEvent:
    delta: str                              # text added since the previous event
    tokens: list[int]                       # tokens added since the previous event
    stats: Stats                            # snapshot after this step
    finish_reason: str | None = None        # set on the last event only
    finish_detail: str = ""


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str
    stats: Stats
    finish_detail: str = ""
