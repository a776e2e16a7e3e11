"""The Space as the web process runs it: request checks, GPU jobs and what they report, and the server's description
(/info); Gradio-free, called by the page and the routes (docs/space.md)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from ...errors import DFlashError, RequestError
from ..gpu_job import AnswerSoFar, GpuJob, ReplyChunk, info_digest, owner_of
from ..provenance import SourceRuns
from ..requests import AUTO, ChatRequest, Limits, build_request
from ..scrub import scrub_paths
from ..setup.config import SpaceConfig
from ..setup.presets import DemoFiles, ResolvedPair, file_facts
from .calls import Calls, ReplyJob
from .clients import ClientIdentity, client_of_scope
from .gate import excerpt
from .gpu_time import GpuTimeEstimator
from .policy import Call

log = logging.getLogger(__name__)
# Errors `spaces` raises while scheduling, before any worker is involved: the worker (if any) is still there.
SCHEDULING_ERRORS = ("ZeroGPU quota exceeded", "ZeroGPU illegal duration", "ZeroGPU queue timeout",
                     "ZeroGPU pending credits exceeded", "ZeroGPU client error")  # fmt: skip
SERVER_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 40, "min_p": 0.0}
SERVER_DEFAULTS, MODEL_DEFAULTS = "server defaults", "the model's general.sampling"
RunGpu = Callable[[GpuJob], Iterator[ReplyChunk]]


class JobHolder(Protocol):  # who holds a reply's running job (page.session.ChatSession): Stop and Clear reach it

    def attach(self, job: ReplyJob[ReplyChunk]) -> None: ...

    def detach(self, job: ReplyJob[ReplyChunk]) -> None: ...


class WorkerError(DFlashError):  # a runtime error of the GPU worker, reported back as data (`kind`: its class)

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Reply:
    """One phase's answer so far, assembled from the chunks, its `stats` as the API returns them."""

    phase: str = "chat"
    text: str = ""
    sources: SourceRuns = field(default_factory=SourceRuns)
    draft_lengths: list[int] = field(default_factory=list)
    notice: str | None = None
    finish_reason: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    last: ReplyChunk | None = None  # the chunk added last: what the reply grew by

    def add(self, chunk: ReplyChunk) -> None:
        self.last = chunk
        self.text += chunk.delta
        self.sources.add(chunk.source_runs)
        self.draft_lengths.extend(chunk.draft_lengths)
        self.notice = chunk.notice or self.notice
        self.finish_reason = chunk.finish_reason


def decode_speed(stats: Mapping[str, Any]) -> float | None:
    """Tokens per second of the decode steps; the first token (the prefill's own sample) is not counted."""
    steps, generated, decode_ms = stats.get("target_steps", 0), stats.get("n_generated", 0), stats.get("decode_ms", 0)
    if not steps or generated < 2 or decode_ms <= 0:
        return None
    return round((generated - 1) / (decode_ms / 1000.0), 2)


def wait_problem(wait_until: Any, timeout_s: Any) -> str | None:
    """What is wrong with /wait's values, or None."""
    if wait_until not in ("idle", "busy"):
        return f"until must be 'idle' or 'busy', got {excerpt(wait_until)}"
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 <= timeout_s <= 120:
        return f"timeout_s must be a number in [0, 120], got {excerpt(timeout_s)}"
    return None


