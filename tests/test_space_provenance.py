"""The draft made visible, without a server: the runs a reply accumulates (also across chunks a slow reader skips),
the highlighted reply HTML (escaped, a prefix of itself as it grows, thinking still folded by the real Chatbot), the
session that shows it or not, the speed chart's points (taken by work done) and the A/B verdict's wording."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from html.parser import HTMLParser

import gradio as gr
import pytest

from dflash_runtime.space.gpu_job import ReplyChunk
from dflash_runtime.space.page.highlight import DRAFT_CLASS, ReplyView, reply_html
from dflash_runtime.space.page.session import ChatSession
from dflash_runtime.space.page.speedup import ACCEPTANCE, SPEED, SpeedTrace
from dflash_runtime.space.page.views import ab_markdown, ab_verdict
from dflash_runtime.space.provenance import SourceRuns, draft_text, merged
from dflash_runtime.space.web.calls import Calls
from dflash_runtime.space.web.jobs import ReplyJob
from dflash_runtime.stats import Stats

TIMEOUT_S = 30.0
NASTY = 'a <script>alert("x")</script> & b\n\n$$x^2$$ \'q\' <think> **bold**\n```code```'


class Shown(HTMLParser):
    """What a browser shows of the HTML: all text (`<br>` as a line break), the draft-marked text, and the tags."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.text, self.draft, self.tags = "", "", []
        self._in_draft = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "br":
            self._add("\n")
        if tag == "span" and tuple(v for k, v in attrs if k == "class") == (DRAFT_CLASS,):
            self._in_draft += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "span":
            self._in_draft -= 1

    def handle_data(self, data: str) -> None:
        self._add(data)

    def _add(self, text: str) -> None:
        self.text += text
        if self._in_draft:
            self.draft += text


def shown(html: str) -> Shown:
    parser = Shown()
    parser.feed(html)
    parser.close()
    return parser


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


def test_reply_html_escapes_everything_and_marks_exactly_the_draft_text() -> None:
    rng = random.Random(7)
    for _ in range(50):
        text = "".join(rng.choice([*NASTY, "é", "\n"]) for _ in range(rng.randint(1, 80)))
        runs = random_runs(text, rng)
        html = reply_html(text, runs)
        view = shown(html)
        assert view.text == text
        assert view.draft == draft_text(text, runs)
        assert set(view.tags) <= {"div", "span", "br"}, "the only markup is ours"
        assert "$" not in html and "\n" not in html, "no LaTeX delimiter, no blank line that ends the HTML block"


def test_a_growing_reply_renders_as_a_growing_prefix() -> None:
    """What the page received stays a prefix of what it receives next, so Gradio streams only the new part."""
    rng = random.Random(3)
    text = NASTY * 3
    runs = random_runs(text, rng)
    previous, covered, sent = "", 0, []
    for n, source in runs:
        sent.append((n, source))
        covered += n
        html = reply_html(text[:covered], sent)
        assert html.startswith(previous)
        previous = html


@pytest.mark.parametrize("seed", range(6))
def test_the_incremental_view_renders_what_a_whole_render_does(seed: int) -> None:
    """Step by step, with thinking tags that open, close (also split across steps) or only look like one: the view
    that appends each step's runs gives the HTML of the whole reply at every step."""
    rng = random.Random(seed)
    pieces = ["<think>", "\n", "let me see", "</think>", "</th", "ink>", "<thi", " answer & <b>", "$x$", "é", "\n\n"]
    text = ("  " if seed % 2 else "") + "".join(rng.choice(pieces) for _ in range(40))
    runs = random_runs(text, rng)
    view, covered, sent, appended = ReplyView(), 0, [], 0
    while sent != runs:
        step = runs[len(sent) : len(sent) + rng.randint(1, 4)]
        sent += step
        covered += sum(n for n, _ in step)
        before = view.html
        html = view.update(text[:covered], sent, step)
        assert html == reply_html(text[:covered], sent), f"after {covered} characters"
        appended += bool(before) and html.startswith(before)
    assert appended > len(runs) // 8, "most steps append"


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
            (len(answer) - 6, "target"), (6, "draft")]  # fmt: skip
    chatbot = gr.Chatbot(reasoning_tags=[("<think>", "</think>")])
    messages = chatbot.postprocess([{"role": "assistant", "content": reply_html(text, runs)}]).root
    assert [(m.metadata or {}).get("title") for m in messages] == ["Reasoning", None]
    folded, prose = (shown(m.content[0].text) for m in messages)
    assert folded.text.strip() == "let me see. the draft wrote this" and folded.draft == "the draft wrote this"
    assert prose.text.strip() == "the answer & more" and prose.draft == "& more"
    still_thinking = chatbot.postprocess([{"role": "assistant", "content": reply_html(thinking, runs[:3])}]).root
    assert len(still_thinking) == 1 and (still_thinking[0].metadata or {}).get("status") == "pending"


def test_the_session_keeps_plain_text_and_shows_it_highlighted_or_not() -> None:
    session = ChatSession()
    epoch, _ = session.start_turn("hi <b>")
    runs = [(4, "target"), (5, "draft"), (2, "target")]
    shown_now = session.show_reply(epoch, "one <two> 3", runs)
    assert shown_now is not None and shown_now[0]["content"] == "hi <b>", "visitors' messages stay as they are"
    assert f'<span class="{DRAFT_CLASS}">&lt;two&gt;</span>' in shown_now[1]["content"]
    assert session.messages[1]["content"] == "one <two> 3", "the history sent back is the plain text"
    plain = session.set_highlight(False)
    assert plain == session.messages and DRAFT_CLASS not in str(plain)
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
