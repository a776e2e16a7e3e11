"""The live statistics of one answer as a first-time visitor reads them: one plain sentence (how much of the answer
the draft wrote, about how much faster it came), then a folded table whose every term says what it means, with
counts that add up as shown. Plain strings, testable without a browser."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .speedup import Estimate, Pending
from .views import method_label

EMPTY_STATS = "*How much of an answer the draft wrote, and how much faster it came, shows here as it is written.*"
WAITING_STATS = "*Waiting for the first tokens (the first request also loads the model)…*"
REFUSED_STATS = "*No answer: the message was not sent (the notice under the chat says why).*"
EMPTY_DETAILS = "*The steps, acceptance and timings of an answer appear here.*"
# An estimate whose interval reaches further than this share of its centre either way says too little to be the
# figure: the summary says so in words instead ("too early to tell") and the details keep the numbers.
TOO_WIDE = 0.25
# Speed-ups whose interval holds 1 within this (relative) are "about as fast": no gain to speak of, either way.
ABOUT_SAME = 0.05


def _fmt_ms(value: float) -> str:
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _speculative(stats: Mapping[str, Any]) -> bool:
    return bool(stats.get("speculative") and stats.get("method"))


def _finished(stats: Mapping[str, Any]) -> str | None:
    reason = stats.get("finish_reason")
    if not reason:
        return None
    detail = stats.get("finish_detail")
    return f"{reason}" + (f" ({detail})" if detail else "")


def timed_steps(estimate: Estimate, plain_steps: int) -> str:
    """Which plain steps the estimate rests on, said so that it matches the table's count of plain steps: only those
    timed alone (no verify step in the same update) are, so it can be fewer."""
    if estimate.plain_steps >= plain_steps:
        return f"its {_plural(estimate.plain_steps, 'plain step')}"
    return f"{estimate.plain_steps} of its {plain_steps} plain steps, those timed with no verify step among them"


def _digits(estimate: Estimate) -> int:
    return 2 if estimate.margin < 0.1 else 1  # as many as the uncertainty leaves meaningful


def interval(estimate: Estimate) -> str:
    """The estimate's range (about 95 %), as "1.2–1.4×"."""
    d = _digits(estimate)
    return f"{max(0.0, estimate.ratio - estimate.margin):.{d}f}–{estimate.ratio + estimate.margin:.{d}f}×"


def too_wide(estimate: Estimate) -> bool:
    return estimate.margin > TOO_WIDE * estimate.ratio


def direction(estimate: Estimate) -> str | None:
    """What an estimate too wide for a figure still says: "faster" or "slower" where its whole range does, else
    None (the summary and the badge say the same)."""
    if estimate.ratio - estimate.margin > 1 + ABOUT_SAME:
        return "faster"
    if estimate.ratio + estimate.margin < 1 - ABOUT_SAME:
        return "slower"
    return None


def speed_up_phrase(estimate: Estimate | Pending | None, done: bool) -> str:
    """How much faster than the target alone, in words a visitor who never heard of drafts reads: the estimate with
    its range where the range is narrow enough to say it, else "too early to tell" (or, the answer ended, "too
    uncertain to tell"), with why."""
    if estimate is None:
        return "how much faster than the main model alone: not estimated here (A/B measures it)"
    if isinstance(estimate, Pending):
        if estimate.fixed:
            return f"how much faster than the main model alone: not estimated ({estimate.reason}; A/B measures it)"
        verdict = "too uncertain to tell" if done else "too early to tell"
        return f"how much faster than the main model alone: **{verdict}** ({estimate.reason}; A/B measures it)"
    low, high = estimate.ratio - estimate.margin, estimate.ratio + estimate.margin
    if too_wide(estimate):  # the range says the direction at most
        if way := direction(estimate):
            return f"**{way}** than the main model alone, by how much still uncertain (estimate: {interval(estimate)})"
        verdict = "too uncertain to tell" if done else "too early to tell"
        return (f"how much faster than the main model alone: **{verdict}** (the estimate spans {interval(estimate)}; "
                "A/B measures it)")  # fmt: skip
    if low <= 1 + ABOUT_SAME and high >= 1 - ABOUT_SAME:
        return (f"**about as fast** as the main model alone (estimate: {interval(estimate)}): checking the draft's "
                "guesses cost about what they saved")  # fmt: skip
    ratio = f"{estimate.ratio:.{_digits(estimate)}f}×"
    if high < 1:
        return f"**slower** than the main model alone, **about {ratio}** its speed (estimate: {interval(estimate)})"
    return f"**about {ratio} as fast** as the main model alone (estimate: {interval(estimate)})"


