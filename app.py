"""DFlash 2 speculative decoding: a streaming chat Space (ZeroGPU, a local CUDA GPU, or CPU).

The UI wiring only: presets, requests, downloads, the engine host and the text shown live in
`dflash_runtime.space`. API endpoints for gradio_client: /chat (streaming),
/generate (one shot) and /info.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any

try:  # ZeroGPU provides `spaces`; elsewhere its decorator is a no-op, and without it an identity stands in
    import spaces

    gpu: Callable[..., Any] = spaces.GPU
except ImportError:

    def gpu(task: Callable[..., Any] | None = None, **_settings: Any) -> Any:
        return task if callable(task) else (lambda function: function)


import gradio as gr
import pandas as pd

from dflash_runtime import load_pair
from dflash_runtime.errors import DFlashError
from dflash_runtime.space.downloads import PairDownload
from dflash_runtime.space.host import EngineHost, ReplyChunk
from dflash_runtime.space.presets import (
    PairPreset,
    ResolvedPair,
    choose_run_mode,
    configured_preset,
    cuda_device_present,
    on_zero_gpu,
    overrides_in_env,
)
from dflash_runtime.space.requests import ChatRequest, Limits, build_request, estimate_gpu_seconds
from dflash_runtime.space.startup import run_startup_check
from dflash_runtime.space.views import (
    EMPTY_STATS,
    WAITING_STATS,
    ab_markdown,
    acceptance_rows,
    info_markdown,
    mode_banner,
    stats_markdown,
)

MODE = choose_run_mode(os.environ, overrides_in_env(os.environ), cuda_device_present())
PRESET = configured_preset(MODE)
PRESETS = {PRESET.name: PRESET}
LIMITS = Limits.from_env(PRESET)
DOWNLOAD = PairDownload.from_env(PRESET)
HOST = EngineHost(load_pair)  # the engine lives where generation runs: this process, or the ZeroGPU worker
ZERO_GPU = on_zero_gpu()
GPU_SIZE = os.environ.get("DFLASH_GPU_SIZE") or None  # "large" (half a card, the ZeroGPU default) or "xlarge"
ENGINE_QUEUE = "engine"  # every generating event shares one queue slot: one request at a time per engine
LAST_ENGINE_INFO: dict[str, Any] = {}
PLOT_EVERY_S = 0.25
# Adaptive drafting (0) suits real models; on random-weight test models it would switch drafting off, so the
# offline demo drafts the full length to show the machinery at work.
DEFAULTS = {"max_tokens": 512, "temperature": 0.0, "top_p": 1.0, "draft_max": PRESET.draft_max if MODE.tiny else 0}
EXAMPLES = [
    "Explain speculative decoding in three sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five facts about the planet Mars.",
    "Translate 'the quick brown fox jumps over the lazy dog' into French and German.",
]


def build_info() -> tuple[dict[str, str], dict[str, Any]]:
    """The native build's self-check (probed in a child process: no CUDA here) as info-box lines, plus details."""
    status, details = run_startup_check()
    print(f"[startup] {status}", flush=True)
    if ZERO_GPU:
        device = f"ZeroGPU, {GPU_SIZE or 'large'} slice, allocated per request"
    else:
        gpus = [d.get("name") or "GPU" for d in details.get("cuda_devices") or []]
        device = ", ".join(gpus) if gpus else "CPU"
    keys = ("llama_cpp_version", "cuda_build", "gpu_offload", "cuda_devices", "dflash_missing_symbols", "ok")
    lines = {"llama.cpp build": status, "Device": device, "Mode": MODE.reason}
    return lines, {"status": status, **{key: details.get(key) for key in keys}}


BUILD_INFO, STARTUP_DETAILS = build_info()


# -- generation (inside the GPU allocation on ZeroGPU) ------------------------------------------------------------


def reply_seconds(request: ChatRequest, preset: PairPreset, files: ResolvedPair) -> int:
    return estimate_gpu_seconds(request, LIMITS)


def comparison_seconds(request: ChatRequest, preset: PairPreset, files: ResolvedPair) -> int:
    return estimate_gpu_seconds(request, LIMITS, runs=2)


@contextmanager
def user_errors() -> Iterator[None]:
    """Runtime errors become gr.Error: the caller sees the message (ZeroGPU forwards only gr.Error's text)."""
    try:
        yield
    except DFlashError as error:
        raise gr.Error(str(error), title=type(error).__name__, print_exception=False) from error


@gpu(duration=reply_seconds, size=GPU_SIZE)
def reply_on_gpu(request: ChatRequest, preset: PairPreset, files: ResolvedPair) -> Iterator[ReplyChunk]:
    with user_errors():
        yield from HOST.stream_reply(request, preset, files)


