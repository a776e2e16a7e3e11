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
left out. Where many are timed, the mean is of every timed step, the slow ones too: the answer's own speed counts its
steps' stalls, and so does a plain answer's (a mean without its slowest tenth put the estimate a quarter below the A/B
on a loaded machine).

Where drafting pays, plain steps are rare: the adaptive draft length takes one at its second round and one every few
dozen rounds after (dflash_runtime.decoding.controller), so the estimate rests on few of them. Two things then move a
mean of them away from a plain answer's mean step, and the estimate meets both:
- One step may stall (a page fault, the scheduler, a collection): of two or three steps, one stall would be the
  figure. So the centre of a few is their median; of two, the faster one raised by what the faster of two falls
  short of their centre (`FASTER_OF_TWO` spreads).
- A plain step among verify steps is not a plain answer's step: it runs after a verify of several rows, on other
  threads (GPU-like settings), with other data in the caches. Measured here it sits 6 % (one standard deviation) off
  a plain answer's mean step beyond its own noise, alike for every lone step of the answer, so more of them do not
  average it away: `LONE_STEP`, in the margin for the share of the timed plain steps that came alone.
The spread of one step is that of the verify steps around the median of their row count (from their median absolute
deviation: the spread of steps that did not stall), or the plain steps' own where they disagree more. A verify's rows
are not extrapolated to one row: where batches run on more threads than one-row decodes, a verify of eight rows may
cost what a one-row step costs, and only a one-row step says what plain decoding costs. Nor is a plain step corrected
for the load its neighbouring verify steps say: load slows a verify on two threads far more than a one-row step on
one, and on 87 answers such a correction's error was no smaller (9.6 % against 9.0 %; one plain step was put at 2.9
times a plain answer's). Measured on 100 answers of the demo pair (GPU-like thread regime; 60 on a quiet machine, 40
with bursts of load on one core), against the A/B: off by 6 % (root mean square) quiet and 12 % with bursts, margins
about ±13 %, two of 100 missed; the plain mean of the same steps with three verify spreads was off by 6 % and 18 %,
margins about ±11 % and ±22 %, four missed.

With `MIN_PLAIN_STEPS` timed plain steps, spread over the answer and carrying its load themselves, their plain mean and
their own spread are used. The estimate is shown from `MIN_TOKENS` tokens on. Its margin, about 95 % carried to the
ratio, is Z standard errors of the difference between the mean timed step and the mean step of a plain answer as long
as this one (what the A/B measures: one token a step), so it holds for what the A/B then measures, not only for this
answer's own steps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MIN_PLAIN_STEPS = 8  # timed plain steps whose own mean and spread stand for the answer's
MIN_SPREAD_STEPS = 8  # verify steps timed alone (of row counts seen twice) before their spread stands for one step's
MIN_TOKENS = 32  # tokens written before a figure: the first few steps are dominated by the answer's start
FASTER_OF_TWO = 0.5642  # how far below their mean the faster of two normal samples falls, in standard deviations
MAD_TO_SD = 1.4826  # a normal spread's standard deviation over its median absolute deviation
Z = 2.0  # standard errors in the margin: about 95 %
# How far a plain step timed alone among verify steps may sit from a plain answer's mean step beyond its own noise
# (relative, one standard deviation): it runs after a verify of several rows, on other threads (GPU-like settings) and
# with other data in the caches. Measured 6 % over 25 answers of the demo pair in the GPU-like thread regime.
LONE_STEP = 0.06


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
    """Not shown yet: why, in a few words a visitor reads ("no one-token step timed yet")."""

    reason: str
    timed: int = 0  # timed plain steps so far
    fixed: bool = False  # a fixed draft length: never shown in this answer


@dataclass(frozen=True)
class _Timed:
    """A stretch between two snapshots with one kind of step in it: plain steps (`plain` > 0, one row each), or one
    verify step of `rows` rows (`ms`: its target step, without the draft's own work)."""

    rows: int
    ms: float
    plain: int = 0
    lone: bool = False  # one plain step right after a verify step (not in a run of plain steps)


