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
left out. The mean is of every timed step, the slow ones too: the answer's own speed counts its steps' stalls, and so
does a plain answer's (a mean without its slowest tenth put the estimate a quarter below the A/B on a loaded machine).

Where drafting pays, plain steps are rare: the adaptive draft length takes one at its second round and one every few
dozen rounds after (dflash_runtime.controller), so the estimate rests on few of them. Its uncertainty is then that
of a mean of so few steps, with the spread of one step's time taken from every step of the answer timed alone
(`MIN_SPREAD_STEPS`: the verify steps too, each against the mean of the steps of its row count, pooled). A verify's
rows are not extrapolated to one row: where batches run on more threads than one-row decodes (GPU-like settings),
a verify of eight rows may cost what a one-row step costs, and only a one-row step says what plain decoding costs.
With `MIN_PLAIN_STEPS` timed plain steps their own spread is used. The estimate is shown from `MIN_TOKENS` tokens on.
Its margin, about 95 % carried to the ratio, is twice the standard error of the difference between the mean timed
step and the mean step of a plain answer as long as this one (three times where the spread is borrowed: see
Z_BORROWED) (what the A/B measures: one token a step), so it holds
for what the A/B then measures, not only for this answer's own steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MIN_PLAIN_STEPS = 8  # timed plain steps whose own spread gives the margin (fewer: the spread of every timed step)
MIN_SPREAD_STEPS = 8  # steps timed alone before their spread stands for one step's
MIN_TOKENS = 32  # tokens written before a figure: the first few steps are dominated by the answer's start
# Standard errors in the margin: 2 (about 95 %) with the plain steps' own spread; 3 where it is borrowed from the
# steps timed alone, verifies mostly, which vary less than a lone one-row step among them does (with two to four
# plain steps, intervals of 2 missed the A/B's ratio by up to 1.1 times their width on 3 of 15 prompts).
Z_OWN, Z_BORROWED = 2.0, 3.0


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
    _alone: dict[int, list[float]] = field(default_factory=dict)  # wall ms of steps timed alone, by their rows
    # (plain steps, verify steps, decode ms, inject ms, draft ms, drafted) of the previous snapshot
    _last: tuple[int, int, float, float, float, int] | None = None

    def add(self, stats: Mapping[str, Any]) -> None:
        now = (int(stats.get("plain_steps") or 0), int(stats.get("verify_steps") or 0),
               float(stats.get("decode_ms") or 0.0), float(stats.get("inject_ms") or 0.0),
               float(stats.get("draft_ms") or 0.0), int(stats.get("drafted") or 0))  # fmt: skip
        if self._last is not None:
            plain, verify = now[0] - self._last[0], now[1] - self._last[1]
            elapsed = (now[2] - self._last[2]) - (now[3] - self._last[3])
            if plain > 0 and verify == 0 and elapsed > 0:
                self._samples.append((plain, elapsed))
                if plain == 1:
                    self._alone.setdefault(1, []).append(elapsed)
            if plain == 0 and verify == 1:  # one verify alone: its target step, without the draft's own work
                step = elapsed - (now[4] - self._last[4])
                if step > 0:
                    self._alone.setdefault(1 + now[5] - self._last[5], []).append(step)
        self._last = now

    @property
    def timed_steps(self) -> int:
        return sum(steps for steps, _ in self._samples)

    def current(self, stats: Mapping[str, Any]) -> Estimate | Pending:
        """The estimate for the answer whose latest statistics are `stats` (its decode speed, `decode_tok_s`)."""
        timed, speed = self.timed_steps, stats.get("decode_tok_s")
        if timed == 0:
            fixed = stats.get("draft_length") not in ("auto", 0, None)
            if fixed and not stats.get("plain_steps"):
                return Pending("a fixed draft length drafts at every step, so there is no plain step to compare with")
            return Pending("it shows once this answer has taken a plain step to compare with", timed)
        if timed < self.min_plain_steps and self.spread_steps < MIN_SPREAD_STEPS:
            return Pending(f"it shows once {MIN_SPREAD_STEPS} steps are timed", timed)
        if not speed or int(stats.get("n_generated") or 0) < self.min_tokens:
            return Pending(f"it shows after {self.min_tokens} tokens", timed)
        samples = self._samples
        mean_ms = sum(ms for _, ms in samples) / timed
        if timed >= self.min_plain_steps:
            # Each interval's mean step, weighted by its steps: the spread of one step's time around the mean.
            spread = math.sqrt(sum(n * (ms / n - mean_ms) ** 2 for n, ms in samples) / (timed - 1)) / mean_ms
            z = Z_OWN
        else:
            spread, z = self.relative_spread(), Z_BORROWED
        plain_answer_steps = max(1, int(stats.get("n_generated") or 0))
        relative = z * spread * math.sqrt(1 / timed + 1 / plain_answer_steps)
        ratio = float(speed) * mean_ms / 1000.0
        return Estimate(ratio, ratio * relative, float(speed), 1000.0 / mean_ms, timed)

    @property
    def spread_steps(self) -> int:
        """Steps timed alone in groups of at least two (those whose spread is known)."""
        return sum(len(times) for times in self._alone.values() if len(times) > 1)

    def relative_spread(self) -> float:
        """One step's time around the mean of its row count's, relative to that mean: pooled over the steps timed
        alone."""
        deviations = []
        for times in self._alone.values():
            if len(times) > 1:
                mean = sum(times) / len(times)
                deviations += [t / mean - 1 for t in times]
        groups = sum(1 for times in self._alone.values() if len(times) > 1)
        return math.sqrt(sum(d * d for d in deviations) / max(1, len(deviations) - groups))


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
