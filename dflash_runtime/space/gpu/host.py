"""The engine host: this process's engine (the GPU worker's on ZeroGPU), running up to its sequences' worth of jobs
at once, each streamed back as plain data (gpu_job.py). `spaces` throws a worker away after any exception of the GPU
function, so `run` never raises the runtime's own errors: it ends the stream with a chunk that carries the error, and
an engine failure closes the engine once no other job runs on it (docs/space.md)."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, suppress
from dataclasses import replace
from typing import Any

from ... import errors
from ...errors import DFlashError, RemoteDeviceError, RequestError
from ...files.footprint import ParallelPlan, plan_parallel, with_remote_memory
from ...files.gguf_meta import read_gguf
from ...native.backends import FreeMemory, free_memory
from ..gpu_job import GpuJob, ReplyChunk, Resume, client_of_owner, info_digest, phase_decoding, resumed_stats
from ..requests import DEFAULT_SYSTEM_PROMPT, ChatRequest, thinking_prefix
from ..scrub import public_engine_info, scrub_paths, without_endpoints
from ..setup.presets import PairPreset, ResolvedPair, draft_unavailable, fallback_methods
from ..setup.settings import PublicSettings
from .fitting import FittedConversation, fit_request, prompt_tokens

log = logging.getLogger(__name__)
# Errors after which the engine is not to be trusted: it is closed, and the next job loads it again.
ENGINE_FAILURES = (errors.DecodeError, errors.EngineClosedError, RemoteDeviceError)
PUBLIC_OWNER = "public prefix"  # the owner of the requests that put the public prefix back in the cache


class EngineHost:
    """Owns this process's engine: built on first use, rebuilt when the preset or files change (once no job runs on
    it), with counters that tell a warm worker from a new one."""

    def __init__(self, loader: Callable[..., Any], settings: PublicSettings | None = None,
                 memory: Callable[[int], FreeMemory] | None = None) -> None:  # fmt: skip
        self._loader, self._settings = loader, settings or PublicSettings()
        self._memory = memory or free_memory  # read just before a load that sizes its sequences to memory
        self._state = threading.Condition()  # held for the bookkeeping only: a load runs outside it
        self._running = 0
        self._engine: Any = None
        self._key: tuple[Any, ...] | None = None  # the loaded engine's preset and files; None for a failed one too
        # Per thinking switch: the loaded engine's public prompt prefix, and whether the engine keeps it.
        self._public_tokens: dict[bool, list[int]] = {}
        self._public_kept: set[bool] = set()
        self._keeping = threading.Lock()  # one request puts a public prefix in the cache
        self._parallel = 1  # the loaded engine's sequences
        self.parallel_plan: ParallelPlan | None = None  # how they were sized to memory (DFLASH_PARALLEL=auto)
        self.loads, self.requests = 0, 0
        self.last_load_s: float | None = None
        self.previous_request: dict[str, Any] = {}
        self._described: dict[str, str] = {}  # what the host adds to the loaded engine's description

    def close(self, wait: bool = True) -> None:
        """Close the engine once no job runs on it (or after the busy timeout); without `wait`, under the lock now."""
        with self._state:
            if wait:
                self._state.wait_for(lambda: not self._running, self._settings.busy_timeout_s)
            if self._engine is not None:
                self._engine.close()
                self._engine, self._key = None, None

    def _enter(self, job: GpuJob) -> bool | None:
        """Take a sequence of the job's engine (False), or the host alone to (re)build it (True: the job loads it, and
        nobody enters meanwhile); None after the busy timeout."""
        key = (job.preset, job.files)
        with self._state:
            if not self._state.wait_for(lambda: self._running < (self._parallel if self._key == key else 1),
                                        self._settings.busy_timeout_s):  # fmt: skip
                return None
            self._running, self.requests, loading = self._running + 1, self.requests + 1, self._key != key
            if loading:
                self._key = None  # no job enters the engine before the load has replaced it
            return loading

    def _load(self, preset: PairPreset, files: ResolvedPair) -> None:
        """Load the engine (closing the one before) with the host to itself, its parked states shared out by client. A
        draft that fails validation leaves the target alone where it drafts with a model of its own (an MTP head)."""
        from ...cache.sessions import SessionPolicy  # the core's cache modules import libllama: only where engines run

        self.close(wait=False)
        started, settings = time.monotonic(), self._settings
        branches = preset.branches if files.draft_path is not None else 0  # a tree's paths need the draft
        self._parallel = self._sequences(preset, files, branches)
        parking = SessionPolicy(park_on_switch=False, group_of=client_of_owner, active_share=settings.active_share,
                                per_group=settings.parked_per_client)  # fmt: skip
        options = {"n_ctx": preset.n_ctx, "n_gpu_layers": preset.n_gpu_layers, "parallel": self._parallel,
                   "draft_capacity": preset.draft_capacity, "numerics": preset.numerics, "sessions": parking,
                   "busy_timeout_s": settings.busy_timeout_s, **({"rpc": list(preset.rpc)} if preset.rpc else {}),
                   **({"branches": branches} if branches else {})}  # fmt: skip
        problem, fallback = files.draft_problem, fallback_methods(files.target_path) if files.draft_problem else ()
        try:
            self._engine = self._loader(files.target_path, files.draft_path, **options)
        except (errors.PairMismatchError, errors.ModelFileError) as error:
            if files.draft_path is None or not (fallback := fallback_methods(files.target_path)):
                raise  # (a target at fault raises the same opened alone)
            self._engine, problem = self._loader(files.target_path, None, **options), str(error)
        self._described = {"parallel_plan": self.parallel_plan.describe()} if self.parallel_plan is not None else {}
        if problem:  # why it runs without its draft, and what it drafts with
            self._described["draft_problem"] = scrub_paths(draft_unavailable(problem, fallback))
        self.loads += 1
        self.last_load_s = round(time.monotonic() - started, 3)
        with self._state:  # the jobs that wait for this engine go in
            self._key, self._public_tokens, self._public_kept = (preset, files), {}, set()
            self._state.notify_all()

    def _sequences(self, preset: PairPreset, files: ResolvedPair, branches: int) -> int:
        """The preset's sequences, or with `parallel_fit` as many as fit in the memory free now (at least 1) beside
        `branches` spare ones, from the files' headers."""
        self.parallel_plan = None
        if not preset.parallel_fit:
            return preset.parallel
        memory = self._memory(preset.n_gpu_layers)
        if preset.rpc:
            from ...native.rpc import remote_memory

            memory = with_remote_memory(memory, remote_memory(preset.rpc))
        try:
            draft = read_gguf(files.draft_path) if files.draft_path is not None else None
        except errors.ModelFileError:
            draft = None  # the load says what is wrong with it, and may run the target alone (see _load)
        self.parallel_plan = plan_parallel(read_gguf(files.target_path), draft, memory, n_ctx=preset.n_ctx,
                                           draft_capacity=preset.draft_capacity, limit=preset.parallel,
                                           n_gpu_layers=preset.n_gpu_layers, branches=branches)  # fmt: skip
        log.info("answers at once: %d (DFLASH_PARALLEL=auto: %s)", self.parallel_plan.parallel,
                 self.parallel_plan.describe())
        return self.parallel_plan.parallel

    def _owner_arguments(self, engine: Any, owner: str, tokens: list[int], thinking: bool) -> dict[str, Any]:
        """The engine's arguments that keep a job's cache to its owner. The public prefix (the page's system prompt
        up to where the visitor's message begins) is all or nothing, and in the cache before every request that
        declares it, put back by a one-token request of nobody's (docs/space.md)."""
        if thinking not in self._public_tokens:  # the common prefix of two conversations that differ only there
            system = {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
            a, b = (prompt_tokens(engine, [system, {"role": "user", "content": text}], thinking) for text in "ab")
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            self._public_tokens[thinking] = a[:same]
        public = self._public_tokens[thinking]
        declared = len(public) if len(tokens) > len(public) and tokens[: len(public)] == public else 0
        if declared and thinking not in self._public_kept:
            with self._keeping:  # one request makes it; others that declare it meanwhile wait (it is one token long)
                if thinking not in self._public_kept:
                    engine.generate(public, max_tokens=1, speculative=False, cache_owner=PUBLIC_OWNER,
                                    public_prefix=declared)  # fmt: skip
                    self._public_kept.add(thinking)
        # nobody's session: a fresh owner, nothing to reuse, never parked
        return {"cache_owner": owner or secrets.token_hex(16), "public_prefix": declared}

    def run(self, job: GpuJob) -> Iterator[ReplyChunk]:
        """Stream the job's phases; every runtime error ends the stream as an error chunk (see the module doc)."""
        started = time.monotonic()
        facts: dict[str, Any] = {"pid": os.getpid(), "previous_request": dict(self.previous_request)}
        outcome = {"finish_reason": "closed before the first token", "n_generated": 0}  # this job's, as it ended
        if (loading := self._enter(job)) is None:
            yield _error_chunk(RequestError(f"the engine stayed busy for {self._settings.busy_timeout_s:.0f} s; retry"))
            return

        def report() -> dict[str, Any]:  # what the worker says of itself on a job's first and last chunk
            return {**facts, "loads": self.loads, "requests": self.requests, "engine_loaded": self._engine is not None,
                    "used_s": round(time.monotonic() - started, 3)}  # fmt: skip

        try:
            if loading:
                self._load(job.preset, job.files)
            facts.update(loaded_now=loading, load_s=self.last_load_s if loading else None)
            for chunk in self._phases(self._engine, job, report):
                outcome = {"finish_reason": chunk.finish_reason or "closed by the caller",
                           "n_generated": chunk.stats.get("n_generated", 0), "phase": chunk.phase}  # fmt: skip
                yield chunk
        except DFlashError as error:
            if isinstance(error, ENGINE_FAILURES):
                with self._state:  # nobody enters it; its last job closes it (now would end the others' answers)
                    self._key = None
                    if self._running <= 1:
                        self.close(wait=False)
            if isinstance(error, RemoteDeviceError):  # the log names the server; a visitor is not told where it is
                log.warning("%s", error)
                error = RemoteDeviceError(without_endpoints(str(error), job.preset.rpc))
            outcome = {"finish_reason": "error", "error_type": type(error).__name__, "n_generated": 0}
            worker = report()  # after the engine was condemned: it says whether the engine is still loaded
            yield replace(_error_chunk(error), worker=worker, used_s=worker["used_s"])
        finally:
            self.previous_request = outcome
            with self._state:  # the job leaves: the last one to leave a failed engine closes it
                self._running -= 1
                if self._key is None and not self._running:
                    self.close(wait=False)
                self._state.notify_all()

    def _phases(self, engine: Any, job: GpuJob, report: Callable[[], dict[str, Any]]) -> Iterator[ReplyChunk]:
        """The job's phases' chunks from where it yielded; the last one once every phase's stream has closed."""
        request, so_far = job.request, job.resume or Resume()
        fitted = fit_request(engine, request)
        owner = {**self._owner_arguments(engine, job.cache_owner, fitted.tokens, request.enable_thinking),
                 "prefill_chunk": self._settings.prefill_chunk}  # the engine's arguments for this job's requests
        info = {**public_engine_info(engine.info()), **self._described}
        known = info_digest(info) == job.engine_info_seen
        answers = {p: list(t) for p, t in so_far.answers.items()}
        final, first = None, True
        try:
            for phase in job.phases[so_far.phase:]:
                tokens = answers.setdefault(phase, list(so_far.tokens))
                with closing(_stream(engine, request, fitted, phase, owner, so_far)) as chunks:
                    for chunk in chunks:
                        tokens += chunk.tokens
                        chunk.engine_info, known = (None, known) if known else (info, True)
                        last = chunk.finish_reason is not None and phase == job.phases[-1]
                        chunk.worker, first = (report() if first or last else {}), False
                        chunk.used_s = report()["used_s"]
                        if last:
                            final = chunk  # sent once every phase's stream has closed
                        else:
                            yield chunk
                so_far = Resume()  # the next phase starts afresh
            if final is not None:
                final.divergences = _divergences(engine, request, fitted.tokens, answers)
                if job.conversation:  # copied aside inside its own request: the next visitor's costs the same
                    engine.park(job.cache_owner)  # by its key: with several sequences, no one is "current"
                yield final
        except GeneratorExit:  # closed, maybe to yield its turn: parked inside its own request, as at its end
            if job.cache_owner and self._key is not None:  # (not a failed engine's)
                with suppress(DFlashError):  # its next turn reuses it
                    engine.park(job.cache_owner)
            raise


def _divergences(engine: Any, request: ChatRequest, prompt: list[int],
                 answers: dict[str, list[int]]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """At temperature 0, why each phase's answer differs from plain decoding's."""
    plain = answers.get("plain")
    if request.temperature != 0 or plain is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for phase, tokens in answers.items():
        if phase != "plain" and tokens != plain:
            try:
                out[phase] = engine.explain_divergence(prompt, plain, tokens).to_dict()
            except DFlashError as error:  # the answers stand; only their explanation is missing
                out[phase] = {"kind": "unexplained", "summary": f"not explained: {scrub_paths(str(error))}"}
    return out


def _error_chunk(error: DFlashError) -> ReplyChunk:
    return ReplyChunk("", {}, "error", error_type=type(error).__name__, error=str(error))


def _stream(engine: Any, request: ChatRequest, fitted: FittedConversation, phase: str, owner: dict[str, Any],
            so_far: Resume) -> Iterator[ReplyChunk]:
    """The phase's chunks (a progress chunk at each prompt chunk's end, where the job may yield), going on after the
    tokens it wrote before it yielded its turn (`so_far`): its text released as one stream of all its tokens would
    release it (UTF-8 and stop strings across the join), its statistics summed with its earlier turns'."""
    from ...text.deltas import TextDeltas  # imports libllama: only where engines run

    kwargs = request.generation_kwargs(*phase_decoding(request, phase))
    texts = TextDeltas(engine.pair.vocabulary, request.stop)
    for token in so_far.tokens:
        texts.feed(token)
    texts.take_runs()
    if so_far.tokens:
        kwargs["max_tokens"] -= len(so_far.tokens)
        kwargs["stop"] = None  # stop strings are matched here, across the join
    # The thinking tag the template opens at every prompt's end, shown with the reply so that it folds whole.
    probe, thinking = [{"role": "user", "content": "a"}], request.enable_thinking and not so_far.tokens
    prefix = thinking_prefix(engine.render_chat(probe, enable_thinking=True)) if thinking else ""
    runs: list[tuple[int, str]] = [(len(prefix), "target")] if prefix else []
    delta, notice, lengths_sent, drafted_sent = prefix, None if so_far.tokens else fitted.notice, 0, 0
    with closing(engine.stream([*fitted.tokens, *so_far.tokens], **kwargs, **owner, prefill_events=True)) as events:
        for event in events:
            if not event.tokens and event.finish_reason is None:
                yield ReplyChunk("", {}, phase=phase, dropped_turns=fitted.dropped_turns, progress=True)
                continue
            stats = resumed_stats(so_far.stats, event.stats.to_dict())
            lengths, drafted_by = stats.pop("draft_lengths"), stats.pop("drafted_by")  # drafted_by: at the end
            text = "".join(texts.feed(t, s) for t, s in zip(event.tokens, event.token_sources, strict=False))
            finish, detail = ("stop", "stop string") if texts.stopped else (event.finish_reason, event.finish_detail)
            if finish is not None:
                text += texts.finish()
                stats["drafted_by"] = [*so_far.drafted_by, *drafted_by]
            yield ReplyChunk(delta + text, stats, finish, detail, notice, phase, dropped_turns=fitted.dropped_turns,
                             source_runs=[*runs, *texts.take_runs()], draft_lengths=lengths[lengths_sent:],
                             tokens=list(event.tokens), drafted_by=drafted_by[drafted_sent:])  # fmt: skip
            runs, delta, notice, lengths_sent, drafted_sent = [], "", None, len(lengths), len(drafted_by)
            if finish is not None:
                return
