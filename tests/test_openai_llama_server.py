"""`python -m dflash_runtime serve` against `llama-server --jinja` on a generated pair, both with the same speculative
type (a DFlash 2 draft, draft length 3): the same messages at temperature 0 get the same text, finish reason, counts
and draft statistics, streamed and not, and the response objects are compared field by field.

It needs a llama-server built from the same vendored llama.cpp as the wheel (tools/compare_llama_server.py says how);
give its path in DFLASH_LLAMA_SERVER. Without it the test is reported as not run (a skip that says so), never
passed."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from app_fixtures import REPO_ROOT
from llama_server import BINARY, needs_llama_server
from openai_clients import RunningServer, running_serve, sse_events

from dflash_runtime.testing.tiny_models import TinyPair, tiny_pair

sys.path.insert(0, str(REPO_ROOT / "tools"))
from compare_llama_server import LlamaServer

N_CTX = 1024
DRAFT_LENGTH = 3
MAX_TOKENS = 48
CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "the quick brown fox"}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello there"},
     {"role": "user", "content": "once upon a time the"}],
]  # fmt: skip
# What llama-server's objects hold that ours do not, and why (anything else it holds, ours must, of the same type).
SERVER_ONLY = {
    "system_fingerprint": "its build's id",
}
pytestmark = needs_llama_server


def shape(value: Any, prefix: str = "") -> dict[str, str]:
    """Every field's path and JSON type (lists: their first element)."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
             type(None): "null"}  # fmt: skip
    out = {prefix: kinds[type(value)]} if prefix else {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(shape(item, f"{prefix}.{key}" if prefix else key))
    elif isinstance(value, list) and value:
        out.update(shape(value[0], f"{prefix}[0]"))
    return out


@pytest.fixture(scope="module")
def pair() -> TinyPair:
    return tiny_pair("dense", "dflash2", head="shaped")


@pytest.fixture(scope="module")
def llama_server(pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    argv = ["-m", str(pair.target), "-md", str(pair.draft), "--spec-type", "draft-dflash",
            "--spec-draft-n-max", str(DRAFT_LENGTH), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0",
            "-c", str(N_CTX), "-np", "1", "-t", "2", "-ngl", "0", "--spec-draft-ngl", "0", "--jinja", "-fa", "off",
            "--no-warmup", "--no-webui", "--metrics"]  # fmt: skip
    log = REPO_ROOT / "test-artifacts" / "openai_llama_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = LlamaServer(Path(BINARY), argv, log, timeout=120.0)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ours(pair: TinyPair) -> Iterator[RunningServer]:
    assert pair.draft is not None
    with running_serve(pair.target, pair.draft, REPO_ROOT / "test-artifacts" / "openai_llama_server_ours.log",
                       "--n-ctx", str(N_CTX), "--draft-length", str(DRAFT_LENGTH), "--threads", "2") as server:
        yield server


def ask(base: str, messages: list[dict[str, str]], stream: bool) -> Any:
    # The thinking switch said explicitly: left out, llama-server renders this template with it off (its prompt ends
    # with an empty thinking block), the engine with the template's own default (no block).
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "cache_prompt": False, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    if not stream:
        response = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        return list(sse_events(response))


def first_difference(a: str, b: str) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at character {at}: {a[at:at + 20]!r} vs {b[at:at + 20]!r}"


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_the_same_messages_get_the_same_answer_and_shape(llama_server: LlamaServer, ours: RunningServer,
                                                         index: int) -> None:  # fmt: skip
    messages = CONVERSATIONS[index]
    server_url = f"http://127.0.0.1:{llama_server.port}"
    theirs, mine = ask(server_url, messages, False), ask(ours.url, messages, False)
    print(json.dumps({"llama-server": theirs, "ours": mine}, indent=1)[:4000])
    their_text, my_text = theirs["choices"][0]["message"]["content"], mine["choices"][0]["message"]["content"]
    assert my_text == their_text, first_difference(my_text, their_text)
    assert mine["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert mine["usage"][name] == theirs["usage"][name], name
    for name in ("predicted_n", "draft_n", "draft_n_accepted"):
        assert mine["timings"][name] == theirs["timings"][name], name
    # the engine may reuse the previous request's first tokens (llama-server's cache_prompt is off here)
    prompt = [t["prompt_n"] + t.get("cache_n", 0) for t in (mine["timings"], theirs["timings"])]
    assert prompt[0] == prompt[1] == mine["usage"]["prompt_tokens"]

    their_shape, my_shape = shape(theirs), shape(mine)
    missing = {path: kind for path, kind in their_shape.items() if path not in my_shape and path not in SERVER_ONLY}
    differ = {path: (kind, my_shape[path]) for path, kind in their_shape.items()
              if path in my_shape and my_shape[path] != kind and "null" not in (kind, my_shape[path])}  # fmt: skip
    print("fields only ours has:", sorted(set(my_shape) - set(their_shape)))
    assert not missing, f"llama-server's fields that ours lacks: {missing}"
    assert not differ, f"fields of another type: {differ}"

    their_chunks, my_chunks = ask(server_url, messages, True), ask(ours.url, messages, True)
    assert their_chunks[-1] == my_chunks[-1] == "[DONE]"

    def joined(chunks: list[Any]) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"])

    assert joined(my_chunks) == joined(their_chunks) == their_text
    their_last = [c for c in their_chunks[:-1] if c["choices"] and c["choices"][0]["finish_reason"]][-1]
    my_last = [c for c in my_chunks[:-1] if c["choices"] and c["choices"][0]["finish_reason"]][-1]
    chunk_missing = [p for p in shape(their_last) if p not in shape(my_last) and p not in SERVER_ONLY]
    assert not chunk_missing, f"the last chunk's fields that ours lacks: {chunk_missing}"
