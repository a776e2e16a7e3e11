"""The Space end to end through gradio_client: app.py runs in a subprocess in offline mode (tiny generated models)
and every answer is checked against a separate engine opened on the same files, at temperature 0."""

from __future__ import annotations

import itertools
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gradio as gr
import pytest
from app_fixtures import REPO_ROOT, RunningApp, launch_app, stop_app
from gradio_client import Client
from gradio_client.exceptions import AppError
from gradio_client.utils import Status

from dflash_runtime import load_pair
from dflash_runtime.errors import PromptTooLongError
from dflash_runtime.space.fitting import fit_conversation
from dflash_runtime.space.host import ReplyChunk
from dflash_runtime.space.presets import ResolvedPair, choose_run_mode, cuda_device_present, preset_from_env
from dflash_runtime.space.requests import (
    ChatRequest,
    Limits,
    build_request,
    clean_history,
    estimate_gpu_seconds,
    strip_thinking,
    thinking_prefix,
)
from dflash_runtime.space.views import ab_markdown, acceptance_rows, info_markdown, mode_banner, stats_markdown
from dflash_runtime.stats import Stats

N_CTX = 1024
MAX_INPUT_CHARS = 6000
MAX_NEW_TOKENS = 600
Message = dict[str, str]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    artifacts = REPO_ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    env = {
        "DFLASH_DEMO": "tiny",
        "DFLASH_N_CTX": str(N_CTX),
        "DFLASH_MAX_INPUT_CHARS": str(MAX_INPUT_CHARS),
        "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
    }
    app = launch_app(env, artifacts / "app_api_server.log")
    yield app
    stop_app(app.process)


@pytest.fixture(scope="module")
def client(server: RunningApp) -> Client:
    return Client(server.url, verbose=False)


@pytest.fixture(scope="module")
def info(client: Client) -> dict[str, Any]:
    return client.predict(api_name="/info")


@pytest.fixture(scope="module")
def reference(info: dict[str, Any]) -> Iterator[Any]:
    """An engine of our own on the server's files: what the server must answer, token for token."""
    preset = info["presets"][info["default_preset"]]
    engine = load_pair(Path(preset["target"]), Path(preset["draft"]), n_ctx=preset["n_ctx"], draft_max=7)
    yield engine
    engine.close()


def expected_answer(engine: Any, messages: list[Message], max_tokens: int) -> str:
    return engine.chat(messages, enable_thinking=False, max_tokens=max_tokens, temperature=0.0).text


def chat_args(message: str, **changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "message": message,
        "history": [],
        "system_prompt": "",
        "preset": "tiny-random",
        "max_tokens": 48,
        "temperature": 0.0,
        "top_p": 1.0,
        "draft_max": 7,
        "speculative": True,
        "thinking": False,
    }
    args.update(changes)
    return args


def stream_chat(client: Client, **args: Any) -> list[tuple[str, dict[str, Any]]]:
    job = client.submit(**args, api_name="/chat")
    chunks = [tuple(output) for output in job]
    job.result()  # raises the server's error, if any
    return chunks  # type: ignore[return-value]


def check_stats(stats: dict[str, Any], prompt_tokens: int, max_tokens: int) -> None:
    """The statistics agree with each other and with the request."""
    assert stats["n_prompt"] == prompt_tokens
    assert stats["n_reused"] + stats["n_prefilled"] == stats["n_prompt"]
    assert 0 < stats["n_generated"] <= max_tokens
    assert 0 <= stats["accepted"] <= stats["drafted"]
    assert sum(stats["accepted_per_position"]) == stats["accepted"]
    assert sum(stats["drafted_per_position"]) == stats["drafted"]
    if stats["drafted"]:
        assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["drafted"], abs=1e-4)
    if stats["verify_steps"]:
        expected_length = stats["verify_emitted"] / stats["verify_steps"]
        assert stats["mean_accepted_length"] == pytest.approx(expected_length, abs=1e-4)
    assert stats["decode_tok_s"] > 0 and stats["verify_ms"] > 0
    for name in ("prefill_ms", "draft_ms", "verify_ms"):
        assert stats[name] >= 0
    assert stats["finish_reason"] in ("stop", "length")
    assert stats["preset"] == "tiny-random"


