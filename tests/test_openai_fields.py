"""The /v1 request checks and response pieces on their own: each bad field a 400 naming it, the thinking split the
same streamed as whole, the shapes' counts the engine's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_layering import PACKAGE, imported

from dflash_runtime.openai_api import shapes
from dflash_runtime.openai_api.errors import ApiError
from dflash_runtime.openai_api.fields import CHAT, COMPLETION, check_request, parse_body
from dflash_runtime.openai_api.thinking import ThinkingSplitter, split

CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(body: dict, kind: str = CHAT) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check_request(body, kind)
    return caught.value


@pytest.mark.parametrize(("change", "param"), [
    ({"n": 2}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": True}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"seed": 2**40}, "seed"),
    ({"stop": [1]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": True}, "logprobs"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"temprature": 0.5}, "temprature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"reasoning": 1}}, "chat_template_kwargs.reasoning"),
])  # fmt: skip
def test_each_bad_chat_field_is_a_400_naming_it(change: dict, param: str) -> None:
    error = refusal({**CHAT_BODY, **change})
    assert (error.status, error.body()["error"]["param"]) == (400, param)
    assert error.body()["error"]["type"] == "invalid_request_error" and error.message


def test_fields_turned_off_and_informational_ones_are_taken() -> None:
    body = {**CHAT_BODY, "n": 1, "logprobs": False, "frequency_penalty": 0, "presence_penalty": 0.0, "tools": [],
            "user": "someone", "metadata": {"a": "b"}, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 7, "stop": "\n", "seed": -1, "chat_template_kwargs": {"enable_thinking": True},
            "messages": [{"role": "developer", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": None}, {"role": "user", "content": "c", "name": "x"}]}
    request = check_request(body, CHAT)
    assert request.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                {"role": "assistant", "content": ""}, {"role": "user", "content": "c"})
    assert (request.max_tokens, request.stop, request.seed, request.enable_thinking) == (7, ("\n",), None, True)
    assert request.stream and request.include_usage


def test_completion_fields() -> None:
    request = check_request({"model": "m", "prompt": ["once upon"], "max_tokens": 3}, COMPLETION)
    assert (request.prompt, request.max_tokens, request.messages) == ("once upon", 3, ())
    assert refusal({"prompt": ["a", "b"]}, COMPLETION).param == "prompt"
    assert refusal({"prompt": "a", "messages": []}, COMPLETION).param == "messages"  # a chat field here
    assert refusal({"prompt": "a", "echo": True}, COMPLETION).param == "echo"


@pytest.mark.parametrize("body", [b"{", b"[1]", b'{"temperature": NaN}', b"\xff"])
def test_a_body_that_is_not_a_json_object_is_a_400(body: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(body)
    assert caught.value.status == 400


@pytest.mark.parametrize(("text", "opened", "expected"), [
    ("<think>\nweighing it</think>\n\nthe answer", False, ("weighing it", "the answer")),
    ("weighing it</think>the answer", True, ("weighing it", "the answer")),
    ("  <think>a</think>", False, ("a", "")),
    ("no thinking here", False, ("", "no thinking here")),
    ("<thin", False, ("", "<thin")),
    ("<think>never closed", False, ("never closed", "")),
    ("", False, ("", "")),
])  # fmt: skip
def test_thinking_splits_the_same_streamed_at_any_cuts(text: str, opened: bool, expected: tuple[str, str]) -> None:
    assert split(text, opened) == expected
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 3)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        splitter = ThinkingSplitter(opened)
        parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == expected, pieces


def test_usage_and_timings_are_the_engines_counts() -> None:
    stats = {"n_prompt": 12, "n_reused": 4, "n_prefilled": 8, "n_generated": 30, "prefill_ms": 16.0,
             "decode_ms": 300.0, "drafted": 40, "accepted": 25, "method": "dflash", "draft_length": "auto"}
    assert shapes.usage(stats) == {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42,
                                   "prompt_tokens_details": {"cached_tokens": 4}}
    timings = shapes.timings(stats)
    assert (timings["prompt_n"], timings["cache_n"], timings["predicted_n"]) == (8, 4, 30)
    assert (timings["draft_n"], timings["draft_n_accepted"], timings["predicted_per_second"]) == (40, 25, 100.0)
    assert shapes.speculative_figures(stats)["method"] == "dflash"
    assert [shapes.finish_reason(r) for r in ("stop", "length", "cancelled", None)] == ["stop", "length", "stop", None]


@pytest.mark.parametrize("path", sorted((PACKAGE / "openai_api").glob("*.py")), ids=lambda p: p.name)
def test_the_api_imports_nothing_of_the_space_the_drop_in_or_the_test_models(path: Path) -> None:
    """The Space's web process builds these objects too: no llama_cpp through the drop-in, nothing of the Space."""
    assert not imported(path) & {"space", "testing", "llama_compat"}
