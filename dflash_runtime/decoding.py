"""One request on the engine's parts, split as llama.cpp splits speculative decoding:

- begin: reuse the cached prefix (rolling back, or restoring a context checkpoint), prefill the rest in chunks with
  the target features injected into the draft, checkpoints saved where a later request can use them;
- per step: choose a draft length (clamped to the room left), draft a block, decode `[id_last, drafts]` on the
  target, walk the verifier over the rows (accept), cut both caches to what was accepted.

Cancellation is checked between prefill chunks and between steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from .batches import TokenBatch
from .cache import PairCache
from .checkpoints import CheckpointCosts
from .controller import DraftPolicy
from .drafter import BlockDrafter, DraftSampling, Proposal
from .features import FeatureBridge
from .pair import LinkedPair
from .results import StreamEvent
from .sampling import ChainProbabilities, Sampler, SamplingParams
from .stats import Stats
from .textstream import TextStream
from .verify import DRAFT, TARGET, MatchVerifier, RejectionVerifier


@dataclass(frozen=True)
class Request:
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    speculative: bool
    draft_max: int | str
    n_min: int
    p_min: float
    verify: str  # "sample" or "match": how drafts are checked above temperature 0
    on_prefill: Callable[[int, int], None] | None = None  # (tokens prefilled, tokens to prefill) after each chunk


@dataclass
class Parts:
    """The engine's parts a request runs on."""

    pair: LinkedPair
    cache: PairCache
    batch: TokenBatch
    bridge: FeatureBridge | None
    drafter: BlockDrafter | None


class _Clock:
    """Accumulates time spent inside native calls."""

    def __init__(self) -> None:
        self.s = 0.0

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.s += time.perf_counter() - self._t


@dataclass
class _Step:
    tokens: list[int]
    sources: list[str]
    delta: str
    finish: str | None = None
    detail: str = ""