@gpu(duration=comparison_seconds, size=GPU_SIZE)
def compare_on_gpu(request: ChatRequest, preset: PairPreset, files: ResolvedPair) -> Iterator[ReplyChunk]:
    with user_errors():
        yield from HOST.stream_comparison(request, preset, files)


# -- web process helpers ------------------------------------------------------------------------------------------


def checked_request(**fields: Any) -> ChatRequest:
    with user_errors():
        return build_request(presets=list(PRESETS), limits=LIMITS, **fields)


def settings_fields(
    system_prompt: str,
    max_tokens: float,
    temperature: float,
    top_p: float,
    draft_max: float,
    speculative: bool,
    thinking: bool,
    preset: str = PRESET.name,
) -> dict[str, Any]:
    """build_request's settings from the settings widgets (or the API's parameters) in their order."""
    return {
        "preset": preset,
        "system_prompt": system_prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "draft_max": draft_max,
        "speculative": speculative,
        "enable_thinking": thinking,
    }


def poll_model_files(timeout_s: float = 1.0) -> ResolvedPair | None:
    """The pair's local files once downloaded (in this web process, never in the GPU function); None meanwhile."""
    with user_errors():
        return DOWNLOAD.poll(timeout_s)


def model_files() -> ResolvedPair:
    with user_errors():
        return DOWNLOAD.wait()


def remember_engine(chunk: ReplyChunk) -> None:
    if chunk.engine_info and not LAST_ENGINE_INFO:
        LAST_ENGINE_INFO.update(chunk.engine_info)


def api_stats(chunk: ReplyChunk) -> dict[str, Any]:
    return {
        **chunk.stats,
        "finish_reason": chunk.finish_reason,
        "finish_detail": chunk.finish_detail,
        "notice": chunk.notice,
        "preset": PRESET.name,
    }


def plot_frame(stats: dict[str, Any]) -> pd.DataFrame:
    # Explicit dtypes: the plot fixes its axis types from the first (empty) frame it receives.
    frame = pd.DataFrame(acceptance_rows(stats), columns=["position", "acceptance"])
    return frame.astype({"position": "string", "acceptance": "float64"})


def server_info() -> dict[str, Any]:
    download = DOWNLOAD.status()
    return {
        "presets": {name: preset.describe() for name, preset in PRESETS.items()},
        "default_preset": PRESET.name,
        "offline_demo": MODE.tiny,
        "mode_reason": MODE.reason,
        "build": STARTUP_DETAILS,
        "limits": LIMITS.describe(),
        "download": {"state": download.state, "summary": download.summary()},
        "engine": dict(LAST_ENGINE_INFO),
    }


# -- API endpoints ------------------------------------------------------------------------------------------------


