"""DFlash 2 speculative decoding: a streaming chat Space (ZeroGPU, a local CUDA GPU, or CPU).

The page's layout and its wiring only. What runs lives in `dflash_runtime.space`: the service (requests, GPU jobs,
/info), the endpoints and event handlers, the GPU function and the engine host. API endpoints for gradio_client:
/chat (streaming), /generate (one shot) and /info; the OpenAI-compatible /v1 routes on the same port
(dflash_runtime.space.web.openai_routes).
"""

from __future__ import annotations

import signal
import sys

STOPPED = 128 + signal.SIGINT  # a shell's status for a command that Ctrl+C ended
# Ctrl+C while the page is being built (the imports, the build check): no traceback (unless Ctrl+C is ignored here).
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda *_: sys.exit(STOPPED))

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gradio as gr
from starlette.middleware import Middleware

from dflash_runtime.space.gpu import zerogpu
from dflash_runtime.space.page.endpoints import (
    AB_LABEL,
    AB_MOST,
    CHECKED_PARAMETERS,
    CHECKED_VALUES,
    PageHandlers,
    draft_length_choices,
    engine_sharing,
    make_api,
    method_choices,
    method_menu_help,
    plot_frame,
    sampling_note,
)
from dflash_runtime.space.page.highlight import CSS as HIGHLIGHT_CSS
from dflash_runtime.space.page.highlight import LEGEND
from dflash_runtime.space.page.panel import EMPTY_DETAILS, EMPTY_STATS
from dflash_runtime.space.page.session import ChatSession
from dflash_runtime.space.page.views import mode_banner
from dflash_runtime.space.requests import DEFAULT_SYSTEM_PROMPT
from dflash_runtime.space.setup.settings import queue_size
from dflash_runtime.space.setup.startup import run_startup_check
from dflash_runtime.space.web.clients import servers_forward_nothing
from dflash_runtime.space.web.gate import Endpoints, HttpGate
from dflash_runtime.space.web.openai_routes import v1_app
from dflash_runtime.space.web.service import SpaceService

log = logging.getLogger("dflash_space")
# Every generating event shares one queue whose concurrency is the engine's parallel sequences (DFLASH_PARALLEL).
ENGINE_QUEUE = "engine"
# Waiting visitors and API calls (ZeroGPU Spaces would otherwise keep one waiting event and refuse the rest).
QUEUE_SIZE = queue_size()
MAX_FILE_SIZE = "1kb"  # the page takes no files (the HTTP gate refuses every upload; this is Gradio's own bound)
EXAMPLES = [
    "Explain speculative decoding in three sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five facts about the planet Mars.",
    "Translate 'the quick brown fox jumps over the lazy dog' into French and German.",
]