class Decoding:
    def __init__(self, parts: Parts, prompt: Sequence[int], req: Request, policy: DraftPolicy | None,
                 cancelled: Callable[[], bool]) -> None:
        self.parts = parts
        self.prompt = list(prompt)
        self.req = req
        self.policy = policy
        self.cancelled = cancelled
        pair = parts.pair
        self.stats = Stats(speculative=req.speculative, draft_capacity=pair.draft_capacity,
                           draft_policy=req.draft_max if req.speculative else 0, verify_mode=self._verify_mode())
        self.costs = CheckpointCosts()
        self.clock = _Clock()
        self.text = TextStream(pair.vocab, req.stop)
        self._t_start = time.perf_counter()

    def _verify_mode(self) -> str:
        if not self.req.speculative:
            return "plain"
        return "greedy" if self.req.sampling.greedy else self.req.verify

    # -- the request ------------------------------------------------------------------------------------------

    def events(self) -> Iterator[StreamEvent]:
        with contextlib.ExitStack() as resources:
            verifier, draft_sampling = self._verifier(resources)
            if self.policy is not None:
                self.policy.begin_request()
            last_rows = self._prefill()
            if last_rows is None:
                yield self.final_event([], [], "", "cancelled", "cancelled during the prompt")
                return
            self._t_start, self.clock.s = time.perf_counter(), 0.0
            step = self._accept(verifier.walk(Proposal(), first_row=last_rows - 1))  # the prefill's own sample
            while step.finish is None:
                if self.stats.n_generated >= self.req.max_tokens:
                    step.finish, step.detail = "length", f"max_tokens={self.req.max_tokens} reached"
                    break
                if len(self.parts.cache) >= self.parts.pair.n_ctx:
                    step.finish, step.detail = "length", f"the context is full ({self.parts.pair.n_ctx} tokens)"
                    break
                yield self._event(step)
                if self.cancelled():
                    step = _Step([], [], "", "cancelled", "cancelled by the caller")
                    break
                step = self._step(self._id_last, verifier, draft_sampling)
            yield self.final_event(step.tokens, step.sources, step.delta, step.finish or "stop", step.detail)

    def final_event(self, tokens: list[int], sources: list[str], delta: str, finish: str,
                    detail: str) -> StreamEvent:
        delta += self.text.finish()
        self._time()
        if self.policy is not None:
            self.stats.controller = self.policy.describe()
        return StreamEvent(delta, tokens, self.stats.snapshot(), finish, detail, sources, self.text.take_runs())

    def _event(self, step: _Step) -> StreamEvent:
        self._time()
        return StreamEvent(step.delta, step.tokens, self.stats.snapshot(), token_sources=step.sources,
                           delta_sources=self.text.take_runs())

    def _time(self) -> None:
        s = self.stats
        s.decode_ms = (time.perf_counter() - self._t_start) * 1000.0
        s.native_ms = self.clock.s * 1000.0
        s.checkpoint_restored_at = self.costs.restored_at
        s.checkpoint_restore_ms = self.costs.restore_ms
        s.checkpoints_saved, s.checkpoint_bytes = self.costs.saved, self.costs.saved_bytes
        s.checkpoint_save_ms = self.costs.save_ms

    def _verifier(self, resources: contextlib.ExitStack) -> tuple[Any, DraftSampling | None]:
        pair, sampling = self.parts.pair, self.req.sampling
        if self.stats.verify_mode == "sample":
            rng = np.random.default_rng(sampling.seed)
            chain = ChainProbabilities(sampling, pair.n_vocab)
            resources.callback(chain.free)
            verifier = RejectionVerifier(chain, rng, pair.target_ctx, pair.n_vocab)
            return verifier, DraftSampling(chain, rng)
        sampler = resources.enter_context(Sampler(sampling))
        return MatchVerifier(sampler, pair.target_ctx), None

    # -- begin: prefix reuse and prefill ------------------------------------------------------------------------

    def _prefill(self) -> int | None:
        """Bring the cache to the prompt; returns the row count of the last decode (its last row has the logits
        of the prompt's last token), or None when cancelled."""
        t0 = time.perf_counter()
        parts, prompt, stats = self.parts, self.prompt, self.stats
        cache, n_batch = parts.cache, parts.pair.n_batch
        kept = cache.reuse(prompt, self.costs)
        end = len(prompt)
        stats.n_prompt, stats.n_reused, stats.n_prefilled = end, kept, end - kept
        # A checkpoint just before the last prompt token serves the same prompt again and the next chat turn.
        split = end - 1 if cache.checkpointing else -1
        pos, rows = kept, 0
        while pos < end:
            if self.cancelled():
                return None
            if pos == split:
                self._checkpoint(prompt_end=True)
            stop = min(pos + n_batch, end)
            if pos < split < stop:
                stop = split
            rows = self._decode(prompt[pos:stop], "last" if stop == end else "none")
            pos = stop
            if self.req.on_prefill is not None:
                self.req.on_prefill(pos - kept, end - kept)
            if parts.bridge is not None and (self.req.speculative or parts.bridge.n_pending >= parts.bridge.capacity):
                parts.bridge.flush()  # speculative requests inject each prompt chunk at once, as llama.cpp does
            if pos < end and pos != split:
                self._checkpoint(prompt_end=False)
        stats.prefill_ms = (time.perf_counter() - t0) * 1000.0
        return rows

    def _checkpoint(self, *, prompt_end: bool) -> None:
        if self.parts.cache.checkpoint_due(prompt_end=prompt_end):
            self.parts.cache.save_checkpoint(self.costs)

    def _decode(self, tokens: Sequence[int], outputs: str) -> int:
        parts = self.parts
        pos0 = len(parts.cache)
        n = parts.batch.fill(tokens, pos0, outputs=outputs)
        with self.clock:
            parts.batch.decode(parts.pair.target_ctx, "target")
        parts.cache.decoded(tokens)
        if parts.bridge is not None:
            parts.bridge.capture(n, pos0)
        return n

    # -- one step: draft → verify → accept ----------------------------------------------------------------------

    def _step(self, id_last: int, verifier: Any, draft_sampling: DraftSampling | None) -> _Step:
        t_round = time.perf_counter()
        parts, req, stats, policy = self.parts, self.req, self.stats, self.policy
        pos0 = len(parts.cache)
        # Like llama.cpp's server: leave room in the context, and draft nothing past max_tokens.
        room = max(0, min(parts.pair.n_ctx - pos0 - 2, req.max_tokens - stats.n_generated - 1))
        n_block = policy.choose(pos0, room) if policy is not None else 0
        proposal = Proposal()
        if n_block > 0:
            # Rows left pending by plain rounds belong to those rounds' cost, not to this one's.
            t_round += self._inject_pending()
            proposal = self._propose(id_last, pos0, n_block, draft_sampling)
        if policy is not None:
            stats.draft_lengths.append(len(proposal.tokens))
        t = time.perf_counter()
        self._decode([id_last, *proposal.tokens], "all")
        eager = policy is None or policy.eager_inject
        t_inject = self._inject_pending() if proposal.tokens and eager else 0.0
        step = self._accept(verifier.walk(proposal))
        stats.verify_ms += (time.perf_counter() - t - t_inject) * 1000.0
        n_accepted = step.sources.count(DRAFT)
        parts.cache.roll_back(pos0 + 1 + n_accepted)
        if proposal.tokens:
            stats.record_verify(len(proposal.tokens), n_accepted, len(step.tokens))
        else:
            stats.plain_steps += 1
        if policy is not None:
            policy.observe(n_block, len(proposal.tokens), n_accepted, time.perf_counter() - t_round)
        self._checkpoint(prompt_end=False)
        return step

    def _propose(self, id_last: int, pos0: int, n_block: int, sampling: DraftSampling | None) -> Proposal:
        drafter = self.parts.drafter
        assert drafter is not None
        t = time.perf_counter()
        with self.clock:
            proposal = drafter.draft(id_last, pos0, n_block, n_min=self.req.n_min, p_min=self.req.p_min,
                                     sampling=sampling)
        self.stats.draft_ms += (time.perf_counter() - t) * 1000.0
        return proposal

    def _inject_pending(self) -> float:
        """Bring the draft cache up to date with the target's; returns the seconds it took."""
        bridge = self.parts.bridge
        assert bridge is not None
        t = time.perf_counter()
        with self.clock:
            bridge.flush()
        spent = time.perf_counter() - t
        self.stats.inject_ms += spent * 1000.0
        return spent

    def _accept(self, walk: Iterator[tuple[int, str]]) -> _Step:
        """Emit the verifier's tokens until the walk ends, the end of generation or a stop string."""
        step = _Step([], [], "")
        vocab = self.parts.pair.vocab
        while True:
            with self.clock:  # the walk samples the target's rows
                item = next(walk, None)
            if item is None:
                break
            token, source = item
            if ll.llama_vocab_is_eog(vocab, token):
                step.finish, step.detail = "stop", "end of generation"
                break
            step.tokens.append(token)
            step.sources.append(source)
            step.delta += self.text.feed(token, source)
            if self.text.stopped:
                step.finish, step.detail = "stop", "stop string"
                break
        self.stats.n_generated += len(step.tokens)
        if step.tokens:
            self._id_last = step.tokens[-1]
        return step


__all__ = ["DRAFT", "TARGET", "Decoding", "Parts", "Request"]
