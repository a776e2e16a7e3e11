"""One request on its sequence, split as llama.cpp splits speculative decoding, in the phases an engine step drives
(steps.py) — every running request's phase shares the step's one target decode:

- begin: make a sequence the request owner's (cache/sessions.py), reuse its cached prefix (rolling back, or restoring a
  context checkpoint);
- prefill: the rest of the prompt in chunks, as the step's token budget allows, each drafter processing every
  chunk, checkpoints saved where a later request can use them; then the first sample;
- per step: choose a draft length (clamped to the room left), let the request's drafter draft, decode
  `[id_last, drafts]` on the target, let every drafter process it, walk the verifier over the rows (accept), cut the
  sequence to what was accepted. After a draft tree whose accepted path left its spine, the path's tokens (the
  lead) come first: `[lead, id_last, drafts]`, its drafter having taken the path's rows from the tree's decode.

Cancellation is checked between prefill chunks and between steps. A request's events wait in its own queue: a
request whose reader is EVENTS_AHEAD events behind takes no part in the next step, so that readers a little slower
than the one that steps the engine still share its steps, and a suspended stream soon costs nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cache.checkpoints import CheckpointCosts, prompt_marks
from ..cache.pair_cache import PairCache
from ..cache.sessions import CacheOwners
from ..cache.spares import SpareSequences
from ..drafters.drafting import DraftAsk, Drafter, Rows
from ..drafters.method_list import MethodList, split
from ..drafters.proposal import DRAFT, TARGET, DraftSampling, Proposal
from ..drafters.tree import ROOT, DraftTree, TreeWalker, accepted_path
from ..errors import RollbackError
from ..native.batches import TokenBatch
from ..native.sampling import Sampler, SamplerDistribution, SamplingParams
from ..pair import LinkedPair
from ..results.events import StreamEvent
from ..results.stats import Stats
from ..text.deltas import TextDeltas
from .controller import DraftPolicy
from .verify import Verifier, Verifiers, target_distribution

EVENTS_AHEAD = 4  # events a request may make before its reader has taken them
AUTO_TREE_NODES = 8  # tree_nodes="auto": twice the draft length, and at least this (alternatives to short drafts)


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
    owner: Hashable | None = None  # whose text this is: only its own cached tokens are reused (cache/sessions.py)
    public_prefix: int = 0  # leading prompt tokens that any owner may reuse
    on_prefill: Callable[[int, int], None] | None = None  # (tokens prefilled, tokens to prefill) after each chunk
    prefill_events: bool = False  # an event (no tokens) after each prompt chunk but the last: a place to stop
    prefill_chunk: int = 0  # the most prompt tokens of it a step takes while other requests share the step (0: all)
    # a draft tree's verify rows beside the root's (drafters/dflash_tree.py); "auto": see AUTO_TREE_NODES
    tree_nodes: int | str = "auto"

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
    """The engine's parts the requests run on: one cache per sequence, the drafters and the batch all share."""

    pair: LinkedPair
    caches: list[PairCache]
    batch: TokenBatch
    drafters: dict[str, Drafter]
    verifiers: Verifiers
    owners: CacheOwners
    controls: frozenset[int]  # control token ids: message boundaries, where checkpoints serve the next turn
    spares: SpareSequences  # the target's spare sequences, for the paths of draft trees


class Clock:
    """Accumulates time spent inside native calls."""

    def __init__(self) -> None:
        self.s = 0.0

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.s += time.perf_counter() - self._t


@dataclass
class Emitted:
    """What a phase emitted: tokens, their sources and text, and the finish when the request ends with them."""

    tokens: list[int]
    sources: list[str]
    delta: str
    finish: str | None = None
    detail: str = ""


