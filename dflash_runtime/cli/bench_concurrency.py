"""Concurrent streams on one engine: for each concurrency c, c requests at once, each read on its own thread.

For each mode (plain decoding, or a method and a draft length, as bench.py names them) and each c, one short
round at that concurrency runs first, unmeasured (the first round of a mode at a new batch width pays allocations
and first touches that a measured round would report as its speed), then c distinct prompts start together (a
barrier) and run to their end; the engine, opened once with `parallel=max(concurrencies)`, batches them into one
target decode per step. The cache is reset before every round, so each stream prefills its whole prompt. Reported
per mode and c, from the round of median aggregate speed:
- `tok_s`: all streams' tokens / the wall time from the first stream's start to the last one's end;
- `stream_tok_s_median`: each stream's tokens / its own wall time, the median over the streams;
- `ttft_ms_median`, `ttft_ms_max`: from a stream's start to its first event that carries tokens;
- `rows_per_decode`, `pad_rows_per_decode`, `step_ms`: from `engine.step_counters()` deltas, rows decoded (filler
  rows that even out the requests' rows included, and apart) / target decodes and the time in engine steps / target
  decodes; `stream_steps` sums the streams' own target steps (verify + plain), so
  `decodes < stream_steps + prefill decodes` means decodes were shared;
- `scaling`: `tok_s` over the same mode's at one stream (when 1 is among the concurrencies).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..results.tables import table
from .bench import WARMUP_TOKENS, BenchConfig, progress_bar, request_options, runs_note

DEFAULT_TIMEOUT_S = 600.0
COUNTERS = ("decodes", "rows", "pad_rows", "step_ms")


def distinct_prompts(base: Sequence[str], n: int) -> list[str]:
    """n different prompts: the base list in order, repeated ones marked with their round ("... (2)")."""
    return [base[i % len(base)] + ("" if i < len(base) else f" ({i // len(base) + 1})") for i in range(n)]


@dataclass
class StreamRun:
    """One stream of a round: times are perf_counter seconds."""

    prompt: int
    start: float = 0.0
    first: float | None = None  # the first event that carried tokens
    end: float = 0.0
    tokens: int = 0
    ids: list[int] = field(default_factory=list)
    stats: Any = None
    finish_reason: str | None = None

    def summary(self) -> dict[str, Any]:
        wall = self.end - self.start
        s = self.stats
        return {"prompt": self.prompt, "tokens": self.tokens, "tok_s": self.tokens / wall if wall > 0 else 0.0,
                "ttft_ms": 1000.0 * ((self.first or self.end) - self.start), "wall_ms": 1000.0 * wall,
                "n_generated": s.n_generated if s else 0, "target_steps": s.target_steps if s else 0,
                "n_prefilled": s.n_prefilled if s else 0,
                "drafted": s.drafted if s else 0, "accepted": s.accepted if s else 0,
                "finish_reason": self.finish_reason}


def _read_stream(engine: Any, prompt: str | Sequence[int], options: dict[str, Any], run: StreamRun,
                 barrier: threading.Barrier, errors: list[BaseException]) -> None:
    try:
        barrier.wait()
        run.start = time.perf_counter()
        with engine.stream(prompt, **options) as events:
            for event in events:
                if event.tokens and run.first is None:
                    run.first = time.perf_counter()
                run.tokens += len(event.tokens)
                run.ids += event.tokens
                run.stats, run.finish_reason = event.stats, event.finish_reason
        run.end = time.perf_counter()
    except BaseException as exc:  # re-raised by the caller, on its own thread
        errors.append(exc)
        barrier.abort()


def run_streams(engine: Any, prompts: Sequence[str | Sequence[int]], options: Sequence[dict[str, Any]],
                timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[list[StreamRun], dict[str, float]]:
    """All prompts at once, one thread each, on a reset cache: each stream's run and the step counters' deltas."""
    n = len(prompts)
    barrier = threading.Barrier(n, timeout=timeout_s)
    runs = [StreamRun(i) for i in range(n)]
    errors: list[BaseException] = []
    engine.reset()  # every stream prefills its prompt from scratch
    before = engine.step_counters()
    threads = [threading.Thread(target=_read_stream, args=(engine, p, o, r, barrier, errors), daemon=True)
               for p, o, r in zip(prompts, options, runs, strict=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        engine.cancel()
        raise TimeoutError(f"{n} concurrent streams did not end within {timeout_s:.0f} s")
    if errors:
        raise errors[0]
    after = engine.step_counters()
    return runs, {k: after[k] - before[k] for k in COUNTERS}


def run_round(engine: Any, prompts: Sequence[str], options: Sequence[dict[str, Any]],
              timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """All prompts at once, one thread each; the round's figures (see the module doc)."""
    runs, delta = run_streams(engine, prompts, options, timeout_s)
    n = len(runs)
    streams = [r.summary() for r in runs]
    wall = max(r.end for r in runs) - min(r.start for r in runs)
    tokens = sum(s["tokens"] for s in streams)
    ttft = [s["ttft_ms"] for s in streams]
    drafted, accepted = sum(s["drafted"] for s in streams), sum(s["accepted"] for s in streams)
    decodes = int(delta["decodes"])
    return {
        "streams": n, "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall > 0 else 0.0,
        "stream_tok_s_median": statistics.median(s["tok_s"] for s in streams),
        "ttft_ms_median": statistics.median(ttft), "ttft_ms_max": max(ttft),
        "decodes": decodes, "rows": int(delta["rows"]), "rows_per_decode": delta["rows"] / decodes if decodes else 0.0,
        "pad_rows_per_decode": delta["pad_rows"] / decodes if decodes else 0.0,
        "step_ms": delta["step_ms"] / decodes if decodes else 0.0,
        "stream_steps": sum(s["target_steps"] for s in streams),
        "acceptance_rate": accepted / drafted if drafted else 0.0, "per_stream": streams,
    }


