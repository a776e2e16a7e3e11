"""The draft made visible, without a server: the runs a reply accumulates (also across chunks a slow reader skips),
the highlighted reply (its Markdown as written, whole words marked where the draft wrote most of them, nothing marked
where a mark would break the Markdown, a prefix of itself as it grows, thinking still folded by the real Chatbot),
the session that shows it or not, the speed chart's points (taken by work done) and the A/B verdict's wording."""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator

import gradio as gr
import pytest

from dflash_runtime.results.stats import Stats
from dflash_runtime.space.gpu_job import ReplyChunk
from dflash_runtime.space.page.highlight import BADGE_CLASS, DRAFT_CLASS, ReplyView, reply_markdown, with_badge
from dflash_runtime.space.page.session import ChatSession
from dflash_runtime.space.page.speedup import ACCEPTANCE, SPEED, SpeedTrace
from dflash_runtime.space.page.views import ab_markdown, ab_verdict
from dflash_runtime.space.provenance import SourceRuns, draft_text, merged
from dflash_runtime.space.web.calls import Calls, ReplyJob

TIMEOUT_S = 30.0
def random_runs(text: str, rng: random.Random) -> list[tuple[int, str]]:
    runs, offset = [], 0
    while offset < len(text):
        n = min(rng.randint(1, 6), len(text) - offset)
        runs.append((n, rng.choice(["draft", "target"])))
        offset += n
    return runs


def test_runs_accumulate_joined_for_the_api_and_as_they_came_for_the_view() -> None:
    sources = SourceRuns()
    sources.add([(3, "target"), (2, "draft")])
    sources.add([(4, "draft"), (0, "target"), (1, "target")])
    assert sources.chunks == [(3, "target"), (2, "draft"), (4, "draft"), (1, "target")]
    assert sources.runs == [(3, "target"), (6, "draft"), (1, "target")] == merged(sources.chunks)
    first = sources.as_json()
    assert first == [[3, "target"], [6, "draft"], [1, "target"]] and sources.n_chars == 10
    sources.add([(2, "target")])
    assert first == [[3, "target"], [6, "draft"], [1, "target"]], "a list already returned never changes"
    assert draft_text("abcdefghijkl", sources.runs) == "defghi"


def test_a_reader_that_skips_chunks_keeps_every_run() -> None:
    """The page reads the latest chunk only; the chunks it skips join their text, runs and draft lengths to the next
    one, and what comes once (the notice, the engine's description) is kept."""
    chunks = [ReplyChunk(delta=chr(97 + i % 26), stats={"n_generated": i + 1}, draft_lengths=[i],
                         source_runs=[(1, "draft" if i % 3 else "target")]) for i in range(40)]  # fmt: skip
    chunks[0].notice, chunks[0].engine_info = "dropped", {"target_arch": "qwen3"}
    chunks[-1].finish_reason = "length"

    def stream() -> Iterator[ReplyChunk]:
        yield from chunks

    calls = Calls()
    job = ReplyJob(stream, calls, calls.admitted("c", 1), is_final=lambda c: c.finish_reason is not None,
                   fold=ReplyChunk.then)  # fmt: skip

    async def slow_reader() -> list[ReplyChunk]:
        taken = []
        async for chunk in job.chunks(latest_only=True):
            if not taken:
                await asyncio.to_thread(job.wait_done, TIMEOUT_S)  # everything else queues meanwhile
            taken.append(chunk)
        return taken

    taken = asyncio.run(asyncio.wait_for(slow_reader(), TIMEOUT_S))
    assert len(taken) < len(chunks), "the reader skipped chunks"
    sources = SourceRuns()
    for chunk in taken:
        sources.add(chunk.source_runs)
    text = "".join(chunk.delta for chunk in taken)
    assert text == "".join(chunk.delta for chunk in chunks) and sources.n_chars == len(text)
    assert sources.runs == merged(run for chunk in chunks for run in chunk.source_runs)
    assert [n for chunk in taken for n in chunk.draft_lengths] == list(range(40))
    assert any(chunk.notice == "dropped" and chunk.engine_info for chunk in taken), "what comes once is kept"
    assert taken[-1].stats == {"n_generated": 40}


OPEN, CLOSE = f'<span class="{DRAFT_CLASS}">', "</span>"
MARK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "it's", "état", "42", "v1.2",
         "https://example.org/x"]  # fmt: skip
