"""Text the Space shows: the live statistics panel, the per-position acceptance rows, the A/B summary and the
info box. Plain strings and dicts, so they are testable without a browser."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .. import methods as draft_methods
from .presets import PairPreset
from .requests import Limits
from .runmode import RunMode

EMPTY_STATS = "*Statistics appear here while the model answers.*"
WAITING_STATS = "*Waiting for the first tokens (the first request also loads the model)…*"
# An absolute path (two or more components) that starts a word: /home/user/.cache/x.gguf -> x.gguf. Slashes inside
# words or after a colon (tok/s, 1/2, https://host/...) are left alone.
_PATH = re.compile(r"(?<![\w.~:/-])(?:/[^\s/'\"():,;<>`]+)+/([^\s/'\"():,;<>`]+)")


def scrub_paths(text: str) -> str:
    """`text` with the server's absolute file-system paths cut down to their file names, for anything a visitor
    reads (the info box, /info, error messages)."""
    return _PATH.sub(r"\1", text)


def _fmt_ms(value: float) -> str:
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _gpu_time_row(stats: Mapping[str, Any]) -> tuple[str, str] | None:
    used = stats.get("gpu_seconds_used")
    requested = stats.get("gpu_seconds_requested")
    if requested is not None:
        used_text = "…" if used is None else f"{used:.1f} s"
        return "GPU time requested / used", f"{requested} s / {used_text}"
    return ("Engine time", f"{used:.1f} s") if used is not None else None


def stats_markdown(stats: Mapping[str, Any]) -> str:
    """The live panel: speed, acceptance, time split, prompt cache use and GPU time of one request (its statistics
    as the API returns them)."""
    if not stats or "decode_tok_s" not in stats:
        return EMPTY_STATS
    drafting = stats.get("speculative") and stats.get("method") and stats.get("drafted", 0)
    mode = f"{method_label(stats.get('method'))} speculative" if drafting else "plain"
    speed = stats["decode_tok_s"]
    speed_text = f"**{speed:.1f} tok/s** ({mode})" if speed is not None else f"… ({mode}: after the first step)"
    rows = [
        ("Decode speed", speed_text),
        ("Generated", f"{stats['n_generated']} tokens in {stats['verify_steps']} verify steps"),
        ("Acceptance rate", f"{stats['acceptance_rate']:.0%}"),
        ("Mean accepted length", f"{stats['mean_accepted_length']:.2f} tokens / step"),
        ("Drafted / accepted", f"{stats['drafted']} / {stats['accepted']}"),
        ("Draft vs verify", f"{_fmt_ms(stats['draft_ms'])} vs {_fmt_ms(stats['verify_ms'])}"),
        ("Prompt tokens", f"{stats['n_prompt']}: {stats['n_reused']} reused, {stats['n_prefilled']} prefilled"),
        ("Prefill", _fmt_ms(stats["prefill_ms"])),
    ]
    gpu_time = _gpu_time_row(stats)
    if gpu_time:
        rows.append(gpu_time)
    if stats.get("finish_reason"):
        detail = stats.get("finish_detail")
        rows.append(("Finished", f"{stats['finish_reason']}" + (f" ({detail})" if detail else "")))
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return "| Statistic | Value |\n| --- | --- |\n" + table


def acceptance_rows(stats: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Acceptance rate of each draft position (accepted / verified there), for the bar plot."""
    accepted = stats.get("accepted_per_position") or []
    drafted = stats.get("drafted_per_position") or []
    return [
        {"position": str(i + 1), "acceptance": round(a / d, 4) if d else 0.0}
        for i, (a, d) in enumerate(zip(accepted, drafted, strict=False))
    ]


METHOD_LABELS = {m.name: m.label for m in draft_methods.REGISTRY}
PLAIN_LABEL = "Plain (target only)"