def bench_concurrency(engine: Any, cfg: BenchConfig, concurrencies: Sequence[int],
                      progress: Callable[[], None], timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, list[dict]]:
    """Per mode, one result per concurrency (the round of median tok/s over cfg.runs rounds)."""
    prompts = distinct_prompts(cfg.prompt_list, max(concurrencies))
    out: dict[str, list[dict]] = {}
    for mode in cfg.mode_names():
        results = []
        for c in concurrencies:
            warm = [{**request_options(mode, cfg, seed=i), "max_tokens": WARMUP_TOKENS} for i in range(c)]
            run_streams(engine, prompts[:c], warm, timeout_s)  # unmeasured (see the module doc)
            rounds = []
            for run in range(cfg.runs):
                options = [request_options(mode, cfg, seed=1000 * run + i) for i in range(c)]
                rounds.append(run_round(engine, prompts[:c], options, timeout_s))
                progress()
            rounds.sort(key=lambda r: r["tok_s"])
            best = dict(rounds[(len(rounds) - 1) // 2])
            best["runs_tok_s"] = [r["tok_s"] for r in rounds]
            results.append(best)
        one = next((r["tok_s"] for r in results if r["streams"] == 1), 0.0)
        for r in results:
            r["scaling"] = r["tok_s"] / one if one else 0.0
        out[mode] = results
    return out


def run_concurrency(pairs: Sequence[tuple[str, str, str]], cfg: BenchConfig, concurrencies: Sequence[int],
                    opener: Callable[[str, str], Any], timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    progress = progress_bar(len(pairs) * len(cfg.mode_names()) * len(concurrencies) * cfg.runs)
    out: dict[str, Any] = {"config": {"modes": cfg.mode_names(), "runs": cfg.runs, "max_tokens": cfg.max_tokens,
                                      "temperature": cfg.temperature, "concurrency": list(concurrencies),
                                      "warmup_tokens": WARMUP_TOKENS,
                                      "prompts": distinct_prompts(cfg.prompt_list, max(concurrencies))},
                           "pairs": {}}
    for name, target, draft in pairs:
        started = time.perf_counter()
        with opener(target, draft) as engine:
            open_s = time.perf_counter() - started
            methods = [m for m in cfg.methods if m != "plain" and engine.capacity(m) > 0]
            pair_cfg = BenchConfig(**{**cfg.__dict__, "methods": methods})
            # a short pair's progress bar still ends: count the modes it skips as done
            for _ in range((len(cfg.mode_names()) - len(pair_cfg.mode_names())) * len(concurrencies) * cfg.runs):
                progress()
            out["pairs"][name] = {"target": target, "draft": draft, "methods": methods, "open_s": open_s,
                                  "parallel": getattr(engine, "parallel", 1),
                                  "concurrency": bench_concurrency(engine, pair_cfg, concurrencies, progress,
                                                                   timeout_s)}
    print(format_concurrency(out))
    return out


def format_concurrency(results: dict[str, Any]) -> str:
    rows = []
    for name, pair in results["pairs"].items():
        for mode, per_c in pair["concurrency"].items():
            for r in per_c:
                rows.append((name, mode, r["streams"], r["tok_s"], r["scaling"], r["stream_tok_s_median"],
                             r["ttft_ms_median"], r["ttft_ms_max"], r["rows_per_decode"], r["step_ms"],
                             r["acceptance_rate"]))
    headers = ("pair", "mode", "streams", "tok/s", "×1", "stream tok/s", "ttft ms", "ttft max ms", "rows/decode",
               "step ms", "accept")
    note = runs_note(int(results["config"].get("runs", 1))).replace("one unmeasured request", "one unmeasured round")
    return table(headers, rows) + "\n" + note
