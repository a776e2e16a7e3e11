"""The Space as the web process runs it: configuration, request checks, GPU jobs and what they report, and the
server's description (/info). Gradio-free: the endpoints and the page call it (dflash_runtime.space.page.endpoints).
Everything that can be checked is checked here, before a GPU is asked for; the GPU function runs the job
(dflash_runtime.space.gpu.zerogpu) and its chunks come back through a ReplyJob, which stops the work when the caller
leaves. The GPU-time estimates learn from conversations' finished answers (gpu_time.py)."""

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
from ..setup import presets as space_presets
from ..setup.downloads import PairDownload
from ..setup.presets import DemoFiles, PairPreset, ResolvedPair
from ..setup.runmode import RunMode, choose_run_mode, cuda_device_present, on_zero_gpu, settle_run_mode
from ..setup.settings import PublicSettings
from .calls import Calls
from .clients import ClientIdentity, client_of_request
from .gate import excerpt
from .gpu_time import GpuTimeEstimator
from .jobs import ReplyJob
from .policy import Call

log = logging.getLogger(__name__)
BUILD_KEYS = ("llama_cpp_version", "cuda_build", "gpu_offload", "cuda_devices", "wheel_architectures",
              "compiled_architectures", "dflash_missing_symbols", "problems", "ok")  # fmt: skip
# Errors `spaces` raises while scheduling, before any worker is involved: the worker (if any) is still there.
SCHEDULING_ERRORS = ("ZeroGPU quota exceeded", "ZeroGPU illegal duration", "ZeroGPU queue timeout",
                     "ZeroGPU pending credits exceeded", "ZeroGPU client error")  # fmt: skip
SERVER_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 40, "min_p": 0.0}
SERVER_DEFAULTS, MODEL_DEFAULTS = "server defaults", "the model's general.sampling"
RunGpu = Callable[[GpuJob], Iterator[ReplyChunk]]


class JobHolder(Protocol):
    """Who holds a reply's running job while it streams (a tab's conversation: page.session.ChatSession), so that
    Stop and Clear reach it."""

    def attach(self, job: ReplyJob[ReplyChunk]) -> None: ...

    def detach(self, job: ReplyJob[ReplyChunk]) -> None: ...


class WorkerError(DFlashError):
    """A runtime error raised where generation runs and reported back as data (`kind` is its class name)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Reply:
    """One phase's answer so far, as the web process assembles it from the chunks: the text, who wrote it, the draft
    lengths, and the statistics as the API returns them (`stats`, refreshed for each chunk)."""

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
    """Tokens per second of the decode steps: the tokens they wrote over their time. The first token is the
    prefill's own sample, timed at almost nothing, so it is not counted; None before a step has written a token."""
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


def _scrubbed(value: Any) -> Any:
    if isinstance(value, str):
        return scrub_paths(value)
    return [_scrubbed(item) for item in value] if isinstance(value, list) else value


def web_process_facts() -> dict[str, Any]:
    """What this process has loaded (it must load no llama.cpp backend, model or context on ZeroGPU)."""
    from ...native import backends

    pair = sys.modules.get("dflash_runtime.pair")  # never imported here: then it holds nothing
    return {"pid": os.getpid(), "backends_loaded": backends.backends_loaded(),
            "native_libraries": backends.mapped_native_libraries(),
            "live_handles": pair.live_handles() if pair is not None else 0}  # fmt: skip


