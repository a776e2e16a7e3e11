"""One request on the engine's parts, split as llama.cpp splits speculative decoding:

- begin: make the caches the request owner's (sessions.py), reuse the cached prefix (rolling back, or restoring a
  context checkpoint), prefill the rest in chunks, each drafter processing every chunk, checkpoints saved where a
  later request can use them;
- per step: choose a draft length (clamped to the room left), let the request's drafter draft, decode
  `[id_last, drafts]` on the target, let every drafter process it, walk the verifier over the rows (accept), cut the
  caches to what was accepted.

Cancellation is checked between prefill chunks and between steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .batches import TokenBatch
from .cache import PairCache
from .checkpoints import CheckpointCosts, prompt_marks
from .controller import DraftPolicy
from .drafting import Drafter
from .methods import Chain, split
from .pair import LinkedPair
from .proposal import DRAFT, TARGET, DraftSampling, Proposal
from .results import StreamEvent
from .sampling import ChainProbabilities, Sampler, SamplingParams
from .sessions import CacheOwners
from .stats import Stats
from .textstream import TextStream
from .verify import Verifier, Verifiers


@dataclass(frozen=True)
class Request:
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    method: str | None  # the drafter that drafts; None: plain decoding
    draft_length: int | str  # "auto" or a fixed length (0: no draft)
    n_min: int
    p_min: float
    verify: str  # "sample" or "match": how drafts are checked above temperature 0
    owner: Hashable | None = None  # whose text this is: only its own cached tokens are reused (sessions.py)
    public_prefix: int = 0  # leading prompt tokens that any owner may reuse
    on_prefill: Callable[[int, int], None] | None = None  # (tokens prefilled, tokens to prefill) after each chunk

    @property
    def speculative(self) -> bool:
        return self.method is not None

    @property
    def verify_mode(self) -> str:
        if not self.speculative:
            return "plain"
        return "greedy" if self.sampling.greedy else self.verify


@dataclass
class Parts:
    """The engine's parts a request runs on."""

    pair: LinkedPair
    cache: PairCache
    batch: TokenBatch
    drafters: dict[str, Drafter]
    verifiers: Verifiers
    owners: CacheOwners
    controls: frozenset[int]  # control token ids: message boundaries, where checkpoints serve the next turn


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
        self.drafter = Chain(parts.drafters, split(req.method)) if req.method is not None else None
        self.stats = Stats(speculative=req.speculative, method=req.method,
                           draft_capacity=self.drafter.capacity if self.drafter else 0,
                           draft_length=req.draft_length if req.speculative else 0, verify_mode=req.verify_mode)
        self.costs = CheckpointCosts()
        self.clock = _Clock()
        self.text = TextStream(parts.pair.vocabulary, req.stop)
        self._t_start = time.perf_counter()
        self._prefilled = False
        self._drafted_by: str | None = None  # the method that drafted the current step (a chain's member)

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
            if self.drafter is not None:
                self.drafter.begin()
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

    def _verifier(self, resources: contextlib.ExitStack) -> tuple[Verifier, DraftSampling | None]:
        pair, sampling, verifiers = self.parts.pair, self.req.sampling, self.parts.verifiers
        if self.stats.verify_mode == "sample":
            rng = np.random.default_rng(sampling.seed)
            chain = ChainProbabilities(sampling, pair.n_vocab)
            resources.callback(chain.free)
            return verifiers.sample(chain, rng, pair.target_ctx, pair.n_vocab), DraftSampling(chain, rng)
        sampler = resources.enter_context(Sampler(sampling))
        return verifiers.match(sampler, pair.target_ctx), None

    # -- begin: prefix reuse and prefill ------------------------------------------------------------------------

    def _prefill(self) -> int | None:
        """Bring the cache to the prompt; returns the row count of the last decode (its last row has the logits
        of the prompt's last token), or None when cancelled."""
        parts, prompt, stats, req = self.parts, self.prompt, self.stats, self.req
        cache, n_batch = parts.cache, parts.pair.n_batch
        limit = parts.owners.switch(req.owner, prompt, req.public_prefix)
        t0 = time.perf_counter()
        kept = cache.reuse(prompt, self.costs, limit)
        end = len(prompt)
        stats.n_prompt, stats.n_reused, stats.n_prefilled = end, kept, end - kept
        marks = prompt_marks(prompt, parts.controls, req.public_prefix) if cache.checkpointing else []
        # The first request that declares a public prefix keeps a copy of the caches right after it (sessions.py).
        public_base = req.public_prefix if kept < req.public_prefix and parts.owners.needs_public_base(
            prompt, req.public_prefix) else 0  # fmt: skip
        marks = sorted({m for m in marks if m > kept} | ({public_base} if public_base else set()))
        pos, rows = kept, 0
        while pos < end:
            if self.cancelled():
                return None
            if marks and pos == marks[0]:
                marks.pop(0)
                cache.save_checkpoint(self.costs)
            stop = min(pos + n_batch, end, marks[0] if marks else end)
            rows = self._decode(prompt[pos:stop], "last" if stop == end else "none", eager=req.speculative)
            pos = stop
            if req.on_prefill is not None:
                req.on_prefill(pos - kept, end - kept)
            if pos == public_base:
                if marks and pos == marks[0]:
                    marks.pop(0)
                    cache.save_checkpoint(self.costs)
                cache.public_len = pos
                parts.owners.keep_public_base()
            if pos < end and not (marks and pos == marks[0]) and cache.interval_due():
                cache.save_checkpoint(self.costs)
        if req.public_prefix > cache.public_len:
            cache.public_len = min(req.public_prefix, end)
        stats.prefill_ms = (time.perf_counter() - t0) * 1000.0
        self._prefilled = True
        return rows

    def _decode(self, tokens: Sequence[int], outputs: str, *, eager: bool) -> int:
        """Decode on the target, then let every drafter process the rows (eagerly only the request's own)."""
        parts = self.parts
        pos0 = len(parts.cache)
        n = parts.batch.fill(tokens, pos0, outputs=outputs)
        with self.clock:
            parts.batch.decode(parts.pair.target_ctx, "target")
        parts.cache.decoded(tokens)
        t = time.perf_counter()
        with self.clock:
            for drafter in parts.drafters.values():
                drafter.process(tokens, pos0, eager=eager and self.drafter is not None
                                and drafter in self.drafter.members)
        if self._prefilled:
            self.stats.inject_ms += (time.perf_counter() - t) * 1000.0
        return n

    # -- one step: draft → verify → accept ----------------------------------------------------------------------

    def _step(self, id_last: int, verifier: Verifier, draft_sampling: DraftSampling | None) -> _Step:
        t_round = time.perf_counter()
        parts, req, stats, policy = self.parts, self.req, self.stats, self.policy
        pos0 = len(parts.cache)
        # Like llama.cpp's server: leave room in the context, and draft nothing past max_tokens.
        room = max(0, min(parts.pair.n_ctx - pos0 - 2, req.max_tokens - stats.n_generated - 1))
        n_block = policy.choose(pos0, room) if policy is not None else 0
        proposal = Proposal()
        if n_block > 0:
            # Rows left pending by plain rounds belong to those rounds' cost, not to this one's.
            t_round += self._catch_up()
            proposal = self._propose(id_last, pos0, n_block, draft_sampling)
        if policy is not None:
            stats.draft_lengths.append(len(proposal.tokens))
        t = time.perf_counter()
        inject_before = stats.inject_ms
        self._decode([id_last, *proposal.tokens], "all", eager=bool(proposal.tokens))
        step = self._accept(verifier.walk(proposal))
        step_ms = (time.perf_counter() - t) * 1000.0 - (stats.inject_ms - inject_before)
        stats.verify_ms += step_ms
        n_accepted = step.sources.count(DRAFT)
        if self.drafter is not None and proposal.tokens:
            self.drafter.accept(n_accepted)
        parts.cache.roll_back(pos0 + 1 + n_accepted)
        if proposal.tokens:
            stats.record_verify(len(proposal.tokens), n_accepted, len(step.tokens), self._drafted_by)
        else:
            stats.plain_steps += 1
            stats.plain_ms += step_ms
        if policy is not None:
            policy.observe(n_block, len(proposal.tokens), n_accepted, time.perf_counter() - t_round)
        if parts.cache.interval_due():
            parts.cache.save_checkpoint(self.costs)
        return step

    def _propose(self, id_last: int, pos0: int, n_block: int, sampling: DraftSampling | None) -> Proposal:
        assert self.drafter is not None
        t = time.perf_counter()
        with self.clock:
            proposal, self._drafted_by = self.drafter.draft(id_last, pos0, n_block, n_min=self.req.n_min,
                                                            p_min=self.req.p_min, sampling=sampling)
        self.stats.draft_ms += (time.perf_counter() - t) * 1000.0
        return proposal

    def _catch_up(self) -> float:
        """Bring the request's drafter up to date with the target; returns the seconds it took."""
        assert self.drafter is not None
        t = time.perf_counter()
        with self.clock:
            self.drafter.catch_up()
        spent = time.perf_counter() - t
        self.stats.inject_ms += spent * 1000.0
        return spent

    def _accept(self, walk: Iterator[tuple[int, str]]) -> _Step:
        """Emit the verifier's tokens until the walk ends, the end of generation or a stop string."""
        step = _Step([], [], "")
        vocab = self.parts.pair.vocabulary
        while True:
            with self.clock:  # the walk samples the target's rows
                item = next(walk, None)
            if item is None:
                break
            token, source = item
            if vocab.is_eog(token):
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
