"""Speculative vs plain decoding on the same engine: alternating runs, medians, a table and JSON."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .report import table

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

    @property
    def prompt_list(self) -> list[str]:
        return self.prompts or DEFAULT_PROMPTS


def tiny_targets(spec: str) -> list[tuple[str, str, str]]:
    """Generated pairs: 'matrix' (widths 512 and 1024 × random/const heads × dense/hybrid) or kind:head:width,..."""
    from .testing.tiny_models import tiny_pair

    if spec == "matrix":
        items = [(k, h, w) for w in (512, 1024) for h in ("random", "const") for k in ("dense", "hybrid")]
    else:
        items = []
        for part in spec.split(","):
            kind, head, width = part.split(":")
            items.append((kind, head, int(width)))
    out = []
    for kind, head, width in items:
        p = tiny_pair(kind, "dflash2", head=head, n_embd=width, dims="scaled" if width >= 256 else "tiny")
        out.append((f"{kind}-{head}-{width}", str(p.target), str(p.draft)))
    return out


def _totals() -> dict[str, float]:
    return dict(gen=0, decode_ms=0.0, host_ms=0.0, drafted=0, accepted=0, emitted=0, verify=0, steps=0)


def _add(tot: dict[str, float], engine: Any, prompt: str, mode: int | str, cfg: BenchConfig) -> None:
    spec = mode != "plain"
    s = engine.generate(prompt, max_tokens=cfg.max_tokens, speculative=spec, draft_max=mode if spec else None).stats
    tot["gen"] += s.n_generated
    tot["decode_ms"] += s.decode_ms
    tot["host_ms"] += s.host_ms
    tot["drafted"] += s.drafted
    tot["accepted"] += s.accepted
    tot["emitted"] += s.verify_emitted
    tot["verify"] += s.verify_steps
    tot["steps"] += s.target_steps


def _summary(tot: dict[str, float]) -> dict[str, float]:
    return {
        "tok_s": tot["gen"] / (tot["decode_ms"] / 1000.0) if tot["decode_ms"] else 0.0,
        "acceptance_rate": tot["accepted"] / tot["drafted"] if tot["drafted"] else 0.0,
        "mean_accepted_length": tot["emitted"] / tot["verify"] if tot["verify"] else 0.0,
        "step_ms": tot["decode_ms"] / tot["steps"] if tot["steps"] else 0.0,
        "host_ms_per_step": tot["host_ms"] / tot["steps"] if tot["steps"] else 0.0,
    }


def bench_pair(engine: Any, cfg: BenchConfig, progress: Callable[[], None]) -> dict[str, Any]:
    modes: list[int | str] = ["plain", *cfg.modes]
    engine.generate(cfg.prompt_list[0], max_tokens=8)  # warm-up: allocations, first-touch of the weights
    runs: dict[str, list[dict[str, float]]] = {str(m): [] for m in modes}
    for _ in range(cfg.runs):
        totals = {str(m): _totals() for m in modes}
        for prompt in cfg.prompt_list:
            for mode in modes:  # alternate modes prompt by prompt so drifts of the machine hit them alike
                _add(totals[str(mode)], engine, prompt, mode, cfg)
        for mode in modes:
            runs[str(mode)].append(_summary(totals[str(mode)]))
        progress()
    plain = statistics.median(r["tok_s"] for r in runs["plain"])
    result = {}
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        med["speedup"] = med["tok_s"] / plain if plain else 0.0
        med["runs_tok_s"] = [r["tok_s"] for r in rs]
        result[mode] = med
    return result


def run_bench(pairs: Sequence[tuple[str, str, str]], cfg: BenchConfig, opener: Callable[[str, str], Any]
              ) -> dict[str, Any]:
    total = len(pairs) * cfg.runs
    done = 0

    def progress() -> None:
        nonlocal done
        done += 1
        bar = "#" * (30 * done // total)
        print(f"\r[{bar:<30}] {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    out: dict[str, Any] = {"config": {"modes": [str(m) for m in cfg.modes], "runs": cfg.runs,
                                      "max_tokens": cfg.max_tokens, "prompts": cfg.prompt_list}, "pairs": {}}
    for name, target, draft in pairs:
        with opener(target, draft) as engine:
            out["pairs"][name] = {"target": target, "draft": draft, "modes": bench_pair(engine, cfg, progress)}
    print(format_results(out))
    return out


def format_results(results: dict[str, Any]) -> str:
    rows = []
    for name, pair in results["pairs"].items():
        for mode, r in pair["modes"].items():
            rows.append((name, mode, r["tok_s"], r["speedup"], r["acceptance_rate"], r["mean_accepted_length"],
                         r["step_ms"], r["host_ms_per_step"]))
    return table(("pair", "mode", "tok/s", "vs plain", "accept", "mean len", "step ms", "host ms/step"), rows)
