"""The GPU time a request asks ZeroGPU for, from measured speeds.

ZeroGPU checks the *requested* duration (× the platform's factor, 1.5 on a Blackwell `large` slice) against the
visitor's remaining daily quota, so asking for too much refuses visitors who could have been served, and asking for
too little lets the platform stop a long answer. The worker reports what it measured (decode and prefill speed, the
model-load time, the time it used) with its chunks.

A public Space serves visitors who send whatever they like: a burst of requests that draft badly (text unlike the
draft's training, a high temperature) or tokenize densely must not change the time asked of everybody else. So each
figure a visitor's answer can move (decode speed per mode, prefill speed, characters per token) is the **median of
the recent clients' votes** (`WINDOW` clients, see clients.py: an address, not a session id, which costs nothing to
multiply), each client voting once with the median of its own newest `PER_SOURCE` answers, an odd number of votes
counted (see RecentMedian): however many calls a client makes, it moves the median by one vote at most. And since
addresses are cheap to multiply, the figure follows that median at a pace bounded by the work behind the answers
(`PacedFigure`: at most ×1.25 per 4,096 tokens decoded, prefilled or read), so many clients' few odd calls move it
little. Until a figure is measured it is the configured default; its first measurement replaces the default.
The load time is not a visitor's doing; it follows its measurements
(slower ones count more) and is added only when the worker may be new (the first request, or after a worker was
lost).

| variable | meaning | default |
| --- | --- | --- |
| `DFLASH_GPU_SECONDS_MAX` | the most a request may ask for | 240 |
| `DFLASH_GPU_SECONDS_BASE` | slack added to every request | 5 |
| `DFLASH_GPU_LOAD_SECONDS` | model load on a new worker, until measured | 30 |
| `DFLASH_GPU_DECODE_TOK_S` | decode speed, until measured | 20 |
| `DFLASH_GPU_PREFILL_TOK_S` | prefill speed, until measured | 500 |
"""

from __future__ import annotations

import math
import os
import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..requests import ChatRequest
from ..setup.settings import env_number

MIN_SECONDS = 5
SAFETY = 0.8  # plan with 80 % of the estimated speeds: answers differ in how well the draft does
CHARS_PER_TOKEN = 3.0  # until measured; ~3 characters per token is on the safe side for English and code
MIN_DECODE_TOKENS = 16  # shorter answers say little about the speed (fixed costs dominate)
MIN_PREFILL_TOKENS = 64
WINDOW = 32  # recent clients behind each figure
PER_SOURCE = 3  # answers of one client behind its vote
# A figure moves towards its clients' median by at most this factor per WORK_TOKENS tokens of work behind the answers
# that move it (tokens decoded, prefilled, or prompt tokens read): many clients' few odd calls move it little.
MOVE_PER_WORK = 1.25
WORK_TOKENS = 4096


@dataclass(frozen=True)
class GpuTimeSettings:
    seconds_max: int = 240
    base_s: float = 5.0
    load_s: float = 30.0
    decode_tok_s: float = 20.0
    prefill_tok_s: float = 500.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GpuTimeSettings:
        env = os.environ if env is None else env
        return cls(
            seconds_max=int(env_number(env, "DFLASH_GPU_SECONDS_MAX", cls.seconds_max)),
            base_s=env_number(env, "DFLASH_GPU_SECONDS_BASE", cls.base_s),
            load_s=env_number(env, "DFLASH_GPU_LOAD_SECONDS", cls.load_s),
            decode_tok_s=env_number(env, "DFLASH_GPU_DECODE_TOK_S", cls.decode_tok_s),
            prefill_tok_s=env_number(env, "DFLASH_GPU_PREFILL_TOK_S", cls.prefill_tok_s),
        )


@dataclass(frozen=True)
class GpuEstimate:
    seconds: int  # the duration given to @spaces.GPU
    includes_load: bool


def _toward(old: float, new: float, conservative_is_lower: bool) -> float:
    """Move an estimate towards a measurement: 70 % of the way to the conservative side, 20 % to the other."""
    conservative = new < old if conservative_is_lower else new > old
    return old + (0.7 if conservative else 0.2) * (new - old)


class RecentMedian:
    """One figure from the recent measurements of many sources (clients): each of the newest `window` sources votes
    once, with the median of its own newest `per_source` measurements, and the figure is the median of an odd number
    of votes (with an even number, the newest source's is left out), so one source moves it by one vote at most (and
    not at all while it would only make the count even), however often it measures; `default` until the first
    measurement."""

    def __init__(self, default: float, window: int = WINDOW, per_source: int = PER_SOURCE) -> None:
        self.default = default
        self._window = window
        self._per_source = per_source
        self._values: OrderedDict[str, deque[float]] = OrderedDict()

    def add(self, source: str, value: float) -> None:
        own = self._values.pop(source, None) or deque(maxlen=self._per_source)
        own.append(value)
        self._values[source] = own  # the newest source last
        while len(self._values) > self._window:
            self._values.popitem(last=False)

    @property
    def measured(self) -> int:
        return sum(len(own) for own in self._values.values())

    @property
    def value(self) -> float:
        votes = [statistics.median(own) for own in self._values.values()]  # the newest source's last
        if len(votes) % 2 == 0:
            votes = votes[:-1]  # an odd count: one vote is the figure, none is averaged with its neighbour
        return statistics.median(votes) if votes else self.default


