"""A Space request: limits (from the environment), field checks with one clear message each, the history as the
model should see it, and the ZeroGPU time a request asks for. Nothing here imports gradio or touches CUDA."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError
from .presets import PairPreset

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
Message = dict[str, str]


def _env_number(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class Limits:
    """Bounds of a request, and the figures behind the ZeroGPU duration estimate (all overridable by env)."""

    max_new_tokens: int = 4096
    max_input_chars: int = 32000
    draft_max: int = 7
    gpu_seconds_max: int = 240
    gpu_seconds_base: float = 30.0  # engine load on a fresh worker plus slack
    gpu_decode_tok_s: float = 15.0  # deliberately pessimistic decode speed
    gpu_prefill_tok_s: float = 800.0

    @classmethod
    def from_env(cls, preset: PairPreset, env: Mapping[str, str] | None = None) -> Limits:
        env = os.environ if env is None else env
        return cls(
            max_new_tokens=int(_env_number(env, "DFLASH_MAX_NEW_TOKENS", cls.max_new_tokens)),
            max_input_chars=int(_env_number(env, "DFLASH_MAX_INPUT_CHARS", cls.max_input_chars)),
            draft_max=preset.draft_max,
            gpu_seconds_max=int(_env_number(env, "DFLASH_GPU_SECONDS_MAX", cls.gpu_seconds_max)),
            gpu_seconds_base=_env_number(env, "DFLASH_GPU_SECONDS_BASE", cls.gpu_seconds_base),
            gpu_decode_tok_s=_env_number(env, "DFLASH_GPU_DECODE_TOK_S", cls.gpu_decode_tok_s),
            gpu_prefill_tok_s=_env_number(env, "DFLASH_GPU_PREFILL_TOK_S", cls.gpu_prefill_tok_s),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "max_input_chars": self.max_input_chars,
            "temperature": [0.0, 2.0],
            "top_p": [0.01, 1.0],
            "draft_max": [0, self.draft_max],
            "draft_max_0_means": "adaptive draft length",
        }


@dataclass(frozen=True)
class ChatRequest:
    """One validated request: the new message, the conversation before it, and the sampling settings."""

    preset: str
    message: str
    history: tuple[Message, ...] = ()
    system_prompt: str = ""
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    draft_max: int | str = "auto"
    speculative: bool = True
    enable_thinking: bool = False

    @property
    def input_chars(self) -> int:
        return len(self.message) + len(self.system_prompt) + sum(len(m["content"]) for m in self.history)

    def generation_kwargs(self, speculative: bool) -> dict[str, Any]:
        """The engine's keyword arguments; `speculative` is passed in (an A/B run overrides the request's)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "draft_max": self.draft_max,
            "speculative": speculative,
        }


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer():
        raise RequestError(f"{name} must be a whole number, got {value!r}")
    return int(value)


def _as_float(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= float(value) <= high:
        raise RequestError(f"{name} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def clean_history(history: Any) -> tuple[Message, ...]:
    """Accept a list of {"role", "content"} dicts (user / assistant turns) and keep what the model should see:
    assistant answers without their thinking, and no empty answers (a reply stopped before its first token)."""
    if history is None:
        return ()
    if not isinstance(history, list | tuple):
        raise RequestError("history must be a list of {'role': 'user' | 'assistant', 'content': str} messages")
    cleaned: list[Message] = []
    for index, item in enumerate(history):
        if not isinstance(item, Mapping) or item.get("role") not in ("user", "assistant"):
            raise RequestError(f"history[{index}] must be a dict with role 'user' or 'assistant'")
        content = item.get("content")
        if not isinstance(content, str):
            raise RequestError(f"history[{index}]['content'] must be a string")
        if item["role"] == "assistant":
            content = strip_thinking(content)
            if not content.strip():
                continue
        cleaned.append({"role": str(item["role"]), "content": content})
    return tuple(cleaned)


def build_request(
    *,
    preset: str,
    presets: Sequence[str],
    limits: Limits,
    message: Any,
    history: Any = None,
    system_prompt: Any = "",
    max_tokens: Any = 512,
    temperature: Any = 0.0,
    top_p: Any = 1.0,
    draft_max: Any = 0,
    speculative: Any = True,
    enable_thinking: Any = False,
) -> ChatRequest:
    """Check every field against `limits` and return the request, or raise RequestError saying what is wrong."""
    if preset not in presets:
        raise RequestError(f"unknown preset {preset!r}; this server offers {', '.join(map(repr, presets))}")
    if not isinstance(message, str) or not message.strip():
        raise RequestError("the message is empty: type something to send")
    system_prompt = system_prompt or ""
    if not isinstance(system_prompt, str):
        raise RequestError("system_prompt must be a string")
    request = ChatRequest(
        preset=preset,
        message=message,
        history=clean_history(history),
        system_prompt=system_prompt,
        max_tokens=_as_int("max_tokens", max_tokens),
        temperature=_as_float("temperature", temperature, 0.0, 2.0),
        top_p=_as_float("top_p", top_p, 0.01, 1.0),
        draft_max=_draft_setting(draft_max, limits.draft_max),
        speculative=bool(speculative),
        enable_thinking=bool(enable_thinking),
    )
    if not 1 <= request.max_tokens <= limits.max_new_tokens:
        raise RequestError(f"max_tokens must be in 1..{limits.max_new_tokens}, got {request.max_tokens}")
    if request.input_chars > limits.max_input_chars:
        raise RequestError(
            f"the conversation is {request.input_chars} characters long; this server accepts up to "
            f"{limits.max_input_chars}: shorten the message or clear the history"
        )
    return request


def _draft_setting(value: Any, draft_max: int) -> int | str:
    if value == "auto":
        return "auto"
    number = _as_int("draft_max", value)
    if not 0 <= number <= draft_max:
        raise RequestError(f"draft_max must be in 0..{draft_max} (0 = adaptive), got {number}")
    return "auto" if number == 0 else number


def estimate_gpu_seconds(request: ChatRequest, limits: Limits, runs: int = 1) -> int:
    """ZeroGPU duration for a request: engine start + prefill + the longest possible decode, capped."""
    prompt_tokens = request.input_chars / 3  # ~3 characters per token is on the safe side for English and code
    seconds = limits.gpu_seconds_base
    seconds += runs * (prompt_tokens / limits.gpu_prefill_tok_s + request.max_tokens / limits.gpu_decode_tok_s)
    return max(10, min(limits.gpu_seconds_max, math.ceil(seconds)))


# -- fitting a conversation in the context ----------------------------------------------------------------------



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


# -- streaming replies ------------------------------------------------------------------------------------------

