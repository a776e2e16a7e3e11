"""Speculative vs plain decoding on the same engine: alternating runs, medians, a table and JSON.

A mode is "plain", or a draft method with a draft length ("dflash 3", "mtp auto") and, above temperature 0, a
verification ("dflash 3 sample", "mtp auto match").
Before anything is measured, every mode answers one short request (`WARMUP_TOKENS`), unmeasured: the first request
of a mode pays allocations and first touches of the weights and buffers that a measured one would report as its
speed. Each request's prompt is new to the cache (the engine is reset between requests, so every mode pays the
same prefill); a hybrid target's context-checkpoint cost per request (ms, bytes) is reported with it, and each
pair's open time (header validation, both models, both contexts) with the pair.

With concurrencies (`run_concurrency`), each mode runs c streams at once instead, one thread each, on one engine
opened with `parallel=max(concurrencies)`: aggregate and per-stream tok/s, time to first token, and the engine's
rows per target decode and step time (bench_concurrency.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..results.stats import tokens_per_verify
from ..results.tables import table

WARMUP_TOKENS = 8  # a warm-up request's length: enough for every kind of step (prefill, draft, verify, plain)

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List the planets of the solar system in order.",
    "Explain in two sentences why the sky is blue.",
    "the quick brown fox jumps over the lazy dog. the quick brown fox",
]


@dataclass
class BenchConfig:
    modes: list[int | str]
    runs: int = 3
    max_tokens: int = 128
    prompts: list[str] | None = None
    temperature: float = 0.0
    verify: list[str] = field(default_factory=lambda: ["sample"])
    methods: list[str] = field(default_factory=lambda: ["dflash"])

    @property
    def prompt_list(self) -> list[str]:
        return self.prompts or DEFAULT_PROMPTS

    def mode_names(self) -> list[str]:
        """"plain", then one name per method and draft length (and per verification above temperature 0)."""
        names = ["plain"]
        for method in self.methods:
            for length in self.modes:
                if self.temperature > 0:
                    names += [f"{method} {length} {verify}" for verify in self.verify]
                else:
                    names.append(f"{method} {length}")
        return names


def request_options(mode: str, cfg: BenchConfig, seed: int) -> dict[str, Any]:
    """A mode name ("plain", "dflash 3", "mtp auto match") as the keyword arguments of a request."""
    method, length, verify = [*mode.split(" "), "", ""][:3]
    options: dict[str, Any] = dict(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=seed)
    if method == "plain":
        options["speculative"] = False
    else:
        options["method"] = method
        options["draft_length"] = "auto" if length == "auto" else int(length)
        options["verify"] = verify or "sample"
    return options


def warm_up(engine: Any, cfg: BenchConfig, modes: Sequence[str]) -> None:
    """One short request per mode, not measured (see the module doc)."""
    for mode in modes:
        engine.reset()
        engine.generate(cfg.prompt_list[0], **{**request_options(mode, cfg, seed=0), "max_tokens": WARMUP_TOKENS})


def runs_note(runs: int) -> str:
    """What the figures rest on, printed under every table."""
    note = f"Each mode warmed up with one unmeasured request of {WARMUP_TOKENS} tokens first."
    if runs == 1:
        return note + (" Every figure rests on one run: on a shared machine it can be off by tens of percent "
                       "(--runs 3 reports medians).")  # fmt: skip
    return note + f" Figures: the median of {runs} runs."


def _run_request(engine: Any, prompt: str, mode: str, cfg: BenchConfig, seed: int) -> Any:
    engine.reset()  # every mode prefills the same prompt from scratch
    return engine.generate(prompt, **request_options(mode, cfg, seed)).stats


_SUMS = ("gen", "decode_ms", "host_ms", "drafted", "accepted", "emitted", "verify", "steps", "requests",
         "checkpoint_ms", "checkpoint_bytes")


def _add(tot: dict[str, float], s: Any) -> None:
    tot["gen"] += s.n_generated
    tot["decode_ms"] += s.decode_ms
    tot["host_ms"] += s.host_ms
    tot["drafted"] += s.drafted
    tot["accepted"] += s.accepted
    tot["emitted"] += s.verify_emitted
    tot["verify"] += s.verify_steps
    tot["steps"] += s.target_steps
    tot["requests"] += 1
    tot["checkpoint_ms"] += s.checkpoint_save_ms + s.checkpoint_restore_ms
    tot["checkpoint_bytes"] += s.checkpoint_bytes


def _summary(tot: dict[str, float]) -> dict[str, float]:
    def per(a: str, b: str) -> float:
        return tot[a] / tot[b] if tot[b] else 0.0

    return {
        "tok_s": tot["gen"] / (tot["decode_ms"] / 1000.0) if tot["decode_ms"] else 0.0,
        "acceptance_rate": per("accepted", "drafted"),
        "mean_accepted_length": tokens_per_verify(tot["emitted"], tot["verify"]),
        "step_ms": per("decode_ms", "steps"),
        "host_ms_per_step": per("host_ms", "steps"),
        "checkpoint_ms_per_request": per("checkpoint_ms", "requests"),
        "checkpoint_bytes_per_request": per("checkpoint_bytes", "requests"),
    }


def bench_pair(engine: Any, cfg: BenchConfig, progress: Callable[[], None]) -> dict[str, Any]:
    modes = cfg.mode_names()
    warm_up(engine, cfg, modes)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for run in range(cfg.runs):
        totals = {m: dict.fromkeys(_SUMS, 0.0) for m in modes}
        for index, prompt in enumerate(cfg.prompt_list):
            for mode in modes:  # alternate modes prompt by prompt so drifts of the machine hit them alike
                _add(totals[mode], _run_request(engine, prompt, mode, cfg, seed=1000 * run + index))
        for mode in modes:
            runs[mode].append(_summary(totals[mode]))
        progress()
    plain = statistics.median(r["tok_s"] for r in runs["plain"])
    result = {}
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        med["speedup"] = med["tok_s"] / plain if plain else 0.0
        med["runs_tok_s"] = [r["tok_s"] for r in rs]
        result[mode] = med
    return result


def progress_bar(total: int) -> Callable[[], None]:
    """A callable that advances a progress bar of `total` steps on stderr."""
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        bar = "#" * (30 * done // total)
        print(f"\r[{bar:<30}] {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    return progress


def run_bench(pairs: Sequence[tuple[str, str, str]], cfg: BenchConfig, opener: Callable[[str, str], Any]
              ) -> dict[str, Any]:
    progress = progress_bar(len(pairs) * cfg.runs)
    out: dict[str, Any] = {"config": {"modes": cfg.mode_names(), "runs": cfg.runs, "max_tokens": cfg.max_tokens,
                                      "temperature": cfg.temperature, "prompts": cfg.prompt_list,
                                      "warmup_tokens": WARMUP_TOKENS}, "pairs": {}}
    for name, target, draft in pairs:
        started = time.perf_counter()
        with opener(target, draft) as engine:
            open_s = time.perf_counter() - started
            methods = [m for m in cfg.methods if engine.capacity(m) > 0]  # those the pair runs
            pair_cfg = BenchConfig(**{**cfg.__dict__, "methods": methods})
            out["pairs"][name] = {"target": target, "draft": draft, "methods": methods, "open_s": open_s,
                                  "modes": bench_pair(engine, pair_cfg, progress)}
    print(format_results(out))
    return out


def format_results(results: dict[str, Any]) -> str:
    rows = []
    for name, pair in results["pairs"].items():
        for mode, r in pair["modes"].items():
            rows.append((name, pair["open_s"], mode, r["tok_s"], r["speedup"], r["acceptance_rate"],
                         r["mean_accepted_length"], r["step_ms"], r["host_ms_per_step"], r["checkpoint_ms_per_request"],
                         r["checkpoint_bytes_per_request"] / 2**20))
    headers = ("pair", "open s", "mode", "tok/s", "vs plain", "accept", "mean len", "step ms", "host ms/step",
               "ckpt ms/req", "ckpt MiB/req")
    return table(headers, rows) + "\n" + runs_note(int(results["config"].get("runs", 1)))