MARKDOWN = ["**bold**", "_em_", "`code`", "``a b``", "$$x^2$$", "<b>", "</b>", "snake_case", "a|b", "[link](u)",
            "&amp;", "\\*", "~~gone~~", "(aside)", '"quoted"']  # fmt: skip
LINE_STARTS = ["", "", "", "- ", "1. ", "# ", "> ", "    ", "```\n", "| "]


def unmarked(markdown: str) -> str:
    return MARK.sub(lambda m: m.group(1), markdown)


def majority(text: str, runs: list[tuple[int, str]], start: int, end: int) -> bool:
    """Whether the draft wrote more than half of text[start:end]."""
    flags = "".join(("d" if source == "draft" else "t") * n for n, source in runs)
    return 2 * flags[start:end].count("d") > end - start


def random_answer(rng: random.Random, lines: int = 12) -> str:
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS if rng.random() < 0.7 else MARKDOWN) for _ in range(rng.randint(0, 8))]
        out.append(rng.choice(LINE_STARTS) + " ".join(words))
    return rng.choice(["\n", "\n\n"]).join(out)


def test_the_highlight_marks_whole_words_and_adds_nothing_else() -> None:
    """On answers of words and Markdown, with random runs: taking the marks away gives the text back exactly (the
    chat renders the same Markdown with the highlight on or off); every mark holds a whole word's letters (never
    part of a word: no "d|og") that the draft wrote most of; a sentence of plain words has every such word marked."""
    rng = random.Random(11)
    for _ in range(60):
        text = random_answer(rng)
        runs = random_runs(text, rng)
        markdown = reply_markdown(text, runs)
        assert unmarked(markdown) == text
        offset = 0  # where each mark's word sits in the text: the marks only add characters
        for mark in MARK.finditer(markdown):
            start = mark.start() - offset
            word = mark.group(1)
            end = start + len(word)
            offset += len(OPEN) + len(CLOSE)
            before, after = text[start - 1 : start], text[end : end + 1]
            assert not (before.isalnum() or after.isalnum()), f"a mark inside a word: {text[start - 3 : end + 3]!r}"
            assert majority(text, runs, start, end), f"{word!r} is marked, the draft wrote less than half of it"
            assert not set(word) & set("*_`$<>[]|\\~"), f"Markdown syntax inside a mark: {word!r}"
    sentence = "the quick brown fox jumps over the lazy dog"
    runs = random_runs(sentence, rng)
    words = [(m.start(), m.end()) for m in re.finditer(r"\S+", sentence)]
    expected = [sentence[a:b] for a, b in words if majority(sentence, runs, a, b)]
    assert [m.group(1) for m in MARK.finditer(reply_markdown(sentence, runs))] == expected


def test_the_highlight_leaves_code_formulas_and_markup_unmarked() -> None:
    """A mark where Markdown would show it as text (code, a formula) or read it as something else (a tag's
    attribute, a list's number, a table's cell separator) breaks the answer: there the words stay unmarked, though
    the draft wrote all of them; around it, words are marked."""
    text = ("1. first point\n\n```python\nprint('drafted code')\n```\n\nsee `drafted code` and $$drafted x$$ and "
            '<a title="drafted words">link</a> **bold words**\n\n    indented code line\n\n| cell | other |\n|---|---|')
    markdown = reply_markdown(text, [(len(text), "draft")])
    marked = [m.group(1) for m in MARK.finditer(markdown)]
    assert "1." not in marked and "first" in marked and "point" in marked
    for unmarked_word in ("print('drafted", "drafted", "code", "code`", "x$$", 'title="drafted', "words\">link</a>",
                          "indented", "line", "|---|---|"):  # fmt: skip
        assert unmarked_word not in marked, unmarked_word
    assert "see" in marked and "and" in marked and "bold" in marked and "words" in marked and "cell" in marked
    assert f"**{OPEN}bold{CLOSE} {OPEN}words{CLOSE}**" in markdown, "emphasis stays outside the marks"
    assert "```python\nprint('drafted code')\n```" in markdown and "`drafted code`" in markdown


