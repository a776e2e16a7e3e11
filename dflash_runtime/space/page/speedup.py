"""An answer's speed as the page shows it: a live estimate of how much faster it runs than plain decoding would, from
the answer's own steps, and the chart's trace of its decode speed and acceptance (`SpeedTrace`: a point per stretch of
generated tokens, so the chart's updates follow the work done, not the clock).

Plain decoding writes one token per step of the target. A speculative answer with an adaptive draft length takes
plain steps too (one token, no draft) wherever drafting would not pay, so the time of those steps, measured inside
the same answer, says what plain decoding costs here and now: on the same engine, under the same load (other answers
sharing its steps make every step of this answer longer, plain ones included). The estimate is this answer's speed
against one token per such step.

A plain step is timed as the wall time between two consecutive snapshots of the answer's statistics with nothing
but plain steps between them (`decode_ms` grows by the whole step: the target's decode, sampling, the host's work
and the stream), less the time the draft took to take in the target's features then (`inject_ms`: plain decoding
does no such thing), so it costs what a step of a plain answer costs. Snapshots that mix verify and plain steps are
left out. The mean leaves out the tenth of the timed steps that took longest and the tenth that took shortest (a
machine that stalls once for a second would otherwise move the figure by tens of percent). The estimate is shown only
once it rests on `MIN_PLAIN_STEPS` timed steps and `MIN_TOKENS` tokens; its uncertainty is the standard error of
that mean, twice (about 95 %), carried to the ratio.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MIN_PLAIN_STEPS = 8  # timed plain steps before a figure is shown: fewer swing by tens of percent
MIN_TOKENS = 32  # and tokens written: the first few steps are dominated by the answer's start
TRIM = 0.1  # the share of timed intervals left out at each end of the mean


@dataclass(frozen=True)
class Estimate:
    """The answer's speed against plain decoding, from `plain_steps` timed plain steps."""

    ratio: float  # this answer's tok/s over plain decoding's (one token per timed plain step)
    margin: float  # ± this, about 95 %: the uncertainty of the mean plain step
    speed: float  # this answer's tok/s
    plain_speed: float  # one token per timed plain step
    plain_steps: int


@dataclass(frozen=True)
class Pending:
    """Not shown yet: why, in a few words."""

    reason: str
    timed: int = 0  # timed plain steps so far


@dataclass
class LiveSpeedUp:
    """Fed every snapshot of one answer's statistics, in order (`add`); `current` is the estimate so far."""

    min_plain_steps: int = MIN_PLAIN_STEPS
    min_tokens: int = MIN_TOKENS
    _samples: list[tuple[int, float]] = field(default_factory=list)  # (plain steps, their wall ms) per interval
    # (plain steps, verify steps, decode ms, inject ms) of the previous snapshot
    _last: tuple[int, int, float, float] | None = None

    def add(self, stats: Mapping[str, Any]) -> None:
        now = (int(stats.get("plain_steps") or 0), int(stats.get("verify_steps") or 0),
               float(stats.get("decode_ms") or 0.0), float(stats.get("inject_ms") or 0.0))  # fmt: skip
        if self._last is not None:
            plain, verify = now[0] - self._last[0], now[1] - self._last[1]
            elapsed = (now[2] - self._last[2]) - (now[3] - self._last[3])
            if plain > 0 and verify == 0 and elapsed > 0:
                self._samples.append((plain, elapsed))
        self._last = now

    @property
    def timed_steps(self) -> int:
        return sum(steps for steps, _ in self._samples)

    def current(self, stats: Mapping[str, Any]) -> Estimate | Pending:
        """The estimate for the answer whose latest statistics are `stats` (its decode speed, `decode_tok_s`)."""
        timed, speed = self.timed_steps, stats.get("decode_tok_s")
        if timed < self.min_plain_steps:
            fixed = stats.get("draft_length") not in ("auto", 0, None)
            if fixed and not stats.get("plain_steps"):
                return Pending("a fixed draft length drafts at every step, so there is no plain step to compare with")
            return Pending(f"it shows once this answer has taken {self.min_plain_steps} plain steps to compare with",
                           timed)  # fmt: skip
        if not speed or int(stats.get("n_generated") or 0) < self.min_tokens:
            return Pending(f"it shows after {self.min_tokens} tokens", timed)
        kept = trimmed(self._samples)
        steps = sum(n for n, _ in kept)
        mean_ms = sum(ms for _, ms in kept) / steps
        # Each interval's mean step, weighted by its steps: the spread of one step's time around the mean.
        spread = sum(n * (ms / n - mean_ms) ** 2 for n, ms in kept) / max(1, steps - 1)
        relative = 2 * math.sqrt(spread / steps) / mean_ms
        ratio = float(speed) * mean_ms / 1000.0
        return Estimate(ratio, ratio * relative, float(speed), 1000.0 / mean_ms, timed)


def trimmed(samples: list[tuple[int, float]], share: float = TRIM) -> list[tuple[int, float]]:
    """The intervals less the `share` with the longest and the `share` with the shortest step time."""
    cut = int(len(samples) * share)
    ordered = sorted(samples, key=lambda sample: sample[1] / sample[0])
    return ordered[cut : len(ordered) - cut] if cut else ordered


# -- the chart's trace -------------------------------------------------------------------------------------------------

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
