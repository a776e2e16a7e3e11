"""Fitting a conversation in the context: the oldest turns go first, the newest message always stays."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import PromptTooLongError
from .requests import ChatRequest, Message


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

