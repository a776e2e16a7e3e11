"""The engine host: the engine of the process where generation runs (the GPU worker on ZeroGPU), built on first use,
up to its parallel sequences' worth of requests at once, streaming replies as plain data that crosses the ZeroGPU
process line, with a progress chunk at each prompt chunk's end (where a long prompt's job may yield its turn). Who
runs when is the web process's policy (web/policy.py).

`spaces` throws a ZeroGPU worker away (with its loaded model) after any exception raised in the GPU function, so
`EngineHost.run` never raises the runtime's own errors: it ends the stream with a chunk that carries the error. A
request error leaves the engine as it is; an engine failure closes it once no other request runs on it, and the next
request rebuilds it in the same worker. Anything else (a bug, a CUDA fault) raises: a fresh worker is the cure. Every
chunk says whether the engine is loaded, so the web process knows when the next request must plan a load."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ... import errors
from ...errors import DFlashError, RemoteDeviceError, RequestError
from ...files.footprint import ParallelPlan, plan_parallel, with_remote_memory
from ...files.gguf_meta import read_gguf
from ...native.backends import FreeMemory, free_memory
from ..gpu_job import GpuJob, ReplyChunk, Resume, client_of_owner, info_digest, phase_decoding, resumed_stats
from ..requests import DEFAULT_SYSTEM_PROMPT, ChatRequest, thinking_prefix
from ..scrub import scrub_paths
from ..setup.presets import PairPreset, ResolvedPair, draft_unavailable, fallback_methods
from ..setup.settings import PublicSettings
from .fitting import FittedConversation, fit_conversation, fit_prompt, prompt_tokens

log = logging.getLogger(__name__)
# Errors after which the engine's state is not to be trusted: it is closed, and the next request loads it again.
# Any other runtime error (a bad request, a prompt too long, a busy engine) leaves it as it is.
ENGINE_FAILURES = (errors.DecodeError, errors.EngineClosedError, RemoteDeviceError)


# What the cache holds now (tokens, checkpoints, the owners' parked states) and how many answers run: the state of
# somebody's requests.
PRIVATE_ENGINE_KEYS = ("n_cached", "n_cached_by_sequence", "checkpoints", "sessions", "running")
PUBLIC_OWNER = "public prefix"  # the owner of the requests that put the public prefix back in the cache


def _public_info(info: dict[str, Any]) -> dict[str, Any]:
    """The engine's description without the server's file-system paths (file names only) and without the cache's
    state (what the previous request left)."""
    public = {
        k: Path(v).name if k in ("target", "draft") and isinstance(v, str) else v
        for k, v in info.items()
        if k not in PRIVATE_ENGINE_KEYS
    }
    if isinstance(public.get("placement"), dict):  # no server addresses (an RPC server trusts whoever connects)
        placement = {k: v for k, v in public["placement"].items() if k != "rpc"}  # nor traffic: it follows requests
        placement["devices"] = [{**d, "where": "local" if d.get("where") == "local" else "remote"}
                                for d in placement.get("devices", [])]  # fmt: skip
        public["placement"] = placement
    return public


def without_endpoints(text: str, endpoints: tuple[str, ...]) -> str:
    """`text` with the RPC servers' addresses (as given and as parsed) replaced by "<DFLASH_RPC>"."""
    from ...native.rpc import parse_endpoint

    for endpoint in endpoints:
        host, port = parse_endpoint(endpoint)
        for spelling in (endpoint, f"{host}:{port}"):
            text = text.replace(spelling, "<DFLASH_RPC>")
    return text


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class EngineFacts:
    """What the host learns once per loaded engine: per thinking switch, the public prompt prefix and the thinking
    tag the template opens."""

    public_tokens: dict[bool, list[int]] = field(default_factory=dict)
    thinking_prefix: dict[bool, str] = field(default_factory=dict)
    public_kept: set[bool] = field(default_factory=set)  # thinking switches whose public prefix the engine keeps
    keeping: threading.Lock = field(default_factory=threading.Lock)  # one request puts a public prefix in the cache

    def public(self, engine: Any, thinking: bool) -> list[int]:
        """The prompt tokens every visitor can send: the page's system prompt up to where the visitor's own message
        begins (the common prefix of two conversations that differ only there)."""
        if thinking not in self.public_tokens:
            system = {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
            a, b = ([system, {"role": "user", "content": text}] for text in ("a", "b"))
            tokens_a = prompt_tokens(engine, a, thinking)
            self.public_tokens[thinking] = tokens_a[: common_prefix(tokens_a, prompt_tokens(engine, b, thinking))]
        return self.public_tokens[thinking]

    def prefix(self, engine: Any, thinking: bool) -> str:
        """The thinking tag the template opens at the end of every prompt (when thinking is on), shown with the
        reply so it folds whole. The template's generation prompt does not depend on the conversation."""
        if thinking not in self.thinking_prefix:
            probe = [{"role": "user", "content": "a"}]
            self.thinking_prefix[thinking] = (thinking_prefix(engine.render_chat(probe, enable_thinking=True))
                                              if thinking else "")  # fmt: skip
        return self.thinking_prefix[thinking]


class EngineHost:
    """Owns this process's engine: built on first use, rebuilt when the preset or files change (once no request runs
    on it), up to the preset's `parallel` requests at once, with counters that tell a warm worker from a new one
    (`loads`, `requests`, the process id). A request reuses cached tokens only if its own `cache_owner` put them
    there, beyond the public prefix of its prompt (the page's system prompt): nobody else's request can."""

    def __init__(self, loader: Callable[..., Any], settings: PublicSettings | None = None,
                 memory: Callable[[int], FreeMemory] | None = None) -> None:  # fmt: skip
        self._loader, self._settings = loader, settings or PublicSettings()
        self._busy_timeout_s = self._settings.busy_timeout_s
        # What is free where the caches go (backends.free_memory): read just before a load, with the previous engine
        # closed, when the preset sizes its sequences to memory (DFLASH_PARALLEL=auto).
        self._memory = memory or free_memory
        # How many requests run, whether the engine is being (re)built and whether a failure condemned it: held for
        # this bookkeeping only; a load runs outside it, newcomers waiting (each wait bounded by busy_timeout_s).
        self._state = threading.Condition()
        self._running, self._loading, self._condemned = 0, False, False
        self._engine: Any = None
        self._key: tuple[Any, ...] | None = None
        self._facts: EngineFacts | None = None
        self._parallel = 1  # the loaded engine's sequences
        self.parallel_plan: ParallelPlan | None = None  # how they were sized to memory (DFLASH_PARALLEL=auto)
        self.loads, self.requests = 0, 0
        self.last_load_s: float | None = None
        self.previous_request: dict[str, Any] = {}
        self.draft_problem: str | None = None  # why the loaded engine runs without its draft
        self._fallback: tuple[str, ...] = ()  # the methods it then drafts with (the target's own)

    def close(self) -> None:
        """Close the engine once no request runs on it (or after busy_timeout_s)."""
        with self._state:
            self._state.wait_for(lambda: not self._running and not self._loading, self._busy_timeout_s)
            self._close()

    def _close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine, self._key, self._facts = None, None, None

    def _ready(self, job: GpuJob) -> bool:
        return self._engine is not None and self._key == (job.preset, job.files) and not self._condemned

    def _admits(self, job: GpuJob) -> bool:
        """Whether `job` may start now: a sequence is free and the engine is the job's (or nothing runs, so that the
        job may build it). Call with the condition held."""
        if self._loading or self._running >= (self._parallel if self._ready(job) else 1):
            return False
        return self._ready(job) or not self._running

    def _enter(self, job: GpuJob) -> bool:
        """Take a place on the engine for `job`; False when none came within busy_timeout_s."""
        with self._state:
            if not self._state.wait_for(lambda: self._admits(job), self._busy_timeout_s):
                return False
            self._running += 1
            self.requests += 1
            return True

    def _leave(self, job: GpuJob) -> None:
        with self._state:
            self._running -= 1
            if self._condemned and not self._running:
                self._close()
            self._state.notify_all()

    def _condemn(self) -> None:
        """The engine failed: closed now when this request is the only one on it, else by the last one to leave
        (closing it would end the others' answers); either way the next request loads it again."""
        with self._state:
            if self._running <= 1:
                self._close()
            else:
                self._condemned = True

    def _engine_for(self, job: GpuJob) -> tuple[Any, bool]:
        """The engine for the job's preset and files, and whether it was loaded now. A (re)build happens only with
        this job alone on the host (see _admits); newcomers wait until it is done."""
        with self._state:
            if self._ready(job):
                return self._engine, False
            self._loading = True
        try:
            return self._ensure(job.preset, job.files)
        finally:
            with self._state:
                self._loading = False
                self._state.notify_all()

    def _options(self, preset: PairPreset, files: ResolvedPair) -> dict[str, Any]:
        """The engine's options: `parallel` sequences (the requests that run at once), the Space's one wait for a
        sequence (not the library's), and states parked only by their own request, shared out by client."""
        from ...cache.sessions import SessionPolicy  # the core's cache modules import libllama: only where engines run

        branches = preset.branches if files.draft_path is not None else 0  # a tree's paths need the draft
        self._parallel = self._sequences(preset, files, branches)
        parking = SessionPolicy(park_on_switch=False, group_of=client_of_owner, active_share=self._settings.
                                active_share, per_group=self._settings.parked_per_client)  # fmt: skip
        return {"n_ctx": preset.n_ctx, "n_gpu_layers": preset.n_gpu_layers, "draft_capacity": preset.draft_capacity,
                "parallel": self._parallel, "numerics": preset.numerics, "busy_timeout_s": self._busy_timeout_s,
                "sessions": parking, **({"rpc": list(preset.rpc)} if preset.rpc else {}),
                **({"branches": branches} if branches else {})}  # fmt: skip

    def _ensure(self, preset: PairPreset, files: ResolvedPair) -> tuple[Any, bool]:
        """Load the engine for this preset and files (closing the one before); (engine, True)."""
        self._close()
        started = time.monotonic()
        options = self._options(preset, files)
        self.draft_problem = files.draft_problem
        self._fallback = fallback_methods(files.target_path) if files.draft_problem else ()
        if files.draft_path is None:
            self._engine = self._loader(files.target_path, None, **options)
        else:
            try:
                self._engine = self._loader(files.target_path, files.draft_path, **options)
            except (errors.PairMismatchError, errors.ModelFileError) as error:
                # A draft that fails validation: the target alone still accelerates when it runs a method with a
                # model of its own (an MTP head). (If the target itself is at fault, opening it alone raises that.)
                self._fallback = fallback_methods(files.target_path)
                if not self._fallback:
                    raise
                self._engine = self._loader(files.target_path, None, **options)
                self.draft_problem = str(error)
        self._key, self._condemned = (preset, files), False
        self._facts = EngineFacts()
        self.loads += 1
        self.last_load_s = round(time.monotonic() - started, 3)
        return self._engine, True

    def _sequences(self, preset: PairPreset, files: ResolvedPair, branches: int) -> int:
        """How many sequences to open: the preset's, or with `parallel_fit` as many as fit in the memory free now (at
        least 1, at most the preset's) beside `branches` spare ones, from the files' headers."""
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
            draft = None  # the load says what is wrong with it, and may run the target alone (see _ensure)
        self.parallel_plan = plan_parallel(read_gguf(files.target_path), draft, memory, n_ctx=preset.n_ctx,
                                           draft_capacity=preset.draft_capacity, limit=preset.parallel,
                                           n_gpu_layers=preset.n_gpu_layers, branches=branches)  # fmt: skip
        log.info("answers at once: %d (DFLASH_PARALLEL=auto: %s)", self.parallel_plan.parallel,
                 self.parallel_plan.describe())
        return self.parallel_plan.parallel

    def run(self, job: GpuJob) -> Iterator[ReplyChunk]:
        """Stream the job's phases; every runtime error ends the stream as an error chunk (see the module doc)."""
        started = time.monotonic()
        report: dict[str, Any] = {"pid": os.getpid(), "previous_request": dict(self.previous_request)}
        self._outcome = {"finish_reason": "closed before the first token", "n_generated": 0}
        closed_early = False
        if not self._enter(job):
            yield self._error_chunk(RequestError(f"the engine stayed busy for {self._busy_timeout_s:.0f} s; retry"))
            return
        try:
            engine, loaded_now = self._engine_for(job)
            report.update(loaded_now=loaded_now, load_s=self.last_load_s if loaded_now else None)
            try:
                yield from self._phases(engine, job, lambda: self._report(report, started), started)
            except GeneratorExit:
                closed_early = True  # maybe to yield its turn (web/jobs.py): its owner's state is parked below
                raise
        except DFlashError as error:
            yield self._failed(error, job, lambda: self._report(report, started))
        finally:
            if closed_early and job.cache_owner:
                with suppress(DFlashError):  # parked inside its own request, as at its end: its next turn reuses it
                    self._engine_parks(job.cache_owner)
            self.previous_request = self._outcome
            self._leave(job)

    def _failed(self, error: DFlashError, job: GpuJob, report: Callable[[], dict[str, Any]]) -> ReplyChunk:
        if isinstance(error, ENGINE_FAILURES):
            self._condemn()
        if isinstance(error, RemoteDeviceError):  # the log names the server; a visitor is not told where it is
            log.warning("%s", error)
            error = RemoteDeviceError(without_endpoints(str(error), job.preset.rpc))
        self._outcome = {"finish_reason": "error", "error_type": type(error).__name__, "n_generated": 0}
        chunk = self._error_chunk(error)
        chunk.worker = report()  # after the engine was condemned: it says whether the engine is still loaded
        chunk.used_s = chunk.worker["used_s"]
        return chunk

    def _phases(self, engine: Any, job: GpuJob, report: Callable[[], dict[str, Any]],
                started: float) -> Iterator[ReplyChunk]:  # fmt: skip
        """The job's phases' chunks (from where it yielded, with `resume`), the last one once every phase's stream
        has closed, with its divergences; a conversation's state parked before it."""
        facts = self._facts
        assert facts is not None
        fitted = self._fit(engine, job.request)
        owner = {**self._owner_arguments(engine, facts, job.cache_owner, fitted.tokens, job.request.enable_thinking),
                 "prefill_chunk": self._settings.prefill_chunk}  # the engine's arguments for this job's requests
        info, known = self._info(engine, job)
        resume = job.resume
        answers = {p: list(t) for p, t in resume.answers.items()} if resume else {}
        final, first = None, True
        for index, phase in enumerate(job.phases[resume.phase:] if resume else job.phases):
            going_on = resume if index == 0 else None
            so_far = answers.setdefault(phase, list(going_on.tokens) if going_on is not None else [])
            with closing(self._stream(engine, facts, job.request, fitted, phase, owner, so_far, going_on)) as chunks:
                for chunk in chunks:
                    self._outcome = {"finish_reason": chunk.finish_reason or "closed by the caller",
                                     "n_generated": chunk.stats.get("n_generated", 0), "phase": phase}  # fmt: skip
                    chunk.engine_info, known = (None, known) if known else (info, True)
                    chunk.used_s = round(time.monotonic() - started, 3)
                    last = chunk.finish_reason is not None and phase == job.phases[-1]
                    chunk.worker, first = (report() if first or last else {}), False
                    if last:
                        final = chunk  # sent once every phase's stream has closed
                    else:
                        yield chunk
        if final is not None:
            final.divergences = self._divergences(engine, job, fitted.tokens, answers)
            if job.conversation:  # copied aside inside its own request: the next visitor's costs the same
                engine.park(job.cache_owner)  # by its key: with several sequences, no one is "current"
            yield final

    @staticmethod
    def _fit(engine: Any, request: ChatRequest) -> FittedConversation:
        if request.raw_prompt:  # control tokens only from a template: a raw prompt's text is text
            return fit_prompt(request, partial(engine.tokenize, parse_special=False), engine.n_ctx)
        return fit_conversation(request, partial(prompt_tokens, engine, enable_thinking=request.enable_thinking),
                                engine.n_ctx)  # fmt: skip

    def _info(self, engine: Any, job: GpuJob) -> tuple[dict[str, Any], bool]:
        """The engine's public description, and whether the web process holds it already."""
        info = _public_info(engine.info())
        if self.parallel_plan is not None:
            info["parallel_plan"] = self.parallel_plan.describe()
        if self.draft_problem:
            info["draft_problem"] = scrub_paths(draft_unavailable(self.draft_problem, self._fallback))
        return info, info_digest(info) == job.engine_info_seen

    def _engine_parks(self, owner: str) -> None:
        with self._state:
            engine = self._engine if not self._condemned else None
        if engine is not None:
            engine.park(owner)

    @staticmethod
    def _divergences(engine: Any, job: GpuJob, prompt: list[int], answers: dict[str, list[int]]
                     ) -> dict[str, dict[str, Any]]:  # fmt: skip
        """At temperature 0, why each phase's answer differs from plain decoding's (a near-tie or a fault)."""
        plain = answers.get("plain")
        if job.request.temperature != 0 or plain is None:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for phase, tokens in answers.items():
            if phase != "plain" and tokens != plain:
                try:
                    out[phase] = engine.explain_divergence(prompt, plain, tokens).to_dict()
                except DFlashError as error:  # the answers stand; only their explanation is missing
                    out[phase] = {"kind": "unexplained", "summary": f"not explained: {scrub_paths(str(error))}"}
        return out

    @staticmethod
    def _owner_arguments(engine: Any, facts: EngineFacts, owner: str, tokens: list[int],
                         thinking: bool) -> dict[str, Any]:  # fmt: skip
        """The engine's keyword arguments that keep this request's cache to its owner (see the class doc).

        The public prefix is all or nothing: the page's whole system prompt up to where the visitor's text begins,
        or none of it (a part of it would tell how far another visitor's prompt followed it). And it is in the cache
        before every request that declares it: an engine reuses a public prefix only if it is cached, so whether it
        is would tell whether the previous visitor used the page's system prompt; when the previous request did not
        leave it there, a one-token request of nobody's puts it back first."""
        owner = owner or secrets.token_hex(16)  # nobody's session: a fresh owner, nothing to reuse, never parked
        public = facts.public(engine, thinking)
        declared = len(public) if len(tokens) > len(public) and tokens[: len(public)] == public else 0
        if declared and thinking not in facts.public_kept:
            # The engine keeps a copy of the caches after the public prefix, made by the first request that declares
            # it: made here by nobody's request, so that no visitor's figures say whether it was already there. One
            # request makes it; others that declare it meanwhile wait for it (it is one token long).
            with facts.keeping:
                if thinking not in facts.public_kept:
                    with engine.stream(public, max_tokens=1, speculative=False, cache_owner=PUBLIC_OWNER,
                                       public_prefix=declared) as events:  # fmt: skip
                        for _ in events:
                            pass
                    facts.public_kept.add(thinking)
        return {"cache_owner": owner, "public_prefix": declared}

    def _report(self, report: dict[str, Any], started: float) -> dict[str, Any]:
        used_s = round(time.monotonic() - started, 3)
        loaded = self._engine is not None
        return {**report, "loads": self.loads, "requests": self.requests, "engine_loaded": loaded, "used_s": used_s}

    @staticmethod
    def _error_chunk(error: DFlashError) -> ReplyChunk:
        return ReplyChunk(delta="", stats={}, finish_reason="error", error_type=type(error).__name__, error=str(error))

    @staticmethod
    def _stream(engine: Any, facts: EngineFacts, request: ChatRequest, fitted: FittedConversation, phase: str,
                owner: dict[str, Any], tokens: list[int], resume: Resume | None = None) -> Iterator[ReplyChunk]:
        """The phase's chunks, a progress chunk after each prompt chunk but the last (where the job may yield); its
        tokens are added to `tokens` as they come. With `resume`, the phase goes on from where it yielded its turn
        (see GoingOn)."""
        speculative, method = phase_decoding(request, phase)
        kwargs = request.generation_kwargs(speculative, method)
        going_on = GoingOn(engine, request, resume) if resume is not None and (resume.tokens or resume.stats) else None
        if going_on is not None:
            kwargs["max_tokens"] -= len(going_on.tokens)
            kwargs["stop"] = None  # stop strings are matched here, across the join
        prefix = facts.prefix(engine, request.enable_thinking) if going_on is None else ""
        runs: list[tuple[int, str]] = [(len(prefix), "target")] if prefix else []
        delta, notice, lengths_sent, drafted_sent = prefix, fitted.notice if going_on is None else None, 0, 0
        with closing(engine.stream([*fitted.tokens, *(going_on.tokens if going_on else ())], **kwargs, **owner,
                                   prefill_events=True)) as events:  # fmt: skip
            for event in events:
                if not event.tokens and event.finish_reason is None:
                    yield ReplyChunk("", {}, phase=phase, dropped_turns=fitted.dropped_turns, progress=True)
                    continue
                tokens += event.tokens
                stats = event.stats.to_dict()
                lengths, drafted_by = stats.pop("draft_lengths"), stats.pop("drafted_by")  # drafted_by: at the end
                text, text_runs = event.delta, event.delta_sources
                finish, detail = event.finish_reason, event.finish_detail
                if going_on is not None:
                    text, text_runs, finish, detail, stats = going_on.event(event, stats)
                if finish is not None:
                    stats["drafted_by"] = [*(going_on.drafted_by if going_on else ()), *drafted_by]
                yield ReplyChunk(delta + text, stats, finish, detail, notice, phase, dropped_turns=fitted.dropped_turns,
                                 source_runs=[*runs, *text_runs], draft_lengths=lengths[lengths_sent:],
                                 tokens=list(event.tokens), drafted_by=drafted_by[drafted_sent:])  # fmt: skip
                runs, delta, notice, lengths_sent, drafted_sent = [], "", None, len(lengths), len(drafted_by)
                if finish is not None:
                    return


class GoingOn:
    """A phase going on where it yielded its turn: the prompt followed by its tokens so far, the text released as one
    stream of all its tokens would release it (UTF-8 and stop strings across the join), the statistics summed with
    its earlier turns' (gpu_job.Resume)."""

    def __init__(self, engine: Any, request: ChatRequest, resume: Resume) -> None:
        from ...text.deltas import TextDeltas  # imports libllama: only where engines run

        self.tokens, self.drafted_by, self._before = resume.tokens, resume.drafted_by, dict(resume.stats)
        self._text = TextDeltas(engine.pair.vocabulary, request.stop)
        for token in resume.tokens:
            self._text.feed(token)
        self._text.take_runs()

    def event(self, event: Any, stats: dict[str, Any]) -> tuple[str, list[tuple[int, str]], str | None, str,
                                                                 dict[str, Any]]:  # fmt: skip
        """An event's (text, its runs, finish reason, detail, statistics) as the whole answer's."""
        text = "".join(self._text.feed(t, s) for t, s in zip(event.tokens, event.token_sources, strict=False))
        finish, detail = event.finish_reason, event.finish_detail
        if self._text.stopped:
            finish, detail = "stop", "stop string"
        elif finish is not None:
            text += self._text.finish()
        return text, self._text.take_runs(), finish, detail, resumed_stats(self._before, stats)