def prompt_length(engine: Any, messages: list[Message]) -> int:
    return len(engine.tokenize(engine.render_chat(messages, enable_thinking=False)))


def test_info_describes_the_offline_pair(info: dict[str, Any]) -> None:
    assert info["offline_demo"] is True and info["default_preset"] == "tiny-random"
    preset = info["presets"]["tiny-random"]
    assert preset["random_weights"] is True and preset["n_ctx"] == N_CTX
    assert Path(preset["target"]).is_file() and Path(preset["draft"]).is_file()
    assert info["limits"]["max_new_tokens"] == MAX_NEW_TOKENS
    assert info["limits"]["max_input_chars"] == MAX_INPUT_CHARS
    assert info["build"]["status"].startswith("llama-cpp-python")
    assert info["build"]["dflash_missing_symbols"] == []


def test_streaming_chat_equals_the_engine_and_reports_consistent_stats(client: Client, reference: Any) -> None:
    chunks = stream_chat(client, **chat_args("hello world, how are you?", max_tokens=60))
    assert len(chunks) >= 3, "the answer must arrive in several chunks"
    texts = [text for text, _ in chunks]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    final_text, final_stats = chunks[-1]
    messages = [{"role": "user", "content": "hello world, how are you?"}]
    assert final_text == expected_answer(reference, messages, 60)
    check_stats(final_stats, prompt_length(reference, messages), 60)
    assert final_stats["drafted"] > 0 and final_stats["speculative"] is True
    assert all(stats["finish_reason"] is None for _, stats in chunks[:-1])
    generated = [stats["n_generated"] for _, stats in chunks]
    assert generated == sorted(generated), "live counters only grow"


def test_history_and_system_prompt_reach_the_model(client: Client, reference: Any) -> None:
    history = [
        {"role": "user", "content": "what is the capital of france?"},
        {"role": "assistant", "content": "<think>\nthinking is not sent back\n</think>\n\nparis is the capital."},
    ]
    args = chat_args("and the answer is?", history=history, system_prompt="be brief.", max_tokens=40)
    final_text, stats = stream_chat(client, **args)[-1]
    messages = [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "what is the capital of france?"},
        {"role": "assistant", "content": "paris is the capital."},
        {"role": "user", "content": "and the answer is?"},
    ]
    assert final_text == expected_answer(reference, messages, 40)
    check_stats(stats, prompt_length(reference, messages), 40)


def test_generate_answers_in_one_piece(client: Client, reference: Any) -> None:
    text, stats = client.predict(**chat_args("one two three four", max_tokens=32), api_name="/generate")
    messages = [{"role": "user", "content": "one two three four"}]
    assert text == expected_answer(reference, messages, 32)
    check_stats(stats, prompt_length(reference, messages), 32)
    assert stats["finish_reason"] == "length" and stats["n_generated"] == 32


def test_plain_decoding_gives_the_same_text_without_drafts(client: Client, reference: Any) -> None:
    args = chat_args("the quick brown fox", max_tokens=40)
    speculative_text, speculative_stats = client.predict(**args, api_name="/generate")
    plain_text, plain_stats = client.predict(**{**args, "speculative": False}, api_name="/generate")
    assert plain_text == speculative_text
    assert plain_stats["drafted"] == 0 and plain_stats["speculative"] is False
    assert speculative_stats["drafted"] > 0


BAD_REQUESTS = [
    ({"message": ""}, "message is empty"),
    ({"message": "   \n"}, "message is empty"),
    ({"message": "x" * (MAX_INPUT_CHARS + 1)}, f"accepts up to {MAX_INPUT_CHARS}"),
    ({"max_tokens": 0}, "max_tokens must be in 1..600"),
    ({"max_tokens": MAX_NEW_TOKENS + 1}, "max_tokens must be in 1..600"),
    ({"temperature": -0.5}, "temperature must be a number in"),
    ({"temperature": 9}, "temperature must be a number in"),
    ({"top_p": 0}, "top_p must be a number in"),
    ({"draft_max": 99}, "draft_max must be in 0..7"),
    ({"draft_max": -1}, "draft_max must be in 0..7"),
    ({"preset": "../../etc/passwd.gguf"}, "unknown preset"),
    ({"history": [{"role": "robot", "content": "hi"}]}, "history[0] must be a dict"),
    ({"history": "not a list"}, "history must be a list"),
]