class SpaceService:
    def __init__(self, *, mode: RunMode, preset: PairPreset, limits: Limits, download: PairDownload, build_status: str,
                 build: Mapping[str, Any], run_gpu: RunGpu, quota_seconds: Callable[[int], int | None], zero_gpu: bool,
                 gpu_size: str | None, show_diagnostics: bool = False,
                 settings: PublicSettings | None = None) -> None:  # fmt: skip
        settings = settings or PublicSettings()
        self.mode = replace(mode, problems=tuple(scrub_paths(problem) for problem in mode.problems))
        self.preset, self.limits, self.download = preset, limits, download
        self.build_status = scrub_paths(build_status)
        self.build = {key: _scrubbed(build.get(key)) for key in BUILD_KEYS}
        self.estimator = GpuTimeEstimator(settings)
        self.zero_gpu, self.gpu_size, self.show_diagnostics = zero_gpu, gpu_size, show_diagnostics
        self.calls = Calls(settings, capacity=preset.parallel)  # the fair-share policy, shared with the HTTP gate
        self.engine_info: dict[str, Any] = {}
        self.worker_info: dict[str, Any] = {}
        self._run_gpu, self._quota_seconds = run_gpu, quota_seconds
        self._owner_secret = secrets.token_bytes(32)  # owner keys cannot be derived from a session id elsewhere
        # Adaptive drafting ("auto") with the pair's default method, the real pair and the offline demo alike (the
        # demo's generated draft is right about as often, position by position, as a real one). Sampling starts from
        # the server's defaults; a real pair's own `general.sampling.*` replace them once its target file is here.
        self.defaults: dict[str, Any] = {**SERVER_SAMPLING, "max_tokens": 512, "method": AUTO, "draft_length": AUTO}
        self.sampling_source = SERVER_DEFAULTS
        self.file_facts: dict[str, Any] = {}  # methods and draft problem the pair's files tell, before any load
        if preset.target.local_path is not None and (preset.draft.local_path is not None or preset.random_weights):
            files = ResolvedPair(preset.target.local_path, preset.draft.local_path)
            if files.target_path.is_file():
                self.model_files_known(files)

    @classmethod
    def from_env(cls, build_status: str, build: Mapping[str, Any], env: Mapping[str, str] | None = None,
                 demo_files: DemoFiles | None = None, *, run_gpu: RunGpu, quota_seconds: Callable[[int], int | None],
                 gpu_size: str | None) -> SpaceService:  # fmt: skip
        """The service as the environment configures it, given the start-up check's result and the GPU function
        (`run_gpu`, with what ZeroGPU charges for a duration and the GPU size asked: dflash_runtime.space.gpu.zerogpu,
        which the composition root hands in); `demo_files` makes the offline demo's generated models."""
        env = os.environ if env is None else env
        zero_gpu, has_cuda = on_zero_gpu(env), cuda_device_present()
        mode = choose_run_mode(env, space_presets.overrides_in_env(env), has_cuda)
        mode = settle_run_mode(mode, build, zero_gpu=zero_gpu, has_cuda=has_cuda,
                               n_gpu_layers=space_presets.configured_preset(False, env).n_gpu_layers)  # fmt: skip
        parallel, fit = space_presets.parallel_from_env(env, zero_gpu)
        preset = replace(space_presets.configured_preset(mode.tiny, env, demo_files), parallel=parallel,
                         parallel_fit=fit)  # fmt: skip
        return cls(mode=mode, preset=preset, limits=Limits.from_env(preset.draft_capacity, env),
                   download=PairDownload.from_env(preset, env), build_status=build_status, build=build,
                   run_gpu=run_gpu, quota_seconds=quota_seconds, zero_gpu=zero_gpu, gpu_size=gpu_size,
                   show_diagnostics=env.get("DFLASH_DIAGNOSTICS", "").strip() in ("1", "true", "yes"),
                   settings=PublicSettings.from_env(env))  # fmt: skip

    @property
    def parallel(self) -> int:
        """How many answers run at once on the engine: the loaded engine's sequences, else DFLASH_PARALLEL (with
        `auto` the most: the engine opens as many as fit in memory; 1 on ZeroGPU)."""
        return int(self.engine_info.get("parallel") or self.preset.parallel)

    # -- requests -------------------------------------------------------------------------------------------------

    def check(self, **fields: Any) -> ChatRequest:
        """A validated request (build_request's fields), or RequestError saying what is wrong. Sampling fields left
        out (or None) take the server's current defaults (the model's own, once known)."""
        for name in SERVER_SAMPLING:
            if fields.get(name) is None:
                fields[name] = self.defaults[name]
        return build_request(presets=[self.preset.name], limits=self.limits, methods=self.methods(), **fields)

    def methods(self) -> list[str] | None:
        """The draft methods the pair runs, the default first: the loaded engine's, else what its files tell
        (a draft, an MTP head in the target's header); None while unknown."""
        if "methods" in self.engine_info:
            return list(self.engine_info["methods"])
        return self.file_facts.get("methods")

    def draft_problem(self) -> str | None:
        return self.engine_info.get("draft_problem") or self.file_facts.get("draft_problem")

    def model_files_known(self, files: ResolvedPair) -> None:
        """Read what the pair's files tell from their headers (no model is opened): the methods, and for a real
        pair the target's recommended sampling (`general.sampling.*`), which become the defaults."""
        if self.file_facts:
            return
        try:
            methods = space_presets.pair_methods(files.target_path, files.draft_path, self.preset.branches)
            fallback = space_presets.fallback_methods(files.target_path)
            sampling = {} if self.mode.tiny else space_presets.header_sampling_defaults(files.target_path)
        except DFlashError as error:  # the load reports it properly; here it only means "not known"
            log.warning("could not read the pair's headers: %s", error)
            return
        problem = files.draft_problem and space_presets.draft_unavailable(scrub_paths(files.draft_problem), fallback)
        self.file_facts = {"methods": methods, "draft_problem": problem or None}
        if sampling:
            self.defaults.update(sampling)
            self.sampling_source = MODEL_DEFAULTS

    async def poll_files(self, timeout_s: float = 1.0) -> ResolvedPair | None:
        """The pair's local files once downloaded (here, never in the GPU function); None while downloading."""
        files = await asyncio.to_thread(self.download.poll, timeout_s)
        if files is not None:
            self.model_files_known(files)
        return files

    async def files(self) -> ResolvedPair:
        """The pair's local files, waiting for the download at most the Space's busy timeout (then RequestError: an
        API call does not wait out a download of many gigabytes; the page shows its progress meanwhile)."""
        deadline = time.monotonic() + self.calls.settings.busy_timeout_s
        while (files := await self.poll_files()) is None:
            if time.monotonic() >= deadline:
                progress = scrub_paths(self.download.status().summary())
                raise RequestError(f"the model pair is still downloading ({progress}): retry in a few minutes")
        return files

    def owner_key(self, session_hash: str | None, call: Call | None = None) -> str:
        """The cache owner of a request: an opaque key derived from the caller's session (`reply` adds its client's,
        see gpu_job.owner_of); "" for a call without a conversation (a session-less raw call, /v1)."""
        if not session_hash or (call is not None and call.sessionless):
            return ""
        return hmac.new(self._owner_secret, session_hash.encode(), hashlib.sha256).hexdigest()[:32]

    def client(self, request: Any) -> ClientIdentity:
        """The client of a Gradio handler's request (see clients.py)."""
        return client_of_request(request, self.calls.settings)

    async def reply(self, request: ChatRequest, phases: tuple[str, ...] = ("chat",), *, owner: str,
                    client: ClientIdentity, latest_only: bool = False, session: JobHolder | None = None,
                    call: Call | None = None) -> AsyncIterator[Reply]:  # fmt: skip
        """Run `request` on the GPU for `owner` (see owner_key; "" for no conversation) of `client` and stream its
        reply, phase by phase, after each chunk (the same Reply object, grown: read it before asking for the next).
        Errors reported by the worker are raised as WorkerError; leaving the loop (or being cancelled) stops the engine.

        Every route's engine work passes here. `call`: the engine call the HTTP gate admitted; one abandoned before it
        starts ends here, without asking for a GPU. Without one (a route the gate does not count) the call is admitted
        here, against the same limits (calls.AdmissionError when over one)."""
        call = call or self.calls.admitted(client.key, len(phases))
        try:
            if not self.calls.start(call):
                log.info("an answer nobody reads was dropped before it started")
                return
            async for reply in self._reply(request, phases, owner, client, latest_only, session, call):
                yield reply
        finally:
            self.calls.finish(call)

    def _job(self, request: ChatRequest, phases: tuple[str, ...], owner: str, client: ClientIdentity,
             files: ResolvedPair) -> GpuJob:  # fmt: skip
        """The GPU job: a conversation's owner is its client's (parked states are shared out by client), and a call
        of no conversation gets an owner of its own, kept only across its turns (see gpu_job.GpuJob)."""
        job = GpuJob(request, self.preset, files, phases, cache_owner=owner_of(client.key, owner or "once-" +
                     secrets.token_hex(8)), conversation=bool(owner),
                     engine_info_seen=info_digest(self.engine_info) if self.engine_info else "")  # fmt: skip
        estimate = self.estimator.estimate(request, job.speculative_phases())
        log.info("request: %d chars, max_tokens %d, phases %s; GPU time %s s (quota %s s, load included: %s)",
                 request.input_chars, request.max_tokens, ",".join(phases), estimate.seconds,
                 self._quota_seconds(estimate.seconds), estimate.includes_load)  # fmt: skip
        return replace(job, gpu_seconds=estimate.seconds)

    async def _reply(self, request: ChatRequest, phases: tuple[str, ...], owner: str, client: ClientIdentity,
                     latest_only: bool, session: JobHolder | None, call: Call) -> AsyncIterator[Reply]:  # fmt: skip
        spec = self._job(request, phases, owner, client, await self.files())
        job: ReplyJob[ReplyChunk] = ReplyJob(
            partial(self._run_gpu, spec), self.calls, call, is_final=lambda chunk: chunk.finish_reason is not None,
            fold=ReplyChunk.then, orphan_timeout_s=self.calls.settings.busy_timeout_s,
            owner=spec.cache_owner if owner else None, resumable=AnswerSoFar(spec, self._run_gpu))  # fmt: skip
        if session is not None:
            session.attach(job)
        replies: dict[str, Reply] = {}  # per phase: an A/B run streams two answers
        try:
            async for chunk in job.chunks(latest_only):
                self._learn(chunk, first=not replies)
                if chunk.progress:
                    continue  # a prompt chunk's end: nothing to show
                reply = replies.setdefault(chunk.phase, Reply(chunk.phase))
                reply.add(chunk)
                reply.stats = self.reply_stats(chunk, reply, self._quota_seconds(spec.gpu_seconds), request.notes)
                if chunk.finish_reason and owner:  # conversations' answers teach the estimate (gpu_time.py)
                    finished = {**chunk.stats, "decode_tok_s": reply.stats["decode_tok_s"]}
                    self.estimator.observe(finished, request, chunk.dropped_turns - request.dropped_turns, client.key)
                yield reply
        except Exception as error:
            if not isinstance(error, DFlashError):
                if getattr(error, "title", None) not in SCHEDULING_ERRORS:
                    self.estimator.worker_lost()  # the ZeroGPU worker (and the loaded model) is gone
                log.warning("the GPU call failed: %s: %s", type(error).__name__, error)
            raise
        finally:
            if session is not None:
                session.detach(job)

    def _learn(self, chunk: ReplyChunk, first: bool) -> None:
        """What a chunk tells of the engine and the worker (and the worker's error, raised)."""
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
        """The statistics the API returns (and the panel shows) for one chunk; `source_runs` says who wrote the text
        so far: [[n_chars, "draft" | "target"], ...] covering it exactly."""
        return {**chunk.stats, "decode_tok_s": decode_speed(chunk.stats), "draft_lengths": list(reply.draft_lengths),
                "finish_reason": chunk.finish_reason, "finish_detail": chunk.finish_detail, "notice": reply.notice,
                "preset": self.preset.name, "gpu_seconds_requested": requested, "gpu_seconds_used": chunk.used_s,
                "source_runs": reply.sources.as_json(), "notes": list(notes)}  # fmt: skip

    # -- the server's description -----------------------------------------------------------------------------------

    def info_when(self, wait_until: str, timeout_s: float) -> dict[str, Any]:
        """`info()` once the engine slot is idle or busy (`wait_until`), or after `timeout_s` (≤ 120 s) at most."""
        problem = wait_problem(wait_until, timeout_s)
        if problem is not None:
            raise RequestError(problem)
        came = self.calls.wait(wait_until == "busy", float(timeout_s))
        return {**self.info(), "waited_out": not came}

    def info(self) -> dict[str, Any]:
        download, counts, settings = self.download.status(), self.calls.counts(), self.calls.settings
        return {
            "presets": {self.preset.name: self.preset.describe()}, "default_preset": self.preset.name,
            "defaults": dict(self.defaults), "sampling_defaults_from": self.sampling_source,
            "methods": self.methods(), "default_method": (self.methods() or [None])[0],
            "draft_problem": self.draft_problem(), "offline_demo": self.mode.tiny, "mode_reason": self.mode.reason,
            "problems": list(self.mode.problems), "fix": self.mode.fix,
            "build": {"status": self.build_status, **self.build}, "limits": self.limits.describe(),
            "download": {"state": download.state, "summary": scrub_paths(download.summary())},
            "busy": counts["running"] > 0, "parallel": self.parallel,  # answers running (or being stopped), at most
            **counts,  # answers running, waiting, and turns yielded to another client: counts, nothing of whose
            "engine": dict(self.engine_info),
            "gpu_time": {"zero_gpu": self.zero_gpu, "gpu_size": self.gpu_size, **self.estimator.describe()},
            "queue": {**asdict(settings), "client_from": "X-Forwarded-For" if settings.trusted_proxy_hops else
                      "socket"},
            **(self.diagnostics() if self.show_diagnostics else {}),
        }  # fmt: skip

    def diagnostics(self) -> dict[str, Any]:
        """The processes as last seen (the GPU worker's id, loads, requests and the last request's outcome; what the
        web process has loaded): for the operator (DFLASH_DIAGNOSTICS=1), never on a public Space, where they would
        tell one visitor about another's requests."""
        return {"worker": dict(self.worker_info), "web_process": web_process_facts()}
