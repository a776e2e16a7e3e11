"""A Space request: limits (from the environment), field checks with one clear message each, and the history as the
model should see it. Everything here runs in the web process, before any GPU is asked for; nothing imports gradio or
touches CUDA.

Callers reach `build_request` with JSON values (gradio's API passes them through untouched), so every field is checked
for its type as well as its range: booleans are booleans, integers are integers, text is valid Unicode.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import methods as draft_methods
from ..errors import RequestError
from .setup.settings import env_number

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The page's system prompt: every visitor can send it, so the prompt tokens it renders to are public (see host.py).
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
Message = dict[str, str]
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.01, 1.0)
TOP_K_RANGE = (0, 1000)  # 0: no top-k cut
MIN_P_RANGE = (0.0, 0.99)
AUTO = "auto"
METHOD_CHOICES = (AUTO, *draft_methods.runnable(lambda needs: True))  # "auto": the pair's default method
DRAFT_MAX_NOTE = ("draft_max is deprecated: send draft_length ('auto' or an integer, 0 = no draft); "
                  "draft_max 0 meant 'auto'")  # fmt: skip


class MessageTooLongError(RequestError):
    """A message refused for its length: by its characters here, or (PromptTooLongError, where the prompt is fitted
    to the context) by its tokens. Both read alike (`too_long`) and are told alike."""


def too_long(detail: str) -> str:
    """The one wording of a message refused for its length."""
    return f"the message is too long: {detail}: shorten the message or the system prompt"


@dataclass(frozen=True)
class Limits:
    """Bounds of a request (all overridable by env). `max_history_messages` and `max_input_chars` bound the work one
    request can cause before it reaches the engine: older turns beyond them are dropped before any tokenization."""

    max_new_tokens: int = 4096
    max_input_chars: int = 32000
    max_history_messages: int = 256
    draft_capacity: int = 7  # the pair's: the longest draft_length a request may ask

    @classmethod
    def from_env(cls, draft_capacity: int, env: Mapping[str, str] | None = None) -> Limits:
        env = os.environ if env is None else env
        return cls(
            max_new_tokens=int(env_number(env, "DFLASH_MAX_NEW_TOKENS", cls.max_new_tokens)),
            max_input_chars=int(env_number(env, "DFLASH_MAX_INPUT_CHARS", cls.max_input_chars)),
            max_history_messages=int(env_number(env, "DFLASH_MAX_HISTORY_MESSAGES", cls.max_history_messages)),
            draft_capacity=draft_capacity,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "max_input_chars": self.max_input_chars,
            "max_history_messages": self.max_history_messages,
            "temperature": list(TEMPERATURE_RANGE),
            "top_p": list(TOP_P_RANGE),
            "top_k": list(TOP_K_RANGE),
            "min_p": list(MIN_P_RANGE),
            "method": list(METHOD_CHOICES),
            "draft_length": [AUTO, [0, self.draft_capacity]],
            "draft_length_means": "'auto' = adaptive, 0 = no draft, n = fixed length up to the pair's capacity",
        }


@dataclass(frozen=True)
class ChatRequest:
    """One validated request: the new message, the conversation before it, and the sampling settings.

    `dropped_turns` counts the oldest turns left out already here (message or character limits); fitting the rest
    into the context may drop more."""

    preset: str
    message: str
    history: tuple[Message, ...] = ()
    system_prompt: str = ""
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 40
    min_p: float = 0.0
    method: str = AUTO  # "auto" (the pair's default), "dflash" or "mtp"
    draft_length: int | str = AUTO
    speculative: bool = True
    enable_thinking: bool = False
    dropped_turns: int = 0
    seed: int | None = None  # the sampler's seed above temperature 0 (None: a random one)
    notes: tuple[str, ...] = ()  # said back with the answer (e.g. a deprecated parameter was used)
    stop: tuple[str, ...] = ()  # stop strings (the /v1 API's `stop`)
    raw_prompt: bool = False  # `message` is a completion's prompt as is: no template, system prompt or history

    @property
    def input_chars(self) -> int:
        return len(self.message) + len(self.system_prompt) + sum(len(m["content"]) for m in self.history)

    def generation_kwargs(self, speculative: bool, method: str | None = None) -> dict[str, Any]:
        """The engine's keyword arguments; `speculative` and `method` are passed in (an A/B run overrides the
        request's: `method` None means the request's own)."""
        method = self.method if method is None else method
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "method": None if method == AUTO else method,
            "draft_length": self.draft_length,
            "speculative": speculative,
            "seed": self.seed,
            "stop": list(self.stop) or None,
        }


# -- field checks ---------------------------------------------------------------------------------------------------


def _shown(value: Any, limit: int = 40) -> str:
    """A value as an error message quotes it: repr (escapes surrogates and control characters), cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int, high: int, hint: str = "") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer in {low}..{high}{hint}, got {_shown(value)}")
    return value


