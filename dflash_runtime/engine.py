"""The speculative engine: a linked pair, the caches' bookkeeping, and requests streamed on its sequences.

Every emitted token is a target sample given the accepted prefix, so the output is the target's own: token for
token at temperature 0, and in distribution above it (see decoding/verify.py). The caches are kept between requests:
a new request prefills only what follows the prefix it shares with the cache (see cache/pair_cache.py for the one rule
of going back, and cache/checkpoints.py for hybrid targets). Lifetime, cancellation and busy rules are in
decoding/occupancy.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import llama_cpp

from . import methods
from .cache.checkpoints import CheckpointPolicy, CheckpointStore
from .cache.pair_cache import PairCache
from .cache.sessions import CacheOwners, SessionPolicy
from .cache.spares import SpareSequences
from .decoding.checks import check_length, check_tree_nodes, checked_owner, checked_request, prompt_tokens
from .decoding.controller import Policies
from .decoding.divergence import Divergence, explain
from .decoding.occupancy import CLOSED_MESSAGE, Occupancy, RequestStream
from .decoding.request import Decoding, Parts, Request
from .decoding.steps import Steps
from .decoding.verify import Verifiers
from .deprecated import renamed, renamed_keyword
from .drafters.drafting import MTP, TokenView
from .errors import EngineBusyError, EngineClosedError, RequestError
from .files.gguf_meta import read_gguf
from .native.batches import TokenBatch
from .native.sampling import SamplingParams
from .pair import LinkedPair, PairOptions
from .results.events import Result, StreamEvent
from .results.stats import Stats
from .text.chat import ChatTemplate, ControlToken, control_tokens, model_template

DEFAULT_BUSY_TIMEOUT_S = 300.0


class Engine:
    """Generates with a target and its draft methods: a linked DFlash draft, the target's own MTP head, or the target
    alone. Up to `parallel` requests run at once (a keyword of `LinkedPair`), batched into one target decode per
    step.

    Keyword arguments: those of `LinkedPair` (n_ctx, n_gpu_layers, draft_capacity, mtp, n_batch, n_threads,
    n_rs_seq, parallel, verbose; rpc, tensor_split, draft_gpu_layers, rpc_cpu for remote devices), plus
    `draft_length` (a request's default: "auto" or a fixed length), `checkpoints` (a
    `CheckpointPolicy` for hybrid targets; `CheckpointPolicy(max_count=0)` turns them off), `sessions` (a
    `SessionPolicy`: how many other owners' caches are kept aside), `verifiers` (how drafts are checked: see
    decoding/verify.py), `busy_timeout_s` (how long another thread's request waits for the engine; None waits as long as
    it takes) and `method_options` (a method's own settings by name, e.g. {"ngram-mod": {"n_match": 16}}; see the
    method's module). `draft_policy=` is the deprecated spelling of `draft_length=`.
    """

    def __init__(self, target_path: str | os.PathLike[str], draft_path: str | os.PathLike[str] | None = None, *,
                 draft_length: str | int | None = None, checkpoints: CheckpointPolicy | None = None,
                 sessions: SessionPolicy | None = None, verifiers: Verifiers | None = None,
                 busy_timeout_s: float | None = DEFAULT_BUSY_TIMEOUT_S, draft_policy: str | int | None = None,
                 method_options: Mapping[str, Mapping[str, Any]] | None = None, mtp: bool | None = None,
                 **pair_options: Any) -> None:
        length = renamed_keyword("draft_policy", "draft_length", draft_policy, draft_length, "auto")
        methods.check_options(method_options or {})
        options = PairOptions.from_keywords(**pair_options)
        # Each header read once per load: the registry claims the draft from it, the pair opens from it.
        target = read_gguf(target_path)
        draft = read_gguf(draft_path) if draft_path is not None else None
        if draft is None:
            methods.refuse_alone(target)
        self.pair = LinkedPair(target, draft, options,
                               draft_file=methods.draft_file(draft) if draft is not None else None,
                               target_parts=methods.target_parts({MTP: mtp}))
        try:
            self._open(length, checkpoints or CheckpointPolicy(), sessions or SessionPolicy(),
                       verifiers or Verifiers(), busy_timeout_s, dict(method_options or {}))
        except BaseException:
            self.pair.close()
            raise

    def _open(self, draft_length: str | int, checkpoints: CheckpointPolicy, sessions: SessionPolicy,
              verifiers: Verifiers, busy_timeout_s: float | None,
              method_options: dict[str, Mapping[str, Any]]) -> None:
        pair = self.pair
        batch = TokenBatch(pair.n_batch)
        # Made with the drafters: they read each sequence's tokens, and whose requests it runs, through these views.
        caches: list[PairCache] = []
        owners: list[CacheOwners] = []
        views = [TokenView(functools.partial(lambda seq: caches[seq].tokens, seq),
                           functools.partial(lambda seq: owners[0].owner_of(seq), seq),
                           lambda owner: owners[0].keeps(owner)) for seq in range(pair.parallel)]
        try:
            drafters = methods.open_drafters(pair, views, method_options)
        except BaseException:
            batch.free()
            raise
        for seq in range(pair.parallel):
            store = CheckpointStore(pair.target_ctx, checkpoints, seq) if pair.is_recurrent else None
            caches.append(PairCache(pair.target_ctx, list(drafters.values()), recurrent=pair.is_recurrent,
                                    n_rs_seq=pair.n_rs_seq, checkpoints=store, seq=seq))
        # Control tokens are read once, here: chat prompts and checkpoint positions need them on every request.
        self._controls: list[ControlToken] = control_tokens(pair.vocabulary)
        owners.append(CacheOwners(caches, sessions))
        spares = SpareSequences(pair.target_ctx, pair.branch_seqs, recurrent=pair.is_recurrent, n_rs_seq=pair.n_rs_seq)
        self._parts = Parts(pair, caches, batch, drafters, verifiers, owners[0],
                            frozenset(t.id for t in self._controls), spares)
        spares.prime()
        self._steps = Steps(self._parts)
        self._occupancy = Occupancy(self._free, busy_timeout_s, pair.parallel, self._steps.run)
        self.default_draft_length = check_length(draft_length, max(map(self.capacity, self.methods), default=0))
        self._policies = Policies(pair.verify_cap)
        self.template = model_template(pair.chat_template_source(), pair.vocabulary)

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
    def parallel(self) -> int:
        """How many requests run at once, each on a sequence of its own (`load_pair(..., parallel=N)`)."""
        return self.pair.parallel

    @property
    def draft_capacity(self) -> int:
        """The longest draft this pair was opened for (0 without a draft)."""
        return self.pair.draft_capacity

    @property
    def draft_max(self) -> int:
        """The deprecated spelling of `draft_capacity`."""
        renamed("Engine.draft_max", "Engine.draft_capacity")
        return self.pair.draft_capacity

    @property
    def methods(self) -> tuple[str, ...]:
        """The draft methods this engine can run, in the registry's order (methods.py): "dflash" with a DFlash draft,
        "mtp" with the target's MTP head, the n-gram methods on every pair, then the listed method lists."""
        return methods.available(self.pair)

    @property
    def default_method(self) -> str | None:
        """The method a speculative request uses when it names none: DFlash when loaded, else MTP, else None."""
        return methods.default(self.pair)

    def capacity(self, method: str) -> int:
        """The longest draft of a method or method list this engine runs (0 for one it does not)."""
        return methods.capacity(self.pair, method)

    def sampling_defaults(self) -> dict[str, float | int]:
        """The target's recommended sampling (`general.sampling.*`), as llama.cpp applies it: only keys present."""
        with self._open_native():
            return self.pair.sampling_defaults()

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
        method: str | None = None,
        draft_length: int | str | None = None,
        n_min: int = 0,
        p_min: float = 0.0,
        verify: str = "sample",
        cache_owner: Hashable | None = None,
        public_prefix: int = 0,
        on_prefill: Callable[[int, int], None] | None = None,
        prefill_events: bool = False,
        prefill_chunk: int = 0,
        draft_max: int | str | None = None,
        tree_nodes: int | str = "auto",
    ) -> RequestStream:
        """A request's events, one per engine step; the request starts at the first `next()`.

        `method`: one of `methods` (default `default_method`), or a method list "a,b" in order of preference
        (each step drafted by the first that proposes something); `speculative=False` decodes plainly.
        `draft_length`: "auto" (the adaptive controller), 0 (no draft) or a fixed length ≤ the method's capacity;
        default the engine's `draft_length`. `verify` ("sample" or "match") chooses how drafts are checked above
        temperature 0. `cache_owner` (any hashable key, e.g. a visitor's session) limits prefix reuse to what the
        same owner put in the cache, plus the first `public_prefix` tokens of the prompt when they are cached (see
        cache/sessions.py). `on_prefill(done, total)` is called after each prompt chunk the engine decodes (progress
        of a long prompt); it runs inside the engine step (on whichever request's thread steps the engine), so it must
        be quick and must not start or read requests of this engine; it may cancel the request.
        `prefill_events`: an event without tokens after each prompt chunk but the last, so that a caller may stop
        (close) a long prompt between its chunks; the same owner's next request goes on from what was prefilled.
        `prefill_chunk`: the most prompt tokens of this request one step takes while other requests share the step
        (0: as many as the step's token budget allows), so that a long prompt costs the others' steps little; beside
        a request that is generating, the step's prompts together take the largest of their chunks.
        `tree_nodes` (method "dflash-tree"): a draft tree's verify rows beside the root's down to where its paths
        leave the linear draft (each path then runs to the full depth), "auto" (twice the draft length, at least 8)
        or an integer ≥ 1; the tree is `draft_length` deep.
        `draft_max=` is the deprecated spelling of `draft_length=`."""
        self.check_open()
        length = renamed_keyword("draft_max", "draft_length", draft_max, draft_length, None)
        tokens = prompt_tokens(prompt, self.pair, lambda text: self._tokenize(text, True, True))
        req = checked_request(self.pair, self.default_draft_length, max_tokens,
                              SamplingParams(temperature, top_k, top_p, min_p, seed), stop, speculative,
                              method, length, n_min, p_min, verify)  # fmt: skip
        owner = checked_owner(cache_owner, public_prefix, len(tokens))
        nodes = check_tree_nodes(tree_nodes)
        return self._start(tokens, replace(req, **owner, on_prefill=on_prefill, prefill_events=prefill_events,
                                              prefill_chunk=max(0, int(prefill_chunk)), tree_nodes=nodes))

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
        return template.tokens(messages, self._tokenize, self._controls, enable_thinking=enable_thinking)

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
            return self.pair.vocabulary.text(tokens)

    def token_text(self, token: int) -> str:
        """The text of one token, special tokens rendered."""
        with self._open_native():
            return self.pair.vocabulary.piece_text(token)

    # -- state --------------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every cached prefix (every sequence's caches and checkpoints, the parked states); waits until no
        request runs."""
        with self._occupancy.exclusive():
            for cache in self._parts.caches:
                cache.clear()
            self._parts.owners.forget()
            self._parts.spares.prime()  # nothing of the requests' stays in them either

    def park(self, owner: Hashable | None = None) -> None:
        """Copy `owner`'s live state aside now (host memory), so that it comes back at its owner's next request even
        after its sequence went to another owner, and no other owner's request pays for the copy. With one sequence,
        `park()` parks its current owner's. Owners that never park are not kept when
        `SessionPolicy(park_on_switch=False)`; see cache/sessions.py. Runs between two steps: other requests go on."""
        with self._occupancy.native():
            self._parts.owners.park(owner, current=owner is None)

    def draft_policy(self, owner: Hashable, method: str, draft_length: int | str = "auto") -> dict[str, Any] | None:
        """What the draft policy kept across requests for (owner, method, length) has learnt, or None."""
        return self._policies.kept(owner, method, draft_length)

    def explain_divergence(self, prompt: str | Sequence[int], plain: Sequence[int], other: Sequence[int], *,
                           verify_rows: int | None = None) -> Divergence:
        """Why two temperature-0 answers to `prompt` differ (`plain`: plain decoding's tokens, `other`: e.g. a
        speculative answer's): the first differing position, its row scored as plain decoding computes it (one row
        after the same prefix) and as a verify batch of `verify_rows` rows does (default: one more than the draft
        capacity), both candidates' logits and margins, and whether the difference is a near-tie that this build's
        rounding can flip or a fault (see decoding/divergence.py). Runs between requests on an idle sequence, whose
        state is put back afterwards (no step runs meanwhile; the running requests keep their sequences)."""
        tokens = prompt_tokens(prompt, self.pair, lambda text: self._tokenize(text, True, True))
        pair = self.pair
        rows = verify_rows if verify_rows is not None else max(2, min(pair.verify_cap, pair.draft_capacity or 7) + 1)
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= pair.n_ubatch:
            raise RequestError(f"verify_rows must be an integer in 1..{pair.n_ubatch} (got {verify_rows!r})")
        if len(tokens) + max(len(plain), len(other)) + rows > pair.n_ctx:
            raise RequestError("the prompt, the answers and the verify rows do not fit the context")
        with self._occupancy.native():
            idle = self._parts.owners.idle()
            if not idle:
                raise EngineBusyError("every sequence runs a request: explain the divergence when one is idle")
            cache = min(idle, key=len)  # the emptiest idle sequence: the least to copy aside
            parked = cache.park() if len(cache) else None
            try:
                return explain(pair.target_ctx, cache.seq, n_batch=pair.n_batch, n_vocab=pair.n_vocab,
                               n_embd=pair.n_embd, eos=pair.vocabulary.eos, batch_invariant=pair.batch_invariant,
                               prompt=tokens, a=list(plain), b=list(other), verify_rows=rows,
                               piece=pair.vocabulary.piece_text)
            finally:
                cache.clear()
                if parked is not None:
                    cache.unpark(parked)
                for other in self._parts.caches:  # its decodes ran beside every other sequence
                    other.beside_decode()

    def step_counters(self) -> dict[str, float | int]:
        """Engine-wide totals since it opened (for benchmarks): target decodes, the rows they held, time in steps."""
        with self._occupancy.cond:
            return self._steps.counters.to_dict()

    def info(self) -> dict[str, Any]:
        with self._open_native():
            pair, caches = self.pair, self._parts.caches
            draft = {"draft_kind": None, "block_size": None, "target_layer_ids": []}
            if pair.draft_file is not None:
                draft.update(pair.draft_file.describe(pair.spec))
            stores = [c.checkpoints.describe() if c.checkpoints is not None else None for c in caches]
            return {
                "target": str(pair.target_info.path),
                "draft": str(pair.draft_info.path) if pair.draft_info else None,
                "target_arch": pair.target_info.arch,
                "hybrid": pair.is_recurrent,
                "methods": list(self.methods),
                "default_method": self.default_method,
                "mtp_capacity": methods.capacity(pair, MTP),
                "mtp_error": next(iter(pair.part_errors.values()), None),
                "part_errors": dict(pair.part_errors),
                "sampling_defaults": pair.sampling_defaults(),
                **draft,
                "draft_capacity": pair.draft_capacity,
                "n_ctx": pair.n_ctx,
                "n_batch": pair.n_batch,
                "n_rs_seq": pair.n_rs_seq,
                "n_vocab": pair.n_vocab,
                "n_embd": pair.n_embd,
                "n_cached": sum(len(c) for c in caches),  # every sequence's (n_cached_by_sequence: each one's)
                "parallel": pair.parallel,
                "threads": {"decode": pair.threads.decode, "batch": pair.threads.batch},
                "running": self._parts.owners.running,
                "n_cached_by_sequence": [len(cache) for cache in self._parts.caches],
                "batch_invariant": pair.batch_invariant,
                "placement": pair.placement(),
                "numerics": pair.numerics,
                "checkpoints": _all_checkpoints(stores),
                "sessions": self._parts.owners.describe(),
                "chat_template": self.template is not None,
                "supports_thinking": bool(self.template and self.template.supports_thinking),
                "llama_cpp_version": llama_cpp.__version__,
            }

    def close(self) -> None:
        """Close the engine at once; a request suspended or running ends with one final "cancelled" event, and the
        native handles are freed as soon as no step runs (see decoding/occupancy.py). Idempotent."""
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
        for drafter in parts.drafters.values():
            drafter.free()
        parts.batch.free()
        parts.spares.free()
        self.pair.close()

    @contextlib.contextmanager
    def _open_native(self) -> Iterator[None]:
        """Native reads outside requests: under the occupancy lock, so close() cannot free them midway."""
        with self._occupancy.cond:
            self.check_open()
            yield

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        with self._open_native():
            return self.pair.vocabulary.tokenize(text, add_special=add_special, parse_special=parse_special)

    def _template(self) -> ChatTemplate:
        self.check_open()
        if self.template is None:
            raise RequestError(f"{self.pair.target_info.path.name} has no chat template (tokenizer.chat_template)")
        return self.template

    def _start(self, tokens: list[int], req: Request) -> RequestStream:
        holder: dict[str, Decoding] = {}

        def decoding(stream: RequestStream) -> Decoding:
            policy = None if req.method is None else self._policies.get(req.owner, req.method, req.draft_length,
                                                                         self.capacity(req.method))
            holder["run"] = run = Decoding(self._parts, tokens, req, policy, stream.cancelled.is_set)
            if policy is not None:
                run.on_release.append(functools.partial(self._policies.give_back, policy))
            return run

        def final(detail: str) -> StreamEvent:
            run = holder.get("run")
            if run is not None:
                return run.final_event([], [], "", "cancelled", detail)
            stats = Stats(speculative=req.speculative, method=req.method, n_prompt=len(tokens),
                          draft_capacity=self.capacity(req.method) if req.method else 0)
            return StreamEvent("", [], stats, "cancelled", detail)

        return RequestStream(self._occupancy, decoding, final)


def load_pair(target_path: Any, draft_path: Any = None, *, numerics: str = "exact", **kwargs: Any) -> Engine:
    """Open a target and (optionally) its DFlash draft, linked, and the target's MTP head when it has one; returns an
    Engine (see dflash_runtime.engine). `load_pair(target)` on a target with an MTP head gives an MTP engine.

    `numerics`: "exact" (default) opens a CPU target on kernels whose rows do not depend on their batch, so every
    temperature-0 answer is bit-identical to plain decoding's after any history; "fast" takes the fastest kernels
    (FlashAttention, repacked weights), exact up to near-ties. `engine.info()["numerics"]` says which holds and why
    (a GPU's kernels are never batch-invariant); docs/numerics.md."""
    return Engine(target_path, draft_path, numerics=numerics, **kwargs)


def _all_checkpoints(stores: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Every sequence's checkpoints in one description: the policy (the same for all), count and bytes summed over
    the sequences, sequence 0's positions (as with one sequence), and each sequence's own under "by_sequence" (None
    on a target without checkpoints)."""
    kept = [s for s in stores if s is not None]
    if not kept:
        return None
    return {**kept[0], "count": sum(s["count"] for s in kept), "bytes": sum(s["bytes"] for s in kept),
            "by_sequence": kept}
