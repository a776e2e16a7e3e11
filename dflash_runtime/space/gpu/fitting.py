"""Fitting a conversation in the context: the oldest turns go first, the newest message always stays.

The cost is a few full renders, not one per turn: the first render (everything) gives the tokens per character, which
guesses the cut; renders then confirm the cut exactly (the guess and its neighbour), searching outwards from the guess
only when it was off. The prompt grows with every turn kept, so "fits" is monotone in the cut and the search finds the
smallest exact cut. The tokens of the cut it keeps are what the engine reads: nothing is rendered or tokenized twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ...errors import PromptTooLongError
from ..requests import ChatRequest, Message, too_long, turn_starts


def prompt_tokens(engine: Any, messages: list[Message], enable_thinking: bool) -> list[int]:
    """The prompt of `messages` exactly as the engine reads it: the one place the Space tokenizes a conversation."""
    return engine.chat_tokens(messages, enable_thinking=enable_thinking)


def dropped_notice(dropped_turns: int) -> str | None:
    if not dropped_turns:
        return None
    turns = "turn" if dropped_turns == 1 else "turns"
    return f"The conversation outgrew the context: the model no longer sees the {dropped_turns} oldest {turns}."


@dataclass(frozen=True)
class FittedConversation:
    messages: list[Message]
    dropped_turns: int  # here and, before, by the request's own limits
    tokens: list[int]  # the prompt the engine reads
    renders: int  # full prompt renders it took (the work fitting did)

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens)

    @property
    def notice(self) -> str | None:
        return dropped_notice(self.dropped_turns)


def fit_conversation(
    request: ChatRequest, encode: Callable[[list[Message]], list[int]], n_ctx: int
) -> FittedConversation:
    """Drop the oldest turns until the prompt leaves room to answer (max_tokens, at most half the context).
    `encode` gives a conversation's prompt tokens (see `prompt_tokens`)."""
    system = [{"role": "system", "content": request.system_prompt}] if request.system_prompt.strip() else []
    latest = [{"role": "user", "content": request.message}]
    history = list(request.history)
    starts = turn_starts(history)
    reserve = min(request.max_tokens, n_ctx // 2)
    encoded: dict[int, list[int]] = {}

    def tokens(cut: int) -> int:  # cut = index into starts: how many turns are dropped
        if cut not in encoded:
            encoded[cut] = encode(system + history[starts[cut] :] + latest)
        return len(encoded[cut])

    def fits(cut: int) -> bool:
        return tokens(cut) + reserve <= n_ctx

    cut = 0 if fits(0) else _smallest_fitting_cut(fits, _guess(history, starts, tokens(0), n_ctx - reserve), starts)
    if cut is None:
        last = len(starts) - 1
        raise PromptTooLongError(too_long(f"it needs {tokens(last)} prompt tokens; with {reserve} kept for the "
                                          f"answer the {n_ctx}-token context cannot hold it"))
    messages = system + history[starts[cut] :] + latest
    return FittedConversation(messages, request.dropped_turns + cut, encoded[cut], len(encoded))


def fit_request(engine: Any, request: ChatRequest) -> FittedConversation:
    """A request's prompt fitted in the engine's context: a completion's as it is, a conversation's older turns
    dropped as needed."""
    if request.raw_prompt:  # control tokens only from a template: a raw prompt's text is text
        return fit_prompt(request, partial(engine.tokenize, parse_special=False), engine.n_ctx)
    encode = partial(prompt_tokens, engine, enable_thinking=request.enable_thinking)
    return fit_conversation(request, encode, engine.n_ctx)


def fit_prompt(request: ChatRequest, tokenize: Callable[[str], list[int]], n_ctx: int) -> FittedConversation:
    """A completion's prompt as it is (`request.raw_prompt`: no template), refused when it leaves no room to answer
    (max_tokens, at most half the context)."""
    tokens = tokenize(request.message)
    reserve = min(request.max_tokens, n_ctx // 2)
    if len(tokens) + reserve > n_ctx:
        raise PromptTooLongError(too_long(f"it has {len(tokens)} tokens; with {reserve} kept for the answer the "
                                          f"{n_ctx}-token context cannot hold it"))
    return FittedConversation([], request.dropped_turns, tokens, 1)


def _guess(history: list[Message], starts: list[int], all_tokens: int, budget: int) -> int:
    """The cut the characters suggest, at the measured tokens per character of the whole conversation."""
    chars = [len(message["content"]) + 1 for message in history]  # + 1: the template's per-message tokens
    total = sum(chars) or 1
    excess = (all_tokens - budget) * total / all_tokens  # characters to drop
    dropped = 0
    for cut, start in enumerate(starts):
        if dropped >= excess:
            return cut
        dropped += sum(chars[start : starts[cut + 1]]) if cut + 1 < len(starts) else 0
    return len(starts) - 1


def _smallest_fitting_cut(fits: Callable[[int], bool], guess: int, starts: list[int]) -> int | None:
    """The smallest cut in 1.. that fits (cut 0 does not): from the guess, steps that double until the answer is
    bracketed, then halving; a guess off by one costs two renders."""
    last = len(starts) - 1
    guess = min(max(guess, 1), last)
    if fits(guess):
        low, high, step = 0, guess, 1  # cut `low` does not fit, cut `high` does
        while high - step > 0:
            if not fits(high - step):
                low = high - step
                break
            high, step = high - step, step * 2
    else:
        low, high, step = guess, None, 1
        while high is None:
            probe = min(low + step, last)
            if fits(probe):
                high = probe
            elif probe == last:
                return None
            else:
                low, step = probe, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high