@dataclass
class Planned:
    """A request's part of the next target decode."""

    tokens: list[int]
    outputs: str  # "all", "last" or "none"
    eager: bool  # drafters of the request's method list take the rows into their contexts now
    proposal: Proposal | None = None  # a step's draft (None: a prefill chunk)
    n_block: int = 0
    row0: int = 0
    pad: int = 0  # filler rows after `tokens` in the decode, cut with the rejected ones (see steps.Steps._pad)
    lead: int = 0  # leading tokens before id_last (no outputs): a tree's path accepted off its spine, decoded now
    tree: DraftTree | None = None  # the draft tree as decoded: its first path in `tokens`, the others in `branches`
    branches: list[tuple[int, list[int]]] = field(default_factory=list)  # (spare sequence, [lead, id_last, path])
    branch_row0: list[int] = field(default_factory=list)
    branch_pad: list[int] = field(default_factory=list)  # filler rows after each path (see steps.Steps._branch)

    @property
    def filler(self) -> list[int]:
        """The filler rows' tokens: the last token again (any does: nothing reads their outputs)."""
        return [self.tokens[-1]] * self.pad

    @property
    def rows(self) -> int:
        """The rows this request takes in its own sequence."""
        return len(self.tokens) + self.pad

    @property
    def decode_rows(self) -> int:
        """The rows this request takes in the target decode: its own and its tree's other paths'."""
        return self.rows + sum(len(tokens) for _, tokens in self.branches) + sum(self.branch_pad)

    def branch(self, path: list[int]) -> list[int]:
        """A path's rows in its spare sequence: the request's lead and id_last, then the path's tokens."""
        return [*self.tokens[:self.lead + 1], *path]

    def tree_rows(self) -> dict[int, int]:
        """Each tree node's row in the decode (tree.ROOT: id_last's), a node shared by paths read from the first."""
        rows = {ROOT: self.row0 + self.lead}
        for root, path in self._decoded_paths():
            for depth, node in enumerate(path):
                rows.setdefault(node, root + 1 + depth)
        return rows

    def root_through(self, node: int) -> int:
        """The row of id_last in the first decoded path through `node`: the path's nodes follow it, one per depth."""
        return next(root for root, path in self._decoded_paths() if node in path)

    def _decoded_paths(self) -> list[tuple[int, list[int]]]:
        """Each decoded path (the spine first) with its row of id_last."""
        assert self.tree is not None
        roots = [row0 + self.lead for row0 in (self.row0, *self.branch_row0)]
        return list(zip(roots, self.tree.paths(), strict=True))


