"""Text the Space shows: the per-position acceptance rows, the method menu's help, the A/B summary and the info box
(the live statistics: panel.py). Plain strings and dicts, so they are testable without a browser."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ... import methods as draft_methods
from ..requests import Limits
from ..scrub import scrub_paths
from ..setup.presets import PairPreset
from ..setup.runmode import RunMode
from ..web.service import Reply
from .highlight import escape


def acceptance_rows(stats: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Acceptance rate of each draft position (accepted / verified there), for the bar plot."""
    accepted = stats.get("accepted_per_position") or []
    drafted = stats.get("drafted_per_position") or []
    return [
        {"position": str(i + 1), "acceptance": round(a / d, 4) if d else 0.0}
        for i, (a, d) in enumerate(zip(accepted, drafted, strict=False))
    ]


PLAIN_LABEL = "Plain"
VERIFY_MODES = {"greedy": "greedy match (temperature 0)", "sample": "rejection sampling",
                "match": "sample and match"}  # fmt: skip


def method_label(method: str | None, draft_kind: str | None = None) -> str:
    """How the page names a draft method, short ("DFlash" for a v1 draft)."""
    if method == "dflash" and draft_kind == "dflash1":
        return "DFlash"
    if method and draft_methods.METHOD_SEPARATOR in method:
        return " → ".join(method_label(m, draft_kind) for m in draft_methods.split(method))
    known = draft_methods.registry().get(method or "")
    return known.label if known else "speculative"


def method_description(method: str | None, draft_kind: str | None = None) -> str:
    """A method's label with what it is, where the label alone does not say (the About box: the registry's)."""
    known = draft_methods.registry().get(method or "")
    return known.about if known and known.about else method_label(method, draft_kind)


def method_help(methods: list[str], draft_kind: str | None = None, default: str | None = None) -> str:
    """The method menu's help: one line for "auto" and for each method or method list in the menu."""
    lines = [f"- **auto**: the pair's default{f' ({method_label(default, draft_kind)})' if default else ''}"]
    for method in methods:
        members = draft_methods.split(method)
        if len(members) > 1:
            names = [method_label(m, draft_kind) for m in members]
            what = (f"each step drafted by {names[0]} where it finds something (the answer copies its prompt), "
                    f"by {' then '.join(names[1:])} elsewhere")  # fmt: skip
        else:
            known = draft_methods.registry().get(method)
            what = known.help if known and known.help else "a draft method of this pair"
        lines.append(f"- **{method_label(method, draft_kind)}**: {what}")
    return "\n".join(lines)


