"""The Space in a real browser: headless Debian Chromium driven over the DevTools protocol (websocket-client).

The page loads, a message goes out, the answer and the live statistics appear, Stop interrupts a long answer and
the next turn still completes, the chat's retry, edit and undo give what sending anew gives, the A/B button reports a
speed-up, two tabs are answered at the same time on an engine of two sequences; the layout is checked by geometry at
a phone's 390 × 844 and at 1400 × 900 (nothing wider than the window, nothing over the chat's text, the message box
the phone's width, the summary in view when an answer ends); every final summary is checked for words that contradict
each other; screenshots land in test-artifacts/."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import websocket
from app_fixtures import REPO_ROOT, RunningApp, free_port, launch_app, running_app, stop_app
from gradio_client import Client
from space_client import demo_pair, expected_answer, info_when, reference_engine, summary_contradiction
from zerogpu_fake import FakeDeviceApi

pytestmark = pytest.mark.browser

ARTIFACTS = REPO_ROOT / "test-artifacts"
N_CTX = 2048
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-allow-origins=*",
    "--window-size=1400,1000",
]


class DevTools:
    """The few DevTools protocol calls the test needs, on one page target."""

    def __init__(self, ws_url: str) -> None:
        self._socket = websocket.create_connection(ws_url, timeout=700, suppress_origin=True)  # > any wait_for
        self._ids = count(1)
        self._events: list[str] = []  # methods of the protocol events seen since the last navigation

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self._ids)
        self._socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._socket.recv())
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply.get("method", ""))

    def navigate(self, url: str) -> None:
        """Open `url` and return once its load event fired (the socket's timeout bounds the wait)."""
        self._events = []
        self.call("Page.navigate", url=url)
        while "Page.loadEventFired" not in self._events:
            self._events.append(json.loads(self._socket.recv()).get("method", ""))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0, what: str = "") -> Any:
        """The value of `expression` once it is truthy: the page checks it on every change of its document (and
        every 50 ms for what no mutation shows), and answers this one call when it holds or the time is up."""
        waiter = f"""new Promise(resolve => {{
            const check = () => {{ try {{ return ({expression}); }} catch (e) {{ return null; }} }};
            const done = value => {{
                observer.disconnect(); clearInterval(ticker); clearTimeout(limit); resolve(value);
            }};
            const observer = new MutationObserver(() => {{ const v = check(); if (v) done(v); }});
            observer.observe(document, {{subtree: true, childList: true, characterData: true, attributes: true}});
            const ticker = setInterval(() => {{ const v = check(); if (v) done(v); }}, 50);
            const limit = setTimeout(() => done(null), {int(timeout_s * 1000)});
            const first = check(); if (first) done(first);
        }})"""
        value = self.evaluate(waiter)
        if not value:
            raise TimeoutError(f"timed out waiting for {what or expression}")
        return value

    def click(self, selector: str) -> None:
        """A real mouse click at the element's centre (so the page sees pointer events, not a synthetic .click())."""
        box = self.evaluate(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)});"
            " el.scrollIntoView({block: 'center'}); const r = el.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def type_into(self, selector: str, text: str) -> None:
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def screenshot(self, path: Path, whole: bool = True) -> None:
        """The whole page, or (whole=False) what the window shows."""
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=whole)["data"]
        path.write_bytes(base64.b64decode(data))

    def screenshot_of(self, selector: str, path: Path) -> None:
        """A picture of one element (the page scrolled so that it is whole)."""
        box = self.evaluate(
            f"(() => {{ const el = document.querySelector({json.dumps(selector)}); el.scrollIntoView();"
            " const r = el.getBoundingClientRect();"
            " return [r.x + window.scrollX, r.y + window.scrollY, r.width, r.height]; })()"
        )
        clip = {"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1}
        data = self.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self._socket.close()


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_DIAGNOSTICS": "1"}  # the worker's last request
    with running_app(env, ARTIFACTS / "app_browser_server.log") as app:
        yield app


@contextmanager
def open_pages(url: str, count: int = 1) -> Iterator[list[DevTools]]:
    """Headless Chromium with `count` tabs on `url`, each driven over DevTools."""
    if CHROMIUM is None:
        pytest.fail("Chromium is required for the browser test: apt-get install -y chromium")
    port = free_port()
    profile = tempfile.mkdtemp(prefix="dflash-chromium-")
    browser = subprocess.Popen(
        [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={port}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pages = []
        listening = _devtools_listening(browser)
        for _ in range(count):
            devtools = DevTools(_new_page_socket_url(browser, port, listening))
            devtools.call("Page.enable")
            devtools.call("Runtime.enable")
            devtools.navigate(url)
            pages.append(devtools)
        yield pages
        for devtools in pages:
            devtools.close()
    finally:
        browser.terminate()
        browser.wait(timeout=20)
        shutil.rmtree(profile, ignore_errors=True)


@contextmanager
def open_page(url: str) -> Iterator[DevTools]:
    """Headless Chromium on `url`, driven over DevTools."""
    with open_pages(url) as pages:
        yield pages[0]


DESKTOP = {"width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": False}  # the window, without its frame
PHONE = {"width": 390, "height": 844, "deviceScaleFactor": 1, "mobile": True}


@pytest.fixture(scope="module")
def page(server: RunningApp) -> Iterator[DevTools]:
    with open_page(server.url) as devtools:
        devtools.call("Emulation.setDeviceMetricsOverride", **DESKTOP)
        yield devtools


def _devtools_listening(browser: subprocess.Popen[str]) -> threading.Event:
    """Set once Chromium says its DevTools endpoint listens (a line on its stderr), or once it exited."""
    listening = threading.Event()

    def watch() -> None:
        assert browser.stderr is not None
        for line in browser.stderr:
            if line.startswith("DevTools listening on"):
                listening.set()
        listening.set()  # the stream ended: Chromium exited

    threading.Thread(target=watch, daemon=True).start()
    return listening


def _new_page_socket_url(browser: subprocess.Popen[str], port: int, listening: threading.Event,
                         timeout_s: float = 60.0) -> str:  # fmt: skip
    """Once Chromium's DevTools endpoint listens, open a new blank page target."""
    if not listening.wait(timeout_s) or browser.poll() is not None:
        raise TimeoutError("Chromium did not expose DevTools")
    request = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?about:blank", method="PUT")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["webSocketDebuggerUrl"]


def expected_reply(message: str, max_tokens: int = 512) -> str:
    """What the page must show for `message` as the first turn (with the page's default system prompt)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": message}]
    with reference_engine(N_CTX) as engine:
        return expected_answer(engine, messages, max_tokens)


def same_text(shown: str, expected: str) -> bool:
    return " ".join(shown.split()) == " ".join(expected.split())


def text_of(selector: str) -> str:
    return f"(document.querySelector({json.dumps(selector)})?.innerText || '')"


BOT_MESSAGES = "#chatbot [data-testid='bot']"
STATS = text_of("#stats")  # the sentence on top (the folded table's text is not rendered while it is folded)
DETAILS = "(document.querySelector('#stats-table')?.innerText || '')"  # the table, once opened


# Each explanation of the statistics table smaller than 13 px, or with a contrast against the page under 7:1 (WCAG's
# enhanced level), with its size and contrast.
EXPLANATION_FAULTS = """(() => {
    const luminance = color => {
        const [r, g, b] = color.match(/[\\d.]+/g).slice(0, 3).map(v => v / 255)
            .map(v => v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
        return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    };
    const page = luminance(getComputedStyle(document.body).backgroundColor);
    const explanations = Array.from(document.querySelectorAll('#stats-table small'));
    if (!explanations.length) return ['no explanation'];
    return explanations.map(el => {
        const style = getComputedStyle(el), text = luminance(style.color);
        const contrast = (Math.max(page, text) + 0.05) / (Math.min(page, text) + 0.05);
        return [el.innerText.slice(0, 30), parseFloat(style.fontSize), Math.round(contrast * 10) / 10];
    }).filter(([, size, contrast]) => size < 13 || contrast < 7);
})()"""


def details_of(page: DevTools) -> str:
    """The statistics table, opened first as a visitor opens it (folded, it is not rendered)."""
    if not page.evaluate("!!document.querySelector('#stats-table table')"):
        page.click("#stats-details .label-wrap")
        page.wait_for("!!document.querySelector('#stats-table table')", 10, "the opened statistics table")
    return page.evaluate(DETAILS)


def bot_texts(page: DevTools) -> list[str]:
    """The answers' texts as shown, without the speed badge under each."""
    return page.evaluate(f"Array.from(document.querySelectorAll({json.dumps(BOT_MESSAGES)})).map({WITHOUT_BADGE})")


# An answer's text as shown without its badge (a copy, laid out beside it, so that innerText follows the layout).
WITHOUT_BADGE = """e => {
    const c = e.cloneNode(true);
    c.querySelectorAll('.dflash-badge').forEach(b => b.remove());
    e.after(c);
    const text = c.innerText;
    c.remove();
    return text;
}"""


def badges(page: DevTools) -> list[str]:
    """The speed badges under the answers."""
    return page.evaluate("Array.from(document.querySelectorAll('#chatbot .dflash-badge')).map(e => e.innerText)")


USER_MESSAGES = "#chatbot [data-testid='user']"


def user_texts(page: DevTools) -> list[str]:
    return page.evaluate(f"Array.from(document.querySelectorAll({json.dumps(USER_MESSAGES)})).map(e => e.innerText)")


def send(page: DevTools, message: str, with_enter: bool = False) -> None:
    page.type_into("#message-box textarea", message)
    if with_enter:
        for kind in ("keyDown", "keyUp"):
            page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                      text="\r" if kind == "keyDown" else "")  # fmt: skip
    else:
        page.click("#send")


def wait_for_answer(page: DevTools, answers: int, timeout_s: float = 90) -> str:
    """Wait until `answers` bot messages show and the statistics report the finish; returns the statistics, which
    must not contradict themselves (tests/space_client.py)."""
    page.wait_for(
        f"document.querySelectorAll({json.dumps(BOT_MESSAGES)}).length === {answers} && {STATS}.includes('Finished')",
        timeout_s,
        f"answer {answers} and its final statistics",
    )
    stats = page.evaluate(STATS)
    assert summary_contradiction(stats) is None, (summary_contradiction(stats), stats)
    return stats


def generated_tokens(stats: str) -> int:
    match = re.search(r"(?:of these|without a draft:) (\d+) tokens?", stats)
    assert match, f"no token count in {stats!r}"
    return int(match.group(1))


def wait_for_page(page: DevTools) -> None:
    """Until the page has rendered, to its last components in each column (they come after the first ones)."""
    rendered = ["#message-box textarea", "#send", "#draft-legend", "#max-tokens input[type='number']", "#about"]
    page.wait_for(" && ".join(f"!!document.querySelector({json.dumps(s)})" for s in rendered), 60, "the page to load")


def wait_idle(server: RunningApp, timeout_s: float = 60) -> None:
    """Until the server has closed the running reply (its engine slot is free again)."""
    info_when(Client(server.url, verbose=False), "idle", timeout_s)


def previous_request(server: RunningApp) -> dict[str, Any]:
    """The engine host's record of the request before the last one."""
    return Client(server.url, verbose=False).predict(api_name="/info")["worker"]["previous_request"]


DRAFT_SPANS = "#chatbot [data-testid='bot'] .dflash-draft"
# Every highlight mark that begins or ends inside a word (a letter right before or after it): "d|og".
BROKEN_MARKS = f"""Array.from(document.querySelectorAll({json.dumps(DRAFT_SPANS)})).filter(span => {{
    const before = span.previousSibling?.textContent ?? '', after = span.nextSibling?.textContent ?? '';
    return /[\\p{{L}}\\p{{N}}]$/u.test(before) || /^[\\p{{L}}\\p{{N}}]/u.test(after);
}}).map(span => span.innerText)"""


def draft_spans(page: DevTools) -> list[str]:
    """The texts the chat shows highlighted as the draft's."""
    return page.evaluate(f"Array.from(document.querySelectorAll({json.dumps(DRAFT_SPANS)})).map(e => e.innerText)")


CHARTS = ("#speed-chart", "#acceptance-chart")
ALL_CHARTS = (*CHARTS, "#acceptance-plot")


def is_shown(selector: str) -> str:
    """A JavaScript test: the element takes room on the page (present, displayed, with a size)."""
    return (f"(el => !!el && el.offsetParent !== null && el.getBoundingClientRect().width > 0 && "
            f"el.getBoundingClientRect().height > 0)(document.querySelector({json.dumps(selector)}))")  # fmt: skip


def shown_boxes(page: DevTools, selectors: tuple[str, ...]) -> list[str]:
    """Which of the elements take room on the page."""
    return [selector for selector in selectors if page.evaluate(is_shown(selector))]


# Every header of the A/B table whose text is cut (its content wider than its box), and every box from the table up
# to the A/B panel whose content is wider than the box (a scrollbar, or a part out of sight).
AB_TABLE_FAULTS = """(() => {
    const table = document.querySelector('#ab-result table');
    if (!table) return ['no table'];
    const faults = Array.from(table.querySelectorAll('th')).filter(th => th.scrollWidth > th.clientWidth + 1)
        .map(th => 'header cut: ' + th.innerText);
    for (let el = table; el; el = el.parentElement) {
        if (el.scrollWidth > el.clientWidth + 1) faults.push('overflow: ' + el.tagName + '.' + el.className);
        if (el.id === 'ab-result') break;
    }
    const right = table.getBoundingClientRect().right;
    if (right > document.documentElement.clientWidth + 1) faults.push('table past the window: ' + right);
    return faults;
})()"""


def chart_lines(page: DevTools, chart: str) -> list[int]:
    """The lines a chart draws (SVG): the number of points of each."""
    return page.evaluate(
        f"Array.from(document.querySelectorAll({json.dumps(chart + ' svg .mark-line path')}))"
        ".map(p => (p.getAttribute('d') || '').split('L').length)"
    )


def chart_text(page: DevTools, chart: str) -> str:
    return page.evaluate(text_of(chart)) + " " + page.evaluate(
        f"Array.from(document.querySelectorAll({json.dumps(chart + ' svg text')})).map(t => t.textContent).join(' ')"
    )


def test_no_chart_box_shows_before_the_first_answer(page: DevTools) -> None:
    wait_for_page(page)
    page.wait_for("!!document.querySelector('#stats')", 20, "the statistics panel")
    assert shown_boxes(page, ALL_CHARTS) == [], "an empty chart box shows before any answer"
    assert shown_boxes(page, ("#draft-legend",)) == ["#draft-legend"], "the highlight is on: its legend shows"
    page.screenshot(ARTIFACTS / "app_browser_before_answer.png")


def below_the_fold(page: DevTools, selectors: tuple[str, ...]) -> dict[str, Any]:
    """The elements not wholly inside the first screen (the page not scrolled), with their box's top and bottom."""
    return page.evaluate(
        f"(() => {{ const out = {{}}; for (const s of {json.dumps(selectors)}) {{"
        " const el = document.querySelector(s); const r = el ? el.getBoundingClientRect() : null;"
        " if (!r || r.height === 0 || r.top < 0 || r.bottom > window.innerHeight) out[s] = r && [r.top, r.bottom]; }"
        " return out; })()"
    )


FIRST_SCREEN = ("#message-box textarea", "#send", "#examples", "#examples button")
EXAMPLE = "List five facts about the planet Mars."
# What the layout gets wrong, by geometry: an element wider than the window, or past its edges where no box of the
# page clips it (an element scrolled inside a box of its own is not past the page's edge); the chat's label or
# toolbar over its messages.
PAGE_FAULTS = """(() => {
    const width = document.documentElement.clientWidth, faults = [];
    const name = el => el.tagName + (el.id ? '#' + el.id : '') + '.' + String(el.className.baseVal ?? el.className)
        .split(' ')[0];
    const clipped = el => {
        for (let box = el.parentElement; box && box !== document.body; box = box.parentElement) {
            const r = box.getBoundingClientRect();
            if (getComputedStyle(box).overflowX !== 'visible' && r.left >= -1 && r.right <= width + 1) return true;
        }
        return false;
    };
    for (const el of document.querySelectorAll('body *')) {
        const r = el.getBoundingClientRect();
        if (!r.width || !r.height || getComputedStyle(el).visibility === 'hidden') continue;
        if (r.width > width + 1) faults.push('wider than the window: ' + name(el) + ' ' + Math.round(r.width));
        else if ((r.right > width + 1 || r.left < -1) && !clipped(el))
            faults.push('past the edge: ' + name(el) + ' ' + Math.round(r.left) + '..' + Math.round(r.right));
    }
    const log = document.querySelector('#chatbot .bubble-wrap')?.getBoundingClientRect();
    for (const over of document.querySelectorAll('#chatbot label, #chatbot .top-panel')) {
        const r = over.getBoundingClientRect();
        if (log && r.width && r.left < log.right && r.right > log.left && r.top < log.bottom && r.bottom > log.top)
            faults.push("over the chat's messages: " + name(over));
    }
    return faults.slice(0, 20);
})()"""
# The answer's summary wholly inside the window (a pixel's rounding aside: the page scrolls by whole pixels).
SUMMARY_IN_VIEW = ("(r => r.height > 0 && r.top >= -1 && r.bottom <= window.innerHeight + 1)("
                   "document.querySelector('#stats-summary').getBoundingClientRect())")  # fmt: skip
MESSAGE_BOX_SHARE = ("document.querySelector('#message-box textarea').getBoundingClientRect().width / "
                     "document.documentElement.clientWidth")  # fmt: skip


def test_the_first_screen_holds_the_message_box_and_the_examples_and_an_example_click_answers(
        server: RunningApp) -> None:  # fmt: skip
    """On load, at 1400 × 900 and at a phone's 390 × 844, the message box, Send and every example show without
    scrolling, and at 1400 × 900 the A/B button too; on the phone the message box takes at least 90 % of the width,
    nothing is wider than the window or past its edge, the examples wrap inside it; a click on an example sends it
    as it is: it shows as the visitor's message and is answered as if typed and sent."""
    with open_page(server.url) as tab:
        for size, name, first_screen in ((DESKTOP, "desktop", (*FIRST_SCREEN, "#ab")), (PHONE, "phone", FIRST_SCREEN)):
            tab.call("Emulation.setDeviceMetricsOverride", **size)
            tab.navigate(server.url)
            wait_for_page(tab)
            tab.wait_for(f"document.querySelectorAll('#examples button').length === 4 && {is_shown('#stats')}", 20,
                         "the examples")  # fmt: skip
            tab.screenshot(ARTIFACTS / f"app_browser_first_screen_{name}.png", whole=False)
            assert tab.evaluate("window.scrollY") == 0
            assert below_the_fold(tab, first_screen) == {}, f"{name}: under the fold"
            assert tab.evaluate(PAGE_FAULTS) == [], name
            every_example = "Array.from(document.querySelectorAll('#examples button')).every(b => b.offsetParent)"
            assert tab.evaluate(every_example), name
        assert tab.evaluate(MESSAGE_BOX_SHARE) >= 0.9, "the phone's message box takes its width"
        set_slider(tab, "max-tokens", 64)
        example = "Array.from(document.querySelectorAll('#examples button'))" \
                  f".find(b => b.innerText.includes({json.dumps(EXAMPLE[:20])}))"  # fmt: skip
        tab.evaluate(f"{example}.setAttribute('id', 'mars-example')")
        tab.click("#mars-example")
        stats = wait_for_answer(tab, answers=1)
        assert user_texts(tab) == [EXAMPLE] and generated_tokens(stats) == 64
        assert same_text(bot_texts(tab)[0], expected_reply(EXAMPLE, 64))
        assert tab.evaluate("document.querySelector('#message-box textarea').value") == "", "sent, not just filled"


def test_chat_in_the_browser_shows_answer_stats_and_plot(page: DevTools, server: RunningApp) -> None:
    wait_for_page(page)
    for chart in CHARTS:  # empty: no axis with a meaningless tick
        assert "0.000000" not in chart_text(page, chart), chart
    banner = page.evaluate("document.querySelector('#mode-banner').textContent")  # its second part folded
    assert "random-weight test models" in page.evaluate(text_of("#mode-banner")) and "DFLASH_DEMO=off" in banner
    legend = page.evaluate(text_of("#draft-legend"))
    assert "words the draft wrote (most of their characters) and the target accepted" in legend
    assert page.evaluate("!!document.querySelector('#draft-legend .dflash-draft')"), "the legend shows the highlight"

    send(page, "hello world", with_enter=True)  # Enter and Send are one event
    # While it streams, the chat already marks what the draft wrote.
    page.wait_for(f"document.querySelectorAll({json.dumps(DRAFT_SPANS)}).length > 0 && !{STATS}.includes('Finished')",
                  60, "highlighted draft text while the answer streams")  # fmt: skip
    page.screenshot(ARTIFACTS / "app_browser_streaming.png")
    stats = wait_for_answer(page, answers=1)
    share = re.search(r"(\d+) % of these 512 tokens came from the draft, checked and kept by the main model; [\d.]+ "
                      r"tok/s, ", stats)  # fmt: skip
    assert share and int(share.group(1)) > 0, stats
    # The demo's adaptive length takes plain steps: the estimate against plain comes from them, a figure with its
    # range or, too wide to say one, words.
    assert re.search(r"about [\d.]+× as fast as the main model alone \(estimate: [\d.]+–[\d.]+×\)|too uncertain to tell"
                     r"|faster than the main model alone, by how much still uncertain", stats), stats  # fmt: skip
    details = details_of(page)
    for label in ("Decode speed", "vs plain (estimate)", "Verify steps", "steps of the target that checked a draft",
                  "Plain steps", "Draft length", "across your requests in this conversation", "Acceptance rate",
                  "Tokens per verify step", "Prompt", "reused", "the shared system prompt", "Engine time"):  # fmt: skip
        assert label in details, f"{label!r} missing from the statistics table"
    assert page.evaluate(EXPLANATION_FAULTS) == [], "an explanation of the statistics is hard to read"
    counts = re.search(r"512 = (\d+) from the draft \+ (\d+) from the target \(1 right after the prompt, (\d+) after "
                       r"verify steps, (\d+) from plain steps\)", details)  # fmt: skip
    assert counts, details
    accepted, own, verify, plain = map(int, counts.groups())
    assert accepted + own == 512 and 1 + verify + plain == own and plain > 0, "the counts add up as shown"
    estimate = re.search(r"timed over (?:its (\d+)|\d+ of its (\d+)) plain steps", details)
    assert estimate and int(estimate.group(1) or estimate.group(2)) == plain, "the estimate's plain steps: the table's"
    assert f"{round(100 * accepted / 512)} % of these 512 tokens" in stats, "the summary's share is the table's"
    answers = bot_texts(page)
    assert len(answers) == 1 and same_text(answers[0], expected_reply("hello world"))
    spans = draft_spans(page)
    assert spans and all(span in answers[0] for span in spans)
    assert page.evaluate(BROKEN_MARKS) == [], "a highlight mark ends inside a word"
    assert page.evaluate(f"!!document.querySelector({json.dumps(BOT_MESSAGES)} + ' p .dflash-draft')"), \
        "the highlighted answer is rendered as Markdown (paragraphs), not as a block of escaped text"  # fmt: skip
    assert len(badges(page)) == 1 and re.search(r"DFlash 2 · \d+ tok/s · \d+ % from the draft", badges(page)[0])
    assert page.evaluate("!!document.querySelector('#acceptance-plot canvas, #acceptance-plot svg')")
    # The charts: speed and acceptance, each on its own axis, a point per stretch of 10 tokens (512 // 48) at most,
    # never one per step.
    for chart in CHARTS:
        page.wait_for(f"document.querySelectorAll({json.dumps(chart + ' svg .mark-line path')}).length === 1", 20,
                      f"the chart {chart}")  # fmt: skip
        lines = chart_lines(page, chart)
        assert len(lines) == 1 and 10 <= lines[0] <= 512 // 10 + 1, (chart, lines)
    assert "accepted %" in chart_text(page, "#acceptance-chart") and "tok/s" in chart_text(page, "#speed-chart")
    assert page.evaluate("document.querySelector('#thinking')?.offsetParent !== null"), "thinking switch hidden"
    assert shown_boxes(page, ALL_CHARTS) == list(ALL_CHARTS), "the charts show once there are points"
    for chart in ALL_CHARTS:  # one series a chart, named by its title: no legend ("series ○ ...")
        assert "series" not in chart_text(page, chart), chart
    page.screenshot(ARTIFACTS / "app_browser_chat.png")
    page.screenshot_of("#stats", ARTIFACTS / "app_browser_stats_panel.png")


def test_the_highlight_switch_removes_the_marks_and_brings_them_back(page: DevTools) -> None:
    before = bot_texts(page)
    assert draft_spans(page), "the previous answer shows the draft's text"
    page.click("#highlight-draft input")
    page.wait_for(f"document.querySelectorAll({json.dumps(DRAFT_SPANS)}).length === 0", 20, "the marks to go")
    assert [" ".join(t.split()) for t in bot_texts(page)] == [" ".join(t.split()) for t in before]
    page.wait_for(f"!{is_shown('#draft-legend')}", 10, "the legend to go with the highlight")
    page.screenshot(ARTIFACTS / "app_browser_highlight_off.png")
    page.click("#highlight-draft input")
    page.wait_for(f"document.querySelectorAll({json.dumps(DRAFT_SPANS)}).length > 0", 20, "the marks to return")
    page.wait_for(is_shown("#draft-legend"), 10, "the legend to return")
    legend = page.evaluate(text_of("#draft-legend"))
    assert "words the draft wrote (most of their characters) and the target accepted" in legend


def test_stop_interrupts_and_the_next_turn_completes(page: DevTools, server: RunningApp) -> None:
    before = len(bot_texts(page))
    send(page, "the quick brown fox")
    # Running, and far enough for the speed chart's first point (Stop then adds its last one: a line to draw).
    chart_drawn = f"document.querySelectorAll({json.dumps(CHARTS[0] + ' svg .mark-line path')}).length === 1"
    page.wait_for(f"{STATS}.includes('tok/s') && !{STATS}.includes('Finished') && {chart_drawn}", 30,
                  "a running answer with a point on its chart")  # fmt: skip
    page.click("#stop")
    wait_idle(server)
    stats = page.wait_for(f"{STATS}.includes('stopped (by you)') && {STATS}", 20, "the stopped row")
    stopped_at = generated_tokens(stats)
    assert len(bot_texts(page)) == before + 1, "the interrupted answer stays in the chat"
    for chart in CHARTS[:1]:
        page.wait_for(f"document.querySelectorAll({json.dumps(chart + ' svg .mark-line path')}).length === 1", 20,
                      f"the chart {chart} after Stop")  # fmt: skip
    page.screenshot(ARTIFACTS / "app_browser_stopped.png")

    send(page, "one two three")
    stats = wait_for_answer(page, answers=before + 2)
    assert "max_tokens=512 reached" in stats and generated_tokens(stats) == 512
    assert page.evaluate("document.querySelector('#message-box textarea').value") == ""
    stopped = previous_request(server)
    assert stopped["finish_reason"] == "closed by the caller" and stopped_at <= stopped["n_generated"] < 512


def chat_button(page: DevTools, label: str, which: int = -1) -> str:
    """A selector for one of the chat's buttons by its label ("Retry", "Undo", "Edit", "Submit"): the last one, or
    the `which`-th."""
    page.evaluate("document.querySelectorAll('#chat-button').forEach(b => b.removeAttribute('id'))")
    found = page.evaluate(f"(buttons => {{ const b = buttons.at({which}); if (b) b.id = 'chat-button'; return !!b; }})("
                          f"Array.from(document.querySelectorAll('#chatbot button'))"
                          f".filter(b => b.getAttribute('aria-label') === {json.dumps(label)}))")  # fmt: skip
    assert found, f"no {label} button in the chat"
    return "#chat-button"


def test_retry_edit_and_undo_answer_as_a_new_message_does(page: DevTools, server: RunningApp) -> None:
    """The chat's own retry, edit and undo, as a visitor clicks them, at temperature 0: a retry shows the text the
    message got when it was sent, which is what sending it anew gives (the reference engine's); an edit of the
    message answers the edited one as a new conversation would; undo takes the turn back and puts the message in
    the box. Each answer has its speed badge; each goes through the queue as any answer (the server's last request
    is the retried one, ended by its length)."""
    wait_for_page(page)
    page.wait_for(AB_READY, 60, "no answer running")
    page.click("#clear")
    page.wait_for(f"document.querySelectorAll({json.dumps(BOT_MESSAGES)}).length === 0", 20, "the chat to clear")
    set_slider(page, "max-tokens", 48)
    try:
        send(page, "the quick brown fox")
        wait_for_answer(page, answers=1)
        sent = bot_texts(page)[0]
        assert same_text(sent, expected_reply("the quick brown fox", 48))
        page.click(chat_button(page, "Retry"))
        page.wait_for(f"{STATS}.includes('tok/s') && !{STATS}.includes('Finished')", 30, "the retried answer")
        wait_for_answer(page, answers=1)
        assert user_texts(page) == ["the quick brown fox"] and same_text(bot_texts(page)[0], sent), "retried"
        assert len(badges(page)) == 1 and "tok/s" in badges(page)[0]
        page.click(chat_button(page, "Edit", 0))
        page.wait_for("!!document.querySelector('#chatbot .edit-textarea')", 10, "the message's edit box")
        page.evaluate("document.querySelector('#chatbot .edit-textarea').select()")
        page.type_into("#chatbot .edit-textarea", "one two three")
        page.click(chat_button(page, "Submit"))
        page.wait_for(f"{STATS}.includes('tok/s') && !{STATS}.includes('Finished')", 30, "the edited message's answer")
        wait_for_answer(page, answers=1)
        assert user_texts(page) == ["one two three"]
        assert same_text(bot_texts(page)[0], expected_reply("one two three", 48)), "the edit sent as a new message"
        page.click(chat_button(page, "Undo"))
        page.wait_for(f"document.querySelectorAll({json.dumps(BOT_MESSAGES)}).length === 0", 20, "the turn undone")
        assert user_texts(page) == [] and page.evaluate("document.querySelector('#message-box textarea').value") == \
            "one two three", "the message back in the box"  # fmt: skip
    finally:
        clear_box(page)
        set_slider(page, "max-tokens", 512)
    assert previous_request(server)["finish_reason"] == "length", "the retry ran to its length, as any answer"


AB_READY = "!document.querySelector('#ab').disabled"
# Installed in a tab: every text the A/B box showed, in order.
AB_RECORDER = """(() => {
    window.dflashAb = [];
    const box = document.querySelector('#ab-result');
    new MutationObserver(() => {
        const text = box.innerText;
        if (text !== window.dflashAb[window.dflashAb.length - 1]) window.dflashAb.push(text);
    }).observe(box, {subtree: true, childList: true, characterData: true});
    return true;
})()"""


def in_view(selector: str) -> str:
    """A JavaScript test: the element's top edge is inside the window (it shows without scrolling)."""
    return (f"(el => {{ if (!el) return false; const r = el.getBoundingClientRect(); return r.height > 0 && "
            f"r.top >= 0 && r.top < window.innerHeight - 16; }})(document.querySelector({json.dumps(selector)}))")


# The A/B's findings (its first line, each method's speed sentence, the verdict) that are not wholly inside the window.
AB_FINDINGS_OUT_OF_VIEW = """(() => {
    const found = Array.from(document.querySelectorAll('#ab-result p')).filter(p => p.querySelector('strong'));
    if (!found.length) return ['nothing found'];
    return found.filter(p => { const r = p.getBoundingClientRect();
        return r.top < 0 || r.bottom > window.innerHeight || r.height === 0; }).map(p => p.innerText.slice(0, 60));
})()"""
AB_PROGRESS = f"{in_view('#ab-result')} && /A\\/B (starting|running)/.test({text_of('#ab-result')})"


def run_ab(page: DevTools, verdict: str, running: str | None = None) -> str:
    """Click A/B (once it is usable: not while an answer runs) and wait for a verdict that contains `verdict` (each
    temperature has its own wording). Within 2 s of the click its box, under its button, is in view and says what
    runs; a method's speed sentence shows only once its run has finished, the verdict once all have (every text the
    box showed is checked). `running`: a screenshot once that run is on."""
    page.wait_for(AB_READY, 60, "the A/B button to be usable")
    assert page.evaluate(AB_RECORDER)
    page.click("#ab")
    page.wait_for(AB_PROGRESS, 2.0, "the A/B's progress in view within 2 s of the click")
    page.wait_for("(b => b.disabled && b.innerText.includes('A/B running'))(document.querySelector('#ab'))", 10,
                  "the A/B button saying that its run goes on")  # fmt: skip
    if running:
        page.wait_for(f"{text_of('#ab-result')}.includes('A/B running: DFlash 2')", 240, "the DFlash 2 run")
        page.screenshot(ARTIFACTS / running, whole=False)  # what the visitor sees (a whole-page capture scrolls)
        assert page.evaluate(BROKEN_WORDS) == [], "a word breaks across lines while the A/B runs"
    # Eight runs of up to 512 tokens each on the demo pair (plain, DFlash 2, five n-gram methods and a method list).
    result = page.wait_for(f"{text_of('#ab-result')}.includes({json.dumps(verdict)}) && {text_of('#ab-result')}", 600,
                           "the A/B comparison")  # fmt: skip
    shown = page.evaluate("window.dflashAb")
    assert any("A/B running: Plain" in t for t in shown), shown
    assert page.evaluate(AB_FINDINGS_OUT_OF_VIEW) == [], "what the A/B found is not in view where it was clicked"
    for text in shown:
        if "A/B running" in text:
            assert "Texts identical" not in text, f"a verdict before every run has finished: {text}"
        if "A/B running: Plain" in text or "A/B running: DFlash 2" in text:
            assert "DFlash 2: " not in text, f"a speed sentence before its run has finished: {text}"
    return result




def set_temperature(page: DevTools, value: float) -> None:
    """Type the value into the temperature slider's number box, as a visitor would, and leave the box."""
    box = "#temperature input[type='number']"
    page.evaluate(f"document.querySelector({json.dumps(box)}).select()")
    page.type_into(box, str(value))
    page.evaluate(f"document.querySelector({json.dumps(box)}).blur()")
    page.wait_for(f"document.querySelector(\"#temperature input[type='range']\").value === '{value}'", 10,
                  f"the temperature slider at {value}")  # fmt: skip


SPEED_UP = r"DFlash 2: (no measurable speed-up|no speed-up|slower than plain here|[\d.]+× as fast as plain)"


def test_ab_at_temperature_zero_reports_a_speed_up_and_identical_texts(page: DevTools) -> None:
    wait_for_page(page)
    if not bot_texts(page):  # run alone
        send(page, "hello world")
        wait_for_answer(page, answers=1)
    assert page.evaluate("[window.innerWidth, window.innerHeight]") == [1400, 900]
    result = run_ab(page, "At temperature 0", running="app_browser_ab_running.png")
    assert re.search(SPEED_UP, result) and "÷" not in result, result
    assert "Plain" in result and "DFlash 2" in result and "greedy match" in result
    assert "Texts identical: yes" in result and "greedy output, token for token" in result
    assert result.startswith("A/B finished"), result
    # Beside the table, a bar per run (plain and four methods); under both, the five texts side by side, the same.
    page.wait_for(f"{is_shown('#ab-chart')} && document.querySelectorAll('#ab-chart svg .mark-rect path').length === 5",
                  20, "the A/B's chart of speed-ups")  # fmt: skip
    names = page.evaluate("Array.from(document.querySelectorAll('#ab-texts .ab-name')).map(e => e.innerText)")
    assert len(names) == 5 and names[0] == "Plain" and all(n.endswith("· the same text") for n in names[1:]), names
    chart = page.evaluate("document.querySelector('#ab-chart').getBoundingClientRect().left")
    assert chart > page.evaluate("document.querySelector('#ab-result').getBoundingClientRect().right") - 1, \
        "the chart beside the table at 1400 px"  # fmt: skip
    page.screenshot(ARTIFACTS / "app_browser_ab.png")
    page.screenshot_of("#ab-result", ARTIFACTS / "app_browser_ab_table.png")


def test_the_ab_table_fits_at_1400_px_and_on_a_phone(page: DevTools) -> None:
    """The A/B table at the page's 1,400 px and at a phone's 390 px: no header cut short, nothing wider than its box
    (no scrollbar hiding a column), nothing past the window's edge."""
    wait_for_page(page)
    if not page.evaluate(f"{text_of('#ab-result')}.includes('Texts identical')"):  # run alone: an A/B of its own
        if not bot_texts(page):
            page.type_into("#message-box textarea", "hello world")
        run_ab(page, "At temperature 0")
    assert page.evaluate("document.documentElement.clientWidth") > 1300
    assert page.evaluate(AB_TABLE_FAULTS) == []
    headers = page.evaluate("Array.from(document.querySelectorAll('#ab-result th')).map(th => th.innerText.trim())")
    assert headers == ["Method", "Tokens", "tok/s", "Accepted", "Tok/step"], headers
    page.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1, mobile=True)
    try:
        page.wait_for("document.documentElement.clientWidth <= 390", 10, "the phone's width")
        with contextlib.suppress(TimeoutError):  # the layout follows the width within a frame or two
            page.wait_for(f"{AB_TABLE_FAULTS}.length === 0", 5, "the table laid out for the phone")
        page.screenshot_of("#ab-result", ARTIFACTS / "app_browser_ab_phone.png")
        assert page.evaluate(AB_TABLE_FAULTS) == []
    finally:
        page.call("Emulation.setDeviceMetricsOverride", **DESKTOP)
        page.wait_for("document.documentElement.clientWidth > 1300", 10, "the page's own width")


# Every word of the page's texts (the chat's aside) that the layout broke across two lines (a word: what lies between
# spaces, hyphens, slashes and the panel's separators, where a line may break).
BROKEN_WORDS = """(() => {
    const broken = [];
    for (const root of document.querySelectorAll('.prose')) {
        if (root.closest('#chatbot')) continue;  // the model's text: a gibberish word may be longer than a line
        const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            const words = /[^\\s\\-\\/·=+]+/g;
            let match;
            while ((match = words.exec(node.textContent))) {
                const range = document.createRange();
                range.setStart(node, match.index);
                range.setEnd(node, match.index + match[0].length);
                const tops = new Set(Array.from(range.getClientRects()).filter(r => r.width > 0)
                    .map(r => Math.round(r.top)));
                if (tops.size > 1) broken.push(match[0]);
            }
        }
    }
    return broken;
})()"""


def test_on_a_phone_the_statistics_show_while_an_answer_streams_and_no_word_breaks(server: RunningApp) -> None:
    """At 390 × 844, in a new tab, a message sent with Enter from the first screen (the page not scrolled by the
    test): the sentence on top of the statistics is in view while the answer streams (it is under the chat) and
    wholly in view when the answer has ended; nothing is wider than the window or over the chat's messages, with an
    answer and after an A/B (its table, chart and texts); no word of the statistics breaks across lines, the table
    opened; the A/B's progress shows in view within 2 s of its click."""
    with open_page(server.url) as phone:
        phone.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1, mobile=True)
        phone.wait_for("document.documentElement.clientWidth <= 390", 10, "the phone's width")
        wait_for_page(phone)
        phone.screenshot(ARTIFACTS / "app_browser_phone_before.png")
        set_slider(phone, "max-tokens", 160)  # short answers: the A/B below runs five of them
        phone.evaluate("window.scrollTo(0, 0)")
        send(phone, "hello world", with_enter=True)
        phone.wait_for(f"{RUNNING} && {in_view('#stats-summary')}", 60,
                       "the statistics in view while the answer streams")  # fmt: skip
        phone.screenshot(ARTIFACTS / "app_browser_phone_streaming.png", whole=False)  # what the phone shows
        wait_for_answer(phone, answers=1)
        phone.wait_for(SUMMARY_IN_VIEW, 10, "the answer's summary in view once it has ended")
        phone.screenshot(ARTIFACTS / "app_browser_phone_answered.png", whole=False)
        assert phone.evaluate(PAGE_FAULTS) == [], "with an answer"
        details_of(phone)
        assert phone.evaluate(BROKEN_WORDS) == [], "a word of the statistics breaks across lines"
        phone.screenshot_of("#stats", ARTIFACTS / "app_browser_phone_stats.png")
        run_ab(phone, "At temperature 0", running="app_browser_phone_ab_running.png")
        phone.screenshot(ARTIFACTS / "app_browser_phone_ab.png", whole=False)  # what the phone shows once it ends
        phone.wait_for(is_shown("#ab-chart"), 10, "the A/B's chart")
        assert phone.evaluate(PAGE_FAULTS) == [], "after an A/B"


def test_the_method_menu_says_what_each_method_is(page: DevTools) -> None:
    wait_for_page(page)
    help_text = page.wait_for(f"{text_of('#method-help')}.includes('DFlash 2') && {text_of('#method-help')}", 20,
                              "the method menu's help")  # fmt: skip
    for line in ("auto: the pair's default (DFlash 2)", "DFlash 2: a small draft model", "ngram-mod: no draft model",
                 "ngram-map-k: no draft model", "ngram-simple: no draft model", "ngram-map-k4v: no draft model",
                 "ngram-cache: no draft model", "ngram-mod → DFlash 2: each step drafted by ngram-mod"):
        assert line in help_text, f"{line!r} missing from {help_text!r}"


def test_ab_above_temperature_zero_explains_why_the_texts_may_differ(page: DevTools) -> None:
    set_temperature(page, 0.7)
    try:
        result = run_ab(page, "Above temperature 0")
    finally:
        set_temperature(page, 0)
    assert re.search(SPEED_UP, result) and "Drafts checked by rejection sampling" in result, result
    assert re.search(r"Texts identical: (no, as expected|yes, this time)", result), result
    assert re.search(r"same seed \(\d+\)", result) and "rejection sampling" in result and "distribution" in result
    assert "fault" not in result.replace("not a fault", ""), "a sampled difference is never called a fault"
    page.screenshot(ARTIFACTS / "app_browser_ab_sampled.png")


def test_about_box_names_the_pair_and_the_build_without_server_paths(page: DevTools) -> None:
    wait_for_page(page)  # a click before the page is live opens nothing (when this test runs first)
    page.wait_for("!!document.querySelector('#about .label-wrap')", 20, "the About accordion")
    page.click("#about .label-wrap")
    about = page.wait_for(f"{text_of('#about')}.includes('llama.cpp build') && {text_of('#about')}", 20, "the info box")
    for part in ("tiny-random", "random-weight test models", "Quantisation", f"Context: {N_CTX} tokens",
                 "llama-cpp-python 0.3.36", "Device", "Engine: target arch qwen3",
                 f"local file {demo_pair().target.name}"):  # fmt: skip
        assert part in about, f"{part!r} missing from the info box"
    for private in (str(demo_pair().target.parent), str(REPO_ROOT)):
        assert private not in about, f"the info box shows a server path ({private})"
    page.screenshot(ARTIFACTS / "app_browser_about.png")


def test_clear_mid_answer_stops_it_and_the_next_turn_starts_clean(page: DevTools, server: RunningApp) -> None:
    send(page, "fox dog fox dog")
    page.wait_for(f"{STATS}.includes('tok/s') && !{STATS}.includes('Finished')", 30, "a running answer")
    page.click("#clear")
    page.wait_for(f"document.querySelectorAll({json.dumps(BOT_MESSAGES)}).length === 0", 20, "the chat to clear")
    wait_idle(server)
    assert "shows here as it is written" in page.evaluate(STATS), "the statistics as before any answer"
    assert bot_texts(page) == [], "the cleared answer came back"

    send(page, "seven eight nine ten")
    wait_for_answer(page, answers=1)
    assert user_texts(page) == ["seven eight nine ten"]
    assert same_text(bot_texts(page)[0], expected_reply("seven eight nine ten")), "the old conversation was sent"
    cleared = previous_request(server)
    assert cleared["finish_reason"] == "closed by the caller" and cleared["n_generated"] < 512
    page.screenshot(ARTIFACTS / "app_browser_after_clear.png")


ERROR_OVERLAYS = "Array.from(document.querySelectorAll('.wrap span.error')).filter(e => e.offsetParent !== null).length"


def log_noise(server: RunningApp) -> int:
    """Tracebacks and Python warnings in the server's log so far."""
    log = server.log()
    return log.count("Traceback") + log.count("Warning: ")


def clear_box(page: DevTools) -> None:
    page.evaluate("(() => { const box = document.querySelector('#message-box textarea'); box.value = '';"
                  " box.dispatchEvent(new Event('input', {bubbles: true})); })()")  # fmt: skip


def test_a_refused_message_is_told_and_leaves_the_page_usable(page: DevTools, server: RunningApp) -> None:
    """40,000 characters from the page: refused with a clear message in the notice line, no error overlay on any
    output, the text stays in the box, and the next message is answered. A message refused for its characters (here)
    and one refused for its tokens (by the GPU function) both clear the statistics, and neither leaves a traceback
    in the server's log."""
    wait_for_page(page)
    if not bot_texts(page):  # run alone: an answer whose statistics the refusals clear
        send(page, "hello world")
        wait_for_answer(page, answers=1)
    log_before = log_noise(server)
    page.wait_for(AB_READY, 20, "the previous answer to end")
    clear_box(page)
    page.type_into("#message-box textarea", "x y " * 7000)  # 28,000 characters: far more tokens than the context
    page.click("#send")
    page.wait_for(f"{text_of('#context-notice')}.includes('Not sent')", 60, "the refusal by tokens")
    by_tokens = page.wait_for(f"{STATS}.includes('not sent') && {STATS}", 20, "the statistics cleared")
    assert "No answer: the message was not sent" in by_tokens
    clear_box(page)
    page.wait_for(AB_READY, 20, "the refused answer to end")
    answered = len(bot_texts(page))
    send(page, "one two")
    wait_for_answer(page, answers=answered + 1)
    clear_box(page)
    before = len(bot_texts(page))
    page.type_into("#message-box textarea", "x" * 40000)
    page.click("#send")
    notice = page.wait_for(f"{text_of('#context-notice')}.includes('Not sent') && {text_of('#context-notice')}", 20,
                           "the refusal")  # fmt: skip
    assert "accepts up to 32000" in notice
    page.screenshot(ARTIFACTS / "app_browser_refused.png")
    assert page.evaluate(ERROR_OVERLAYS) == 0, "an error overlay covers the page"
    assert page.evaluate("document.querySelector('#message-box textarea').value.length") == 40000, "the text stays"
    assert len(bot_texts(page)) == before, "nothing was sent"
    by_characters = page.wait_for(f"{STATS}.includes('not sent') && {STATS}", 20, "the statistics cleared")
    assert by_characters == by_tokens, "both refusals leave the statistics alike"
    clear_box(page)
    send(page, "one two three")
    wait_for_answer(page, answers=before + 1)
    page.wait_for(f"!{text_of('#context-notice')}.includes('Not sent')", 10, "the notice to go")
    assert page.evaluate(ERROR_OVERLAYS) == 0
    assert log_noise(server) == log_before, "a refused message left a traceback or a warning in the log"


def test_a_new_message_clears_the_previous_ab_result(page: DevTools) -> None:
    run_ab(page, "At temperature 0")
    before = len(bot_texts(page))
    send(page, "four five six")
    page.wait_for(f"{text_of('#ab-result')}.trim() === ''", 10, "the A/B box to clear")
    # While the answer runs, the A/B button is greyed out and says when it can be used (an A/B now would be refused).
    waits = page.wait_for("(b => b.disabled && b.innerText)(document.querySelector('#ab'))", 10, "a greyed out A/B")
    assert "once this answer has finished" in waits
    wait_for_answer(page, answers=before + 1)
    page.wait_for(AB_READY, 20, "the A/B button back once the answer has finished")


def test_ab_table_headers_do_not_break_inside_words(page: DevTools) -> None:
    run_ab(page, "At temperature 0")
    lines = page.evaluate(
        "Array.from(document.querySelectorAll('#ab-result th')).map(th => { const r = document.createRange();"
        " r.selectNodeContents(th); return [th.innerText, new Set(Array.from(r.getClientRects()).map(x => "
        "Math.round(x.top))).size]; })"
    )
    assert lines and all(n == 1 for _, n in lines), f"headers wrapped: {lines}"


def test_a_think_tag_typed_by_a_visitor_stays_text(page: DevTools) -> None:
    before = len(bot_texts(page))
    send(page, "why <think>is this</think> folded?")
    wait_for_answer(page, answers=before + 1)
    assert user_texts(page)[-1].strip() == "why <think>is this</think> folded?"
    folded = page.evaluate(
        f"Array.from(document.querySelectorAll({json.dumps(USER_MESSAGES)})).pop().querySelectorAll("
        "'details, button, .thought-group, [class*=thought]').length"
    )
    assert folded == 0, "the visitor's own message is folded as reasoning"


def test_a_queued_message_shows_while_other_visitors_are_answered(page: DevTools, server: RunningApp) -> None:
    """Other visitors' answers fill every sequence of the engine (the page says how many): a message sent now shows
    in the chat at once, waits its turn, and is answered once they are stopped."""
    monitor = Client(server.url, verbose=False)
    parallel = monitor.predict(api_name="/info")["parallel"]
    assert f"{parallel} answers can run at once on this engine" in page.evaluate(text_of("#engine-sharing"))
    jobs = [Client(server.url, verbose=False).submit(message="hello there", preset="tiny-random", max_tokens=2000,
                                                     api_name="/chat") for _ in range(parallel)]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while monitor.predict(api_name="/info")["running"] < parallel:  # polled to a deadline
            assert time.monotonic() < deadline, "the other visitors' answers did not all start"
        send(page, "my message waits its turn")
        page.wait_for(f"Array.from(document.querySelectorAll({json.dumps(USER_MESSAGES)})).some("
                      "e => e.innerText.includes('my message waits its turn'))", 10, "the queued message")  # fmt: skip
        assert monitor.predict(api_name="/info")["running"] == parallel, "still the other visitors' turn"
        page.screenshot(ARTIFACTS / "app_browser_queued.png")
    finally:
        for job in jobs:
            job.cancel()
    stats = page.wait_for(f"{STATS}.includes('Finished') && {STATS}", 120, "the queued message's answer")
    assert "max_tokens=512 reached" in stats


def test_on_zero_gpu_the_page_shows_the_gpu_time_and_keeps_its_worker(tmp_path: Path) -> None:
    """The page on ZeroGPU (the real `spaces` package against the fake device API): the statistics show the GPU time
    requested (what the device API was asked for) and used, and a second answer reuses the worker's engine."""
    device_api = FakeDeviceApi().start()
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_DIAGNOSTICS": "1",
           **device_api.env(tmp_path / "cgroup")}  # fmt: skip
    app = launch_app(env, ARTIFACTS / "app_browser_zerogpu_server.log")
    try:
        with open_page(app.url) as zero_page:
            wait_for_page(zero_page)
            send(zero_page, "hello world")
            wait_for_answer(zero_page, answers=1)
            details = details_of(zero_page)
            match = re.search(r"GPU time requested / used.*?(\d+) s / ([\d.]+) s", details, re.S)
            assert match, f"no GPU time in {details!r}"
            assert int(match.group(1)) == int(device_api.of("/schedule")[-1].params["durationSeconds"])
            assert same_text(bot_texts(zero_page)[0], expected_reply("hello world"))
            zero_page.screenshot(ARTIFACTS / "app_browser_zerogpu.png")
            send(zero_page, "one two three")
            wait_for_answer(zero_page, answers=2)
        worker = Client(app.url, verbose=False).predict(api_name="/info")["worker"]
    finally:
        stop_app(app.process)
        device_api.stop()
    assert worker["loads"] == 1 and worker["requests"] == 2 and len(device_api.of("/allow")) == 1