def _share(stats: Mapping[str, Any]) -> str:
    """How much of the answer the draft wrote, said without the field's terms."""
    n, accepted = int(stats.get("n_generated") or 0), int(stats.get("accepted") or 0)
    if accepted:
        share = f"{100 * accepted / n:.0f} %" if n else "–"
        return f"**{share}** of these {_plural(n, 'token')} came from the draft, checked and kept by the main model"
    if int(stats.get("drafted") or 0):
        return f"None of these {_plural(n, 'token')} came from the draft: the main model kept none of its guesses"
    return f"None of these {_plural(n, 'token')} came from the draft: it had no guess to offer"


def stats_summary(stats: Mapping[str, Any], estimate: Estimate | Pending | None = None) -> str:
    """The sentence on top of the panel, and how the answer ended once it has."""
    if not stats or "decode_tok_s" not in stats:
        return EMPTY_STATS
    n, speed = int(stats.get("n_generated") or 0), stats.get("decode_tok_s")
    finished = _finished(stats)
    pace = f"**{speed:.1f} tok/s**" if speed else "speed after the first step"
    if _speculative(stats):
        line = f"{_share(stats)}; {pace}, {speed_up_phrase(estimate, finished is not None)}."
    else:
        line = f"Plain decoding, without a draft: **{_plural(n, 'token')}**, one step of the main model each; {pace}."
    if finished:
        line += f"\n\nFinished: {finished}."
    return line


def speed_badge(stats: Mapping[str, Any], estimate: Estimate | Pending | None = None) -> str:
    """One finished answer's figures in a few words, shown under it in the chat: how it was written, its speed, the
    draft's share and the speed-up where its estimate is narrow enough to say one."""
    speed = stats.get("decode_tok_s")
    parts = [f"{speed:.0f} tok/s" if speed else "not timed"]
    if not _speculative(stats):
        return " · ".join(["plain decoding", *parts])
    n, accepted = int(stats.get("n_generated") or 0), int(stats.get("accepted") or 0)
    parts.append(f"{100 * accepted / n:.0f} % from the draft" if n else "nothing written")
    if isinstance(estimate, Estimate) and not too_wide(estimate):
        parts.append(f"≈ {estimate.ratio:.{_digits(estimate)}f}× as fast ({interval(estimate)})")
    elif isinstance(estimate, Estimate) and (way := direction(estimate)):
        parts.append(f"{way} ({interval(estimate)})")
    else:
        parts.append("speed-up uncertain")
    return " · ".join([method_label(stats.get("method")), *parts])


def _tokens_row(stats: Mapping[str, Any]) -> tuple[str, str, str]:
    """The answer's tokens as the sum they are: the draft's accepted ones and the target's own, and where those
    came from (one right after the prompt, one per verify step, one per plain step)."""
    n, accepted = int(stats.get("n_generated") or 0), int(stats.get("accepted") or 0)
    verify, plain = int(stats.get("verify_steps") or 0), int(stats.get("plain_steps") or 0)
    own = n - accepted
    first = own - verify - plain  # the token sampled with the prompt's last pass: 1, once the answer has begun
    if first in (0, 1):
        parts = [f"{verify} after verify steps", f"{plain} from plain steps"]
        where = f" ({', '.join(['1 right after the prompt', *parts] if first else parts)})"
    else:  # an answer cut short (max_tokens, a stop string) inside a step: its parts no longer add up that way
        where = ""
    return ("Tokens", f"{n} = {accepted} from the draft + {own} from the target{where}",
            "every token is the target's choice; the draft's were proposed by the draft and kept by the target")


