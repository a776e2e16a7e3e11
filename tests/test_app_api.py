"""The Space end to end through gradio_client: app.py runs in a subprocess in offline mode (tiny generated models)
and every answer is checked against a separate engine opened on the same files, at temperature 0."""

from __future__ import annotations

import itertools
import json
import re
import statistics
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from gradio_client import Client
from gradio_client.exceptions import AppError
from gradio_client.utils import Status
from space_client import (
    API_PARAMETERS,
    chat_args,
    demo_pair,
    expected_answer,
    prompt_length,
    reference_engine,
    stream_chat,
    take_outputs,
    wait_done,
)

from dflash_runtime.space.provenance import draft_text
from dflash_runtime.space.requests import DEFAULT_SYSTEM_PROMPT, thinking_prefix

N_CTX = 1024
MAX_INPUT_CHARS = 6000
MAX_NEW_TOKENS = 600
Message = dict[str, str]
# The deprecated draft_max (0 meant "auto") is still checked, and says it is deprecated.
OLD_DRAFT = "draft_max must be an integer in 0..7 (0 = adaptive; deprecated: use draft_length)"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningApp]:
    env = {
        "DFLASH_DEMO": "tiny",
        "DFLASH_N_CTX": str(N_CTX),
        "DFLASH_MAX_INPUT_CHARS": str(MAX_INPUT_CHARS),
        "DFLASH_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
        "DFLASH_DIAGNOSTICS": "1",  # /info shows the worker's last request: what a cancelled chat did
    }
    with running_app(env, REPO_ROOT / "test-artifacts" / "app_api_server.log") as app:
        yield app


@pytest.fixture(scope="module")
def client(server: RunningApp) -> Client:
    return Client(server.url, verbose=False)


@pytest.fixture(scope="module")
def info(client: Client) -> dict[str, Any]:
    return client.predict(api_name="/info")


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    with reference_engine(N_CTX) as engine:
        yield engine


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
    assert stats["gpu_seconds_requested"] is None, "off ZeroGPU nothing is requested"
    assert stats["gpu_seconds_used"] > 0


def test_info_describes_the_offline_pair_without_server_paths(info: dict[str, Any]) -> None:
    assert info["offline_demo"] is True and info["default_preset"] == "tiny-random"
    preset = info["presets"]["tiny-random"]
    assert preset["random_weights"] is True and preset["n_ctx"] == N_CTX
    pair = demo_pair()
    assert preset["target"] == f"local file {pair.target.name}" and preset["draft"] == f"local file {pair.draft.name}"
    text = json.dumps(info)
    for private in (str(pair.target.parent), str(REPO_ROOT), "/home/", "/root/", "site-packages"):
        assert private not in text, f"/info shows a server path ({private})"
    assert info["limits"]["max_new_tokens"] == MAX_NEW_TOKENS
    assert info["limits"]["max_input_chars"] == MAX_INPUT_CHARS
    assert info["build"]["status"].startswith("llama-cpp-python")
    assert info["build"]["dflash_missing_symbols"] == []
    assert info["problems"] == [] and info["fix"] is None
    assert info["defaults"] == {"max_tokens": 512, "temperature": 0.0, "top_p": 1.0, "top_k": 40, "min_p": 0.0,
                                "method": "auto", "draft_length": "auto"}, "adaptive, the pair's default method"
    assert info["sampling_defaults_from"] == "server defaults", "the demo keeps temperature 0"
    assert info["methods"] == ["dflash", "ngram-mod", "ngram-map-k", "ngram-simple", "ngram-map-k4v",
                               "ngram-cache", "ngram-mod,dflash"]
    assert info["default_method"] == "dflash"
    assert info["draft_problem"] is None
    assert "random-weight test models" in preset["label"]


def json_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a parameter's schema allows (a union lists them under oneOf or anyOf)."""
    options = schema.get("oneOf") or schema.get("anyOf")
    if options:
        return set().union(*(json_types(option) for option in options))
    return {schema["type"]}


def test_the_api_has_typed_documented_parameters_in_the_documented_order(client: Client) -> None:
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    # null: the server's default (for sampling: the model's own, when it has them); draft_max: only if sent
    expected_types = {"message": {"string"}, "system_prompt": {"string"}, "preset": {"string"},
                      "max_tokens": {"integer"}, "temperature": {"number", "null"}, "top_p": {"number", "null"},
                      "draft_max": {"integer", "null"}, "speculative": {"boolean"}, "thinking": {"boolean"},
                      "method": {"string"}, "draft_length": {"integer", "string"}, "top_k": {"integer", "null"},
                      "min_p": {"number", "null"}}  # fmt: skip
    for name in ("/chat", "/generate"):
        parameters = endpoints[name]["parameters"]
        assert tuple(p["parameter_name"] for p in parameters) == API_PARAMETERS
        for parameter in parameters:
            if parameter["parameter_name"] in expected_types:
                assert json_types(parameter["type"]) == expected_types[parameter["parameter_name"]], parameter
        assert [p["parameter_has_default"] for p in parameters] == [False] + [True] * (len(API_PARAMETERS) - 1)
        assert [r["type"]["type"] for r in endpoints[name]["returns"]] == ["string", "object"]
        assert "Parameters" not in endpoints[name]["description"] and endpoints[name]["description"]
    assert endpoints["/info"]["parameters"] == []
    assert [p["parameter_name"] for p in endpoints["/wait"]["parameters"]] == ["until", "timeout_s"]