@pytest.mark.parametrize("seed", range(6))
def test_a_growing_reply_renders_as_a_growing_prefix_and_ends_as_the_whole(seed: int) -> None:
    """Step by step, with thinking tags that open, close (also split across steps) or only look like one: what the
    page received stays a prefix of what it receives next (Gradio streams only the new part), each step's Markdown
    is that of the whole reply so far (whose last word waits until it is whole), and the ended reply's is the whole
    reply's."""
    rng = random.Random(seed)
    pieces = ["<think>", "\n", "let me see", "</think>", "</th", "ink>", "<thi", " answer & <b>", "$x$", "é", "\n\n",
              " the quick", " brown fox", "`x`"]  # fmt: skip
    text = ("  " if seed % 2 else "") + "".join(rng.choice(pieces) for _ in range(40))
    runs = random_runs(text, rng)
    view, covered, sent, appended, previous = ReplyView(), 0, [], 0, ""
    while sent != runs:
        step = runs[len(sent) : len(sent) + rng.randint(1, 4)]
        sent += step
        covered += sum(n for n, _ in step)
        markdown = view.update(text[:covered], step)
        assert markdown == reply_markdown(text[:covered], sent, done=False), f"after {covered} characters"
        appended += bool(previous) and markdown.startswith(previous)
        previous = markdown
    assert appended > len(runs) // 8, "most steps append"
    assert view.update(text, [], done=True) == reply_markdown(text, runs)
    assert unmarked(reply_markdown(text, runs)) == text


def test_a_long_answer_renders_each_step_in_time_that_does_not_grow_with_it() -> None:
    """4,000 tokens of about 4 characters, a step of 4 tokens at a time: the last steps cost what the first did."""
    rng = random.Random(5)
    session = ChatSession()
    epoch, _ = session.start_turn("write a lot")
    text, runs = "", []
    timings = []
    for _ in range(1000):
        piece = "".join(rng.choice("abcdefgh <>&\n") for _ in range(16))
        text += piece
        runs += random_runs(piece, rng)
        started = time.perf_counter()
        session.show_reply(epoch, text, runs)
        timings.append(time.perf_counter() - started)
    early, late = sorted(timings[50:150])[50], sorted(timings[-100:])[50]  # medians
    assert late < 4 * early + 1e-4, (early, late)


def test_thinking_stays_folded_by_the_chat_and_is_highlighted_inside() -> None:
    thinking, answer = "<think>\nlet me see. the draft wrote this", "</think>\n\nthe answer & more"
    text = thinking + answer
    runs = [(len("<think>\n"), "target"), (len("let me see. "), "target"), (len("the draft wrote this"), "draft"),
            (len(answer) - 4, "target"), (4, "draft")]  # fmt: skip
    chatbot = gr.Chatbot(reasoning_tags=[("<think>", "</think>")])
    messages = chatbot.postprocess([{"role": "assistant", "content": reply_markdown(text, runs)}]).root
    assert [(m.metadata or {}).get("title") for m in messages] == ["Reasoning", None]
    folded, prose = (m.content[0].text for m in messages)
    assert unmarked(folded).strip() == "let me see. the draft wrote this"
    assert unmarked(prose).strip() == "the answer & more"
    assert MARK.findall(folded) == ["the", "draft", "wrote", "this"] and MARK.findall(prose) == ["more"]
    still_thinking = chatbot.postprocess([{"role": "assistant", "content": reply_markdown(thinking, runs[:3])}]).root
    assert len(still_thinking) == 1 and (still_thinking[0].metadata or {}).get("status") == "pending"


