"""Plain-text tables for the command line: a request's statistics (`stats_table`), a benchmark's or a memory plan's
rows (`table`)."""

from __future__ import annotations

from collections.abc import Sequence

from .stats import Stats


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def stats_table(s: Stats) -> str:
    rows = [
        ("prompt tokens (reused / prefilled)", f"{s.n_prompt} ({s.n_reused} / {s.n_prefilled})"),
        ("generated tokens", s.n_generated),
        ("decode tok/s", round(s.decode_tok_s, 2)),
        ("verify steps / plain steps", f"{s.verify_steps} / {s.plain_steps}"),
        ("drafted / accepted", f"{s.drafted} / {s.accepted}"),
        ("acceptance rate", round(s.acceptance_rate, 4)),
        ("mean accepted length", round(s.mean_accepted_length, 3)),
        ("accepted per position", " ".join(map(str, s.accepted_per_position)) or "-"),
        ("prefill / draft / inject / verify ms", f"{s.prefill_ms:.1f} / {s.draft_ms:.1f} / {s.inject_ms:.1f} / "
                                                  f"{s.verify_ms:.1f}"),
        ("host ms (outside libllama)", round(s.host_ms, 2)),
    ]
    return table(("statistic", "value"), rows)