CHAT_HEIGHT = 380  # px at 1400 × 900: the message box, the examples and A/B still fit under it (a phone: PAGE_CSS)
PHONE = "@media (max-width: 480px)"
# Formulas the chat renders (and the highlight leaves unmarked: page/highlight.py reads the same delimiters).
LATEX = [{"left": "$$", "right": "$$", "display": True}]
PAGE_CSS = HIGHLIGHT_CSS + f"""
#intro h1 {{ margin-bottom: 2px; }}
#intro p, #mode-banner p {{ margin: 0; }}
#mode-banner details summary {{ cursor: pointer; }}
/* No word is broken inside: a line breaks between words (a word longer than a whole line is the one exception). */
.prose, .prose * {{ word-break: normal; overflow-wrap: break-word; hyphens: manual; }}
/* The chat's toolbar (copy, clear) on a line of its own above the messages, never over their text. */
#chatbot .wrapper {{ display: flex; flex-direction: column; }}
#chatbot .top-panel {{ position: static; align-self: flex-end; flex: 0 0 auto; }}
#chatbot .bubble-wrap {{ flex: 1 1 auto; min-height: 0; height: auto; }}
#ab-result th {{ white-space: nowrap; overflow-wrap: normal; }}
#ab-result table {{ font-size: var(--text-sm); }}
#ab-result th, #ab-result td {{ padding: 4px 6px; }}
/* The A/B's findings and table beside its chart where both fit, the chart under them where not (a phone). */
#ab-found {{ flex-wrap: wrap; }}
#ab-found > #ab-result, #ab-found > :has(#ab-result) {{ flex: 3 1 320px; min-width: min(320px, 100%); }}
#ab-found > #ab-chart, #ab-found > :has(#ab-chart) {{ flex: 2 1 240px; min-width: min(240px, 100%); }}
.ab-texts {{ display: grid; grid-template-columns: repeat(auto-fit, minmax(240px, 1fr)); gap: 8px; }}
.ab-text {{ border: 1px solid var(--border-color-primary); border-radius: 6px; padding: 6px 8px; min-width: 0; }}
.ab-name {{ font-size: var(--text-sm); margin-bottom: 4px; }}
.ab-body {{ white-space: pre-wrap; font-size: var(--text-sm); max-height: 14em; overflow-y: auto; }}
#stats-table th, #stats-table td {{ padding: 4px 6px; }}
#stats-table table {{ font-size: var(--text-md); width: 100%; }}
/* Each term's explanation, under it: the body's colour and size (the term above it is bold). */
#stats-table small {{ display: block; color: var(--body-text-color); font-size: var(--text-md); font-weight: normal;
                      line-height: 1.35; margin-top: 2px; }}
#method-help {{ font-size: var(--text-sm); }}
#method-help ul {{ margin: 0; }}
#examples {{ padding-top: 0; }}
/* The page's side margins: Gradio's 32 px on a wide window, 8 px on a phone, where the message box takes the width.
   Not in the phone's media rule: Gradio scopes the rules inside one to its content, under the page's margins. */
.gradio-container .app {{ padding-left: clamp(8px, calc((100vw - 390px) / 10 + 8px), 32px) !important;
                          padding-right: clamp(8px, calc((100vw - 390px) / 10 + 8px), 32px) !important; }}
{PHONE} {{
  #message-box {{ padding: 6px; }}
  #intro h1 {{ font-size: 1.15rem; }}
  #intro p, #mode-banner p, #mode-banner summary {{ font-size: var(--text-sm); line-height: 1.4; }}
  /* The message box the whole width; Send and Stop share the line under it; A/B and Clear share one too. */
  #message-row {{ flex-wrap: wrap; gap: 8px; }}
  #message-row > :has(#message-box) {{ flex: 1 1 100% !important; min-width: 100% !important; }}
  #message-row > button {{ flex: 1 1 0 !important; min-width: 0 !important; }}
  #ab-row {{ flex-wrap: nowrap; gap: 8px; }}
  #ab-row > * {{ min-width: 0 !important; }}
  #ab-row > #clear {{ flex: 0 0 80px !important; }}
  #chatbot {{ height: 240px !important; max-height: 240px !important; }}
  /* The examples wrap inside the page, each on as many lines as it needs. */
  #examples .gallery {{ flex-wrap: wrap; }}
  #examples .gallery > * {{ flex: 1 1 100%; max-width: 100%; white-space: normal; }}
  #examples .gallery > * * {{ white-space: normal; }}
  #ab-result th, #ab-result td {{ padding: 3px 3px; }}
  .row:has(> #draft-legend) {{ flex-wrap: wrap; }}
  #draft-legend {{ flex-basis: 100%; font-size: var(--text-xs); }}
}}
"""