def check_float(name: str, value: Any, low: float, high: float) -> float:
    if not _is_number(value) or not math.isfinite(value) or not low <= value <= high:
        raise RequestError(f"{name} must be a number in [{low}, {high}], got {_shown(value)}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false (a boolean), got {_shown(value)}")
    return value


def check_draft_length(value: Any, capacity: int) -> int | str:
    if value == AUTO:
        return AUTO
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= capacity:
        raise RequestError(f"draft_length must be 'auto' or an integer in 0..{capacity} (0 = no draft), "
                           f"got {_shown(value)}")  # fmt: skip
    return value


def check_method(value: Any, available: Sequence[str] | None) -> str:
    """"auto", a registered method or a list of them ("a,b"), and (when the pair's methods are known) one the pair
    runs."""
    known = draft_methods.names()
    if value != AUTO and not (isinstance(value, str) and all(m in known for m in draft_methods.split(value))):
        raise RequestError(f"method must be one of {', '.join(map(repr, METHOD_CHOICES))}, got {_shown(value)} "
                           "(or a list of methods, 'a,b')")
    singles = [m for m in available or () if draft_methods.METHOD_SEPARATOR not in m]
    if available is not None and value != AUTO and not all(m in singles for m in draft_methods.split(value)):
        runs = ", ".join(map(repr, available)) or "none (plain decoding only)"
        raise RequestError(f"method {value!r} is not available on this pair; it runs {runs}")
    return value


def check_text(name: str, value: Any) -> str:
    """A string that encodes as UTF-8: a lone surrogate (possible in JSON) would fail deep in the tokenizer."""
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        raise RequestError(
            f"{name} contains an unpaired surrogate (U+{code:04X}) at character {error.start}: send valid Unicode"
        ) from None
    return value


def check_history(history: Any) -> list[Message]:
    """A list of {"role": "user" | "assistant", "content": str} (other keys, e.g. the chat widget's metadata, are
    ignored), as the model should see it: assistant answers without their thinking, no empty answers (a reply
    stopped before its first token)."""
    if history is None:
        return []
    if not isinstance(history, list | tuple):
        raise RequestError("history must be a list of {'role': 'user' | 'assistant', 'content': str} messages")
    cleaned: list[Message] = []
    for index, item in enumerate(history):
        if not isinstance(item, Mapping) or item.get("role") not in ("user", "assistant"):
            raise RequestError(f"history[{index}] must be a dict with role 'user' or 'assistant'")
        content = check_text(f"history[{index}]['content']", item.get("content"))
        if item["role"] == "assistant":
            content = strip_thinking(content)
            if not content.strip():
                continue
        cleaned.append({"role": str(item["role"]), "content": content})
    return cleaned


def turn_starts(history: Sequence[Message]) -> list[int]:
    """Where the kept history may start: the beginning, then each user message (a turn opens with one), then the
    end (nothing kept). Ascending; each later start drops one more turn."""
    return sorted({0, *(i for i, message in enumerate(history) if message["role"] == "user"), len(history)})


