"""The Space's logic without its UI: run mode, request checks, GPU time estimate, fitting a conversation in the
context, and the engine host that streams replies (one per process: the GPU worker on ZeroGPU).

Nothing here imports gradio or touches CUDA at import time, so the web process can use all of it.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PromptTooLongError, RequestError
from .hub import PairPreset, ResolvedPair, preset_from_env, with_local_files

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DEMO_VALUES_TINY = ("tiny",)
DEMO_VALUES_REAL = ("off", "0", "false", "no", "real")
Message = dict[str, str]


# -- run mode ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunMode:
    """Whether the app serves generated tiny models (offline demo) or the configured pair, and why."""

    tiny: bool
    reason: str


def on_zero_gpu(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def cuda_device_present() -> bool:
    """An NVIDIA device node or driver entry exists; a file check only, so no CUDA context is created."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return Path("/dev/nvidia0").exists() or (gpus.is_dir() and any(gpus.iterdir()))


def choose_run_mode(env: Mapping[str, str], overrides: Sequence[str], has_cuda: bool) -> RunMode:
    """DFLASH_DEMO=tiny forces the offline demo and DFLASH_DEMO=off the real pair; otherwise the real pair runs
    only where it can (ZeroGPU, a CUDA GPU, or model variables set), so a bare `python app.py` never starts a
    multi-GB download on a laptop."""
    demo = env.get("DFLASH_DEMO", "").strip().lower()
    if demo in DEMO_VALUES_TINY:
        return RunMode(True, "DFLASH_DEMO=tiny")
    if demo in DEMO_VALUES_REAL:
        return RunMode(False, f"DFLASH_DEMO={demo}")
    if demo not in ("", "auto"):
        raise ValueError(f"DFLASH_DEMO must be 'tiny', 'off' or 'auto', got {demo!r}")
    if on_zero_gpu(env):
        return RunMode(False, "running on ZeroGPU")
    if overrides:
        return RunMode(False, f"model variables set ({', '.join(overrides)})")
    if has_cuda:
        return RunMode(False, "a CUDA GPU is present")
    return RunMode(True, "no GPU, no ZeroGPU and no model variables")


TINY_PRESET_NAME = "tiny-random"
TINY_N_CTX = 4096


def configured_preset(mode: RunMode, env: Mapping[str, str] | None = None) -> PairPreset:
    """The pair this server offers: the environment's, or in the offline demo generated tiny models (CPU)."""
    env = os.environ if env is None else env
    preset = preset_from_env(env)
    if not mode.tiny:
        return preset
    from .testing.tiny_models import tiny_pair

    pair = tiny_pair(target="dense", draft="dflash2", head="shaped")
    return with_local_files(
        preset,
        pair.target,
        pair.draft,
        name=TINY_PRESET_NAME,
        label="tiny random-weight test models (dense qwen3 target + DFlash 2 draft)",
        n_ctx=preset.n_ctx if env.get("DFLASH_N_CTX", "").strip() else TINY_N_CTX,
        n_gpu_layers=0,
        random_weights=True,
    )


# -- limits and requests ----------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class FittedConversation:
    messages: list[Message]
    dropped_turns: int
    prompt_tokens: int

    @property
    def notice(self) -> str | None:
        if not self.dropped_turns:
            return None
        turns = "turn" if self.dropped_turns == 1 else "turns"
        return (
            f"The conversation outgrew the context: the model no longer sees the {self.dropped_turns} oldest {turns}."
        )


def _cut_points(history: Sequence[Message]) -> list[int]:
    """Where the kept history may start: everything, then after each older turn (a turn opens with a user
    message), then nothing (for an empty history, everything and nothing are the same start, 0)."""
    user_starts = [i for i, message in enumerate(history) if message["role"] == "user"]
    return sorted({0, *user_starts, len(history)})