class PacedFigure:
    """A RecentMedian whose published value follows the median at a pace bounded by work: the first measurement
    replaces the default, and then each answer moves the value towards the median by at most a factor of
    MOVE_PER_WORK per WORK_TOKENS of the answer's work. Votes keep one client from moving the median by more than
    one vote; the pace keeps many clients (addresses are cheap to multiply) from moving the figure by more than the
    work they paid for: 20 clients' three 64-token answers move it by at most ~26 %."""

    def __init__(self, default: float) -> None:
        self.votes = RecentMedian(default)
        self._value: float | None = None

    def add(self, source: str, value: float, work: float) -> None:
        self.votes.add(source, value)
        target = self.votes.value
        if self._value is None:
            self._value = target
            return
        step = MOVE_PER_WORK ** (max(work, 0.0) / WORK_TOKENS)
        self._value = min(max(target, self._value / step), self._value * step)

    @property
    def measured(self) -> int:
        return self.votes.measured

    @property
    def value(self) -> float:
        return self.votes.default if self._value is None else self._value


class GpuTimeEstimator:
    """Running estimates of the worker's speeds and load time (thread-safe), and the duration they give."""

    def __init__(self, settings: GpuTimeSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._figures = {
            "decode_speculative": PacedFigure(settings.decode_tok_s),
            "decode_plain": PacedFigure(settings.decode_tok_s),
            "prefill": PacedFigure(settings.prefill_tok_s),
            "chars_per_token": PacedFigure(CHARS_PER_TOKEN),
        }
        self._load = settings.load_s
        self._load_measured = False
        self._worker_may_be_new = True

    def _decode(self, speculative: bool) -> float:
        return self._figures["decode_speculative" if speculative else "decode_plain"].value

    def estimate(self, request: ChatRequest, phases: tuple[bool, ...]) -> GpuEstimate:
        """Duration for `request` decoded once per phase (True = speculative): load when the worker may be new,
        then for each phase the whole prompt prefilled and max_tokens decoded at the planned speeds."""
        with self._lock:
            prompt_tokens = request.input_chars / self._figures["chars_per_token"].value
            seconds = self.settings.base_s + (self._load if self._worker_may_be_new else 0.0)
            for speculative in phases:
                seconds += prompt_tokens / (self._figures["prefill"].value * SAFETY)
                seconds += request.max_tokens / (self._decode(speculative) * SAFETY)
            bounded = max(MIN_SECONDS, min(self.settings.seconds_max, math.ceil(seconds)))
            return GpuEstimate(bounded, self._worker_may_be_new)

    def observe(self, stats: Mapping[str, Any], request: ChatRequest, dropped_here: int, source: str = "") -> None:
        """Learn from one finished decode (a phase's final statistics) of `source` (the visitor's client)."""
        with self._lock:
            decode_tok_s = stats.get("decode_tok_s") or 0
            if stats.get("n_generated", 0) >= MIN_DECODE_TOKENS and decode_tok_s > 0:
                kind = "decode_speculative" if stats.get("speculative") else "decode_plain"
                self._figures[kind].add(source, decode_tok_s, stats["n_generated"])
            if stats.get("n_prefilled", 0) >= MIN_PREFILL_TOKENS and stats.get("prefill_ms", 0) > 0:
                speed = stats["n_prefilled"] / (stats["prefill_ms"] / 1000.0)
                self._figures["prefill"].add(source, speed, stats["n_prefilled"])
            if not dropped_here and stats.get("n_prompt", 0) > 0:  # the prompt the engine saw was the whole request
                ratio = max(request.input_chars / stats["n_prompt"], 0.5)
                self._figures["chars_per_token"].add(source, ratio, stats["n_prompt"])

    def observe_load(self, seconds: float) -> None:
        """The model load time a worker measured: the first replaces the default, later ones move it (see _toward)."""
        with self._lock:
            self._load = _toward(self._load, seconds, False) if self._load_measured else seconds
            self._load_measured = True

    def engine_seen(self, loaded: bool) -> None:
        """The worker's report: whether its engine is loaded (if not, the next request must plan a load)."""
        with self._lock:
            self._worker_may_be_new = not loaded

    def worker_lost(self) -> None:
        with self._lock:
            self._worker_may_be_new = True

    def describe(self) -> dict[str, Any]:
        with self._lock:
            figures = self._figures
            measured = sorted(name for name, figure in figures.items() if figure.measured)
            return {  # unrounded: the duration a request gets can be recomputed from these
                "decode_tok_s": {"speculative": self._decode(True), "plain": self._decode(False)},
                "prefill_tok_s": figures["prefill"].value,
                "load_s": self._load,
                "chars_per_token": figures["chars_per_token"].value,
                "worker_may_be_new": self._worker_may_be_new,
                "measured": sorted([*measured, *(["load"] if self._load_measured else [])]),
                "answers_counted": {name: figure.measured for name, figure in figures.items()},
                "window": WINDOW,
                "per_client": PER_SOURCE,
                "safety": SAFETY,
                "base_s": self.settings.base_s,
                "seconds_min": MIN_SECONDS,
                "seconds_max": self.settings.seconds_max,
            }