def newest_turns(history: list[Message], max_messages: int, max_chars: int) -> tuple[list[Message], int]:
    """The newest whole turns within `max_messages` messages and `max_chars` characters, and how many turns went.
    Counts characters only: this bounds the work before anything is tokenized."""
    starts = turn_starts(history)
    suffix_chars = [0] * (len(history) + 1)
    for i in range(len(history) - 1, -1, -1):
        suffix_chars[i] = suffix_chars[i + 1] + len(history[i]["content"])
    for dropped, start in enumerate(starts):
        if len(history) - start <= max_messages and suffix_chars[start] <= max_chars:
            return history[start:], dropped
    return [], len(starts) - 1  # unreachable: the last start keeps nothing, which always fits


def build_request(
    *,
    preset: Any,
    presets: Sequence[str],
    limits: Limits,
    message: Any,
    history: Any = None,
    system_prompt: Any = "",
    max_tokens: Any = 512,
    temperature: Any = 0.0,
    top_p: Any = 1.0,
    top_k: Any = 40,
    min_p: Any = 0.0,
    method: Any = AUTO,
    draft_length: Any = AUTO,
    draft_max: Any = None,
    speculative: Any = True,
    enable_thinking: Any = False,
    methods: Sequence[str] | None = None,
) -> ChatRequest:
    """Check every field and return the request, or raise RequestError saying what is wrong. `methods`: the draft
    methods the pair runs, when known. `draft_max` is the old spelling of `draft_length` (0 meant "auto"): taken when
    given, with a note in the request's `notes`.

    The new message and the system prompt must fit `limits.max_input_chars` on their own; older turns that do not
    fit in what is left (or beyond `limits.max_history_messages`) are dropped, oldest first, and counted."""
    if not isinstance(preset, str) or preset not in presets:
        raise RequestError(f"unknown preset {_shown(preset)}; this server offers {', '.join(map(repr, presets))}")
    message = check_text("message", message)
    if not message.strip():
        raise RequestError("the message is empty: type something to send")
    system_prompt = check_text("system_prompt", "" if system_prompt is None else system_prompt)
    own_chars = len(message) + len(system_prompt)
    if own_chars > limits.max_input_chars:
        raise MessageTooLongError(too_long(f"the message and system prompt are {own_chars} characters long; this "
                                           f"server accepts up to {limits.max_input_chars}"))
    kept, dropped = newest_turns(
        check_history(history), limits.max_history_messages, limits.max_input_chars - own_chars
    )
    notes: tuple[str, ...] = ()
    if draft_max is not None:
        number = check_int("draft_max", draft_max, 0, limits.draft_capacity, " (0 = adaptive; deprecated: use "
                           "draft_length)")  # fmt: skip
        draft_length, notes = (AUTO if number == 0 else number), (DRAFT_MAX_NOTE,)
    return ChatRequest(
        preset=preset,
        message=message,
        history=tuple(kept),
        system_prompt=system_prompt,
        max_tokens=check_int("max_tokens", max_tokens, 1, limits.max_new_tokens),
        temperature=check_float("temperature", temperature, *TEMPERATURE_RANGE),
        top_p=check_float("top_p", top_p, *TOP_P_RANGE),
        top_k=check_int("top_k", top_k, *TOP_K_RANGE, " (0 = off)"),
        min_p=check_float("min_p", min_p, *MIN_P_RANGE),
        method=check_method(method, methods),
        draft_length=check_draft_length(draft_length, limits.draft_capacity),
        speculative=check_bool("speculative", speculative),
        enable_thinking=check_bool("thinking", enable_thinking),
        dropped_turns=dropped,
        notes=notes,
    )


# -- thinking ---------------------------------------------------------------------------------------------------------


def thinking_prefix(prompt: str) -> str:
    """The thinking tag a template opened at the end of the prompt, so the shown reply can be folded whole."""
    tail = prompt.rstrip()
    return THINK_OPEN + "\n" if tail.endswith(THINK_OPEN) else ""


def strip_thinking(text: str) -> str:
    """The answer without its thinking block (closed or not), as it goes back into the history."""
    if THINK_CLOSE in text:
        return text.split(THINK_CLOSE, 1)[1].lstrip()
    if text.lstrip().startswith(THINK_OPEN):
        return ""
    return text