def set_slider(page: DevTools, elem_id: str, value: float) -> None:
    """Type the value into a slider's number box, as a visitor would, and leave the box."""
    box = f"#{elem_id} input[type='number']"
    page.wait_for(f"!!document.querySelector({json.dumps(box)})", 20, f"the slider {elem_id}")  # the page renders it
    page.evaluate(f"document.querySelector({json.dumps(box)}).select()")
    page.type_into(box, str(value))
    page.evaluate(f"document.querySelector({json.dumps(box)}).blur()")
    page.wait_for(f"document.querySelector(\"#{elem_id} input[type='range']\").value === '{value}'", 10,
                  f"the slider {elem_id} at {value}")  # fmt: skip


# Installed in a tab: the times (the browser's clock, which its tabs share) at which the tab's last answer grew.
GROWTH_RECORDER = f"""(() => {{
    window.dflashGrowth = [];
    let last = '';
    new MutationObserver(() => {{
        const bots = document.querySelectorAll({json.dumps(BOT_MESSAGES)});
        const text = bots.length ? bots[bots.length - 1].innerText : '';
        if (text.trim() && text !== last) window.dflashGrowth.push(performance.timeOrigin + performance.now());
        last = text;
    }}).observe(document.querySelector('#chatbot'), {{subtree: true, childList: true, characterData: true}});
    return true;
}})()"""
RUNNING = f"{STATS}.includes('tok/s') && !{STATS}.includes('Finished')"