@pytest.mark.parametrize(("changes", "expected"), BAD_REQUESTS, ids=[e for _, e in BAD_REQUESTS])
@pytest.mark.parametrize("endpoint", ["/chat", "/generate"])
def test_bad_input_is_a_clear_error_and_the_server_keeps_serving(
    client: Client, changes: dict[str, Any], expected: str, endpoint: str
) -> None:
    with pytest.raises(AppError, match=re.escape(expected)):
        client.predict(**{**chat_args("hello"), **changes}, api_name=endpoint)
    text, stats = client.predict(**chat_args("hello", max_tokens=4), api_name="/generate")
    assert stats["n_generated"] == 4 and text


def test_a_message_too_long_for_the_context_is_refused(client: Client) -> None:
    long_message = "0123456789 " * 200  # within the character limit; one token per digit overflows the context
    with pytest.raises(AppError, match="context cannot hold it"):
        client.predict(**chat_args(long_message), api_name="/generate")


def test_a_long_conversation_drops_its_oldest_turns_with_a_notice(client: Client, reference: Any) -> None:
    history: list[Message] = []
    for turn in range(8):
        history.append({"role": "user", "content": f"turn {turn}: " + "the quick brown fox jumps. " * 12})
        history.append({"role": "assistant", "content": "hello world, hello model, hello user. " * 6})
    max_tokens = 64
    text, stats = client.predict(**chat_args("what is the answer?", history=history, max_tokens=max_tokens),
                                 api_name="/generate")  # fmt: skip
    match = re.search(r"no longer sees the (\d+) oldest turns?", stats["notice"] or "")
    assert match, f"expected a notice about dropped turns, got {stats['notice']!r}"
    dropped = int(match.group(1))
    latest = [{"role": "user", "content": "what is the answer?"}]
    kept = history[2 * dropped :] + latest
    one_more = history[2 * (dropped - 1) :] + latest
    assert prompt_length(reference, kept) + max_tokens <= N_CTX < prompt_length(reference, one_more) + max_tokens
    assert text == expected_answer(reference, kept, max_tokens)
    assert stats["n_prompt"] == prompt_length(reference, kept)


def test_a_cancelled_chat_leaves_the_next_turn_correct(client: Client, reference: Any) -> None:
    job = client.submit(**chat_args("hello there", max_tokens=MAX_NEW_TOKENS), api_name="/chat")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 2 and not job.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    job.cancel()
    time.sleep(0.5)
    assert job.status().code == Status.CANCELLED
    assert job.outputs()[-1][1]["n_generated"] < MAX_NEW_TOKENS, "the chat should have stopped early"
    text, _ = client.predict(**chat_args("one two three", max_tokens=24), api_name="/generate")
    assert text == expected_answer(reference, [{"role": "user", "content": "one two three"}], 24)


def test_six_concurrent_chats_all_complete_uncorrupted(server: RunningApp, reference: Any) -> None:
    prompts = [f"{word} world, how are you?" for word in ("hello", "big", "small", "the", "one", "what")]
    start = threading.Barrier(len(prompts))

    def run(prompt: str) -> tuple[str, dict[str, Any]]:
        own_client = Client(server.url, verbose=False)
        start.wait()
        return stream_chat(own_client, **chat_args(prompt, max_tokens=40))[-1]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(run, prompts))
    for prompt, (text, stats) in zip(prompts, answers, strict=True):
        assert text == expected_answer(reference, [{"role": "user", "content": prompt}], 40), prompt
        assert stats["finish_reason"] == "length" and stats["n_generated"] == 40
    assert "Traceback" not in server.log()