@dataclass
class LiveSpeedUp:
    """Fed every snapshot of one answer's statistics, in order (`add`); `current` is the estimate so far."""

    min_plain_steps: int = MIN_PLAIN_STEPS
    min_tokens: int = MIN_TOKENS
    _timeline: list[_Timed] = field(default_factory=list)  # in the answer's order
    _verified_last: bool = False  # whether the latest stretch had a verify step in it
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
                self._timeline.append(_Timed(1, elapsed, plain, lone=plain == 1 and self._verified_last))
            if plain == 0 and verify == 1:  # one verify alone: its target step, without the draft's own work
                step = elapsed - (now[4] - self._last[4])
                if step > 0:
                    self._timeline.append(_Timed(1 + now[5] - self._last[5], step))
        self._verified_last = now[1] > (self._last[1] if self._last is not None else 0)
        self._last = now

    @property
    def timed_steps(self) -> int:
        return sum(t.plain for t in self._timeline)

    def current(self, stats: Mapping[str, Any]) -> Estimate | Pending:
        """The estimate for the answer whose latest statistics are `stats` (its decode speed, `decode_tok_s`)."""
        timed, speed = self.timed_steps, stats.get("decode_tok_s")
        if timed == 0:
            fixed = stats.get("draft_length") not in ("auto", 0, None)
            if fixed and not stats.get("plain_steps"):
                return Pending("a fixed draft length takes no one-token step to compare with", fixed=True)
            return Pending("no one-token step (without the draft) timed yet", timed)
        few = timed < self.min_plain_steps
        deviations = _verify_deviations(self._timeline) if few else []
        if few and len(deviations) < MIN_SPREAD_STEPS:
            return Pending(f"fewer than {MIN_SPREAD_STEPS} of its steps timed", timed)
        if not speed or int(stats.get("n_generated") or 0) < self.min_tokens:
            return Pending(f"fewer than {self.min_tokens} tokens", timed)
        plain_answer_steps = max(1, int(stats.get("n_generated") or 0))
        if not few:
            plain = [(t.plain, t.ms) for t in self._timeline if t.plain]
            mean_ms = sum(ms for _, ms in plain) / timed
            # Each stretch's mean step, weighted by its steps: the spread of one step's time around the mean.
            spread = math.sqrt(sum(n * (ms / n - mean_ms) ** 2 for n, ms in plain) / (timed - 1)) / mean_ms
            sampled = spread**2 * (1 / timed + 1 / plain_answer_steps)
        else:
            steps = [t.ms / t.plain for t in self._timeline if t.plain]  # each stretch's mean step
            centre = statistics.median(deviations)
            spread = MAD_TO_SD * statistics.median(abs(d - centre) for d in deviations)
            mean_ms = _centre(steps, spread)
            if len(steps) > 1:  # plain steps that disagree more than verify steps do say so
                spread = max(spread, statistics.stdev(steps) / statistics.mean(steps))
            sampled = spread**2 * (1 / len(steps) + 1 / plain_answer_steps)
        # Lone plain steps share their offset from a plain answer's steps: more of them do not average it away.
        lone = sum(t.plain for t in self._timeline if t.lone) / timed
        relative = Z * math.sqrt(sampled + (LONE_STEP * lone) ** 2)
        ratio = float(speed) * mean_ms / 1000.0
        return Estimate(ratio, ratio * relative, float(speed), 1000.0 / mean_ms, timed)


def _verify_deviations(timeline: list[_Timed]) -> list[float]:
    """Each verify step's time against the median of its row count's, relative (row counts seen once say nothing)."""
    times: dict[int, list[float]] = {}
    for t in timeline:
        if not t.plain:
            times.setdefault(t.rows, []).append(t.ms)
    return [ms / mid - 1 for group in times.values() if len(group) > 1 for mid in [statistics.median(group)]
            for ms in group]  # fmt: skip


def _centre(steps: list[float], spread: float) -> float:
    """What a plain step costs, from a few timed ones: their median, so that one stalled step of three is not the
    answer's cost. Of two, the faster one, raised by what the faster of two falls short of their centre (0.56 spreads):
    the slower may be a stall."""
    if len(steps) == 2:
        return min(steps) * (1 + FASTER_OF_TWO * spread)
    return statistics.median(steps)


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