def test_wait_answers_when_the_engine_is_idle_and_refuses_nonsense(client: Client) -> None:
    idle = client.predict(until="idle", timeout_s=5, api_name="/wait")
    assert idle["busy"] is False and idle["waited_out"] is False
    nobody = client.predict(until="busy", timeout_s=0.2, api_name="/wait")
    assert nobody["waited_out"] is True  # nothing runs: the wait ends at its timeout, with the info
    for until, timeout_s, message in (("soon", 1, "until must be 'idle' or 'busy'"),
                                      ("idle", 600, "timeout_s must be a number in [0, 120]")):
        with pytest.raises(AppError, match=re.escape(message)):
            client.predict(until=until, timeout_s=timeout_s, api_name="/wait")


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


def test_the_api_default_system_prompt_is_the_pages(client: Client, reference: Any) -> None:
    """A call that leaves system_prompt out gets the page's system prompt (and its public prefix); "" is none."""
    text, stats = client.predict(message="one two three", max_tokens=16, temperature=0.0, api_name="/generate")
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": "one two three"}]
    assert text == expected_answer(reference, messages, 16)
    assert stats["n_prompt"] == prompt_length(reference, messages)
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    for name in ("/chat", "/generate"):
        shown = next(p for p in endpoints[name]["parameters"] if p["parameter_name"] == "system_prompt")
        assert shown["parameter_default"] == DEFAULT_SYSTEM_PROMPT, shown
    _, none = client.predict(message="one two three", system_prompt="", max_tokens=4, api_name="/generate")
    assert none["n_prompt"] == prompt_length(reference, messages[1:])


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
    ({"system_prompt": "x" * (MAX_INPUT_CHARS - 2)}, f"accepts up to {MAX_INPUT_CHARS}"),
    ({"max_tokens": 0}, "max_tokens must be an integer in 1..600, got 0"),
    ({"max_tokens": MAX_NEW_TOKENS + 1}, "max_tokens must be an integer in 1..600"),
    ({"temperature": -0.5}, "temperature must be a number in"),
    ({"temperature": 9}, "temperature must be a number in"),
    ({"top_p": 0}, "top_p must be a number in"),
    ({"draft_max": 99}, f"{OLD_DRAFT}, got 99"),
    ({"draft_max": -1}, "draft_max must be an integer in 0..7"),
    ({"draft_length": 8}, "draft_length must be 'auto' or an integer in 0..7 (0 = no draft), got 8"),
    ({"method": "mtp"}, "method 'mtp' is not available on this pair; it runs 'dflash'"),
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


def test_a_cancelled_chat_stops_the_engine_and_the_next_turn_is_correct(client: Client, reference: Any) -> None:
    job = client.submit(**chat_args("hello there", max_tokens=MAX_NEW_TOKENS), api_name="/chat")
    take_outputs(job, 2)
    job.cancel()
    wait_done(job, 30)
    assert job.status().code == Status.CANCELLED
    text, _ = client.predict(**chat_args("one two three", max_tokens=24), api_name="/generate")
    assert text == expected_answer(reference, [{"role": "user", "content": "one two three"}], 24)
    # The engine host's record of the request before the last: the cancelled chat stopped early.
    stopped = client.predict(api_name="/info")["worker"]["previous_request"]
    assert stopped["finish_reason"] == "closed by the caller" and stopped["n_generated"] < MAX_NEW_TOKENS


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
    answer = expected_answer(reference, messages, 24, thinking=True)
    assert text == thinking_prefix(prompt) + answer
    assert stats["n_prompt"] == len(reference.tokenize(prompt))
    assert stats["n_prompt"] != prompt_length(reference, messages), "thinking on and off render different prompts"




# -- provenance: who wrote which text -------------------------------------------------------------------------------


def engine_runs(engine: Any, result: Any) -> list[list[Any]]:
    """The engine's own token_sources as runs over its text: each token's text, marked as its source."""
    pieces = [engine.token_text(token) for token in result.tokens]
    assert "".join(pieces) == result.text, "the tiny vocabulary's pieces spell the text"
    runs: list[list[Any]] = []
    for piece, source in zip(pieces, result.token_sources, strict=True):
        if runs and runs[-1][1] == source:
            runs[-1][0] += len(piece)
        elif piece:
            runs.append([len(piece), source])
    return runs