def fit_conversation(
    request: ChatRequest, count_tokens: Callable[[list[Message]], int], n_ctx: int
) -> FittedConversation:
    """Drop the oldest turns until the prompt leaves room to answer (max_tokens, at most half the context)."""
    system = [{"role": "system", "content": request.system_prompt}] if request.system_prompt.strip() else []
    latest = [{"role": "user", "content": request.message}]
    history = list(request.history)
    reserve = min(request.max_tokens, n_ctx // 2)
    prompt_tokens = 0
    for dropped, start in enumerate(_cut_points(history)):
        messages = system + history[start:] + latest
        prompt_tokens = count_tokens(messages)
        if prompt_tokens + reserve <= n_ctx:
            return FittedConversation(messages, dropped, prompt_tokens)
    raise PromptTooLongError(
        f"the message needs {prompt_tokens} prompt tokens; with {reserve} kept for the answer the "
        f"{n_ctx}-token context cannot hold it: shorten the message or the system prompt"
    )


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


@dataclass
class ReplyChunk:
    """What a streaming reply sends after each engine step (plain data: it crosses the ZeroGPU process line)."""

    text: str
    stats: dict[str, Any]
    finish_reason: str | None = None
    finish_detail: str = ""
    notice: str | None = None
    phase: str = "chat"  # "chat", or "speculative" / "plain" during an A/B comparison
    engine_info: dict[str, Any] = field(default_factory=dict)


class EngineHost:
    """Owns this process's engine: built on first use, rebuilt when the preset or files change, one request at a
    time. On ZeroGPU each GPU worker is a fresh fork, so a new worker starts without an engine and builds one."""

    def __init__(self, loader: Callable[..., Any], busy_timeout_s: float = 120.0) -> None:
        self._loader = loader
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        self._engine: Any = None
        self._key: tuple[Any, ...] | None = None

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine, self._key = None, None

    def _ensure(self, preset: PairPreset, files: ResolvedPair) -> Any:
        key = (preset, files)
        if self._engine is None or self._key != key:
            self.close()
            self._engine = self._loader(
                files.target_path,
                files.draft_path,
                n_ctx=preset.n_ctx,
                n_gpu_layers=preset.n_gpu_layers,
                draft_max=preset.draft_max,
            )
            self._key = key
        return self._engine

    def _acquire(self) -> None:
        if not self._lock.acquire(timeout=self._busy_timeout_s):
            raise RequestError(f"the engine stayed busy for {self._busy_timeout_s:.0f} s; try again")

    def stream_reply(self, request: ChatRequest, preset: PairPreset, files: ResolvedPair) -> Iterator[ReplyChunk]:
        """Fit the conversation in the context and stream the answer, with live stats after every step."""
        self._acquire()
        try:
            engine = self._ensure(preset, files)
            yield from self._stream(engine, request, request.speculative, "chat")
        finally:
            self._lock.release()

    def stream_comparison(self, request: ChatRequest, preset: PairPreset, files: ResolvedPair) -> Iterator[ReplyChunk]:
        """The same request with speculative decoding, then with plain decoding (for the A/B view)."""
        self._acquire()
        try:
            engine = self._ensure(preset, files)
            yield from self._stream(engine, request, True, "speculative")
            yield from self._stream(engine, request, False, "plain")
        finally:
            self._lock.release()

    def _stream(self, engine: Any, request: ChatRequest, speculative: bool, phase: str) -> Iterator[ReplyChunk]:
        thinking = request.enable_thinking

        def count(messages: list[Message]) -> int:
            return len(engine.tokenize(engine.render_chat(messages, enable_thinking=thinking)))

        fitted = fit_conversation(request, count, engine.n_ctx)
        prefix = thinking_prefix(engine.render_chat(fitted.messages, enable_thinking=thinking)) if thinking else ""
        info = engine.info()
        text = prefix
        events = engine.stream_chat(
            fitted.messages, enable_thinking=thinking, **request.generation_kwargs(speculative=speculative)
        )
        try:
            for event in events:
                text += event.delta
                yield ReplyChunk(
                    text=text,
                    stats=event.stats.to_dict(),
                    finish_reason=event.finish_reason,
                    finish_detail=event.finish_detail,
                    notice=fitted.notice,
                    phase=phase,
                    engine_info=info,
                )
        finally:
            events.close()