def test_two_tabs_are_answered_at_the_same_time(tmp_path: Path) -> None:
    """Two visitors' tabs on an engine of two sequences (DFLASH_PARALLEL=2): the page says two answers can run at
    once; the second tab's answer streams while the first's does (each tab's answer grows before the other's ends,
    many times), and each tab shows its own answer and its own statistics."""
    env = {"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": str(N_CTX), "DFLASH_PARALLEL": "2"}
    app = launch_app(env, ARTIFACTS / "app_browser_parallel_server.log")
    asks = {"hello world": 1200, "the quick brown fox": 300}
    try:
        with open_pages(app.url, 2) as tabs:
            for tab, max_tokens in zip(tabs, asks.values(), strict=True):
                wait_for_page(tab)
                sharing = tab.wait_for(f"{text_of('#engine-sharing')}.includes('answers') && "
                                       f"{text_of('#engine-sharing')}", 20, "the sharing note")  # fmt: skip
                assert "2 answers can run at once on this engine" in sharing
                assert tab.evaluate(GROWTH_RECORDER)
                set_slider(tab, "max-tokens", max_tokens)
            first, second = tabs
            send(first, "hello world")
            first.wait_for(RUNNING, 60, "the first tab's answer")
            send(second, "the quick brown fox")
            second.wait_for(RUNNING, 60, "the second tab's answer, while the first one runs")
            assert first.evaluate(RUNNING), "the first tab's answer ended before the second one began"
            first.screenshot(ARTIFACTS / "app_browser_parallel_first_tab.png")
            second.screenshot(ARTIFACTS / "app_browser_parallel_second_tab.png")
            stats = [wait_for_answer(tab, answers=1, timeout_s=240) for tab in tabs]
            growth = [tab.evaluate("window.dflashGrowth") for tab in tabs]
            answers = [bot_texts(tab) for tab in tabs]
    finally:
        stop_app(app.process)
    one, two = growth
    assert two[0] < one[-1] and one[0] < two[-1], "the answers did not stream at the same time"
    during = [sum(1 for t in a if b[0] < t < b[-1]) for a, b in ((one, two), (two, one))]
    assert min(during) >= 5, f"each answer grew while the other streamed: {during}"
    for (message, max_tokens), shown, panel in zip(asks.items(), answers, stats, strict=True):
        assert generated_tokens(panel) == max_tokens and f"max_tokens={max_tokens} reached" in panel
        assert len(shown) == 1 and same_text(shown[0], expected_reply(message, max_tokens)), message