def api_chat(
    message: str,
    history: list[dict[str, str]] | None,
    system_prompt: str,
    preset: str,
    max_tokens: float,
    temperature: float,
    top_p: float,
    draft_max: float,
    speculative: bool,
    thinking: bool,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Stream an answer to `message` after `history` ([{"role": "user" | "assistant", "content": str}, ...]).
    Yields (text so far, statistics) after every engine step; draft_max 0 means adaptive."""
    settings = settings_fields(system_prompt, max_tokens, temperature, top_p, draft_max, speculative, thinking, preset)
    request = checked_request(message=message, history=history, **settings)
    with closing(reply_on_gpu(request, PRESETS[request.preset], model_files())) as chunks:
        for chunk in chunks:
            remember_engine(chunk)
            yield chunk.text, api_stats(chunk)


def api_generate(
    message: str,
    history: list[dict[str, str]] | None,
    system_prompt: str,
    preset: str,
    max_tokens: float,
    temperature: float,
    top_p: float,
    draft_max: float,
    speculative: bool,
    thinking: bool,
) -> tuple[str, dict[str, Any]]:
    """The same as /chat, answered in one piece: (text, statistics)."""
    # The parameters stay spelled out (not *args): gradio names the API's parameters after this signature.
    chunks = api_chat(
        message, history, system_prompt, preset, max_tokens, temperature, top_p, draft_max, speculative, thinking
    )
    text, stats = "", {}
    for text, stats in chunks:  # noqa: B007 - only the last chunk matters
        pass
    return text, stats


# -- UI handlers --------------------------------------------------------------------------------------------------


def build_ui() -> gr.Blocks:
    with gr.Blocks(title="DFlash 2 speculative decoding") as demo:
        gr.Markdown(
            "# DFlash 2 speculative decoding\n"
            "A block-diffusion draft proposes several tokens at once; the target checks them in one pass and keeps "
            "what it would have written anyway. Same answers as the target alone, fewer target steps."
        )
        gr.Markdown(mode_banner(MODE), visible=MODE.tiny, elem_id="mode-banner")
        download_box = gr.Markdown("", visible=False, elem_id="download-status")
        history = gr.State([])
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(
                    label="Chat",
                    height=520,
                    reasoning_tags=[("<think>", "</think>")],
                    feedback_options=None,
                    elem_id="chatbot",
                )
                notice = gr.Markdown("", visible=False, elem_id="context-notice")
                with gr.Row():
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
                with gr.Row():
                    ab_button = gr.Button("A/B: same prompt, plain decoding", elem_id="ab")
                    clear_button = gr.Button("Clear", elem_id="clear")
                gr.Examples(EXAMPLES, inputs=[message_box], label="Examples")
            with gr.Column(scale=2):
                stats_box = gr.Markdown(EMPTY_STATS, label="Live statistics", elem_id="stats", container=True)
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
                )
                ab_box = gr.Markdown("", elem_id="ab-result")
                with gr.Accordion("Settings", open=True):
                    system_prompt = gr.Textbox(label="System prompt", value="You are a helpful assistant.", lines=2)
                    max_tokens = gr.Slider(
                        1, LIMITS.max_new_tokens, value=DEFAULTS["max_tokens"], step=1, label="Max new tokens"
                    )
                    temperature = gr.Slider(0.0, 2.0, value=DEFAULTS["temperature"], step=0.05, label="Temperature")
                    top_p = gr.Slider(0.01, 1.0, value=DEFAULTS["top_p"], step=0.01, label="Top-p")
                    draft_max = gr.Slider(
                        0, PRESET.draft_max, value=DEFAULTS["draft_max"], step=1, label="Draft length (0 = adaptive)"
                    )
                    with gr.Row():
                        speculative = gr.Checkbox(True, label="Speculative decoding")
                        thinking = gr.Checkbox(False, label="Thinking", elem_id="thinking")
                with gr.Accordion("About this Space", open=False, elem_id="about"):
                    info_box = gr.Markdown(info_markdown(PRESET, LIMITS, BUILD_INFO, LAST_ENGINE_INFO))

        timer = gr.Timer(1.0, active=DOWNLOAD.status().state != "done")
        settings = [system_prompt, max_tokens, temperature, top_p, draft_max, speculative, thinking]
        chat_outputs = [chatbot, history, message_box, stats_box, plot, notice, thinking, info_box, download_box]

        def respond(message: str, past: list[dict[str, str]], *values: Any) -> Iterator[dict[Any, Any]]:
            request = checked_request(message=message, history=past, **settings_fields(*values))
            shown = [*past, {"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            yield {
                chatbot: shown,
                history: shown,
                message_box: "",
                stats_box: WAITING_STATS,
                notice: gr.update(visible=False),
            }
            while (files := poll_model_files()) is None:
                yield {stats_box: f"*Downloading the model pair: {DOWNLOAD.status().summary()}*"}
            view = {"plotted_at": 0.0, "notice": None}
            with closing(reply_on_gpu(request, PRESET, files)) as chunks:  # Stop closes it, and the engine's stream
                for chunk in chunks:
                    shown = [*shown[:-1], {"role": "assistant", "content": chunk.text}]
                    yield chunk_update(chunk, shown, view)

        def chunk_update(chunk: ReplyChunk, shown: list[dict[str, str]], view: dict[str, Any]) -> dict[Any, Any]:
            """The outputs one engine step changes; the plot redraws at most every PLOT_EVERY_S."""
            update: dict[Any, Any] = {
                chatbot: shown,
                history: shown,
                stats_box: stats_markdown(chunk.stats, chunk.finish_reason, chunk.finish_detail),
            }
            if chunk.finish_reason or time.monotonic() - view["plotted_at"] > PLOT_EVERY_S:
                update[plot], view["plotted_at"] = plot_frame(chunk.stats), time.monotonic()
            if chunk.notice and chunk.notice != view["notice"]:
                view["notice"] = chunk.notice
                update[notice] = gr.update(value=f"⚠️ {chunk.notice}", visible=True)
                gr.Warning(chunk.notice)
            if chunk.engine_info and not LAST_ENGINE_INFO:
                remember_engine(chunk)
                update[thinking] = gr.update(visible=bool(chunk.engine_info.get("supports_thinking")))
                update[info_box] = info_markdown(PRESET, LIMITS, BUILD_INFO, LAST_ENGINE_INFO)
            return update

        def compare(past: list[dict[str, str]], typed: str, *values: Any) -> Iterator[str]:
            last_user = max((i for i, m in enumerate(past) if m["role"] == "user"), default=None)
            if last_user is None and not typed.strip():
                raise gr.Error("Send a message first (or type one): the A/B run repeats a prompt.")
            message = past[last_user]["content"] if last_user is not None else typed
            earlier = past[:last_user] if last_user is not None else past
            request = checked_request(message=message, history=earlier, **settings_fields(*values))
            yield "Running the prompt with DFlash, then with plain decoding…"
            files = model_files()
            results: dict[str, ReplyChunk] = {}
            with closing(compare_on_gpu(request, PRESET, files)) as chunks:
                for chunk in chunks:
                    results[chunk.phase] = chunk
                    spec, plain = results.get("speculative"), results.get("plain")
                    done = plain is not None and plain.finish_reason is not None
                    identical = (spec.text == plain.text) if done and spec and plain else None
                    yield ab_markdown(spec.stats if spec else {}, plain.stats if plain else None, identical)

        def clear() -> dict[Any, Any]:
            return {
                chatbot: [],
                history: [],
                message_box: "",
                stats_box: EMPTY_STATS,
                plot: plot_frame({}),
                notice: gr.update(value="", visible=False),
                ab_box: "",
            }

        def on_page_load() -> dict[Any, Any]:
            supports = LAST_ENGINE_INFO.get("supports_thinking", True)
            return {
                thinking: gr.update(visible=bool(supports)),
                info_box: info_markdown(PRESET, LIMITS, BUILD_INFO, LAST_ENGINE_INFO),
            }

        def download_tick() -> dict[Any, Any]:
            status = DOWNLOAD.status()
            if status.state == "done":
                return {download_box: gr.update(visible=False), timer: gr.Timer(active=False)}
            return {download_box: gr.update(value=f"**Model download:** {status.summary()}", visible=True)}

        queue_args = {"concurrency_limit": 1, "concurrency_id": ENGINE_QUEUE, "api_visibility": "private"}
        chat_inputs = [message_box, history, *settings]
        submit_event = message_box.submit(respond, chat_inputs, chat_outputs, **queue_args)
        send_event = send_button.click(respond, chat_inputs, chat_outputs, **queue_args)
        ab_event = ab_button.click(compare, [history, message_box, *settings], [ab_box], **queue_args)
        # Cancelling closes the running generator, which ends the engine's stream between two steps (on ZeroGPU the
        # worker sees the close too). Only this session's events are cancelled, never another user's.
        stop_button.click(
            None, None, None, cancels=[submit_event, send_event, ab_event], queue=False, api_visibility="private"
        )
        clear_button.click(
            clear,
            None,
            [chatbot, history, message_box, stats_box, plot, notice, ab_box],
            queue=False,
            api_visibility="private",
        )
        demo.load(on_page_load, None, [thinking, info_box], api_visibility="private")
        timer.tick(download_tick, None, [download_box, timer], api_visibility="private")
        build_api()
    return demo


def build_api() -> None:
    """Hidden components that give /chat and /generate typed, documented parameters; /info takes none."""
    with gr.Column(visible=False):
        message = gr.Textbox(label="message")
        history = gr.JSON(label="history", value=[])
        system_prompt = gr.Textbox(label="system_prompt", value="")
        preset = gr.Dropdown(choices=list(PRESETS), value=PRESET.name, label="preset", allow_custom_value=True)
        max_tokens = gr.Number(value=DEFAULTS["max_tokens"], label="max_tokens", precision=0)
        temperature = gr.Number(value=DEFAULTS["temperature"], label="temperature")
        top_p = gr.Number(value=DEFAULTS["top_p"], label="top_p")
        draft_max = gr.Number(value=DEFAULTS["draft_max"], label="draft_max", precision=0)
        speculative = gr.Checkbox(value=True, label="speculative")
        thinking = gr.Checkbox(value=False, label="thinking")
        text = gr.Textbox(label="text")
        stats = gr.JSON(label="stats")
        info = gr.JSON(label="info")
        chat_button, generate_button, info_button = gr.Button(), gr.Button(), gr.Button()
    inputs = [message, history, system_prompt, preset, max_tokens, temperature, top_p, draft_max, speculative, thinking]
    shared = {"concurrency_limit": 1, "concurrency_id": ENGINE_QUEUE}
    chat_button.click(api_chat, inputs, [text, stats], api_name="chat", **shared)
    generate_button.click(api_generate, inputs, [text, stats], api_name="generate", **shared)
    info_button.click(server_info, None, [info], api_name="info", concurrency_limit=None)


demo = build_ui()

if __name__ == "__main__":
    DOWNLOAD.start()  # the web process fetches the files while the page is already up
    demo.queue(default_concurrency_limit=1).launch()
