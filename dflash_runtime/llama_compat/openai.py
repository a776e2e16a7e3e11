"""OpenAI-style requests and responses for `DFlashLlama`.

Maps llama-cpp-python's request parameters onto the engine's, refuses the ones the engine cannot honour, and
builds the completion / chat-completion objects and stream chunks with the shapes `llama_cpp.Llama` returns (the
envelopes and choices of openai_api/shapes.py), plus every statistic under `"dflash_stats"`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import RequestError
from ..openai_api import shapes
from ..openai_api.shapes import STATS_KEY, ResponseIds, envelope, message_choice, text_choice

# Options of `Llama.create_completion` the engine has no equivalent for, with the value that leaves them off.
# A request that leaves them off runs unchanged; one that turns them on is refused, never silently ignored.
COMPLETION_OPTIONS_OFF: dict[str, Any] = {
    "suffix": None,
    "logprobs": None,
    "typical_p": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repeat_penalty": 1.0,
    "tfs_z": 1.0,
    "mirostat_mode": 0,
    "stopping_criteria": None,
    "logits_processor": None,
    "grammar": None,
    "logit_bias": None,
}

# The same for `Llama.create_chat_completion`, whose `logprobs` is a flag and which adds tool calling.
CHAT_OPTIONS_OFF: dict[str, Any] = {
    **{name: off for name, off in COMPLETION_OPTIONS_OFF.items() if name not in ("suffix", "stopping_criteria")},
    "logprobs": False,
    "top_logprobs": None,
    "functions": None,
    "function_call": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
}

_WHY_UNSUPPORTED = (
    "DFlashLlama samples on the target with temperature, top_k, top_p, min_p and seed only, and never copies "
    "logits to the host (so no logprobs, grammars, penalties or logits processors)"
)


def _is_off(name: str, value: Any, off: Any) -> bool:
    if value is None or value == off:
        return True
    if name == "response_format" and isinstance(value, Mapping):
        return value.get("type", "text") == "text"
    # An empty list / dict of biases, processors, tools or stop criteria changes nothing either.
    return isinstance(value, (list, tuple, dict)) and len(value) == 0


def reject_unsupported(options: Mapping[str, Any], off_values: Mapping[str, Any]) -> None:
    """Raise `RequestError` naming every option in `options` that is turned on but has no engine equivalent."""
    turned_on = [name for name, value in options.items() if not _is_off(name, value, off_values[name])]
    if turned_on:
        raise RequestError(f"unsupported option(s) {', '.join(sorted(turned_on))}: {_WHY_UNSUPPORTED}")


def stop_list(stop: str | Iterable[str] | None) -> list[str] | None:
    """llama-cpp-python accepts one stop string or a list; the engine takes a list, or None for no stop."""
    if stop is None:
        return None
    strings = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) for s in strings):
        raise RequestError(f"stop must be a string or a list of strings, got {stop!r}")
    strings = [s for s in strings if s]
    return strings or None


def sampling_kwargs(
    *,
    max_tokens: int | None,
    no_limit: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float,
    seed: int | None,
    stop: str | Iterable[str] | None,
) -> dict[str, Any]:
    """Engine keyword arguments for one request. `max_tokens` None or ≤ 0 means "until the context is full",
    as in llama-cpp-python; `no_limit` is the token budget that stands for it."""
    return {
        "max_tokens": no_limit if max_tokens is None or max_tokens <= 0 else int(max_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "min_p": float(min_p),
        "seed": seed,
        "stop": stop_list(stop),
    }


class StatsLike(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class EventLike(Protocol):
    """The fields of the engine's `StreamEvent` that responses are built from."""

    delta: str
    tokens: Any
    stats: StatsLike
    finish_reason: str | None


@dataclass
class Outcome:
    """A finished generation, gathered from the engine's stream."""

    text: str = ""
    prompt_tokens: int = 0
    n_tokens: int = 0
    finish_reason: str = "length"
    stats: dict[str, Any] = field(default_factory=dict)


def gather(events: Iterable[EventLike]) -> Outcome:
    """Run a stream to its end and keep what a non-streamed response needs."""
    outcome = Outcome()
    pieces: list[str] = []
    for event in events:
        pieces.append(event.delta)
        outcome.n_tokens += len(event.tokens)
        if event.finish_reason is not None:
            outcome.finish_reason = event.finish_reason
            outcome.stats = event.stats.to_dict()
            outcome.prompt_tokens = int(outcome.stats.get("n_prompt", 0))
    outcome.text = "".join(pieces)
    return outcome


def _counts(outcome: Outcome) -> dict[str, int]:
    """llama-cpp-python's usage: the prompt's tokens and the answer's."""
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.n_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.n_tokens}  # fmt: skip


def _whole(response: dict[str, Any], outcome: Outcome) -> dict[str, Any]:
    """A whole response: the envelope, the token usage and every statistic."""
    response["usage"] = _counts(outcome)
    response[STATS_KEY] = outcome.stats
    return response


def _last(chunk: dict[str, Any], stats: dict[str, Any] | None) -> dict[str, Any]:
    """A stream chunk, and every statistic on the last one."""
    if stats is not None:
        chunk[STATS_KEY] = stats
    return chunk


def completion_response(ids: ResponseIds, outcome: Outcome) -> dict[str, Any]:
    return _whole(envelope(ids, "text_completion", [text_choice(outcome.text, outcome.finish_reason)]), outcome)


def completion_chunk(
    ids: ResponseIds, text: str, finish_reason: str | None = None, stats: dict[str, Any] | None = None
) -> dict[str, Any]:
    return _last(shapes.completion_chunk(ids, text, finish_reason), stats)


def chat_response(ids: ResponseIds, outcome: Outcome) -> dict[str, Any]:
    message = {"role": "assistant", "content": outcome.text}
    return _whole(envelope(ids, "chat.completion", [message_choice(message, outcome.finish_reason)]), outcome)


def chat_chunk(
    ids: ResponseIds, delta: dict[str, str], finish_reason: str | None = None, stats: dict[str, Any] | None = None
) -> dict[str, Any]:
    return _last(shapes.chat_chunk(ids, delta, finish_reason), stats)


def completion_chunks(ids: ResponseIds, events: Iterator[EventLike], echo: str = "") -> Iterator[dict[str, Any]]:
    """Text-completion chunks: one per non-empty delta, then an empty one with the finish reason and stats.

    Closing this generator closes `events`, which stops the engine between two steps."""
    try:
        if echo:
            yield completion_chunk(ids, echo)
        for event in events:
            if event.delta:
                yield completion_chunk(ids, event.delta)
            if event.finish_reason is not None:
                yield completion_chunk(ids, "", event.finish_reason, event.stats.to_dict())
    finally:
        _close(events)


def chat_chunks(ids: ResponseIds, events: Iterator[EventLike]) -> Iterator[dict[str, Any]]:
    """Chat chunks as llama-cpp-python streams them: the assistant role first, then content deltas, then an
    empty delta with the finish reason (and, here, the stats)."""
    try:
        yield chat_chunk(ids, {"role": "assistant"})
        for event in events:
            if event.delta:
                yield chat_chunk(ids, {"content": event.delta})
            if event.finish_reason is not None:
                yield chat_chunk(ids, {}, event.finish_reason, event.stats.to_dict())
    finally:
        _close(events)


def _close(events: Iterator[Any]) -> None:
    close = getattr(events, "close", None)
    if close is not None:
        close()