AB_SCROLL = """() => {
    const row = document.querySelector('#ab-row'), box = document.querySelector('#ab-result');
    if (!row || !box || row.getBoundingClientRect().top <= window.innerHeight * 0.3) return;
    box.style.minHeight = Math.round(window.innerHeight * 0.7) + 'px';  // room to scroll to, before the result comes
    row.scrollIntoView({block: 'start', behavior: 'smooth'});
}"""
# When an answer ends: its one-line summary into view where it is not (a phone's first screen ends above it),
# measured once the page has laid out the answer's last frame (two animation frames on).
SUMMARY_SCROLL = """() => requestAnimationFrame(() => requestAnimationFrame(() => {
    const summary = document.querySelector('#stats-summary');
    if (!summary) return;
    const r = summary.getBoundingClientRect();
    if (r.top < -1 || r.bottom > window.innerHeight + 1) summary.scrollIntoView({block: 'nearest'});
}))"""


def demo_files(spec: Mapping[str, Any]) -> tuple[Path, Path]:
    """The offline demo's generated pair (made once, then cached): the test models live in dflash_runtime.testing,
    which only this file, not the Space's modules, imports."""
    from dflash_runtime.testing.tiny_models import pair_paths

    return pair_paths(spec)


def build_service() -> SpaceService:
    """The native build's self-check (probed in a child process: no CUDA here), then the service it allows."""
    status, details = run_startup_check()
    log.info("llama.cpp build: %s", status)
    service = SpaceService.from_env(status, details, demo_files=demo_files, run_gpu=zerogpu.run_on_gpu,
                                    quota_seconds=zerogpu.quota_seconds, gpu_size=zerogpu.GPU_SIZE)
    mode = service.config.mode
    log.info("mode: %s (%s)", "offline demo" if mode.tiny else service.config.preset.name, mode.reason)
    for problem in mode.problems:
        log.warning("not serving the model pair: %s", problem)
    return service


def trace_chart(title: str, y_title: str, elem_id: str, y_lim: list[float] | None = None) -> gr.LinePlot:
    """One live chart of a trace (see `page/speedup.py`) against tokens generated, hidden until an answer has
    points. One series, so no legend: the title says what it is."""
    return gr.LinePlot(
        None,
        x="tokens",
        y="value",
        y_lim=y_lim,
        height=180,
        title=title,
        x_title="tokens generated",
        y_title=y_title,
        elem_id=elem_id,
        visible=False,
    )


