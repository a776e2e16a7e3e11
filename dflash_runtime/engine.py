"""The speculative engine: a linked pair, the caches' bookkeeping, and requests streamed one at a time.

Every emitted token is a target sample given the accepted prefix, so the output is the target's own: token for
token at temperature 0, and in distribution above it (see verify.py). The caches are kept between requests: a new
request prefills only what follows the prefix it shares with the cache (see cache.py for the one rule of going
back, and checkpoints.py for hybrid targets). Lifetime, cancellation and busy rules are in streams.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import llama_cpp
from llama_cpp import llama_cpp as ll

from .batches import TokenBatch
from .cache import PairCache
from .chat import ChatTemplate, ControlToken, control_tokens
from .checkpoints import CheckpointPolicy, CheckpointStore
from .controller import DraftPolicy, make_policy
from .decoding import Decoding, Parts, Request
from .drafter import BlockDrafter
from .errors import EngineClosedError, PromptTooLongError, RequestError
from .features import FeatureBridge
from .pair import LinkedPair
from .results import Result, StreamEvent
from .sampling import VERIFY_MODES, SamplingParams
from .stats import Stats
from .streams import CLOSED_MESSAGE, Occupancy, RequestStream
from .textstream import detokenize, token_piece

DEFAULT_BUSY_TIMEOUT_S = 300.0


class Engine:
    """Generates with a linked target + DFlash draft pair (or the target alone). One request at a time.

    Keyword arguments: those of `LinkedPair` (n_ctx, n_gpu_layers, draft_capacity, n_batch, n_threads, n_rs_seq,
    verbose), plus `draft_policy` (a request's default draft_max: "auto" or a fixed length), `checkpoints` (a
    `CheckpointPolicy` for hybrid targets; `CheckpointPolicy(max_count=0)` turns them off) and `busy_timeout_s`
    (how long another thread's request waits for the engine; None waits as long as it takes).
    """

    def __init__(self, target_path: str | os.PathLike[str], draft_path: str | os.PathLike[str] | None = None, *,
                 draft_policy: str | int = "auto", checkpoints: CheckpointPolicy | None = None,
                 busy_timeout_s: float | None = DEFAULT_BUSY_TIMEOUT_S, **pair_options: Any) -> None:
        self.pair = LinkedPair(target_path, draft_path, **pair_options)
        try:
            self._open(draft_policy, checkpoints or CheckpointPolicy(), busy_timeout_s)
        except BaseException:
            self.pair.close()
            raise

    def _open(self, draft_policy: str | int, checkpoints: CheckpointPolicy, busy_timeout_s: float | None) -> None:
        pair = self.pair
        self._occupancy = Occupancy(self._free, busy_timeout_s)
        batch = TokenBatch(pair.n_batch)
        bridge = drafter = None
        if pair.spec is not None:
            assert pair.api is not None
            bridge = FeatureBridge(pair.api, pair.target_ctx, pair.draft_ctx, pair.spec.target_layer_ids,
                                   pair.n_embd, pair.n_ubatch)
            drafter = BlockDrafter(pair.api, pair.draft_ctx, pair.spec, pair.n_embd_draft, pair.n_vocab)
        store = CheckpointStore(pair.target_ctx, checkpoints) if pair.is_recurrent else None
        cache = PairCache(pair.target_ctx, pair.draft_ctx, bridge, recurrent=pair.is_recurrent,
                          n_rs_seq=pair.n_rs_seq, checkpoints=store)
        self._parts = Parts(pair, cache, batch, bridge, drafter)
        self.default_draft_policy = draft_policy
        self._policies: dict[str, DraftPolicy] = {}
        self.template = self._load_template()
        self._controls: list[ControlToken] | None = None
        self._sampling_defaults = pair.sampling_defaults()

    # -- the pair's facts ---------------------------------------------------------------------------------------

    @property
    def target_model(self) -> Any:
        return self.pair.target_model

    @property
    def target_ctx(self) -> Any:
        return self.pair.target_ctx

    @property
    def draft_model(self) -> Any:
        return self.pair.draft_model

    @property
    def draft_ctx(self) -> Any:
        return self.pair.draft_ctx

    @property
    def n_ctx(self) -> int:
        return self.pair.n_ctx

    @property
    def n_batch(self) -> int:
        return self.pair.n_batch

    @property
    def draft_capacity(self) -> int:
        """The longest draft this pair was opened for (0 without a draft)."""
        return self.pair.draft_capacity

    @property
    def draft_max(self) -> int:
        """The older spelling of `draft_capacity`."""
        return self.pair.draft_capacity

    @property
    def spec(self) -> Any:
        return self.pair.spec

    @property
    def closed(self) -> bool:
        return self._occupancy.closing

    def check_open(self) -> None:
        if self._occupancy.closing:
            raise EngineClosedError(CLOSED_MESSAGE)

    # -- requests -----------------------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> Result:
        tokens: list[int] = []
        sources: list[str] = []
        parts: list[str] = []
        last: StreamEvent | None = None
        with self.stream(prompt, **kwargs) as events:
            for last in events:
                tokens += last.tokens
                sources += last.token_sources
                parts.append(last.delta)
        assert last is not None and last.finish_reason is not None
        return Result(tokens, "".join(parts), last.finish_reason, last.stats, last.finish_detail, sources)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 40,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        speculative: bool = True,
        draft_max: int | str | None = None,
        n_min: int = 0,
        p_min: float = 0.0,
        verify: str = "sample",
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> RequestStream:
        """A request's events, one per engine step; the request starts at the first `next()`.

        `draft_max`: "auto" (the adaptive controller), or a fixed length ≤ `draft_capacity`; default the engine's
        `draft_policy`. `verify` ("sample" or "match") chooses how drafts are checked above temperature 0.
        `on_prefill(done, total)` is called after each prompt chunk the engine decodes (progress of a long prompt);
        it runs on the decoding thread, between chunks, and may cancel the request."""
        self.check_open()
        tokens = self._prompt_tokens(prompt)
        req = self._request(max_tokens, SamplingParams(temperature, top_k, top_p, min_p, seed), stop, speculative,
                            draft_max, n_min, p_min, verify)
        return self._start(tokens, replace(req, on_prefill=on_prefill))

    def stream_chat(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool | None = None,
                    **kwargs: Any) -> RequestStream:
        return self.stream(self.chat_tokens(messages, enable_thinking=enable_thinking), **kwargs)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool | None = None,
             **kwargs: Any) -> Result:
        return self.generate(self.chat_tokens(messages, enable_thinking=enable_thinking), **kwargs)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool | None = None) -> str:
        """The chat prompt as text (for display; `chat_tokens` is what the model reads)."""
        return self._template().render(messages, enable_thinking=enable_thinking)

    def chat_tokens(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool | None = None) -> list[int]:
        """The chat prompt's tokens: the template's own text may become control tokens, message content never."""
        template = self._template()
        with self._occupancy.cond:
            if self._controls is None:
                self._controls = control_tokens(self.pair.vocab, self.pair.n_vocab, self._special_piece)
            controls = self._controls
        return template.tokens(messages, self._tokenize, controls, enable_thinking=enable_thinking)

    def cancel(self) -> None:
        """Cancel every request of this engine that exists now (running, suspended or not started yet), between
        two steps; each ends with finish_reason "cancelled". Requests created later are not affected."""
        self.check_open()
        self._occupancy.cancel_all()

    # -- tokens -------------------------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        with self._open_native():
            return detokenize(self.pair.vocab, tokens)

    def token_text(self, token: int) -> str:
        """The text of one token, special tokens rendered."""
        with self._open_native():
            return self._special_piece(token)

    # -- state --------------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the cached prefix (both caches and the checkpoints)."""
        with self._occupancy.exclusive():
            self._parts.cache.clear()

    def sampling_defaults(self) -> dict[str, float | int]:
        """The target's recommended sampling from its `general.sampling.*` keys, only those present, named as this
        engine's stream arguments (temperature, top_k, top_p, min_p): `engine.stream(p, **engine.sampling_defaults())`.
        """
        self.check_open()
        return dict(self._sampling_defaults)

    def info(self) -> dict[str, Any]:
        with self._open_native():
            pair, spec, store = self.pair, self.pair.spec, self._parts.cache.checkpoints
            return {
                "target": str(pair.target_info.path),
                "draft": str(pair.draft_info.path) if pair.draft_info else None,
                "target_arch": pair.target_info.arch,
                "hybrid": pair.is_recurrent,
                "draft_kind": None if spec is None else ("dflash2" if spec.is_dflash2 else "dflash1"),
                "block_size": spec.block_size if spec else None,
                "draft_capacity": pair.draft_capacity,
                "target_layer_ids": list(spec.target_layer_ids) if spec else [],
                "n_ctx": pair.n_ctx,
                "n_batch": pair.n_batch,
                "n_rs_seq": pair.n_rs_seq,
                "n_vocab": pair.n_vocab,
                "n_embd": pair.n_embd,
                "n_cached": len(self._parts.cache),
                "checkpoints": store.describe() if store is not None else None,
                "chat_template": self.template is not None,
                "supports_thinking": bool(self.template and self.template.supports_thinking),
                "sampling_defaults": dict(self._sampling_defaults),
                "llama_cpp_version": llama_cpp.__version__,
            }

    def close(self) -> None:
        """Close the engine at once; a request suspended or running ends with one final "cancelled" event, and the
        native handles are freed as soon as no step runs (see streams.py). Idempotent."""
        if not self._occupancy.closing:
            self._occupancy.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- internals ----------------------------------------------------------------------------------------------

    def _free(self) -> None:
        parts = self._parts
        for part in (parts.drafter, parts.bridge, parts.batch):
            if part is not None:
                part.free()
        self.pair.close()

    @contextlib.contextmanager
    def _open_native(self) -> Iterator[None]:
        """Native reads outside requests: under the occupancy lock, so close() cannot free them midway."""
        with self._occupancy.cond:
            self.check_open()
            yield

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        with self._open_native():
            while True:
                buf = (ll.llama_token * cap)()
                n = ll.llama_tokenize(self.pair.vocab, raw, len(raw), buf, cap, add_special, parse_special)
                if n >= 0:
                    return list(buf[:n])
                if n == -(2**31):
                    raise RequestError("the text is too long to tokenize")
                cap = -n

    def _special_piece(self, token: int) -> str:
        return token_piece(self.pair.vocab, token, ctypes.create_string_buffer(256)).decode("utf-8", "replace")

    def _template(self) -> ChatTemplate:
        self.check_open()
        if self.template is None:
            raise RequestError(f"{self.pair.target_info.path.name} has no chat template (tokenizer.chat_template)")
        return self.template

    def _start(self, tokens: list[int], req: Request) -> RequestStream:
        holder: dict[str, Decoding] = {}

        def decoding(stream: RequestStream) -> Iterator[StreamEvent]:
            holder["run"] = run = Decoding(self._parts, tokens, req, self._policy(req), stream.cancelled.is_set)
            return run.events()

        def final(detail: str) -> StreamEvent:
            run = holder.get("run")
            if run is not None:
                return run.final_event([], [], "", "cancelled", detail)
            stats = Stats(speculative=req.speculative, draft_capacity=self.pair.draft_capacity, n_prompt=len(tokens))
            return StreamEvent("", [], stats, "cancelled", detail)

        return RequestStream(self._occupancy, decoding, final, self._parts.cache.clear)

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            tokens = self._tokenize(prompt, True, True)
        else:
            try:
                tokens = [int(t) for t in prompt]
            except (TypeError, ValueError) as error:
                raise RequestError(f"a prompt is a string or a sequence of token ids ({error})") from None
            bad = [t for t in tokens if not 0 <= t < self.pair.n_vocab]
            if bad:
                raise RequestError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.pair.n_vocab - 1})"
                )
        if not tokens:
            raise RequestError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise PromptTooLongError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.n_ctx}: shorten it or open the "
                "pair with a larger n_ctx"
            )
        return tokens

    def _request(self, max_tokens: int, sampling: SamplingParams, stop: str | Sequence[str] | None,
                 speculative: bool, draft_max: int | str | None, n_min: int, p_min: float, verify: str) -> Request:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer (got {max_tokens!r})")
        sampling.check()
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        capacity = self.pair.draft_capacity
        policy = self.default_draft_policy if draft_max is None else draft_max
        fixed_ok = isinstance(policy, int) and not isinstance(policy, bool) and 0 <= policy <= capacity
        if policy != "auto" and not fixed_ok:
            raise RequestError(f"draft_max must be 'auto' or an integer in 0..{capacity} (got {policy!r})")
        if not 0 <= n_min <= capacity or not 0.0 <= p_min < 1.0:
            raise RequestError(f"n_min must be in 0..{capacity} and p_min in [0, 1)")
        if verify not in VERIFY_MODES:
            raise RequestError(f"verify must be one of {', '.join(VERIFY_MODES)} (got {verify!r})")
        on = bool(speculative) and self.pair.spec is not None
        return Request(max_tokens, sampling, stops, on, policy, n_min, p_min, verify)

    def _policy(self, req: Request) -> DraftPolicy | None:
        if not req.speculative:
            return None
        key = str(req.draft_max)
        if key not in self._policies:
            self._policies[key] = make_policy(req.draft_max, self.pair.draft_capacity, verify_cap=self._verify_cap())
        return self._policies[key]

    def _verify_cap(self) -> int:
        # CUDA's small-batch matrix-vector kernels take up to 8 rows: keep verify batches there on a GPU target.
        on_gpu = self.pair.n_gpu_layers != 0 and bool(ll.llama_supports_gpu_offload())
        return 7 if on_gpu else self.pair.n_ubatch - 1

    def _load_template(self) -> ChatTemplate | None:
        raw = ll.llama_model_chat_template(self.pair.target_model, None)
        src = raw.decode("utf-8", "replace") if raw else self.pair.meta("tokenizer.chat_template")
        if not src:
            return None
        vocab, n_vocab = self.pair.vocab, self.pair.n_vocab
        bos, eos = ll.llama_vocab_bos(vocab), ll.llama_vocab_eos(vocab)
        return ChatTemplate(src, self._special_piece(bos) if 0 <= bos < n_vocab else "",
                            self._special_piece(eos) if 0 <= eos < n_vocab else "")
