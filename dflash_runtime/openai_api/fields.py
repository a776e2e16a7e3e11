"""A request body checked into an `ApiRequest`: every field the API takes, each with one clear 400 naming it.

Fields that would change the answer in a way the engine cannot (penalties, logprobs, tools, grammars, n > 1) are
refused when they are turned on, never ignored; informational fields (`user`, `metadata`, ...) are accepted and
unused; any other field is refused by name, so that a misspelt option is not silently dropped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ApiError, bad_field

CHAT, COMPLETION = "chat", "completion"
MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant")
# Sent by clients and libraries for their own bookkeeping; nothing of the answer depends on them.
INFORMATIONAL = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "cache_prompt",
                           "prompt_cache_key", "safety_identifier"})  # fmt: skip
# Options the engine has no equivalent for, with the values that leave them off (as llama_compat refuses them).
OFF: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repeat_penalty": (1, 1.0), "logprobs": (False, 0),
    "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"), "response_format": ({"type": "text"},), "grammar": ("",), "json_schema": ({},),
    "best_of": (1,), "echo": (False,), "suffix": ("",), "typical_p": (1, 1.0), "tfs_z": (1, 1.0),
    "mirostat": (0,), "mirostat_mode": (0,), "modalities": (["text"],), "audio": ({},), "prediction": ({},),
    "reasoning_effort": (),
}  # fmt: skip
WHY_OFF = ("the engine samples with temperature, top_p, top_k, min_p and seed only, and returns text (no penalties, "
           "logprobs, tools, grammars or response formats)")  # fmt: skip
COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                    "stream_options", "n"})  # fmt: skip
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
COMPLETION_FIELDS = COMMON | {"prompt"}


@dataclass(frozen=True)
class ApiRequest:
    """One checked request. Sampling fields left out are None: the server's defaults apply."""

    kind: str  # CHAT or COMPLETION
    model: str | None
    messages: tuple[dict[str, str], ...] = ()  # CHAT: roles system / user / assistant, text content
    prompt: str = ""  # COMPLETION
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    enable_thinking: bool | None = None  # chat_template_kwargs.enable_thinking; None: the template's default

    def sampling(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """temperature, top_p, top_k and min_p: the request's, else `defaults`'."""
        return {name: defaults[name] if getattr(self, name) is None else getattr(self, name)
                for name in ("temperature", "top_p", "top_k", "min_p")}  # fmt: skip


def parse_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (NaN and Infinity refused: they are not JSON)."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON value")

    try:
        value = json.loads(body, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the JSON body is nested too deeply", code="invalid_json") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return value


def _integer(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        span = f"≥ {low}" if high is None else f"in {low}..{high}"
        raise bad_field(name, f"{name} must be an integer {span}, got {json.dumps(value)}")
    return value


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) \
            or not low <= value <= high:  # fmt: skip
        raise bad_field(name, f"{name} must be a number in [{low}, {high}], got {json.dumps(value)}")
    return float(value)


def _boolean(body: Mapping[str, Any], name: str, value: Any = None) -> bool | None:
    value = body.get(name) if value is None else value
    if value is not None and not isinstance(value, bool):
        raise bad_field(name, f"{name} must be true or false, got {json.dumps(value)}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad_field(name, f"{name} must be a string, got {json.dumps(value)[:40]}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_field(name, f"{name} holds an unpaired surrogate at character {error.start}: send valid Unicode") \
            from None  # fmt: skip
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or len(strings) > MAX_STOP:
        raise bad_field("stop", f"stop must be a string or a list of at most {MAX_STOP} strings")
    return tuple(s for s in (_text("stop", s) for s in strings) if s)


def _refuse_unknown(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for name, value in body.items():
        if name in known or name in INFORMATIONAL:
            continue
        if name in OFF:
            if value is None or value in OFF[name]:
                continue
            raise bad_field(name, f"{name} {json.dumps(value)[:60]} is not supported: {WHY_OFF}")
        raise bad_field(name, f"unknown field {name!r}: this server takes {', '.join(sorted(known))}")


def _content(index: int, message: Mapping[str, Any]) -> str:
    """A message's text: a string, or a list of text parts (joined); an assistant's may be null."""
    name = f"messages[{index}].content"
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise bad_field(f"{name}[{j}]", f"{name}[{j}] is a {kind!r} part: this server takes text only")
            parts.append(_text(f"{name}[{j}].text", part.get("text")))
        return "".join(parts)
    return _text(name, content)


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "messages must be a non-empty list of {'role', 'content'} objects")
    checked = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise bad_field(f"messages[{index}].role", f"messages[{index}].role must be one of "
                            f"{', '.join(map(repr, ROLES))}, got {json.dumps(role)[:40]}")  # fmt: skip
        for name in message:
            if name not in ("role", "content", "name"):
                raise bad_field(f"messages[{index}].{name}", f"messages[{index}].{name} is not supported "
                                "(text messages only: role, content, name)")  # fmt: skip
        checked.append({"role": "system" if role == "developer" else role, "content": _content(index, message)})
    return tuple(checked)


def _thinking(body: Mapping[str, Any]) -> bool | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping):
        raise bad_field("chat_template_kwargs", "chat_template_kwargs must be an object")
    for name in kwargs:
        if name != "enable_thinking":
            raise bad_field(f"chat_template_kwargs.{name}", f"chat_template_kwargs.{name} is not supported: the "
                            "template takes enable_thinking only")  # fmt: skip
    return _boolean(kwargs, "chat_template_kwargs.enable_thinking", kwargs.get("enable_thinking"))


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_field("prompt", "prompt must be a string (or a list of one string): one completion a request")
        prompt = prompt[0]
    return _text("prompt", prompt)


def _seed(body: Mapping[str, Any]) -> int | None:
    """The sampler's seed: 0..2^32-1; -1 (llama-server's "random") and null: a random one."""
    seed = _integer(body, "seed", -1, 2**32 - 1)
    return None if seed == -1 else seed


def _max_tokens(body: Mapping[str, Any], kind: str) -> int | None:
    max_tokens = _integer(body, "max_tokens", 1)
    newer = _integer(body, "max_completion_tokens", 1) if kind == CHAT else None
    if max_tokens is not None and newer is not None and max_tokens != newer:
        raise bad_field("max_completion_tokens", "max_tokens and max_completion_tokens differ: send one")
    return newer if newer is not None else max_tokens


def check_request(body: Mapping[str, Any], kind: str) -> ApiRequest:
    """The checked request of a /v1/chat/completions (CHAT) or /v1/completions (COMPLETION) body."""
    _refuse_unknown(body, CHAT_FIELDS if kind == CHAT else COMPLETION_FIELDS)
    n = _integer(body, "n", 1)
    if n is not None and n != 1:
        raise bad_field("n", f"n must be 1: this server answers one choice a request, got {n}")
    model = body.get("model")
    if model is not None:
        model = _text("model", model)
    stream = bool(_boolean(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_field("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
            raise bad_field("stream_options", "stream_options must be an object with include_usage only")
        include_usage = bool(_boolean(options, "stream_options.include_usage", options.get("include_usage")))
    return ApiRequest(
        kind=kind,
        model=model,
        messages=_messages(body) if kind == CHAT else (),
        prompt=_prompt(body) if kind == COMPLETION else "",
        max_tokens=_max_tokens(body, kind),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        top_k=_integer(body, "top_k", 0),
        min_p=_number(body, "min_p", 0.0, 1.0),
        seed=_seed(body),
        stop=_stop(body),
        stream=stream,
        include_usage=include_usage,
        enable_thinking=_thinking(body) if kind == CHAT else None,
    )
