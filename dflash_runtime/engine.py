"""The speculative engine: prefill → (draft → verify → accept → rollback)* over a linked pair.

Every emitted token is a target sample given the accepted prefix, so the output equals target-only decoding:
token-identical at temperature 0, and the same draws (hence the same text for a given seed) above it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp
from llama_cpp import llama_cpp as ll

from .batches import TokenBatch
from .chat import ChatTemplate
from .controller import DraftPolicy, make_policy
from .drafter import BlockDrafter
from .errors import PromptTooLongError, RequestError, RollbackError
from .features import FeatureBridge
from .pair import LinkedPair
from .results import Result, StreamEvent
from .sampling import Sampler, SamplingParams
from .stats import Stats
from .textstream import TextStream, detokenize, token_piece


@dataclass(frozen=True)
class Request:
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    speculative: bool
    draft_max: int | str
    n_min: int
    p_min: float


class _Clock:
    """Accumulates time spent inside native calls."""

    def __init__(self) -> None:
        self.s = 0.0

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.s += time.perf_counter() - self._t


class Engine(LinkedPair):
    """A linked pair that generates. One request at a time; the KV cache is kept between requests and reused."""

    def __init__(self, *args: Any, draft_policy: str | int = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            self._setup(draft_policy)
        except BaseException:
            self.close()
            raise

    def _setup(self, draft_policy: str | int) -> None:
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._kv: list[int] = []  # tokens whose K/V are in the target cache (positions 0..len-1); the draft's ≤ these
        self._mem = ll.llama_get_memory(self.target_ctx)
        self._batch = TokenBatch(self.n_batch)
        self._bridge: FeatureBridge | None = None
        self._drafter: BlockDrafter | None = None
        if self.spec is not None:
            assert self.api is not None
            self._draft_mem = ll.llama_get_memory(self.draft_ctx)
            self._bridge = FeatureBridge(self.api, self.target_ctx, self.draft_ctx, self.spec.target_layer_ids,
                                         self.n_embd, self.n_ubatch)
            self._drafter = BlockDrafter(self.api, self.draft_ctx, self.spec, self.n_embd_draft, self.n_vocab)
        self.default_draft_policy = draft_policy
        self._policies: dict[str, DraftPolicy] = {}
        self.template = self._load_template()

    # -- public API ---------------------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> Result:
        tokens: list[int] = []
        parts: list[str] = []
        last: StreamEvent | None = None
        for last in self.stream(prompt, **kwargs):
            tokens += last.tokens
            parts.append(last.delta)
        assert last is not None and last.finish_reason is not None
        return Result(tokens, "".join(parts), last.finish_reason, last.stats, last.finish_detail)

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
    ) -> Iterator[StreamEvent]:
        self.check_open()
        tokens = self._prompt_tokens(prompt)
        req = self._request(max_tokens, SamplingParams(temperature, top_k, top_p, min_p, seed), stop, speculative,
                            draft_max, n_min, p_min)
        if len(tokens) >= self.n_ctx:
            raise PromptTooLongError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.n_ctx}: shorten it or open the "
                "pair with a larger n_ctx"
            )
        return self._run(tokens, req)

    def stream_chat(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool | None = None,
                    **kwargs: Any) -> Iterator[StreamEvent]:
        return self.stream(self.render_chat(messages, enable_thinking=enable_thinking), **kwargs)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool | None = None,
             **kwargs: Any) -> Result:
        return self.generate(self.render_chat(messages, enable_thinking=enable_thinking), **kwargs)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool | None = None) -> str:
        if self.template is None:
            raise RequestError(f"{self.target_info.path.name} has no chat template (tokenizer.chat_template)")
        return self.template.render(messages, enable_thinking=enable_thinking)

    def cancel(self) -> None:
        """Stop the running request between two steps (thread-safe); it ends with finish_reason "cancelled"."""
        self._cancel.set()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self.check_open()
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        while True:
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def detokenize(self, tokens: Sequence[int]) -> str:
        self.check_open()
        return detokenize(self.vocab, tokens)

    def token_text(self, token: int) -> str:
        return token_piece(self.vocab, token, ctypes.create_string_buffer(256)).decode("utf-8", "replace")

    def reset(self) -> None:
        """Forget the cached prefix (both caches)."""
        self.check_open()
        with self._lock:
            self._clear_caches()

    def info(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "target": str(self.target_info.path),
            "draft": str(self.draft_info.path) if self.draft_info else None,
            "target_arch": self.target_info.arch,
            "hybrid": self.is_recurrent,
            "draft_kind": None if spec is None else ("dflash2" if spec.is_dflash2 else "dflash1"),
            "block_size": spec.block_size if spec else None,
            "draft_max": self.draft_max,
            "target_layer_ids": list(spec.target_layer_ids) if spec else [],
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "n_rs_seq": self.n_rs_seq,
            "n_vocab": self.n_vocab,
            "n_embd": self.n_embd,
            "chat_template": self.template is not None,
            "supports_thinking": bool(self.template and self.template.supports_thinking),
            "llama_cpp_version": llama_cpp.__version__,
        }

    def close(self) -> None:
        if self.closed:
            return
        lock = getattr(self, "_lock", None)
        if lock is None:  # construction failed before the engine's own parts existed
            super().close()
            return
        self._cancel.set()
        with lock:
            for name in ("_drafter", "_bridge", "_batch"):
                part = getattr(self, name, None)
                if part is not None:
                    part.free()
            super().close()

    # -- request checks -----------------------------------------------------------------------------------------

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty")
            return self.tokenize(prompt)
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise RequestError("the prompt is empty")
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.n_vocab - 1})")
        return tokens

    def _request(self, max_tokens: int, sampling: SamplingParams, stop: str | Sequence[str] | None,
                 speculative: bool, draft_max: int | str | None, n_min: int, p_min: float) -> Request:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer (got {max_tokens!r})")
        sampling.check()
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        policy = self.default_draft_policy if draft_max is None else draft_max
        fixed_ok = isinstance(policy, int) and not isinstance(policy, bool) and 0 <= policy <= self.draft_max
        if policy != "auto" and not fixed_ok:
            raise RequestError(f"draft_max must be 'auto' or an integer in 0..{self.draft_max} (got {policy!r})")
        if not 0 <= n_min <= max(self.draft_max, 0) or not 0.0 <= p_min < 1.0:
            raise RequestError(f"n_min must be in 0..{self.draft_max} and p_min in [0, 1)")
        return Request(max_tokens, sampling, stops, speculative and self.spec is not None, policy, n_min, p_min)

    def _policy(self, req: Request) -> DraftPolicy | None:
        if not req.speculative:
            return None
        key = str(req.draft_max)
        if key not in self._policies:
            self._policies[key] = make_policy(req.draft_max, self.draft_max, verify_cap=self._verify_cap())
        return self._policies[key]

    def _verify_cap(self) -> int:
        # CUDA's small-batch matrix-vector kernels take up to 8 rows: keep verify batches there on a GPU target.
        on_gpu = self.n_gpu_layers != 0 and bool(ll.llama_supports_gpu_offload())
        return 7 if on_gpu else self.n_ubatch - 1

    def _load_template(self) -> ChatTemplate | None:
        raw = ll.llama_model_chat_template(self.target_model, None)
        src = raw.decode("utf-8", "replace") if raw else self.meta("tokenizer.chat_template")
        if not src:
            return None
        return ChatTemplate(src, self._special_text(ll.llama_vocab_bos(self.vocab)),
                            self._special_text(ll.llama_vocab_eos(self.vocab)))

    def _special_text(self, token: int) -> str:
        return self.token_text(token) if 0 <= token < self.n_vocab else ""

    # -- cache bookkeeping --------------------------------------------------------------------------------------

    def _clear_caches(self) -> None:
        ll.llama_memory_clear(self._mem, True)
        if self.spec is not None:
            ll.llama_memory_clear(self._draft_mem, True)
            assert self._bridge is not None
            self._bridge.n_pending = 0
        self._kv = []

    def _trim(self, n: int) -> None:
        """Keep positions 0..n-1 in both caches. A refused removal clears both caches (they would still hold
        rejected rows) and raises: never ignored."""
        had = len(self._kv)
        if n < had and not ll.llama_memory_seq_rm(self._mem, 0, n, -1):
            self._clear_caches()
            raise RollbackError(
                f"the target cache refused to roll back to position {n} (had {had}): a hybrid target "
                f"needs n_rs_seq ≥ the draft length (it has {self.n_rs_seq})"
            )
        del self._kv[n:]
        if self._bridge is not None:
            self._bridge.drop_from(n)
            # The draft's cache is attention only: removing a suffix, even an empty one, always succeeds there.
            if not ll.llama_memory_seq_rm(self._draft_mem, 0, n, -1):
                self._clear_caches()
                raise RollbackError(f"the draft cache refused to roll back to position {n}")

    def _reuse_prefix(self, tokens: list[int]) -> int:
        """Keep the longest cached prefix of `tokens` (at least one token is left to decode for its logits)."""
        limit = min(len(self._kv), len(tokens) - 1)
        n = 0
        while n < limit and self._kv[n] == tokens[n]:
            n += 1
        try:
            self._trim(n)
        except RollbackError:
            n = 0  # a recurrent state cannot go back further than its snapshots: start over (caches are cleared)
        return n

    def _flush_features(self) -> None:
        assert self._bridge is not None
        self._bridge.flush()

    # -- the loop -----------------------------------------------------------------------------------------------

    def _decode_target(self, tokens: Sequence[int], outputs: str, clock: _Clock) -> None:
        pos0 = len(self._kv)
        n = self._batch.fill(tokens, pos0, outputs=outputs)
        with clock:
            self._batch.decode(self.target_ctx, "target")
        self._kv.extend(tokens)
        if self._bridge is not None:
            self._bridge.capture(n, pos0)

    def _prefill(self, tokens: list[int], stats: Stats, clock: _Clock, speculative: bool) -> None:
        t0 = time.perf_counter()
        n_reused = self._reuse_prefix(tokens)
        todo = tokens[n_reused:]
        stats.n_prompt, stats.n_reused, stats.n_prefilled = len(tokens), n_reused, len(todo)
        for start in range(0, len(todo), self.n_batch):
            chunk = todo[start:start + self.n_batch]
            last = start + len(chunk) == len(todo)
            self._decode_target(chunk, "last" if last else "none", clock)
            if self._bridge is not None and (speculative or self._bridge.n_pending >= self._bridge.capacity):
                self._flush_features()  # speculative requests inject each prompt chunk at once, as llama.cpp does
        stats.prefill_ms = (time.perf_counter() - t0) * 1000.0

    def _run(self, prompt: list[int], req: Request) -> Iterator[StreamEvent]:
        with self._lock:
            self._cancel.clear()
            yield from self._loop(prompt, req)

    def _loop(self, prompt: list[int], req: Request) -> Iterator[StreamEvent]:
        stats = Stats(speculative=req.speculative, draft_max=self.draft_max)
        policy = self._policy(req)
        if policy is not None:
            policy.begin_request()
        text = TextStream(self.vocab, req.stop)
        clock = _Clock()
        with Sampler(req.sampling) as sampler:
            self._prefill(prompt, stats, clock, req.speculative)
            t_start, clock.s = time.perf_counter(), 0.0
            with clock:
                id_last = sampler.sample(self.target_ctx, -1)
            tokens: list[int] = []
            delta = ""
            finish: str | None = None
            detail = ""
            if ll.llama_vocab_is_eog(self.vocab, id_last):
                finish, detail = "stop", "end of generation"
            else:
                tokens, delta = [id_last], text.feed(id_last)
                stats.n_generated = 1
                if text.stopped:
                    finish, detail = "stop", "stop string"
            while finish is None:
                if stats.n_generated >= req.max_tokens:
                    finish, detail = "length", f"max_tokens={req.max_tokens} reached"
                    break
                if len(self._kv) >= self.n_ctx:
                    finish, detail = "length", f"the context is full ({self.n_ctx} tokens)"
                    break
                self._time(stats, t_start, clock)
                yield StreamEvent(delta, tokens, stats.snapshot())
                tokens, delta = [], ""
                if self._cancel.is_set():
                    finish, detail = "cancelled", "cancelled by the caller"
                    break
                tokens, delta, finish, detail = self._step(id_last, req, policy, sampler, text, stats, clock)
                if tokens:
                    id_last = tokens[-1]
            delta += text.finish()
            self._time(stats, t_start, clock)
            if policy is not None:
                stats.controller = policy.describe()
            yield StreamEvent(delta, tokens, stats.snapshot(), finish, detail)

    @staticmethod
    def _time(stats: Stats, t_start: float, clock: _Clock) -> None:
        stats.decode_ms = (time.perf_counter() - t_start) * 1000.0
        stats.native_ms = clock.s * 1000.0

    def _step(self, id_last: int, req: Request, policy: DraftPolicy | None, sampler: Sampler, text: TextStream,
              stats: Stats, clock: _Clock) -> tuple[list[int], str, str | None, str]:
        """One target decode: [id_last] plus a draft when it pays. Returns (tokens, text, finish, detail)."""
        t_round = time.perf_counter()
        pos0 = len(self._kv)
        # Like llama.cpp's server: leave room in the context and do not draft past max_tokens.
        cap = min(self.n_ctx - pos0 - 2, req.max_tokens - stats.n_generated - 1)
        n_block = policy.choose(pos0) if policy is not None and cap > 0 else 0
        if pos0 + n_block + 1 > self.n_ctx:
            n_block = 0  # the draft's block would not fit in its cache: a plain step, as llama.cpp ends up doing
        drafts: list[int] = []
        if n_block > 0:
            # Rows left pending by plain rounds belong to those rounds' cost, not to this one's.
            t_round += self._inject_pending(stats, clock)
            drafts = self._propose(id_last, pos0, n_block, req, stats, clock)[:cap]
        if policy is not None:
            stats.draft_lengths.append(len(drafts))
        t = time.perf_counter()
        self._decode_target([id_last, *drafts], "all", clock)
        t_inject = self._inject_pending(stats, clock) if drafts and (policy is None or policy.eager_inject) else 0.0
        new, delta, m, finish, detail = self._accept(drafts, sampler, text, clock)
        stats.verify_ms += (time.perf_counter() - t - t_inject) * 1000.0
        stats.n_generated += len(new)
        self._trim(pos0 + 1 + m)
        if drafts:
            stats.record_verify(len(drafts), m, len(new))
        else:
            stats.plain_steps += 1
        if policy is not None:
            policy.observe(n_block, len(drafts), m, time.perf_counter() - t_round)
        return new, delta, finish, detail

    def _inject_pending(self, stats: Stats, clock: _Clock) -> float:
        """Bring the draft cache up to date with the target's; returns the seconds it took."""
        t = time.perf_counter()
        with clock:
            self._flush_features()
        spent = time.perf_counter() - t
        stats.inject_ms += spent * 1000.0
        return spent

    def _propose(self, id_last: int, pos0: int, n_block: int, req: Request, stats: Stats, clock: _Clock) -> list[int]:
        assert self._drafter is not None
        t = time.perf_counter()
        with clock:
            drafts = self._drafter.draft(id_last, pos0, n_block, n_min=req.n_min, p_min=req.p_min)
        stats.draft_ms += (time.perf_counter() - t) * 1000.0
        return drafts

    def _accept(self, drafts: list[int], sampler: Sampler, text: TextStream, clock: _Clock
                ) -> tuple[list[int], str, int, str | None, str]:
        """Sample the verify rows in order while they match the drafts: (tokens, text, n_matched, finish, detail)."""
        new: list[int] = []
        delta = ""
        m = 0
        for i in range(len(drafts) + 1):
            with clock:
                tok = sampler.sample(self.target_ctx, i)
            if ll.llama_vocab_is_eog(self.vocab, tok):
                return new, delta, m, "stop", "end of generation"
            new.append(tok)
            delta += text.feed(tok)
            matched = i < len(drafts) and tok == drafts[i]
            m += matched
            if text.stopped:
                return new, delta, m, "stop", "stop string"
            if not matched:
                break
        return new, delta, m, None, ""