def method_label(method: str | None, draft_kind: str | None = None) -> str:
    """How the page names a draft method ("DFlash" for a v1 draft)."""
    if method == "dflash" and draft_kind == "dflash1":
        return "DFlash"
    if method and draft_methods.CHAIN_SEPARATOR in method:
        return " → ".join(method_label(m, draft_kind) for m in draft_methods.split(method))
    return METHOD_LABELS.get(method or "", "speculative")


def comparison_markdown(
    methods: Mapping[str, Mapping[str, Any] | None],
    plain: Mapping[str, Any] | None,
    identical: Mapping[str, bool | None],
    *,
    temperature: float = 0.0,
    seed: int | None = None,
) -> str:
    """Side by side: the same request decoded plainly and with each draft method (`methods`: label → statistics,
    None or empty while it has not started), per method its acceptance, mean accepted length and speed-up, and what
    the texts being equal or not (`identical`: label → whether its text equals plain's, None until both finished)
    means at this temperature, once every method has finished."""
    lines = ["| Decoding | Tokens | Speed | Acceptance | Mean length | Verify |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, stats in ((PLAIN_LABEL, plain), *methods.items()):
        if stats:
            drafted = bool(stats.get("drafted"))  # nothing drafted: no acceptance to speak of
            acceptance = f"{stats['acceptance_rate']:.0%}" if drafted else "–"
            mean_length = f"{stats['mean_accepted_length']:.2f}" if drafted else "–"
            speed = stats.get("decode_tok_s")
            lines.append(
                f"| {name} | {stats['n_generated']} | {'…' if speed is None else f'{speed:.1f} tok/s'} | "
                f"{acceptance} | {mean_length} | {stats.get('verify_mode', '')} |"
            )
        else:
            lines.append(f"| {name} | … | running or waiting | | | |")
    if plain and plain.get("finish_reason"):
        for name, stats in methods.items():
            if stats:
                lines.append("\n" + speed_up_line(stats, plain, name))
    if identical and all(same is not None for same in identical.values()):  # every method has finished
        lines.append("\n" + comparison_verdict(identical, temperature, seed))  # type: ignore[arg-type]
    return "\n".join(lines)


def ab_markdown(
    speculative: Mapping[str, Any],
    plain: Mapping[str, Any] | None,
    identical: bool | None,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    name: str = "DFlash speculative",
) -> str:
    """`comparison_markdown` for one draft method."""
    return comparison_markdown({name: speculative}, plain, {name: identical}, temperature=temperature, seed=seed)


NOISE = 0.10  # speed ratios within ±10 % of 1 are what two runs of one decoder differ by on a shared machine


def speed_up_line(speculative: Mapping[str, Any], plain: Mapping[str, Any], name: str = "DFlash") -> str:
    """A method's speed-up over plain decoding, claimed only when the draft did something and the difference is
    beyond noise."""
    spec_speed, plain_speed = speculative.get("decode_tok_s"), plain.get("decode_tok_s")
    if not spec_speed or not plain_speed:
        return f"**{name}: speed-up not measured** (an answer too short to time)"
    ratio = spec_speed / plain_speed
    if not speculative.get("accepted"):
        return (f"**{name}: Speed-up: none.** The target accepted none of the draft's tokens (acceptance 0 %), so "
                f"drafting cannot have gained anything; the measured ratio ({ratio:.2f}×) is noise.")  # fmt: skip
    if abs(ratio - 1) <= NOISE:
        return f"**{name}: Speed-up: none measurable** ({ratio:.2f}×, within the ±{NOISE:.0%} two runs differ by)"
    slower = f": {name} was slower here" if ratio < 1 else ""
    return f"**{name}: Speed-up: {ratio:.2f}×** ({name} tok/s ÷ plain tok/s{slower})"


def comparison_verdict(identical: Mapping[str, bool], temperature: float, seed: int | None) -> str:
    """The verdict over every finished method: at temperature 0 one that differs from plain is a fault (named)."""
    if len(identical) == 1:
        return ab_verdict(next(iter(identical.values())), temperature, seed)
    differing = [name for name, same in identical.items() if not same]
    verdict = ab_verdict(not differing, temperature, seed)
    if differing and temperature == 0:
        verdict += f" Differs from plain: {', '.join(differing)}."
    return verdict


def ab_verdict(identical: bool, temperature: float, seed: int | None) -> str:
    """What "identical" means: at temperature 0 both texts are the target's greedy output, token for token, so any
    difference is a fault; above it both are samples of the target's distribution drawn along different paths
    (rejection sampling against the draft vs the target's own sampler), so the same seed need not give the same
    text."""
    if temperature == 0:
        if identical:
            return ("**Texts identical: yes.** At temperature 0 both are the target's greedy output, token for "
                    "token: the draft changes the speed, never the text.")  # fmt: skip
        return ("**Texts identical: NO: this is a fault.** At temperature 0 both must be the target's greedy output, "
                "token for token.")  # fmt: skip
    same_seed = f"the same seed ({seed})" if seed is not None else "the same seed"
    paths = (
        f"both answers are samples of the target's distribution at temperature {temperature:g}, drawn with "
        f"{same_seed} along different paths (rejection sampling against the draft vs the target's own sampler)"
    )
    if identical:
        return f"**Texts identical: yes, this time.** Above temperature 0 {paths}; they can coincide, need not."
    return (f"**Texts identical: no, as expected.** Above temperature 0 {paths}, so different texts are expected and "
            "are not a fault: what DFlash keeps is the distribution, not the draw.")


def mode_banner(mode: RunMode) -> str:
    """Shown on top of the page in the offline demo: why it runs, and how to run the real pair."""
    if not mode.tiny:
        return ""
    if mode.problems:
        problems = "; ".join(mode.problems)
        return (
            f"**The model pair is not served: {mode.reason}.** {problems}. To fix it, {mode.fix}. "
            "Meanwhile this is the **offline demo on random-weight test models**: the answers are gibberish by "
            "design; the speculative machinery and the statistics are real."
        )
    return (
        "**Offline demo: random-weight test models.** The answers are gibberish by design; the speculative "
        f"machinery and the statistics are real. (Started this way because: {mode.reason}.) "
        "To run the real pair, start on a CUDA GPU or ZeroGPU, or set `DFLASH_DEMO=off` "
        "(and optionally `DFLASH_TARGET_REPO` / `DFLASH_DRAFT_REPO` ...)."
    )


def info_markdown(
    preset: PairPreset,
    limits: Limits,
    build: Mapping[str, Any],
    engine_info: Mapping[str, Any] | None,
) -> str:
    """The info box: pair, quantisation, context, limits, llama.cpp build and GPU."""
    kind = "random-weight test models (offline demo)" if preset.random_weights else "configured pair"
    lines = [
        f"**Preset** `{preset.name}`: {kind}",
        f"- Target: `{preset.target.describe()}`",
        f"- Draft: `{preset.draft.describe()}`",
        f"- Quantisation: {preset.quantisation}",
        f"- Context: {preset.n_ctx} tokens; draft length up to {preset.draft_capacity}; "
        f"answers up to {limits.max_new_tokens} tokens",
    ]
    for key, value in build.items():
        lines.append(f"- {key}: {scrub_paths(str(value))}")
    if engine_info:
        lines.append(
            f"- Engine: target arch `{engine_info.get('target_arch')}`"
            f"{' (hybrid)' if engine_info.get('hybrid') else ''}, draft `{engine_info.get('draft_kind')}`, "
            f"block size {engine_info.get('block_size')}, thinking switch "
            f"{'supported' if engine_info.get('supports_thinking') else 'not supported'}"
        )
        methods = [method_label(m, engine_info.get("draft_kind")) for m in engine_info.get("methods") or []]
        lines.append(f"- Draft methods: {', '.join(methods) or 'none (plain decoding only)'}")
        if engine_info.get("draft_problem"):
            lines.append(f"- ⚠️ {scrub_paths(str(engine_info['draft_problem']))}")
    return "\n".join(lines)