class SpaceService:
    """The web process's side of every route (see the module doc), over the configuration read at start."""

    def __init__(self, config: SpaceConfig, limits: Limits, *, run_gpu: RunGpu,
                 quota_seconds: Callable[[int], int | None]) -> None:  # fmt: skip
        self.config, self.limits = config, limits
        self.estimator = GpuTimeEstimator(config.settings)
        self.calls = Calls(config.settings, capacity=config.preset.parallel)  # the policy, shared with the HTTP gate
        self.engine_info: dict[str, Any] = {}
        self.worker_info: dict[str, Any] = {}
        self._run_gpu, self._quota_seconds = run_gpu, quota_seconds
        self._owner_secret = secrets.token_bytes(32)  # owner keys cannot be derived from a session id elsewhere
        # Adaptive drafting with the pair's default method; the server's sampling until a real pair's own
        # `general.sampling.*` replace it, once its target file is here.
        self.defaults: dict[str, Any] = {**SERVER_SAMPLING, "max_tokens": 512, "method": AUTO, "draft_length": AUTO}
        self.sampling_source = SERVER_DEFAULTS
        self.file_facts: dict[str, Any] = {}  # methods and draft problem the pair's files tell, before any load
        target, draft = config.preset.target.local_path, config.preset.draft.local_path
        if target is not None and target.is_file() and (draft is not None or config.preset.random_weights):
            self.model_files_known(ResolvedPair(target, draft))

    @classmethod
    def from_env(cls, build_status: str, build: Mapping[str, Any], env: Mapping[str, str] | None = None,
                 demo_files: DemoFiles | None = None, *, run_gpu: RunGpu, quota_seconds: Callable[[int], int | None],
                 gpu_size: str | None) -> SpaceService:  # fmt: skip
        """The service as the environment configures it (setup/config.py)."""
        env = os.environ if env is None else env
        config = SpaceConfig.from_env(build_status, build, env, demo_files, gpu_size)
        return cls(config, Limits.from_env(config.preset.draft_capacity, env), run_gpu=run_gpu,
                   quota_seconds=quota_seconds)  # fmt: skip

    @property
    def parallel(self) -> int:
        """Answers at once: the loaded engine's sequences, else DFLASH_PARALLEL's."""
        return int(self.engine_info.get("parallel") or self.config.preset.parallel)

    # -- requests -------------------------------------------------------------------------------------------------

    def check(self, **fields: Any) -> ChatRequest:
        """A validated request (build_request's fields; sampling ones left out take the defaults), or RequestError."""
        fields.update({name: self.defaults[name] for name in SERVER_SAMPLING if fields.get(name) is None})
        return build_request(presets=[self.config.preset.name], limits=self.limits, methods=self.methods(), **fields)

    def methods(self) -> list[str] | None:
        """The draft methods the pair runs, the default first: the loaded engine's, else what its files tell."""
        methods = self.engine_info.get("methods", self.file_facts.get("methods"))
        return None if methods is None else list(methods)

    def draft_problem(self) -> str | None:
        return self.engine_info.get("draft_problem") or self.file_facts.get("draft_problem")

    def model_files_known(self, files: ResolvedPair) -> None:
        """Read what the pair's headers tell (no model is opened): the methods, and a real pair's sampling defaults."""
        if self.file_facts:
            return
        try:
            self.file_facts, sampling = file_facts(files, self.config.preset.branches, not self.config.mode.tiny)
        except DFlashError as error:  # the load reports it properly; here it only means "not known"
            log.warning("could not read the pair's headers: %s", error)
            return
        if sampling:
            self.defaults.update(sampling)
            self.sampling_source = MODEL_DEFAULTS

    async def poll_files(self, timeout_s: float = 1.0) -> ResolvedPair | None:
        """The pair's local files once downloaded (here, never in the GPU function); None while downloading."""
        files = await asyncio.to_thread(self.config.download.poll, timeout_s)
        if files is not None:
            self.model_files_known(files)
        return files

    async def files(self) -> ResolvedPair:
        """The pair's local files, waiting for the download at most the busy timeout (then RequestError)."""
        deadline = time.monotonic() + self.config.settings.busy_timeout_s
        while (files := await self.poll_files()) is None:
            if time.monotonic() >= deadline:
                progress = scrub_paths(self.config.download.status().summary())
                raise RequestError(f"the model pair is still downloading ({progress}): retry in a few minutes")
        return files

    def owner_key(self, session_hash: str | None, call: Call | None = None) -> str:
        """A request's cache owner: an opaque key of its session; "" for a call of no conversation."""
        if not session_hash or (call is not None and call.sessionless):
            return ""
        return hmac.new(self._owner_secret, session_hash.encode(), hashlib.sha256).hexdigest()[:32]

    def client(self, request: Any) -> ClientIdentity:
        """The client of a Gradio handler's `gr.Request` (the Starlette request it wraps)."""
        scope = getattr(getattr(request, "request", None), "scope", None)
        return client_of_scope(scope, self.config.settings.trusted_proxy_hops)

    async def reply(self, request: ChatRequest, phases: tuple[str, ...] = ("chat",), *, owner: str,
                    client: ClientIdentity, latest_only: bool = False, session: JobHolder | None = None,
                    call: Call | None = None) -> AsyncIterator[Reply]:  # fmt: skip
        """Run `request` on the GPU for `owner` (see owner_key) and stream each phase's Reply as it grows; the worker's
        errors raise WorkerError, and leaving the loop stops the engine. `call` is the one the HTTP gate admitted;
        without one it is admitted here against the same limits (calls.AdmissionError)."""
        call = call or self.calls.admitted(client.key, len(phases))
        job: ReplyJob[ReplyChunk] | None = None  # once the call has started and the pair's files are here
        try:
            if not self.calls.start(call):
                log.info("an answer nobody reads was dropped before it started")
                return
            spec, job = self._job(request, phases, owner, client, await self.files(), call)
            requested = self._quota_seconds(spec.gpu_seconds)  # what the visitor's quota is charged, if anything
            if session is not None:
                session.attach(job)
            replies: dict[str, Reply] = {}  # per phase: an A/B run streams two answers
            async for chunk in job.chunks(latest_only):
                self._learn(chunk, first=not replies)
                if chunk.progress:
                    continue  # a prompt chunk's end: nothing to show
                reply = replies.setdefault(chunk.phase, Reply(chunk.phase))
                reply.add(chunk)
                reply.stats = self.reply_stats(chunk, reply, requested, request.notes)
                if chunk.finish_reason and owner:  # conversations' answers teach the estimate (gpu_time.py)
                    finished = {**chunk.stats, "decode_tok_s": reply.stats["decode_tok_s"]}
                    self.estimator.observe(finished, request, chunk.dropped_turns - request.dropped_turns, client.key)
                yield reply
        except Exception as error:
            if not isinstance(error, DFlashError):
                if getattr(error, "title", None) not in SCHEDULING_ERRORS:
                    self.estimator.engine_seen(False)  # the ZeroGPU worker (and the loaded model) is gone
                log.warning("the GPU call failed: %s: %s", type(error).__name__, error)
            raise
        finally:
            if session is not None and job is not None:
                session.detach(job)
            self.calls.finish(call)

    def _job(self, request: ChatRequest, phases: tuple[str, ...], owner: str, client: ClientIdentity,
             files: ResolvedPair, call: Call) -> tuple[GpuJob, ReplyJob[ReplyChunk]]:  # fmt: skip
        """The GPU job, and the reply job that runs it in `call`'s turns: a conversation's owner is its client's
        (parked states are shared out by client); a call of no conversation gets an owner of its own, kept across its
        turns."""
        spec = GpuJob(request, self.config.preset, files, phases, cache_owner=owner_of(client.key, owner or "once-" +
                      secrets.token_hex(8)), conversation=bool(owner),
                      engine_info_seen=info_digest(self.engine_info) if self.engine_info else "")  # fmt: skip
        estimate = self.estimator.estimate(request, spec.speculative_phases())
        log.info("request: %d chars, max_tokens %d, phases %s; GPU time %s s (quota %s s, load included: %s)",
                 request.input_chars, request.max_tokens, ",".join(phases), estimate.seconds,
                 self._quota_seconds(estimate.seconds), estimate.includes_load)  # fmt: skip
        spec = replace(spec, gpu_seconds=estimate.seconds)
        return spec, ReplyJob(partial(self._run_gpu, spec), self.calls, call, fold=ReplyChunk.then,
                              is_final=lambda chunk: chunk.finish_reason is not None,
                              orphan_timeout_s=self.config.settings.busy_timeout_s,
                              owner=spec.cache_owner if owner else None, resumable=AnswerSoFar(spec, self._run_gpu))

    def _learn(self, chunk: ReplyChunk, first: bool) -> None:
        """What a chunk tells of the engine and the worker (the worker's error, raised)."""
        if chunk.engine_info:
            self.engine_info = chunk.engine_info
            self.calls.resize(self.parallel)  # the loaded engine may hold fewer sequences than the queue lets through
        self.worker_info = {**self.worker_info, **chunk.worker}
        if "engine_loaded" in chunk.worker:
            self.estimator.engine_seen(chunk.worker["engine_loaded"])
        if chunk.worker.get("loaded_now") and first and chunk.worker.get("load_s") is not None:
            self.estimator.observe_load(chunk.worker["load_s"])
        if chunk.error_type:
            raise WorkerError(chunk.error_type, chunk.error or chunk.error_type)

    def reply_stats(self, chunk: ReplyChunk, reply: Reply, requested: int | None,
                    notes: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
        """The statistics the API returns for one chunk; `source_runs`: [[n_chars, "draft" | "target"], ...]."""
        return {**chunk.stats, "decode_tok_s": decode_speed(chunk.stats), "draft_lengths": list(reply.draft_lengths),
                "finish_reason": chunk.finish_reason, "finish_detail": chunk.finish_detail, "notice": reply.notice,
                "preset": self.config.preset.name, "gpu_seconds_requested": requested, "gpu_seconds_used": chunk.used_s,
                "source_runs": reply.sources.as_json(), "notes": list(notes)}  # fmt: skip

    # -- the server's description -----------------------------------------------------------------------------------

    def info_when(self, wait_until: str, timeout_s: float, client: ClientIdentity) -> dict[str, Any]:
        """`info()` once the engine slot is idle or busy (`wait_until`), or after `timeout_s` at most."""
        if (problem := wait_problem(wait_until, timeout_s)) is not None:
            raise RequestError(problem)
        came = self.calls.wait(wait_until == "busy", float(timeout_s), client.key)
        return {**self.info(), "waited_out": not came}

    def info(self) -> dict[str, Any]:
        config, counts, methods = self.config, self.calls.counts(), self.methods()
        download, preset, mode, settings = config.download.status(), config.preset, config.mode, config.settings
        return {
            "presets": {preset.name: preset.describe()}, "default_preset": preset.name,
            "defaults": dict(self.defaults), "sampling_defaults_from": self.sampling_source,
            "methods": methods, "default_method": (methods or [None])[0], "draft_problem": self.draft_problem(),
            "offline_demo": mode.tiny, "mode_reason": mode.reason, "problems": list(mode.problems), "fix": mode.fix,
            "build": {"status": config.build_status, **config.build}, "limits": self.limits.describe(),
            "download": {"state": download.state, "summary": scrub_paths(download.summary())},
            "busy": counts["running"] > 0, "parallel": self.parallel,
            **counts,  # answers running, waiting, and turns yielded to another client: counts, nothing of whose
            "engine": dict(self.engine_info),
            "gpu_time": {"zero_gpu": config.zero_gpu, "gpu_size": config.gpu_size, **self.estimator.describe()},
            "queue": {**asdict(settings), "client_from": "X-Forwarded-For" if settings.trusted_proxy_hops else
                      "socket"},
            **(self.diagnostics() if config.show_diagnostics else {}),
        }  # fmt: skip

    def diagnostics(self) -> dict[str, Any]:
        """The GPU worker as last seen, and what this process has loaded (on ZeroGPU: no backend, model or context):
        for the operator (DFLASH_DIAGNOSTICS=1), never on a public Space (it tells of others' requests)."""
        from ...native import backends

        pair = sys.modules.get("dflash_runtime.pair")  # never imported here: then it holds nothing
        return {"worker": dict(self.worker_info), "web_process": {
            "pid": os.getpid(), "backends_loaded": backends.backends_loaded(),
            "native_libraries": backends.mapped_native_libraries(),
            "live_handles": pair.live_handles() if pair is not None else 0}}  # fmt: skip