def stats_details(stats: Mapping[str, Any], estimate: Estimate | Pending | None = None) -> str:
    """The folded table: each term with its value and, under it, what it means."""
    if not stats or "decode_tok_s" not in stats:
        return EMPTY_DETAILS
    speculative = _speculative(stats)
    speed = stats.get("decode_tok_s")
    mode = f"{method_label(stats.get('method'))} speculative" if speculative else "plain"
    rows: list[tuple[str, str, str]] = [
        ("Decode speed", f"{speed:.1f} tok/s ({mode})" if speed else f"… ({mode}: after a step)",
         "tokens written per second after the prompt was read"),
    ]
    verify, plain = int(stats.get("verify_steps") or 0), int(stats.get("plain_steps") or 0)
    plain_ms, verify_ms = float(stats.get("plain_ms") or 0.0), float(stats.get("verify_ms") or 0.0)
    if speculative:
        if isinstance(estimate, Estimate):
            vs_plain = (f"≈ {estimate.ratio:.2f}× ({interval(estimate)}, about 95 %"
                        f"{': too wide to say' if too_wide(estimate) else ''}): {estimate.speed:.1f} against "
                        f"{estimate.plain_speed:.1f} tok/s, timed over {timed_steps(estimate, plain)}")  # fmt: skip
        else:
            vs_plain = "not yet" if estimate is None else f"not yet: {estimate.reason}"
        rows += [
            ("vs plain (estimate)", vs_plain,
             "this answer's speed against one token per plain step, both timed in this answer (same engine, same "
             "load as any answers it shares steps with); the A/B button measures plain decoding itself"),
            _tokens_row(stats),
            ("Verify steps", str(verify), "steps of the target that checked a draft: several tokens in one pass"),
            ("Plain steps", str(plain),
             "steps of the target that wrote one token with no draft (the adaptive length takes them where a draft "
             "would not pay)"),
        ]
        drafted, accepted = int(stats.get("drafted") or 0), int(stats.get("accepted") or 0)
        if drafted:
            rows.append(("Acceptance rate", f"{stats.get('acceptance_rate', accepted / drafted):.0%} "
                                            f"({accepted} of {drafted} drafted)",
                         "the share of drafted tokens the target kept"))  # fmt: skip
        if verify:
            per_step = accepted / verify
            rows.append(("Tokens per verify step", f"{per_step + 1:.2f} = {per_step:.2f} accepted + 1 of the target's",
                         "what one verify step wrote on average (also called the mean accepted length)"))
        trees = int(stats.get("tree_steps") or 0)
        if trees:
            nodes, path = int(stats.get("tree_nodes") or 0), int(stats.get("tree_accepted") or 0)
            rows.append(("Draft trees", f"{trees} steps · {nodes / trees:.1f} nodes verified a tree · accepted path "
                                        f"{path / trees:.2f} tokens · {int(stats.get('tree_off_spine') or 0)} off the "
                                        "draft's first choice",
                         "steps that verified a tree of the draft's likeliest alternatives in one target pass, instead "
                         "of its first choice alone; the accepted path is the drafted tokens the target kept"))
        length = stats.get("draft_length")
        rows.append(("Draft length", "auto (adaptive)" if length == "auto" else f"{length} (fixed)",
                     "the longest draft a step asks for; auto chooses it at every step from what it measured, and "
                     "remembers that across your requests in this conversation, per method"
                     if length == "auto" else "the draft asked for at every step"))  # fmt: skip
        rows.append(("Time", f"draft {_fmt_ms(float(stats.get('draft_ms') or 0.0))} · verify steps "
                             f"{_fmt_ms(verify_ms - plain_ms)} · plain steps {_fmt_ms(plain_ms)}",
                     "the draft's passes, and the target's passes in each kind of step"))  # fmt: skip
    else:
        rows += [("Steps", str(plain), "steps of the target, one token each"),
                 ("Time", f"plain steps {_fmt_ms(verify_ms)}", "the target's passes")]  # fmt: skip
    n_prompt, reused = int(stats.get("n_prompt") or 0), int(stats.get("n_reused") or 0)
    rows += [
        ("Prompt", f"{n_prompt} tokens = {reused} reused + {int(stats.get('n_prefilled') or 0)} read now",
         "reused: already in the cache (the shared system prompt, or this conversation's earlier turns), so not "
         "computed again"),
        ("Prefill", _fmt_ms(float(stats.get("prefill_ms") or 0.0)), "the time to read the prompt's new tokens"),
    ]
    gpu_time = _gpu_time_row(stats)
    if gpu_time:
        rows.append(gpu_time)
    finished = _finished(stats)
    if finished:
        rows.append(("Finished", finished, "why the answer ended"))
    table = "\n".join(f"| **{name}**<br><small>{why}</small> | {value} |" for name, value, why in rows)
    return "| Term | Value |\n| --- | --- |\n" + table


def _gpu_time_row(stats: Mapping[str, Any]) -> tuple[str, str, str] | None:
    used = stats.get("gpu_seconds_used")
    requested = stats.get("gpu_seconds_requested")
    if requested is not None:
        used_text = "…" if used is None else f"{used:.1f} s"
        return ("GPU time requested / used", f"{requested} s / {used_text}",
                "what your ZeroGPU quota was charged for, and what the answer took")
    return ("Engine time", f"{used:.1f} s", "the engine's own time for this answer") if used is not None else None