def build_ui(service: SpaceService) -> tuple[gr.Blocks, Endpoints]:
    """The page, and its functions as the HTTP gate checks and counts them (see dflash_runtime.space.web.gate)."""
    handlers = PageHandlers(service)
    preset, limits, defaults = service.config.preset, service.limits, service.defaults
    with gr.Blocks(title="DFlash 2 speculative decoding") as demo:
        # The first screen holds what a visitor came for, at 1400 × 900 and on a phone: a two-line header, the chat,
        # the message box and the examples; the statistics, the A/B and the settings follow.
        gr.Markdown(
            "# DFlash 2 speculative decoding\n"
            "A small draft proposes several tokens at once; the target checks them in one pass and keeps what it "
            "would have written anyway: the same answers, in fewer steps of the target.",
            elem_id="intro",
        )
        gr.Markdown(mode_banner(service.config.mode), visible=service.config.mode.tiny, elem_id="mode-banner")
        download_box = gr.Markdown("", visible=False, elem_id="download-status")
        session = gr.State(ChatSession(), delete_callback=ChatSession.stop)
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(
                    show_label=False,  # no label over the first message
                    height=CHAT_HEIGHT,
                    reasoning_tags=[("<think>", "</think>")],
                    latex_delimiters=LATEX,
                    feedback_options=None,
                    editable="user",  # a visitor's message can be edited and sent again (see the wiring below)
                    buttons=["copy"],
                    elem_id="chatbot",
                )
                with gr.Row(elem_id="message-row"):
                    message_box = gr.Textbox(
                        placeholder="Ask something…",
                        show_label=False,
                        scale=6,
                        lines=1,
                        max_lines=8,
                        elem_id="message-box",
                    )
                    send_button = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
                    stop_button = gr.Button("Stop", variant="stop", scale=1, min_width=80, elem_id="stop")
                # A click sends the example (see the wiring below); the box is left to what the visitor types.
                examples = gr.Dataset(components=[message_box], samples=[[e] for e in EXAMPLES], label="Examples",
                                      samples_per_page=len(EXAMPLES), elem_id="examples")  # fmt: skip
                notice = gr.Markdown("", elem_id="context-notice")  # always mounted: see notice_line
                # Under the message box, where the eye is while the answer streams (also on a phone, where the
                # columns stack): one sentence in plain words; A/B right under it, then the technical table folded.
                with gr.Group(elem_id="stats"):
                    stats_box = gr.Markdown(EMPTY_STATS, elem_id="stats-summary")
                with gr.Row(elem_id="ab-row"):
                    ab_button = gr.Button(AB_LABEL, scale=3, elem_id="ab")
                    clear_button = gr.Button("Clear", scale=1, min_width=80, elem_id="clear")
                # Right under its button: its progress, then what it found (first), then its table; its speed-ups
                # as a chart beside them; the texts side by side under both.
                with gr.Row(equal_height=False, elem_id="ab-found"):
                    ab_box = gr.Markdown("", elem_id="ab-result", min_width=320)
                    ab_chart = gr.BarPlot(
                        None,
                        x="method",
                        y="speed-up",
                        height=220,
                        title="Speed against plain decoding (× plain)",
                        x_title="",
                        y_title="× plain's tok/s",
                        sort=None,
                        elem_id="ab-chart",
                        min_width=240,
                        visible=False,  # until a method's run has finished
                    )
                ab_texts = gr.HTML("", elem_id="ab-texts")
                with gr.Accordion("Details: steps, acceptance, timings", open=False, elem_id="stats-details"):
                    stats_table = gr.Markdown(EMPTY_DETAILS, elem_id="stats-table")
                with gr.Row(equal_height=True):
                    highlight = gr.Checkbox(True, label="Highlight draft tokens", scale=0, min_width=200,
                                            elem_id="highlight-draft")  # fmt: skip
                    legend = gr.HTML(LEGEND, elem_id="draft-legend")  # shown while the highlight is on
            with gr.Column(scale=2):
                sharing = gr.Markdown(engine_sharing(service), elem_id="engine-sharing")
                speed_chart = trace_chart("Decode speed so far", "tok/s", "speed-chart")
                acceptance_chart = trace_chart("Acceptance so far", "accepted %", "acceptance-chart", y_lim=[0, 100])
                plot = gr.BarPlot(
                    plot_frame({}),
                    x="position",
                    y="acceptance",
                    y_lim=[0, 1],
                    height=200,
                    title="Acceptance by draft position",
                    x_title="draft position",
                    y_title="accepted",
                    elem_id="acceptance-plot",
                    visible=False,  # until an answer drafts
                )
                with gr.Accordion("Settings", open=True):
                    system_prompt = gr.Textbox(label="System prompt", value=DEFAULT_SYSTEM_PROMPT, lines=2)
                    max_tokens = gr.Slider(1, limits.max_new_tokens, value=defaults["max_tokens"], step=1,
                                           precision=0, label="Max new tokens", elem_id="max-tokens")  # fmt: skip
                    temperature = gr.Slider(0.0, 2.0, value=defaults["temperature"], step=0.05, label="Temperature",
                                            elem_id="temperature")  # fmt: skip
                    top_p = gr.Slider(0.01, 1.0, value=defaults["top_p"], step=0.01, label="Top-p", elem_id="top-p")
                    top_k = gr.Slider(0, 200, value=defaults["top_k"], step=1, precision=0, label="Top-k (0 = off)",
                                      elem_id="top-k")  # fmt: skip
                    min_p = gr.Slider(0.0, 0.99, value=defaults["min_p"], step=0.01, label="Min-p", elem_id="min-p")
                    sampling_source = gr.Markdown(sampling_note(service), elem_id="sampling-source")
                    method = gr.Dropdown(method_choices(service), value=defaults["method"], label="Draft method",
                                         elem_id="method")  # fmt: skip
                    method_help = gr.Markdown(method_menu_help(service), elem_id="method-help")
                    draft_length = gr.Dropdown(draft_length_choices(preset.draft_capacity),
                                               value=defaults["draft_length"], label="Draft length",
                                               elem_id="draft-length")  # fmt: skip
                    ab_choices_now, ab_picked_now = handlers.built_ab
                    ab_methods = gr.CheckboxGroup(ab_choices_now, value=ab_picked_now, elem_id="ab-methods",
                                                  label=f"A/B compares (plain and at most {AB_MOST} methods)")
                    with gr.Row():
                        speculative = gr.Checkbox(True, label="Speculative decoding")
                        thinking = gr.Checkbox(False, label="Thinking", elem_id="thinking")
                with gr.Accordion("About this Space", open=False, elem_id="about"):
                    info_box = gr.Markdown(handlers.about())

        timer = gr.Timer(1.0, active=service.config.download.status().state != "done")
        settings = [system_prompt, max_tokens, temperature, top_p, top_k, min_p, method, draft_length, speculative,
                    thinking]  # fmt: skip
        # The engine's sequences (with DFLASH_PARALLEL=auto the most: the engine slot admits what the loaded engine
        # holds, see SpaceService.parallel): so many answers run at once, the rest wait.
        answers_at_once = service.parallel
        # Gradio starts every admitted engine event at once: they wait for the engine in its slot, where clients take
        # turns (see dflash_runtime.space.web.policy), so one client's waiting calls hold no place of
        # another's.
        events_at_once = max(QUEUE_SIZE, answers_at_once)
        engine = {"concurrency_limit": events_at_once, "concurrency_id": ENGINE_QUEUE, "api_visibility": "private"}
        # A message is shown at once (outside the queue), then answered in the engine's queue (see PageHandlers). An
        # example, the chat's retry and its edit of a message go out the same way: checked, shown, then answered by
        # `respond` under the same admission as any answer.
        sent = [chatbot, message_box, notice, ab_box, ab_chart, ab_texts, stats_box, stats_table, plot, speed_chart,
                acceptance_chart, ab_button]  # fmt: skip
        answer_outputs = [chatbot, message_box, stats_box, stats_table, plot, speed_chart, acceptance_chart, notice,
                          thinking, info_box, ab_button]  # fmt: skip
        page_only = {"queue": False, "api_visibility": "private"}

        def answered(shown_event: Any) -> Any:
            """The answering event after one that showed a message, and its summary brought into view at the end."""
            answer = shown_event.then(handlers.respond, [session], answer_outputs, **engine)
            answer.then(None, js=SUMMARY_SCROLL, **page_only)
            return answer

        answer_event = answered(gr.on([message_box.submit, send_button.click], handlers.submit,
                                      [message_box, session, *settings], sent, **page_only))  # fmt: skip
        example_event = answered(examples.click(handlers.submit_example, [examples, session, *settings], sent,
                                                **page_only))  # fmt: skip
        retry_event = answered(chatbot.retry(handlers.retry, [session, *settings], sent, **page_only))
        edit_event = answered(chatbot.edit(handlers.edit, [chatbot, session, *settings], sent, **page_only))
        chatbot.undo(handlers.undo, [session],
                     [chatbot, message_box, notice, stats_box, stats_table, plot, speed_chart, acceptance_chart],
                     **page_only)  # fmt: skip
        # The A/B says at once, under its button, what it will run (outside the queue), then runs in the queue.
        ab_outputs = [ab_box, ab_chart, ab_texts, ab_button]
        ab_event = ab_button.click(handlers.compare_start, [session, message_box, ab_methods], ab_outputs,
                                   **page_only).then(handlers.compare, [session, message_box, ab_methods, *settings],
                                                     ab_outputs, **engine)  # fmt: skip
        # In the browser alone: the A/B's button row goes to the top of the window (unless it is near it already),
        # so that what the A/B finds, under it, shows where the visitor clicked, on a phone too.
        ab_button.click(None, js=AB_SCROLL, **page_only)
        # Stop and Clear (and the chat's own clear button) end the answer on the server: its handler then shows
        # where it stopped (or that it was cleared) as the last frame of its own stream, after any it sent before.
        # An A/B run just ends.
        stop_button.click(handlers.stop, [session], [ab_button], cancels=[ab_event], **page_only)
        cleared = [chatbot, message_box, stats_box, stats_table, plot, speed_chart, acceptance_chart, notice, ab_box,
                   ab_chart, ab_texts, ab_button]  # fmt: skip
        clear_button.click(handlers.clear, [session], cleared, cancels=[ab_event], **page_only)
        chatbot.clear(handlers.clear, [session], cleared, cancels=[ab_event], **page_only)
        highlight.change(handlers.highlight, [session, highlight], [chatbot], **page_only)
        highlight.change(lambda on: gr.update(visible=bool(on)), [highlight], [legend], **page_only)
        demo.load(handlers.page_load, None,
                  [thinking, info_box, temperature, top_p, top_k, min_p, sampling_source, method, method_help,
                   sharing, ab_methods],
                  api_visibility="private")  # fmt: skip
        timer.tick(handlers.download_tick, None, [download_box, timer], api_visibility="private")

        chat_api, generate_api, info_api, wait_api = make_api(service)
        chat_event = gr.api(chat_api, api_name="chat", concurrency_limit=events_at_once, concurrency_id=ENGINE_QUEUE)
        generate_event = gr.api(generate_api, api_name="generate", concurrency_limit=events_at_once,
                                concurrency_id=ENGINE_QUEUE)  # fmt: skip
        gr.api(info_api, api_name="info", queue=False)  # never waits behind an answer
        gr.api(wait_api, api_name="wait", queue=False)  # waits on the engine slot, not in the queue

    def one() -> int:
        return 1

    answers = (answer_event, example_event, retry_event, edit_event, chat_event, generate_event)
    weights = {**{event["id"]: one for event in answers}, ab_event["id"]: handlers.comparison_weight}
    return demo, Endpoints.of(demo.config, weights, parameters=CHECKED_PARAMETERS, checks=CHECKED_VALUES)


logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("httpx").setLevel(logging.WARNING)  # its request lines carry URLs with ZeroGPU's visitor tokens
SERVICE = build_service()
demo, ENDPOINTS = build_ui(SERVICE)

if __name__ == "__main__":
    replaced = servers_forward_nothing()  # the client is read from the socket or the trusted hops alone
    if replaced:
        log.warning("FORWARDED_ALLOW_IPS=%s ignored: set DFLASH_TRUSTED_PROXY_HOPS for a proxy in front", replaced)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here Gradio stops the server on Ctrl+C
    SERVICE.config.download.start()  # the web process fetches the files while the page is already up
    # api_open=False: the REST route /run/<name> refuses queued endpoints, so every answer goes through the queue.
    # HttpGate: bounded bodies, checked values, limits on queued answers by client, and no answer runs that nobody
    # reads (see dflash_runtime.space.web.gate and policy).
    gate = Middleware(HttpGate, calls=SERVICE.calls, endpoints=ENDPOINTS, v1=v1_app(SERVICE))  # and /v1's routes
    # Gradio runs at most `max_threads` events at once, of every function (40 unless told): the engine's events, each
    # waiting in the engine slot, and the page's own must all fit, or admitted answers wait in Gradio's queue in the
    # order they came, where the engine slot's turns cannot reach them.
    demo.queue(api_open=False, max_size=QUEUE_SIZE, default_concurrency_limit=1).launch(
        css=PAGE_CSS, max_file_size=MAX_FILE_SIZE, app_kwargs={"middleware": [gate]}, max_threads=QUEUE_SIZE + 16
    )
