"""A request's keywords checked against the pair, into a `Request` (request.py): every refusal a RequestError that
says what would be accepted."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .. import methods
from ..errors import PromptTooLongError, RequestError
from ..native.sampling import VERIFY_MODES, SamplingParams
from ..pair import LinkedPair
from .request import Request

MAX_TREE_NODES = 256  # a draft tree's verify rows (the spare sequences and the batch bound what is decoded)


def check_length(length: Any, capacity: int) -> int | str:
    fixed = isinstance(length, int) and not isinstance(length, bool) and 0 <= length <= capacity
    if length != "auto" and not fixed:
        raise RequestError(f"draft_length must be 'auto' or an integer in 0..{capacity} (got {length!r})")
    return length


def check_tree_nodes(nodes: Any) -> int | str:
    if nodes != "auto" and (isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_TREE_NODES):
        raise RequestError(f"tree_nodes must be 'auto' or an integer in 1..{MAX_TREE_NODES} (got {nodes!r})")
    return nodes


def prompt_tokens(prompt: str | Sequence[int], pair: LinkedPair, tokenize: Callable[[str], list[int]]) -> list[int]:
    """A prompt's tokens: a string tokenized, or token ids checked against the vocabulary; it must fit the context."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("the prompt is empty")
        tokens = tokenize(prompt)
    else:
        try:
            tokens = [int(t) for t in prompt]
        except (TypeError, ValueError) as error:
            raise RequestError(f"a prompt is a string or a sequence of token ids ({error})") from None
        bad = [t for t in tokens if not 0 <= t < pair.n_vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{pair.n_vocab - 1})")
    if not tokens:
        raise RequestError("the prompt is empty")
    if len(tokens) >= pair.n_ctx:
        raise PromptTooLongError(
            f"the prompt has {len(tokens)} tokens but the context holds {pair.n_ctx}: shorten it or open the pair "
            "with a larger n_ctx"
        )
    return tokens


def checked_request(pair: LinkedPair, default_length: int | str, max_tokens: int, sampling: SamplingParams,
                    stop: str | Sequence[str] | None, speculative: bool, method: str | None,
                    draft_length: int | str | None, n_min: int, p_min: float, verify: str) -> Request:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"max_tokens must be a positive integer (got {max_tokens!r})")
    sampling.check()
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    runs = methods.available(pair)
    if method is not None:
        method = methods.METHOD_SEPARATOR.join(methods.check(method, runs))
    chosen = (method or methods.default(pair)) if speculative else None
    capacity = methods.capacity(pair, chosen) if chosen else max((methods.capacity(pair, m) for m in runs), default=0)
    length = check_length(default_length if draft_length is None else draft_length, capacity)
    if not 0 <= n_min <= capacity or not 0.0 <= p_min < 1.0:
        raise RequestError(f"n_min must be in 0..{capacity} and p_min in [0, 1)")
    if verify not in VERIFY_MODES:
        raise RequestError(f"verify must be one of {', '.join(VERIFY_MODES)} (got {verify!r})")
    return Request(max_tokens, sampling, stops, chosen, length, n_min, p_min, verify)


def checked_owner(cache_owner: Hashable | None, public_prefix: int, n_tokens: int) -> dict[str, Any]:
    """A request's `owner` and `public_prefix` (at most the prompt), checked (see cache/sessions.py)."""
    if isinstance(public_prefix, bool) or not isinstance(public_prefix, int) or public_prefix < 0:
        raise RequestError(f"public_prefix must be an integer ≥ 0 (got {public_prefix!r})")
    try:
        hash(cache_owner)
    except TypeError:
        raise RequestError(f"cache_owner must be hashable (got {type(cache_owner).__name__})") from None
    return {"owner": cache_owner, "public_prefix": min(public_prefix, n_tokens)}