def check_runs(text: str, runs: list[list[Any]]) -> None:
    """Runs cover the text exactly, each non-empty, neighbours of different sources (joined), JSON types."""
    assert sum(n for n, _ in runs) == len(text)
    assert all(isinstance(n, int) and n > 0 and source in ("draft", "target") for n, source in runs)
    assert all(a[1] != b[1] for a, b in itertools.pairwise(runs))


PROVENANCE_PROMPTS = ["Explain speculative decoding in three sentences.", "hello world", "one two three four"]


@pytest.mark.parametrize("prompt", PROVENANCE_PROMPTS)
def test_generate_marks_the_text_the_draft_wrote_as_the_engine_does(client: Client, reference: Any, prompt: str
                                                                  ) -> None:
    """A fixed draft length at temperature 0: the server's runs mark exactly the characters of the tokens that the
    engine's own token_sources call "draft", on an engine of our own opened on the same files."""
    text, stats = client.predict(**chat_args(prompt, max_tokens=96, draft_length=7), api_name="/generate")
    check_runs(text, stats["source_runs"])
    result = reference.chat([{"role": "user", "content": prompt}], enable_thinking=False, max_tokens=96,
                            temperature=0.0, draft_length=7)
    assert text == result.text
    assert stats["source_runs"] == engine_runs(reference, result)
    drafted = draft_text(text, [tuple(run) for run in stats["source_runs"]])
    assert drafted == "".join(reference.token_text(t) for t, s in zip(result.tokens, result.token_sources,
                                                                        strict=True) if s == "draft")  # fmt: skip
    assert drafted and stats["accepted"] == result.token_sources.count("draft") > 0


def test_plain_decoding_is_all_target_and_thinking_keeps_the_runs_whole(client: Client) -> None:
    text, stats = client.predict(**chat_args("hello world", max_tokens=40, speculative=False), api_name="/generate")
    assert stats["source_runs"] == [[len(text), "target"]] and stats["drafted"] == 0
    text, stats = client.predict(**chat_args("hello world", max_tokens=40, thinking=True), api_name="/generate")
    check_runs(text, stats["source_runs"])


def test_chat_streams_runs_that_cover_each_chunk_and_only_grow(client: Client) -> None:
    chunks = stream_chat(client, **chat_args("Explain speculative decoding in three sentences.", max_tokens=120))
    assert len(chunks) >= 3
    for (_, before), (text, stats) in itertools.pairwise(chunks):
        check_runs(text, stats["source_runs"])
        earlier = before["source_runs"]
        assert stats["source_runs"][: len(earlier) - 1] == earlier[:-1], "runs already sent stay as they were"
    text, stats = chunks[-1]
    assert draft_text(text, [tuple(run) for run in stats["source_runs"]]), "the adaptive draft wrote some text"
    assert sum(n for n, s in stats["source_runs"] if s == "draft") >= stats["accepted"], "a draft token is >= 1 char"


# -- the offline demo: a pair on which drafting pays ----------------------------------------------------------------

DEMO_PROMPT = "Explain speculative decoding in three sentences."  # the page's first example
DEMO_SYSTEM = "You are a helpful assistant."  # the page's default


def test_the_offline_demo_drafts_adaptively_at_or_above_plain_speed(client: Client) -> None:
    """Adaptive drafting (the default) against plain decoding on the demo's pair, alternating so that the load of a
    shared CPU falls on both alike; medians of the engine's decode speed, with a tolerance for what noise remains."""
    args = chat_args(DEMO_PROMPT, system_prompt=DEMO_SYSTEM, max_tokens=256, draft_length="auto")
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    texts = set()
    for _ in range(4):
        for speculative in (True, False):
            text, stats = client.predict(**{**args, "speculative": speculative}, api_name="/generate")
            runs[speculative].append(stats)
            texts.add(text)
    assert len(texts) == 1, "at temperature 0 both give the target's greedy text"
    adaptive = statistics.median(s["decode_tok_s"] for s in runs[True])
    plain = statistics.median(s["decode_tok_s"] for s in runs[False])
    acceptance = statistics.median(s["acceptance_rate"] for s in runs[True])
    mean_length = statistics.median(s["mean_accepted_length"] for s in runs[True])
    record = {"adaptive_tok_s": adaptive, "plain_tok_s": plain, "speed_up": adaptive / plain,
              "acceptance": acceptance, "mean_accepted_length": mean_length}  # fmt: skip
    (REPO_ROOT / "test-artifacts" / "demo_speed.json").write_text(json.dumps(record, indent=2))
    assert acceptance >= 0.3 and mean_length >= 2.0, record
    assert adaptive >= 0.95 * plain, record