def test_thinking_switch_reaches_the_template(client: Client, reference: Any) -> None:
    messages = [{"role": "user", "content": "what is the answer?"}]
    text, stats = client.predict(**chat_args("what is the answer?", thinking=True, max_tokens=24), api_name="/generate")
    prompt = reference.render_chat(messages, enable_thinking=True)
    answer = reference.chat(messages, enable_thinking=True, max_tokens=24, temperature=0.0).text
    assert text == thinking_prefix(prompt) + answer
    assert stats["n_prompt"] == len(reference.tokenize(prompt))
    assert stats["n_prompt"] != prompt_length(reference, messages), "thinking on and off render different prompts"


# -- the app's logic, without a server ------------------------------------------------------------------------------

LIMITS = Limits(max_new_tokens=4096, max_input_chars=32000, draft_max=7)


def make_request(**fields: Any) -> ChatRequest:
    values: dict[str, Any] = {"preset": "p", "presets": ["p"], "limits": LIMITS, "message": "hi", "max_tokens": 64}
    values.update(fields)
    return build_request(**values)


@pytest.mark.parametrize(
    ("env", "overrides", "has_cuda", "tiny"),
    [
        ({}, [], False, True),
        ({}, [], True, False),
        ({"SPACES_ZERO_GPU": "true"}, [], False, False),
        ({}, ["DFLASH_TARGET_REPO"], False, False),
        ({"DFLASH_DEMO": "tiny"}, ["DFLASH_TARGET_REPO"], True, True),
        ({"DFLASH_DEMO": "off"}, [], False, False),
    ],
)
def test_run_mode_never_downloads_by_surprise(
    env: dict[str, str], overrides: list[str], has_cuda: bool, tiny: bool
) -> None:
    mode = choose_run_mode(env, overrides, has_cuda)
    assert mode.tiny is tiny and mode.reason
    assert ("random-weight" in mode_banner(mode)) is tiny


def test_unknown_demo_value_is_refused() -> None:
    with pytest.raises(ValueError, match="DFLASH_DEMO"):
        choose_run_mode({"DFLASH_DEMO": "maybe"}, [], False)


def test_gpu_duration_follows_the_request_within_bounds() -> None:
    short, long = make_request(max_tokens=64), make_request(max_tokens=2048)
    wordy = make_request(max_tokens=64, message="word " * 5000)
    assert 10 <= estimate_gpu_seconds(short, LIMITS) < estimate_gpu_seconds(long, LIMITS)
    assert estimate_gpu_seconds(short, LIMITS) < estimate_gpu_seconds(wordy, LIMITS)
    assert estimate_gpu_seconds(short, LIMITS, runs=2) > estimate_gpu_seconds(short, LIMITS)
    assert estimate_gpu_seconds(make_request(max_tokens=4096), LIMITS, runs=2) == LIMITS.gpu_seconds_max


def test_oldest_whole_turns_go_first_and_the_system_prompt_stays() -> None:
    history = []
    for turn in range(3):
        history += [{"role": "user", "content": f"u{turn}" + "x" * 98}, {"role": "assistant", "content": "y" * 100}]
    request = make_request(message="m" * 50, history=history, system_prompt="s" * 20, max_tokens=100)

    def count_chars(messages: list[Message]) -> int:  # one token per character
        return sum(len(m["content"]) for m in messages)

    fitted = fit_conversation(request, count_chars, n_ctx=500)
    assert fitted.dropped_turns == 2 and "2 oldest turns" in (fitted.notice or "")
    assert [m["content"][:2] for m in fitted.messages] == ["ss", "u2", "yy", "mm"]
    assert fitted.prompt_tokens == 270
    assert fit_conversation(request, count_chars, n_ctx=2000).dropped_turns == 0
    assert fit_conversation(request, count_chars, n_ctx=2000).notice is None
    with pytest.raises(PromptTooLongError, match="cannot hold it"):
        fit_conversation(make_request(message="m" * 1000), count_chars, n_ctx=500)


def test_a_history_that_opens_with_a_reply_is_kept_whole_when_it_fits() -> None:
    history = [{"role": "assistant", "content": "welcome"}, {"role": "user", "content": "hi"}]
    request = make_request(history=history)
    fitted = fit_conversation(request, lambda messages: len(messages), n_ctx=1000)
    assert fitted.dropped_turns == 0 and len(fitted.messages) == 3


