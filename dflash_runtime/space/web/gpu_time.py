"""The GPU time a request asks ZeroGPU for, from measured speeds: too much refuses visitors who could have been
served, too little lets the platform stop a long answer. Each figure is the clients' vote, so that none moves with one
visitor's calls (docs/public-space.md, "Figures one client cannot move")."""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..requests import ChatRequest
from ..setup.settings import PublicSettings

MIN_SECONDS = 5
SAFETY = 0.8  # plan with 80 % of the estimated speeds: answers differ in how well the draft does
CHARS_PER_TOKEN = 3.0  # until measured; ~3 characters per token is on the safe side for English and code
MIN_DECODE_TOKENS = 16  # shorter answers say little about the speed (fixed costs dominate)
MIN_PREFILL_TOKENS = 64
MOVE_PER_WORK, WORK_TOKENS = 1.25, 4096  # the most a figure moves per tokens of work behind the answers moving it


@dataclass(frozen=True)
class GpuEstimate:
    seconds: int  # the duration given to @spaces.GPU
    includes_load: bool


class Votes:
    """One figure: the median of the recent clients' votes (each the median of its own newest answers), `default`
    until `estimate_voters` clients voted, then moving at most ×1.25 per 4,096 tokens of work."""

    def __init__(self, default: float, settings: PublicSettings) -> None:
        self.default, self.settings = default, settings
        self._votes: OrderedDict[str, deque[float]] = OrderedDict()
        self._value: float | None = None

    def add(self, source: str, value: float, work: float) -> None:
        own = self._votes.pop(source, None) or deque(maxlen=self.settings.estimate_per_client)
        own.append(value)
        self._votes[source] = own  # the newest source last
        while len(self._votes) > self.settings.estimate_window:
            self._votes.popitem(last=False)
        if len(self._votes) < self.settings.estimate_voters:
            return
        votes = [statistics.median(own) for own in self._votes.values()]
        target = statistics.median_low(votes)  # one vote is the figure, whoever voted last
        step = MOVE_PER_WORK ** (max(work, 0.0) / WORK_TOKENS)
        self._value = target if self._value is None else min(max(target, self._value / step), self._value * step)

    @property
    def measured(self) -> int:  # the answers behind the figure: 0 until it moved from its default
        return sum(len(own) for own in self._votes.values()) if self._value is not None else 0

    @property
    def value(self) -> float:
        return self.default if self._value is None else self._value


class GpuTimeEstimator:
    """Running estimates of the worker's speeds and load time (thread-safe), and the duration they give."""

    def __init__(self, settings: PublicSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._figures = {name: Votes(default, settings) for name, default in (
            ("decode_speculative", settings.gpu_decode_tok_s), ("decode_plain", settings.gpu_decode_tok_s),
            ("prefill", settings.gpu_prefill_tok_s), ("chars_per_token", CHARS_PER_TOKEN))}  # fmt: skip
        self._load = settings.gpu_load_s
        self._load_measured = False
        self._worker_may_be_new = True

    def _decode(self, speculative: bool) -> float:
        return self._figures["decode_speculative" if speculative else "decode_plain"].value

    def estimate(self, request: ChatRequest, phases: tuple[bool, ...]) -> GpuEstimate:
        """Duration for `request` decoded once per phase (True = speculative): a load when the worker may be new, then
        per phase the prompt prefilled and max_tokens decoded at the planned speeds."""
        with self._lock:
            prompt_tokens = request.input_chars / self._figures["chars_per_token"].value
            seconds = self.settings.gpu_seconds_base + (self._load if self._worker_may_be_new else 0.0)
            for speculative in phases:
                seconds += prompt_tokens / (self._figures["prefill"].value * SAFETY)
                seconds += request.max_tokens / (self._decode(speculative) * SAFETY)
            bounded = max(MIN_SECONDS, min(self.settings.gpu_seconds_max, math.ceil(seconds)))
            return GpuEstimate(bounded, self._worker_may_be_new)

    def observe(self, stats: Mapping[str, Any], request: ChatRequest, dropped_here: int, source: str) -> None:
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
        """A worker's measured load time: the first replaces the default, later ones move it (slower ones more)."""
        with self._lock:
            if not self._load_measured:
                self._load, self._load_measured = seconds, True
            else:
                self._load += (0.7 if seconds > self._load else 0.2) * (seconds - self._load)

    def engine_seen(self, loaded: bool) -> None:  # if not (or the worker is gone), the next request must plan a load
        with self._lock:
            self._worker_may_be_new = not loaded

    def describe(self) -> dict[str, Any]:
        with self._lock:
            figures, s = self._figures, self.settings
            measured = sorted(name for name, figure in figures.items() if figure.measured)
            return {  # unrounded: the duration a request gets can be recomputed from these
                "decode_tok_s": {"speculative": self._decode(True), "plain": self._decode(False)},
                "prefill_tok_s": figures["prefill"].value,
                "load_s": self._load,
                "chars_per_token": figures["chars_per_token"].value,
                "worker_may_be_new": self._worker_may_be_new,
                "measured": sorted([*measured, *(["load"] if self._load_measured else [])]),
                "answers_counted": {name: figure.measured for name, figure in figures.items()},
                "window": s.estimate_window, "per_client": s.estimate_per_client, "voters": s.estimate_voters,
                "safety": SAFETY, "base_s": s.gpu_seconds_base, "seconds_min": MIN_SECONDS,
                "seconds_max": s.gpu_seconds_max,
            }  # fmt: skip
