"""The GPU time a request asks ZeroGPU for, from measured speeds.

ZeroGPU checks the *requested* duration (× the platform's factor, 1.5 on a Blackwell `large` slice) against the
visitor's remaining daily quota, so asking for too much refuses visitors who could have been served, and asking for
too little lets the platform stop a long answer. The worker reports what it measured (decode and prefill speed, the
model-load time, the time it used) with its chunks; these running estimates start from conservative defaults and
move towards the measurements: fast towards the slow side, slowly towards the fast side. The load time is added only
when the worker may be new (the first request, or after a worker was lost).

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
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .requests import ChatRequest, _env_number

MIN_SECONDS = 5
SAFETY = 0.8  # plan with 80 % of the estimated speeds: answers differ in how well the draft does
CHARS_PER_TOKEN = 3.0  # until measured; ~3 characters per token is on the safe side for English and code
MIN_DECODE_TOKENS = 16  # shorter answers say little about the speed (fixed costs dominate)
MIN_PREFILL_TOKENS = 64


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
            seconds_max=int(_env_number(env, "DFLASH_GPU_SECONDS_MAX", cls.seconds_max)),
            base_s=_env_number(env, "DFLASH_GPU_SECONDS_BASE", cls.base_s),
            load_s=_env_number(env, "DFLASH_GPU_LOAD_SECONDS", cls.load_s),
            decode_tok_s=_env_number(env, "DFLASH_GPU_DECODE_TOK_S", cls.decode_tok_s),
            prefill_tok_s=_env_number(env, "DFLASH_GPU_PREFILL_TOK_S", cls.prefill_tok_s),
        )


@dataclass(frozen=True)
class GpuEstimate:
    seconds: int  # the duration given to @spaces.GPU
    includes_load: bool


def _toward(old: float, new: float, conservative_is_lower: bool) -> float:
    """Move an estimate towards a measurement: 70 % of the way to the conservative side, 20 % to the other."""
    conservative = new < old if conservative_is_lower else new > old
    return old + (0.7 if conservative else 0.2) * (new - old)


class GpuTimeEstimator:
    """Running estimates of the worker's speeds and load time (thread-safe), and the duration they give."""

    def __init__(self, settings: GpuTimeSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._decode = {True: settings.decode_tok_s, False: settings.decode_tok_s}  # by speculative on / off
        self._prefill = settings.prefill_tok_s
        self._load = settings.load_s
        self._chars_per_token = CHARS_PER_TOKEN
        self._worker_may_be_new = True
        self._measured: set[str] = set()

    def estimate(self, request: ChatRequest, phases: tuple[bool, ...]) -> GpuEstimate:
        """Duration for `request` decoded once per phase (True = speculative): load when the worker may be new,
        then for each phase the whole prompt prefilled and max_tokens decoded at the planned speeds."""
        with self._lock:
            prompt_tokens = request.input_chars / self._chars_per_token
            seconds = self.settings.base_s + (self._load if self._worker_may_be_new else 0.0)
            for speculative in phases:
                seconds += prompt_tokens / (self._prefill * SAFETY)
                seconds += request.max_tokens / (self._decode[speculative] * SAFETY)
            bounded = max(MIN_SECONDS, min(self.settings.seconds_max, math.ceil(seconds)))
            return GpuEstimate(bounded, self._worker_may_be_new)

    def observe(self, stats: Mapping[str, Any], request: ChatRequest, dropped_here: int) -> None:
        """Learn from one finished decode (a phase's final statistics)."""
        with self._lock:
            if stats.get("n_generated", 0) >= MIN_DECODE_TOKENS and stats.get("decode_tok_s", 0) > 0:
                kind = "decode_speculative" if stats.get("speculative") else "decode_plain"
                speculative = bool(stats.get("speculative"))
                self._decode[speculative] = self._learn(kind, self._decode[speculative], stats["decode_tok_s"], True)
            if stats.get("n_prefilled", 0) >= MIN_PREFILL_TOKENS and stats.get("prefill_ms", 0) > 0:
                speed = stats["n_prefilled"] / (stats["prefill_ms"] / 1000.0)
                self._prefill = self._learn("prefill", self._prefill, speed, True)
            if not dropped_here and stats.get("n_prompt", 0) > 0:  # the prompt the engine saw was the whole request
                ratio = max(request.input_chars / stats["n_prompt"], 0.5)
                self._chars_per_token = self._learn("chars_per_token", self._chars_per_token, ratio, True)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            self._load = self._learn("load", self._load, seconds, False)

    def _learn(self, name: str, old: float, new: float, conservative_is_lower: bool) -> float:
        """The first measurement replaces the default; later ones move the estimate (see `_toward`)."""
        if name not in self._measured:
            self._measured.add(name)
            return new
        return _toward(old, new, conservative_is_lower)

    def engine_seen(self, loaded: bool) -> None:
        """The worker's report: whether its engine is loaded (if not, the next request must plan a load)."""
        with self._lock:
            self._worker_may_be_new = not loaded

    def worker_lost(self) -> None:
        with self._lock:
            self._worker_may_be_new = True

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {  # unrounded: the duration a request gets can be recomputed from these
                "decode_tok_s": {"speculative": self._decode[True], "plain": self._decode[False]},
                "prefill_tok_s": self._prefill,
                "load_s": self._load,
                "chars_per_token": self._chars_per_token,
                "worker_may_be_new": self._worker_may_be_new,
                "measured": sorted(self._measured),
                "safety": SAFETY,
                "base_s": self.settings.base_s,
                "seconds_min": MIN_SECONDS,
                "seconds_max": self.settings.seconds_max,
            }