def test_the_session_keeps_plain_text_and_shows_it_highlighted_or_not() -> None:
    session = ChatSession()
    epoch, _ = session.start_turn("hi <b>")
    runs = [(4, "target"), (5, "draft"), (2, "target")]
    shown_now = session.show_reply(epoch, "one **two** 3", runs, done=True)
    assert shown_now is not None and shown_now[0]["content"] == "hi <b>", "visitors' messages stay as they are"
    assert f"**{OPEN}two{CLOSE}** 3" in shown_now[1]["content"]
    assert session.messages[1]["content"] == "one **two** 3", "the history sent back is the plain text"
    ended = session.end_reply(epoch, "DFlash 2 · 50 tok/s")
    assert ended is not None and ended[1]["content"].endswith(f'<span class="{BADGE_CLASS}">DFlash 2 · 50 tok/s</span>')
    assert session.messages[1]["content"] == "one **two** 3", "the badge is shown, never sent back"
    plain = session.set_highlight(False)
    assert plain[1]["content"] == with_badge("one **two** 3", "DFlash 2 · 50 tok/s") and DRAFT_CLASS not in str(plain)
    assert DRAFT_CLASS in str(session.set_highlight(True))
    assert session.last_prompt() == ("hi <b>", [])
    epoch, _ = session.start_turn("again")
    session.show_reply(epoch, "xy", [(2, "draft")])
    assert session.undo_turn(epoch) == session.shown() and len(session.shown()) == 2, "a failed turn leaves no trace"
    session.start_turn("third")
    assert session.shown()[-1] == {"role": "assistant", "content": ""}, "no stale highlight on a new answer"
    session.clear()
    assert session.shown() == [] and session.sources == {}
    epoch, shown_now = session.start_turn("is <think>this</think> folded?")
    assert shown_now[0]["content"] == "is &lt;think&gt;this&lt;/think&gt; folded?", "a visitor's tag is text"
    assert session.messages[0]["content"] == "is <think>this</think> folded?", "and is sent as typed"


def stats_after(n: int, decode_ms: float, drafted: int, accepted: int) -> dict:
    return Stats(n_generated=n, decode_ms=decode_ms, drafted=drafted, accepted=accepted).to_dict()


def test_the_speed_chart_takes_a_point_per_stretch_of_tokens() -> None:
    trace = SpeedTrace(every=10)
    taken = []
    # Steps of 1 to 8 tokens, as verify steps emit them; the chart must not care how often it is asked.
    n, rng = 0, random.Random(1)
    while n < 95:
        n += rng.randint(1, 8)
        stats = stats_after(n, decode_ms=5.0 * n, drafted=2 * n, accepted=n)
        if trace.add(stats):
            taken.append(n)
        assert not trace.add(stats), "the same step never adds a second point"
    assert taken and taken[0] >= 10, "no point from the first few tokens (their speed means nothing)"
    assert [t // 10 for t in taken] == list(range(1, n // 10 + 1)), "one point per stretch of 10 tokens"
    final = stats_after(n, decode_ms=5.0 * n + 1, drafted=2 * n, accepted=n)
    assert trace.add(final, final=True), "the end always charts the final statistics"
    last = trace.points[-1]
    assert last[0] == n and last[1] == pytest.approx(final["decode_tok_s"], abs=0.05) and last[2] == 50.0
    assert len(trace.rows(SPEED)) == len(trace.rows(ACCEPTANCE)) == len(trace.points)
    assert trace.rows(ACCEPTANCE)[-1] == {"tokens": n, "value": 50.0}, "acceptance as the engine counts it"
    plain = SpeedTrace(every=4)
    plain.add(stats_after(8, 40.0, 0, 0))
    assert len(plain.rows(SPEED)) == 1 and plain.rows(ACCEPTANCE) == [], "no acceptance before anything is drafted"
    assert not SpeedTrace(every=1).add({**stats_after(1, 0.01, 0, 0), "decode_tok_s": None}, final=True), \
        "no point without a speed"  # fmt: skip


def test_ab_verdict_says_what_identical_means_at_each_temperature() -> None:
    greedy = ab_verdict(True, 0.0, 5)
    assert "identical: yes" in greedy and "greedy output, token for token" in greedy
    assert "fault" in ab_verdict(False, 0.0, 5)
    sampled = ab_verdict(False, 0.7, 1234)
    assert "no, as expected" in sampled and "same seed (1234)" in sampled and "not a fault" in sampled
    assert "rejection sampling" in sampled and "distribution" in sampled and "fault" not in ab_verdict(True, 0.7, 1)
    spec = Stats(n_generated=9, decode_ms=100.0, verify_mode="sample", drafted=6, accepted=3).to_dict()
    plain = {**Stats(n_generated=9, decode_ms=300.0, speculative=False).to_dict(), "finish_reason": "length"}
    summary = ab_markdown(spec, plain, identical=False, temperature=0.7, seed=1234)
    assert "3.00× as fast as plain" in summary and "Drafts checked by rejection sampling" in summary
    assert "as expected" in summary and "Texts identical" not in ab_markdown(spec, None, None)