class Decoding:
    def __init__(self, parts: Parts, prompt: Sequence[int], req: Request, policy: DraftPolicy | None,
                 cancelled: Callable[[], bool]) -> None:
        self.parts = parts
        self.prompt = list(prompt)
        self.req = req
        self.policy = policy
        self.cancelled = cancelled
        self.members = split(req.method) if req.method is not None else ()
        self.rows_beside: int | None = None  # the last decode's rows beside this request's own n + 1
        capacity = min(parts.drafters[m].capacity for m in self.members) if self.members else 0
        self.stats = Stats(speculative=req.speculative, method=req.method, draft_capacity=capacity,
                           draft_length=req.draft_length if req.speculative else 0, verify_mode=req.verify_mode)
        self.costs = CheckpointCosts()
        self.clock = Clock()
        self.text = TextDeltas(parts.pair.vocabulary, req.stop)
        self.events: deque[StreamEvent] = deque()  # emitted, not read yet
        self.error: BaseException | None = None
        self.done = False
        self.cache: PairCache | None = None
        self.method_list: MethodList | None = None
        self.planned: Planned | None = None
        self._resources = contextlib.ExitStack()
        self._verifier: Verifier | None = None
        self._draft_sampling: DraftSampling | None = None
        self._t_start = time.perf_counter()
        self._prefilled = False
        self._pos = self._end = 0
        self._kept = 0
        self._marks: list[int] = []
        self._public_base = 0
        self._id_last = -1
        self._lead: list[int] = []  # emitted tokens before id_last that the cache does not hold yet (see _walk_tree)
        self._tree_walker: TreeWalker | None = None
        # tree_nodes="auto": whether each step drafts a tree or a linear draft, from measured tokens per second
        self.tree_or_linear = policy.tree if policy is not None and req.tree_nodes == "auto" else None
        self._drafted_by: str | None = None  # the method that drafted the current step (a list's member)
        self.on_release: list[Callable[[], None]] = []

    @property
    def seq(self) -> int:
        assert self.cache is not None
        return self.cache.seq

    @property
    def ready(self) -> bool:
        """Whether the request takes part in the next step: not ended, and fewer than EVENTS_AHEAD of its events wait
        unread (a reader a little behind the others keeps its place in their steps; a suspended one soon stops)."""
        return not self.done and len(self.events) < EVENTS_AHEAD and self.error is None

    @property
    def prefilling(self) -> bool:
        return not self._prefilled

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill."""
        return self._end - self._pos

    # -- begin: a sequence, prefix reuse ------------------------------------------------------------------------

    def begin(self) -> None:
        parts, prompt, req, stats = self.parts, self.prompt, self.req, self.stats
        self._verifier, self._draft_sampling, self._tree_walker = self._make_verifier()
        if self.policy is not None:
            self.policy.begin_request()
        self.cache, limit = parts.owners.acquire(req.owner, prompt, req.public_prefix)
        cache = self.cache
        if self.members:
            self.method_list = MethodList(parts.drafters, self.members, cache.seq)
        self._t0 = time.perf_counter()
        kept = cache.reuse(prompt, self.costs, limit)
        end = len(prompt)
        stats.n_prompt, stats.n_reused, stats.n_prefilled = end, kept, end - kept
        marks = prompt_marks(prompt, parts.controls, req.public_prefix) if cache.checkpointing else []
        # The first request that declares a public prefix keeps a copy of the caches right after it (cache/sessions.py).
        public_base = req.public_prefix if kept < req.public_prefix and parts.owners.needs_public_base(
            prompt, req.public_prefix) else 0  # fmt: skip
        self._marks = sorted({m for m in marks if m > kept} | ({public_base} if public_base else set()))
        self._public_base, self._pos, self._end, self._kept = public_base, kept, end, kept

    def release(self) -> None:
        """The request is over (ended, failed or closed): its sequence and resources go back."""
        if self.done:
            return
        if self.cache is not None:
            listed = self.method_list
            if listed is not None and listed.ahead is not None:  # a path's rows its sequence never decoded
                listed.ahead = None
                with contextlib.suppress(RollbackError):  # refused: the caches were cleared, which serves as well
                    self.cache.drop_ahead()
            self.parts.owners.release(self.cache)
        self.done = True
        self._resources.close()
        for hook in self.on_release:
            hook()

    # -- prefill ------------------------------------------------------------------------------------------------

    def plan_prefill(self, budget: int) -> Planned | None:
        """The next prompt chunk, at most `budget` tokens, ending at the next checkpoint mark."""
        if budget <= 0:
            return None
        stop = min(self._pos + budget, self._end, self._marks[0] if self._marks else self._end)
        last = stop == self._end
        self.planned = Planned(self.prompt[self._pos:stop], "last" if last else "none", self.req.speculative)
        return self.planned

    def after_prefill(self) -> None:
        """The chunk was decoded: checkpoints, the public base, progress; then the first sample after the last."""
        assert self.planned is not None and self.cache is not None
        cache, parts, req = self.cache, self.parts, self.req
        planned, self.planned = self.planned, None
        self._pos += len(planned.tokens)
        pos, end, marks = self._pos, self._end, self._marks
        if req.on_prefill is not None:
            req.on_prefill(pos - self._kept, end - self._kept)
        if pos == self._public_base:
            if marks and pos == marks[0]:
                marks.pop(0)
                cache.save_checkpoint(self.costs)
            cache.public_len = pos
            parts.owners.keep_public_base(cache)
        if marks and pos == marks[0]:
            marks.pop(0)
            cache.save_checkpoint(self.costs)
        elif pos < end and cache.interval_due():
            cache.save_checkpoint(self.costs)
        if pos < end:
            if req.prefill_events:
                self.events.append(StreamEvent("", [], self.stats.snapshot()))
            return
        if req.public_prefix > cache.public_len:
            cache.public_len = min(req.public_prefix, end)
        self.stats.prefill_ms = (time.perf_counter() - self._t0) * 1000.0
        self._prefilled = True
        if self.method_list is not None:
            self.method_list.begin()
        self._t_start, self.clock.s = time.perf_counter(), 0.0
        assert self._verifier is not None
        row = planned.row0 + len(planned.tokens) - 1
        self._conclude(self._accept(self._verifier.walk(Proposal(), first_row=row)))  # the prefill's own sample

    # -- one step: draft → verify → accept ----------------------------------------------------------------------

    def plan_step(self, others: int, paths: int = 0) -> tuple[int, DraftAsk | None]:
        """This step's draft length and what to ask the method list (None: a plain step); `others` is the rows the
        step's target decode holds beside this request's n + 1 (see Steps.run: as the last decode held them); `paths`:
        the most tree paths beside the spine the step could decode (0: a tree would be a linear draft, none is
        drafted)."""
        assert self.cache is not None
        self._t_round = time.perf_counter()
        req, stats, policy = self.req, self.stats, self.policy
        pos0 = len(self.cache) + len(self._lead)  # id_last's position: after the lead, which this step decodes first
        # Like llama.cpp's server: leave room in the context, and draft nothing past max_tokens.
        in_context = self.parts.pair.n_ctx - pos0 - 2
        room = max(0, min(in_context, req.max_tokens - stats.n_generated - 1))
        listed = self.method_list
        if self._lead and (listed is None or listed.ahead is None):  # no drafter took the path's rows
            self._n_block = 0
            return 0, None
        n_block = policy.choose(pos0, room, others) if policy is not None else 0
        self._n_block = n_block
        if n_block <= 0 or self.method_list is None:
            return n_block, None
        if paths <= 0:
            nodes = 0
        elif self.tree_or_linear is not None:
            nodes = max(2 * n_block, AUTO_TREE_NODES) if self.tree_or_linear.choose() == "tree" else 0
        else:
            nodes = int(req.tree_nodes)
        # A fixed length cut by max_tokens alone: the block keeps its length (see DraftAsk.n_asked); the context's end
        # cuts the block too, its cells must fit.
        asked = min(req.draft_length, in_context) if isinstance(req.draft_length, int) else 0
        return n_block, DraftAsk(self.seq, self._id_last, pos0, n_block, self.req.n_min, self.req.p_min,
                                 self._draft_sampling, nodes, paths if nodes else 0, n_asked=asked)

    def set_draft(self, proposal: Proposal, drafted_by: str | None, draft_ms: float) -> None:
        self._drafted_by = drafted_by
        self.stats.draft_ms += draft_ms
        if self.policy is not None:
            self.stats.draft_lengths.append(len(proposal.tokens))
        lead, self._lead = self._lead, []
        self.planned = Planned([*lead, self._id_last, *proposal.tokens], "all", bool(proposal.tokens), proposal,
                               self._n_block, lead=len(lead), tree=proposal.tree)

    def plain_step(self) -> Planned:
        if self.policy is not None:
            self.stats.draft_lengths.append(0)
        lead, self._lead = self._lead, []
        self.planned = Planned([*lead, self._id_last], "all", False, Proposal(), self._n_block, lead=len(lead))
        return self.planned

    def after_step(self, decode_ms: float, step_s: float, decode_rows: int) -> None:
        """The step's decode is done: walk the verifier over this request's rows, cut what was rejected.
        `decode_rows`: every row of that decode (every request's, their filler rows and prefill chunks)."""
        assert self.planned is not None and self.planned.proposal is not None and self.cache is not None
        assert self._verifier is not None
        planned, self.planned = self.planned, None
        proposal, stats, policy = planned.proposal, self.stats, self.policy
        t = time.perf_counter()
        ahead: Rows | None = None
        if planned.tree is not None:
            emitted, n_kept, ahead = self._walk_tree(planned)
        else:
            emitted = self._accept(self._verifier.walk(proposal, first_row=planned.row0 + planned.lead))
            n_kept = emitted.sources.count(DRAFT)
        step_ms = decode_ms + (time.perf_counter() - t) * 1000.0
        stats.verify_ms += step_ms
        n_accepted = emitted.sources.count(DRAFT)
        pos0 = len(self.cache) - planned.rows
        if self.method_list is not None:
            self.method_list.ahead = None  # the lead, if any, is in the sequence now
            if proposal.tokens:
                self.method_list.accept(n_accepted)
        self.cache.roll_back(pos0 + planned.lead + 1 + n_kept)
        if ahead is not None and self.method_list is not None:
            self.method_list.adopt(ahead)  # refused: the next step decodes the lead alone, a plain step
        if planned.tree is not None:
            stats.record_verify(planned.tree.depth, n_accepted, len(emitted.tokens), self._drafted_by)
            stats.record_tree(len(planned.tree), planned.decode_rows - planned.pad, n_accepted, n_kept < n_accepted)
            n_accepted = min(n_accepted, len(proposal.tokens))  # the controller's model is the linear draft's
        elif proposal.tokens:
            stats.record_verify(len(proposal.tokens), n_accepted, len(emitted.tokens), self._drafted_by)
        else:
            stats.plain_steps += 1
            stats.plain_ms += step_ms
        # The cost model's key is the whole decode, as it ran: this request's n + 1 rows and everything beside them
        # (its lead, once only, is not).
        self.rows_beside = decode_rows - planned.lead - planned.n_block - 1
        seconds = step_s + time.perf_counter() - t
        if policy is not None:
            policy.observe(planned.n_block, len(proposal.tokens), n_accepted, seconds, rows=decode_rows)
        arms = self.tree_or_linear
        if arms is not None:
            # The lead's rows are the tree's that accepted the path: their share of the step's time, by rows (what
            # they cost on a CPU; more than on a GPU), is the rest of that tree's step.
            lead_s = seconds * planned.lead / decode_rows
            if planned.tree is not None:
                arms.observe("tree", len(emitted.tokens), seconds)
            else:
                if proposal.tokens:  # a linear draft, or a tree that got no path beside its spine: a linear step
                    arms.observe("linear", len(emitted.tokens), seconds - lead_s, ceiling=planned.n_block + 1)
                if lead_s:
                    arms.observe("tree", 0, lead_s, more=True)
        if self.cache.interval_due():
            self.cache.save_checkpoint(self.costs)
        self._conclude(emitted)

    def _walk_tree(self, planned: Planned) -> tuple[Emitted, int, Rows | None]:
        """The tree walk over the decode's rows; how many accepted tokens the request's own sequence holds (the
        accepted path's part on the spine); the rows to adopt, if the accepted path left the spine.

        The rest of such a path (the lead) and the token after it are emitted now; the lead's rows, decoded in the
        path's spare sequence after exactly the request's tokens, are the request's own (the same tokens at the same
        positions after the same state), so its drafter takes them from this decode (`MethodList.adopt`) and the next
        step drafts after id_last at once, decoding `[lead, id_last, drafts]` in the request's sequence from its
        exact state: the lead costs rows, never a decode of its own."""
        assert planned.tree is not None and self._tree_walker is not None and self.cache is not None
        tree = planned.tree
        emitted = self._accept(self._tree_walker.walk(tree, planned.tree_rows().__getitem__))
        accepted = accepted_path(tree, emitted.tokens)
        spine = tree.spine()
        kept = 0
        while kept < min(len(accepted), len(spine)) and accepted[kept] == spine[kept]:
            kept += 1
        if kept == len(accepted) or emitted.finish is not None:
            return emitted, kept, None
        self._lead = emitted.tokens[kept:len(accepted)]
        root = len(self.cache) - planned.rows + planned.lead  # id_last's position
        row = planned.root_through(accepted[-1]) + 1 + kept
        return emitted, kept, Rows(self.seq, list(self._lead), root + 1 + kept, row)

    # -- events -------------------------------------------------------------------------------------------------

    def cancel_now(self) -> None:
        """End here: the caller cancelled (between two steps, or during the prompt)."""
        if self._prefilled:
            self._finish(Emitted([], [], "", "cancelled", "cancelled by the caller"))
        else:
            self._finish(Emitted([], [], "", "cancelled", "cancelled during the prompt"))

    def fail(self, error: BaseException) -> None:
        """The step raised for this request: its sequence may hold a half-done step, so it starts over clean."""
        self.error = error
        if self.cache is not None:
            with contextlib.suppress(Exception):
                self.cache.clear()
        self.release()

    def final_event(self, tokens: list[int], sources: list[str], delta: str, finish: str,
                    detail: str) -> StreamEvent:
        delta += self.text.finish()
        self._time()
        if self.policy is not None:
            self.stats.controller = self.policy.describe()
            if self.tree_or_linear is not None and self.stats.tree_steps:
                self.stats.controller["tree"] = self.tree_or_linear.describe()
        return StreamEvent(delta, tokens, self.stats.snapshot(), finish, detail, sources, self.text.take_runs())

    def _conclude(self, emitted: Emitted) -> None:
        assert self.cache is not None
        if emitted.finish is None:
            if self.stats.n_generated >= self.req.max_tokens:
                emitted.finish, emitted.detail = "length", f"max_tokens={self.req.max_tokens} reached"
            elif len(self.cache) >= self.parts.pair.n_ctx:
                emitted.finish, emitted.detail = "length", f"the context is full ({self.parts.pair.n_ctx} tokens)"
        if emitted.finish is not None:
            self._finish(emitted)
            return
        self._time()
        self.events.append(StreamEvent(emitted.delta, emitted.tokens, self.stats.snapshot(),
                                       token_sources=emitted.sources, delta_sources=self.text.take_runs()))

    def _finish(self, emitted: Emitted) -> None:
        self.events.append(self.final_event(emitted.tokens, emitted.sources, emitted.delta,
                                            emitted.finish or "stop", emitted.detail))
        self.release()

    def _time(self) -> None:
        s = self.stats
        s.decode_ms = (time.perf_counter() - self._t_start) * 1000.0 if self._prefilled else 0.0
        s.native_ms = self.clock.s * 1000.0
        s.checkpoint_restored_at = self.costs.restored_at
        s.checkpoint_restore_ms = self.costs.restore_ms
        s.checkpoints_saved, s.checkpoint_bytes = self.costs.saved, self.costs.saved_bytes
        s.checkpoint_save_ms = self.costs.save_ms

    def _make_verifier(self) -> tuple[Verifier, DraftSampling | None, TreeWalker]:
        """The request's verifier, what its drafter samples with (None: greedy drafts, and chosen trees), and its
        tree verifier: with rejection sampling, recursive rejection over drawn trees (the request's sampler and random
        generator at every node); else the walk that samples each node's row with the request's sampler."""
        pair, sampling, verifiers = self.parts.pair, self.req.sampling, self.parts.verifiers
        if self.stats.verify_mode == "sample":
            rng = np.random.default_rng(sampling.seed)
            distribution = SamplerDistribution(sampling, pair.n_vocab)
            self._resources.callback(distribution.free)
            verifier = verifiers.sample(distribution, rng, pair.target_ctx, pair.n_vocab)
            tree = verifiers.tree_sample(
                lambda row: target_distribution(pair.target_ctx, row, pair.n_vocab, distribution), rng)
            return verifier, DraftSampling(distribution, rng), tree
        sampler = self._resources.enter_context(Sampler(sampling))
        return (verifiers.match(sampler, pair.target_ctx), None,
                verifiers.tree(lambda row: sampler.sample(pair.target_ctx, row)))

    def _accept(self, walk: Iterator[tuple[int, str]]) -> Emitted:
        """Emit the verifier's tokens until the walk ends, the end of generation or a stop string."""
        out = Emitted([], [], "")
        vocab = self.parts.pair.vocabulary
        while True:
            with self.clock:  # the walk samples the target's rows
                item = next(walk, None)
            if item is None:
                break
            token, source = item
            if vocab.is_eog(token):
                out.finish, out.detail = "stop", "end of generation"
                break
            out.tokens.append(token)
            out.sources.append(source)
            out.delta += self.text.feed(token, source)
            if self.text.stopped:
                out.finish, out.detail = "stop", "stop string"
                break
        self.stats.n_generated += len(out.tokens)
        if out.tokens:
            self._id_last = out.tokens[-1]
        return out


__all__ = ["DRAFT", "TARGET", "Decoding", "Parts", "Request"]