def comparison_markdown(
    methods: Mapping[str, Mapping[str, Any] | None],
    plain: Mapping[str, Any] | None,
    identical: Mapping[str, bool | None],
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    divergences: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """Side by side: the same request decoded plainly and with each draft method (`methods`: label → statistics,
    None or empty while it has not started), per method its acceptance, mean accepted length and speed-up, and what
    the texts being equal or not (`identical`: label → whether its text equals plain's, None until both finished)
    means at this temperature, once every method has finished (`divergences`: label → why its text differs from
    plain's at temperature 0, Divergence.to_dict()). What it found comes first, right under its button, where the
    visitor who clicked it looks; the table follows. Five short columns: it fits a phone."""
    lines = [comparison_progress(methods, plain, identical or {})]
    if plain and plain.get("finish_reason"):  # each method's sentence once its own run has finished
        for name, stats in methods.items():
            if stats and (identical.get(name) is not None or stats.get("finish_reason")):
                lines.append("\n" + speed_up_line(stats, plain, name))
    if identical and all(same is not None for same in identical.values()):  # every method has finished
        lines.append("\n" + comparison_verdict(identical, temperature, seed, divergences))  # type: ignore[arg-type]
    lines += ["", "| Method | Tokens | tok/s | Accepted | Tok/step |", "| --- | --- | --- | --- | --- |"]
    modes = []
    for name, stats in ((PLAIN_LABEL, plain), *methods.items()):
        if stats:
            drafted = bool(stats.get("drafted"))  # nothing drafted: no acceptance to speak of
            acceptance = f"{stats['acceptance_rate']:.0%}" if drafted else "–"
            mean_length = f"{stats.get('mean_accepted_length', 1.0):.2f}"  # one definition: 1.00 without a draft
            speed = stats.get("decode_tok_s")
            lines.append(f"| {name} | {stats['n_generated']} | {'…' if speed is None else f'{speed:.1f}'} | "
                         f"{acceptance} | {mean_length} |")  # fmt: skip
            if stats.get("verify_mode") in VERIFY_MODES:
                modes.append(VERIFY_MODES[stats["verify_mode"]])
        else:
            lines.append(f"| {name} | … | waiting | | |")
    checked = f" Drafts checked by {' / '.join(dict.fromkeys(modes))}." if modes else ""
    lines.append(f"\n*Accepted: the drafted tokens the target kept. Tok/step: tokens per verify step, the target's own "
                 f"one included (the mean accepted length; 1.00 where nothing was drafted, as in plain decoding)."
                 f"{checked}*")  # fmt: skip
    return "\n".join(lines)


def comparison_progress(methods: Mapping[str, Mapping[str, Any] | None], plain: Mapping[str, Any] | None,
                        identical: Mapping[str, bool | None]) -> str:  # fmt: skip
    """The A/B's first line: which run is on (and how far it got), or that all have finished."""
    runs = [(PLAIN_LABEL, plain), *methods.items()]
    for index, (name, stats) in enumerate(runs, start=1):
        finished = bool(stats and (stats.get("finish_reason") or identical.get(name) is not None))
        if not finished:
            so_far = f", {_tokens(stats)} so far" if stats else ""
            return f"**A/B running: {name}** ({index} of {len(runs)}{so_far})…"
    return f"**A/B finished**: the same prompt, {len(runs)} runs with the same seed."


def _tokens(stats: Mapping[str, Any]) -> str:
    n = int(stats.get("n_generated") or 0)
    return f"{n} token" if n == 1 else f"{n} tokens"


def ab_markdown(
    speculative: Mapping[str, Any],
    plain: Mapping[str, Any] | None,
    identical: bool | None,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    name: str = "DFlash 2",
) -> str:
    """`comparison_markdown` for one draft method."""
    return comparison_markdown({name: speculative}, plain, {name: identical}, temperature=temperature, seed=seed)


NOISE = 0.10  # speed ratios within ±10 % of 1 are what two runs of one decoder differ by on a shared machine


def speed_up_line(speculative: Mapping[str, Any], plain: Mapping[str, Any], name: str = "DFlash 2") -> str:
    """A method's speed-up over plain decoding, claimed only when the draft did something and the difference is
    beyond noise."""
    spec_speed, plain_speed = speculative.get("decode_tok_s"), plain.get("decode_tok_s")
    if not spec_speed or not plain_speed:
        return f"**{name}: speed-up not measured** (an answer too short to time)"
    ratio = spec_speed / plain_speed
    speeds = f"{spec_speed:.1f} tok/s against plain's {plain_speed:.1f}"
    if not speculative.get("accepted"):
        return (f"**{name}: no speed-up.** The target kept none of the draft's tokens, so drafting cannot have "
                f"gained anything; the measured {ratio:.2f}× ({speeds}) is noise.")  # fmt: skip
    if abs(ratio - 1) <= NOISE:
        return (f"**{name}: no measurable speed-up** ({ratio:.2f}×, {speeds}: within the ±{NOISE:.0%} two runs "
                "differ by)")  # fmt: skip
    if ratio < 1:
        return f"**{name}: slower than plain here, {ratio:.2f}×** ({speeds})"
    return f"**{name}: {ratio:.2f}× as fast as plain** ({speeds})"


def speed_up_rows(methods: Mapping[str, Mapping[str, Any] | None],
                  plain: Mapping[str, Any] | None) -> list[dict[str, Any]]:  # fmt: skip
    """The A/B chart's bars: plain decoding at 1 and each finished method's measured speed over it (× plain)."""
    plain_speed = (plain or {}).get("decode_tok_s")
    if not plain_speed or not (plain or {}).get("finish_reason"):
        return []
    rows = [{"method": PLAIN_LABEL, "speed-up": 1.0}]
    for name, stats in methods.items():
        if stats and stats.get("finish_reason") and stats.get("decode_tok_s"):
            rows.append({"method": name, "speed-up": round(stats["decode_tok_s"] / plain_speed, 3)})
    return rows if len(rows) > 1 else []


TEXTS_CLASS = "ab-texts"


def texts_side_by_side(texts: Mapping[str, str]) -> str:
    """The A/B's answers side by side (a column each; on a phone they stack), plain's first. A text that differs from
    plain's says so in its heading and is marked from its first differing character. The model's text is escaped."""
    if not texts:
        return ""
    names = list(texts)
    plain = texts[names[0]]
    columns = []
    for name in names:
        text = texts[name]
        if name == names[0]:
            note, body = "", escape(text)
        elif text == plain:
            note, body = " · the same text", escape(text)
        else:
            at = next((i for i, (a, b) in enumerate(zip(text, plain, strict=False)) if a != b), min(len(text),
                                                                                                   len(plain)))
            note = f" · differs from character {at + 1}"
            body = escape(text[:at]) + f"<mark>{escape(text[at:])}</mark>"
        columns.append(f'<div class="ab-text"><div class="ab-name"><b>{escape(name)}</b>{note}</div>'
                       f'<div class="ab-body">{body}</div></div>')  # fmt: skip
    return f'<div class="{TEXTS_CLASS}">{"".join(columns)}</div>'


def comparison_verdict(identical: Mapping[str, bool], temperature: float, seed: int | None,
                       divergences: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The verdict over every finished method: at temperature 0 each one that differs from plain is named with what
    the difference is (a near-tie of the kernels' rounding, or a fault)."""
    divergences = divergences or {}
    if len(identical) == 1:
        name, same = next(iter(identical.items()))
        return ab_verdict(same, temperature, seed, divergences.get(name))
    differing = [name for name, same in identical.items() if not same]
    if temperature != 0 or not differing:
        return ab_verdict(not differing, temperature, seed)
    return "\n\n".join(f"{name}: {ab_verdict(False, temperature, seed, divergences.get(name))}"
                       for name in differing)


def divergence_verdict(divergence: Mapping[str, Any] | None) -> str:
    """A temperature-0 difference from plain decoding, as the target's logits at the first differing token explain
    it (dflash_runtime.decoding.divergence): a near-tie that the kernels' rounding breaks either way, or a fault."""
    if not divergence or divergence.get("kind") not in ("near-tie", "fault"):
        detail = f" ({divergence['summary']})" if divergence and divergence.get("summary") else ""
        return ("**Texts identical: NO, and the difference was not explained**" + detail + ". At temperature 0 a "
                "difference is a near-tie of the kernels' rounding or a fault.")
    n, margin, bound = divergence["position"], divergence["margin"], divergence["bound"]
    candidates = f"{divergence['text_a']!r} (plain) and {divergence['text_b']!r}"
    if divergence["kind"] == "near-tie":
        return (f"**Texts differ at token {n}: a near-tie (margin {margin:.2g}, the kernels' rounding), not a "
                f"fault.** There the target's top two candidates, {candidates}, are closer than its kernels' "
                f"summation error can move them (bound {bound:.2g}): the verify batch and plain decoding, summing in "
                "different orders, broke the tie differently; each text is a greedy answer of the target.")
    return (f"**Texts differ at token {n}: fault (margin {margin:.3g}).** There the target prefers one of "
            f"{candidates} by far more than its kernels' rounding can move (bound {bound:.2g}): at temperature 0 "
            "both must be the target's greedy output.")


def ab_verdict(identical: bool, temperature: float, seed: int | None,
               divergence: Mapping[str, Any] | None = None) -> str:
    """What "identical" means: at temperature 0 both texts are the target's greedy output, token for token, so a
    difference is a near-tie of the kernels' rounding or a fault (`divergence` says which); above it both are samples
    of the target's distribution drawn along different paths (rejection sampling against the draft vs the target's
    own sampler), so the same seed need not give the same text."""
    if temperature == 0:
        if identical:
            return ("**Texts identical: yes.** At temperature 0 both are the target's greedy output, token for "
                    "token: the draft changes the speed, never the text.")  # fmt: skip
        return divergence_verdict(divergence)
    same_seed = f"the same seed ({seed})" if seed is not None else "the same seed"
    paths = (
        f"both answers are samples of the target's distribution at temperature {temperature:g}, drawn with "
        f"{same_seed} along different paths (rejection sampling against the draft vs the target's own sampler)"
    )
    if identical:
        return f"**Texts identical: yes, this time.** Above temperature 0 {paths}; they can coincide, need not."
    return (f"**Texts identical: no, as expected.** Above temperature 0 {paths}, so different texts are expected and "
            "are not a fault: what DFlash keeps is the distribution, not the draw.")


def sharing_note(parallel: int, until_loaded: bool = False) -> str:
    """How many answers share the engine (on top of the settings column): what a visitor may wait for, nothing of what
    others ask. `until_loaded`: `parallel` is a most, and the engine, not loaded yet, opens as many as fit."""
    if until_loaded and parallel > 1:
        return (f"*Up to {parallel} answers can run at once on this engine (as many as fit in memory when it loads; "
                "their steps share one target decode); more wait in the queue.*")
    if parallel <= 1:
        return ("*One answer runs at a time on this engine: a message sent while another answer runs waits for it "
                "in the queue.*")  # fmt: skip
    return (f"*{parallel} answers can run at once on this engine (their steps share one target decode); more wait in "
            "the queue.*")


# What the offline demo is, said on its banner (the README's "What you see first" says the same at more length).
DEMO_WHAT = (
    "A generated target writes English words from a small Markov chain (word salad, not answers), and a generated "
    "DFlash 2 draft guesses its next words about as often, position by position, as published DFlash 2 drafts guess "
    "the real pair's. The speculative decoding, the highlight and every figure are real, measured on this CPU: they "
    "are not GPU figures (here a verify of 8 tokens costs about two plain steps; on a GPU about one). Published "
    "llama.cpp DFlash 2 runs of the real pair on a GPU keep about 3.6 tokens per verify step at draft length 7."
)


def mode_banner(mode: RunMode) -> str:
    """Shown on top of the page in the offline demo: why it runs, and how to run the real pair."""
    if not mode.tiny:
        return ""
    if mode.problems:
        problems = "; ".join(mode.problems)
        return (
            f"**The model pair is not served: {mode.reason}.** {problems}. To fix it, {mode.fix}. "
            f"Meanwhile this is the **offline demo on random-weight test models**. {DEMO_WHAT}"
        )
    # One line on top (a phone's first screen keeps room for the chat), the rest folded under it.
    return (
        "**Offline demo: random-weight test models on this CPU.** The answers are word salad; the drafting, the "
        "highlight and every figure are real.\n\n<details><summary>What this demo is, and how to run the real "
        f"pair</summary>\n\n{DEMO_WHAT} (Started this way because: {mode.reason}.) To run the real pair, start on a "
        "CUDA GPU or ZeroGPU, or set `DFLASH_DEMO=off` (and optionally `DFLASH_TARGET_REPO` / `DFLASH_DRAFT_REPO` "
        "...).\n\n</details>"
    )


def answers_at_once(preset: PairPreset, engine_info: Mapping[str, Any] | None) -> str:
    """DFLASH_PARALLEL as it took effect: the loaded engine's sequences, and how `auto` sized them to memory."""
    if engine_info and engine_info.get("parallel"):
        plan = engine_info.get("parallel_plan")
        setting = f"DFLASH_PARALLEL=auto: {plan}" if plan else "DFLASH_PARALLEL"
        return f"{engine_info['parallel']} ({setting})"
    if preset.parallel_fit:
        return f"up to {preset.parallel}, as many as fit in memory when the engine loads (DFLASH_PARALLEL=auto)"
    return f"{preset.parallel} (DFLASH_PARALLEL)"


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
        f"- Answers at once: {answers_at_once(preset, engine_info)}",
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
        methods = [method_description(m, engine_info.get("draft_kind")) for m in engine_info.get("methods") or []]
        lines.append(f"- Draft methods: {', '.join(methods) or 'none (plain decoding only)'}")
        if engine_info.get("draft_problem"):
            lines.append(f"- ⚠️ {scrub_paths(str(engine_info['draft_problem']))}")
    return "\n".join(lines)


@dataclass
class Comparison:
    """The A/B view's state: the latest reply of each phase of one request (plain decoding and each draft method),
    all run with the same seed. `labels`: each method phase's row name."""

    temperature: float
    seed: int
    labels: dict[str, str]
    phases: dict[str, Reply] = field(default_factory=dict)
    divergences: dict[str, dict[str, Any]] = field(default_factory=dict)  # phase → why it differs from plain
    chart_rows: list[dict[str, Any]] = field(default_factory=list)  # the speed-up chart's bars so far
    texts: dict[str, str] = field(default_factory=dict)  # every run's text by row name, once all have finished

    def add(self, reply: Reply) -> str:
        self.phases[reply.phase] = reply
        if reply.last is not None:
            self.divergences.update(reply.last.divergences)
        plain = self.phases.get("plain")
        plain_done = plain is not None and plain.finish_reason is not None
        methods: dict[str, dict[str, Any] | None] = {}
        identical: dict[str, bool | None] = {}
        for phase, label in self.labels.items():
            run = self.phases.get(phase)
            methods[label] = run.stats if run else None
            done = plain_done and run is not None and run.finish_reason is not None
            identical[label] = (run.text == plain.text) if done and run and plain else None
        divergences = {label: self.divergences[phase] for phase, label in self.labels.items()
                       if phase in self.divergences}
        self.chart_rows = speed_up_rows(methods, plain.stats if plain else None)
        self.texts = self._finished_texts() if all(same is not None for same in identical.values()) else {}
        return comparison_markdown(methods, plain.stats if plain else None, identical,
                                   temperature=self.temperature, seed=self.seed,
                                   divergences=divergences)  # fmt: skip

    def _finished_texts(self) -> dict[str, str]:
        """Each run's text by its row name, plain's first (once every run has finished)."""
        runs = [("plain", PLAIN_LABEL), *self.labels.items()]
        return {label: self.phases[phase].text for phase, label in runs if phase in self.phases}