def test_history_keeps_what_the_model_should_see() -> None:
    history = clean_history(
        [
            {"role": "user", "content": "q1", "metadata": {"title": "ignored"}},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer one"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nstopped while thinking"},
        ]
    )
    assert history == (
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "q2"},
    )
    assert strip_thinking("plain answer") == "plain answer"
    assert thinking_prefix("<|im_start|>assistant\n<think>\n") == "<think>\n"
    assert thinking_prefix("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ""


def test_everything_crossing_the_zero_gpu_process_line_pickles() -> None:
    request = make_request(history=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    preset = preset_from_env({})
    files = ResolvedPair(Path("/models/t.gguf"), Path("/models/d.gguf"))
    chunk = ReplyChunk(text="hi", stats=Stats().to_dict(), finish_reason="stop", notice="n", engine_info={"a": 1})
    for value in (request, preset, files, chunk):
        assert pickle.loads(pickle.dumps(value)) == value
    error = pickle.loads(pickle.dumps(gr.Error("the message is empty", title="RequestError")))
    assert error.message == "the message is empty"


def test_statistics_panel_plot_rows_and_ab_summary() -> None:
    stats = Stats(n_prompt=10, n_reused=4, n_prefilled=6, n_generated=9, decode_ms=100.0, draft_max=3)
    stats.record_verify(3, 2, 3)
    stats.record_verify(3, 0, 1)
    panel = stats_markdown(stats.to_dict(), "length", "max_tokens=9 reached")
    assert "90.0 tok/s" in panel and "33%" in panel and "2 / 6" not in panel and "6 / 2" in panel
    assert "10: 4 reused, 6 prefilled" in panel and "length (max_tokens=9 reached)" in panel
    assert acceptance_rows(stats.to_dict()) == [
        {"position": "1", "acceptance": 0.5},
        {"position": "2", "acceptance": 0.5},
        {"position": "3", "acceptance": 0.0},
    ]
    plain = Stats(n_generated=9, decode_ms=300.0, speculative=False).to_dict()
    summary = ab_markdown(stats.to_dict(), plain, identical=True)
    assert "Speed-up: 3.00×" in summary and "Outputs identical: yes" in summary
    assert "running" in ab_markdown(stats.to_dict(), None, None)


def test_info_box_names_the_pair_and_the_build() -> None:
    preset = preset_from_env({})
    text = info_markdown(preset, LIMITS, {"llama.cpp build": "llama-cpp-python 0.3.36"}, {"target_arch": "qwen35"})
    assert "utautako/Qwen3.8-27B-NVFP4-MTP-Q8attn-GGUF" in text and "incoai/Qwen3.8-27B-DFlash2-GGUF" in text
    assert "target NVFP4, draft Q4_K_M" in text and "16384 tokens" in text and "0.3.36" in text


IMPORT_CHECK = """
import inspect, sys
sys.modules["spaces"] = None  # as if the package were not installed: the identity decorator stands in
import app
maps = open("/proc/self/maps").read()
assert "libllama" not in maps and "libcuda" not in maps and "llama_cpp" not in sys.modules, "native code loaded"
assert inspect.isgeneratorfunction(app.reply_on_gpu) and inspect.isgeneratorfunction(app.compare_on_gpu)
assert app.DOWNLOAD.status().state == "idle", "importing must not start a download"
print(app.MODE.tiny, app.PRESET.name)
"""


@pytest.mark.parametrize("demo", ["tiny", "off", None])
def test_importing_the_app_loads_no_native_code_and_needs_no_spaces(demo: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "SPACES_"))}
    if demo is not None:
        env["DFLASH_DEMO"] = demo
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Unset, the app serves the real pair only where a GPU is: a bare `python app.py` on a laptop is the demo.
    tiny = demo == "tiny" or (demo is None and not cuda_device_present())
    expected = "True tiny-random" if tiny else "False qwen3.8-27b-dflash2"
    assert result.stdout.strip().splitlines()[-1] == expected
