"""The API's objects: chat.completion, chat.completion.chunk, text_completion and model lists as OpenAI shapes them
(what the `openai` SDKs parse), `usage` from the engine's own counts, and two extension fields on a finished answer:

- `timings`, llama-server's names for the same figures (`prompt_n`, `cache_n`, `prompt_ms`, `predicted_n`,
  `predicted_ms`, `predicted_per_second`, `draft_n`, `draft_n_accepted`), so tools that read llama-server's draft
  statistics read these;
- `dflash_stats`: the speculative figures in the engine's names (method, draft length, drafted, accepted,
  acceptance, tokens per verify step, decode tok/s, ...), as `DFlashLlama` returns them.

Kept free of llama_cpp: the Space's web process builds these too, and the drop-in (llama_compat/openai.py) builds
its objects from the same envelopes and choices, in llama-cpp-python's keys (no `timings`, every statistic).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STATS_KEY = "dflash_stats"
# The engine's finish reasons as OpenAI names them: an answer the engine ended for another reason (cancelled by the
# server) reads "stop"; dflash_stats.finish_reason keeps the engine's own.
FINISH_REASONS = {"stop": "stop", "length": "length"}
SPECULATIVE_FIGURES = ("method", "speculative", "draft_length", "draft_capacity", "drafted", "accepted",
                       "acceptance_rate", "mean_accepted_length", "verify_steps", "plain_steps", "verify_mode",
                       "decode_tok_s", "n_prompt", "n_reused", "n_generated", "prefill_ms", "decode_ms")  # fmt: skip


@dataclass(frozen=True)
class ResponseIds:
    """The id, creation time and model name that every object of one response shares."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, model: str, chat: bool) -> ResponseIds:
        return cls(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), model)


def finish_reason(engine_reason: str | None) -> str | None:
    return None if engine_reason is None else FINISH_REASONS.get(engine_reason, "stop")


def usage(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's counts: the prompt's tokens (cached ones included, as OpenAI counts them) and the answer's."""
    prompt, completion = int(stats.get("n_prompt", 0)), int(stats.get("n_generated", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("n_reused", 0))}}  # fmt: skip


def _per_second(count: float, ms: float) -> float:
    return round(count / (ms / 1000.0), 3) if ms > 0 else 0.0


def timings(stats: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's `timings` from the engine's statistics."""
    prefilled, prefill_ms = int(stats.get("n_prefilled", 0)), float(stats.get("prefill_ms", 0.0))
    generated, decode_ms = int(stats.get("n_generated", 0)), float(stats.get("decode_ms", 0.0))
    return {
        "cache_n": int(stats.get("n_reused", 0)),
        "prompt_n": prefilled,
        "prompt_ms": prefill_ms,
        "prompt_per_token_ms": round(prefill_ms / prefilled, 3) if prefilled else 0.0,
        "prompt_per_second": _per_second(prefilled, prefill_ms),
        "predicted_n": generated,
        "predicted_ms": decode_ms,
        "predicted_per_token_ms": round(decode_ms / generated, 3) if generated else 0.0,
        "predicted_per_second": _per_second(generated, decode_ms),
        "draft_n": int(stats.get("drafted", 0)),
        "draft_n_accepted": int(stats.get("accepted", 0)),
    }


def speculative_figures(stats: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`dflash_stats`: the engine's figures of this answer (and what the backend adds, e.g. the Space's GPU time)."""
    figures = {name: stats[name] for name in SPECULATIVE_FIGURES if name in stats}
    return {**figures, **(extra or {})}


def envelope(ids: ResponseIds, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": choices}


def text_choice(text: str, reason: str | None) -> dict[str, Any]:
    """A text_completion's choice (whole or a chunk's)."""
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}


def message_choice(message: dict[str, Any], reason: str | None) -> dict[str, Any]:
    return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason(reason)}


def delta_choice(delta: dict[str, str], reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(reason)}


def _finished(response: dict[str, Any], stats: Mapping[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    response["usage"] = usage(stats)
    response["timings"] = timings(stats)
    response[STATS_KEY] = speculative_figures(stats, extra)
    return response


def chat_message(reasoning: str, content: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def chat_response(ids: ResponseIds, reasoning: str, content: str, reason: str | None, stats: Mapping[str, Any],
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    return _finished(envelope(ids, "chat.completion", [message_choice(chat_message(reasoning, content), reason)]),
                     stats, extra)


def completion_response(ids: ResponseIds, text: str, reason: str | None, stats: Mapping[str, Any],
                        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    return _finished(envelope(ids, "text_completion", [text_choice(text, reason)]), stats, extra)


def chat_chunk(ids: ResponseIds, delta: dict[str, str], reason: str | None = None) -> dict[str, Any]:
    return envelope(ids, "chat.completion.chunk", [delta_choice(delta, reason)])


def completion_chunk(ids: ResponseIds, text: str, reason: str | None = None) -> dict[str, Any]:
    return envelope(ids, "text_completion", [text_choice(text, reason)])


def last_chunk(chunk: dict[str, Any], stats: Mapping[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The chunk with the finish reason carries the answer's `timings` and `dflash_stats` (as llama-server's does)."""
    chunk["timings"] = timings(stats)
    chunk[STATS_KEY] = speculative_figures(stats, extra)
    return chunk


def usage_chunk(ids: ResponseIds, obj: str, stats: Mapping[str, Any]) -> dict[str, Any]:
    """`stream_options.include_usage`: one more chunk, no choices, the usage."""
    return {**envelope(ids, obj, []), "usage": usage(stats)}


def model_list(models: list[str], owner: str = "dflash_runtime") -> dict[str, Any]:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": owner} for m in models]}
