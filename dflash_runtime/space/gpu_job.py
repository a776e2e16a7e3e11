"""The GPU job and what comes back, as plain data pickled between the web process and the GPU worker. Both sides
import it; it imports neither."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from copy import deepcopy
from dataclasses import dataclass, field, fields, replace
from itertools import zip_longest
from typing import Any

from .. import methods as draft_methods
from ..results.stats import Stats
from .requests import ChatRequest
from .setup.presets import PairPreset, ResolvedPair

# Each phase's (speculative, method): None for the request's own, method None for the request's method, another
# method for speculative decoding with that one (an A/B comparison).
PHASES: dict[str, tuple[bool, str | None] | None] = {"chat": None, "speculative": (True, None), "plain": (False, None),
                                                    **{m: (True, m) for m in draft_methods.runnable(lambda _: True)}}

@dataclass(frozen=True)
class GpuJob:
    """Everything the GPU function needs (plain data: it is pickled into the ZeroGPU worker)."""

    request: ChatRequest
    preset: PairPreset
    files: ResolvedPair
    phases: tuple[str, ...] = ("chat",)  # e.g. ("dflash", "mtp", "plain") for an A/B comparison
    gpu_seconds: int = 60  # the duration asked of ZeroGPU, decided in the web process
    # Whose text this is (an opaque key): the engine reuses cached tokens only for the same owner. Empty: a fresh one.
    cache_owner: str = ""
    conversation: bool = True  # the owner is a conversation's (parked at the end), or the job's own (across turns)
    engine_info_seen: str = ""  # the digest of the engine description the web process holds (see info_digest)
    resume: Resume | None = None  # an answer that yielded its turn, going on where it was (see Resume)

    def __post_init__(self) -> None:
        if not self.phases or not set(self.phases) <= PHASES.keys():
            raise ValueError(f"phases must be some of {list(PHASES)}, got {self.phases}")

    def speculative_phases(self) -> tuple[bool, ...]:
        return tuple(phase_decoding(self.request, p)[0] for p in self.phases)


def phase_decoding(request: ChatRequest, phase: str) -> tuple[bool, str | None]:
    """(speculative, method) of one phase: method None means the request's own."""
    return PHASES[phase] or (request.speculative, None)


@dataclass
class ReplyChunk:
    """What a reply sends after each engine step. Its size does not grow with the answer: what accumulates comes as
    what this step added, and what does not change within a reply comes once."""

    delta: str  # the text this step added
    # The statistics after this step, without `draft_lengths` (see below) and, but for the last chunk, `drafted_by`.
    stats: dict[str, Any]
    finish_reason: str | None = None
    finish_detail: str = ""
    notice: str | None = None  # on a phase's first chunk only
    phase: str = "chat"  # "chat", or "speculative" / "plain" during an A/B comparison
    engine_info: dict[str, Any] | None = None  # when it differs from what this host sent before
    worker: dict[str, Any] = field(default_factory=dict)  # on a job's first and last chunk: loads, load_s, ...
    used_s: float | None = None  # the GPU function's time so far
    dropped_turns: int = 0
    error_type: str | None = None  # set on a final chunk that reports an error instead of raising it
    error: str | None = None
    # Who wrote `delta`: runs of (n_chars, "draft" | "target") covering it exactly.
    source_runs: list[tuple[int, str]] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)  # the draft lengths chosen in this step's rounds
    # On an A/B comparison's last chunk at temperature 0: each phase whose answer differs from plain decoding's →
    # Divergence.to_dict() (dflash_runtime.decoding.divergence): where, and whether a near-tie or a fault.
    divergences: dict[str, dict[str, Any]] = field(default_factory=dict)
    # What crosses only: the tokens of `delta` and the methods that drafted this step's verify steps (the web process
    # keeps them, so that an answer that yields its turn can go on exactly: see Resume).
    tokens: list[int] = field(default_factory=list)
    drafted_by: list[str] = field(default_factory=list)
    progress: bool = False  # a prompt chunk's end: nothing to show, a step boundary at which the job may yield

    def then(self, newer: ReplyChunk) -> ReplyChunk:
        """This chunk and the `newer` one after it as one (for a reader that skips chunks): what accumulates is joined,
        what comes once is kept."""
        joined = {name: getattr(self, name) + getattr(newer, name)  # what a chunk adds to the ones before
                  for name in ("delta", "source_runs", "draft_lengths", "tokens", "drafted_by")}
        return replace(newer, **joined, notice=newer.notice or self.notice, worker={**self.worker, **newer.worker},
                       engine_info=newer.engine_info or self.engine_info, progress=self.progress and newer.progress,
                       divergences={**self.divergences, **newer.divergences})  # fmt: skip


@dataclass
class Resume:
    """Where a job's answer stood when it yielded its turn: the phase it goes on with (an index), that phase's tokens,
    statistics and draft methods so far, and the earlier phases' whole answers (for an A/B run's divergences). The
    engine goes on from the prompt followed by these tokens, which at temperature 0 is exactly the answer's rest."""

    phase: int = 0
    tokens: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    drafted_by: list[str] = field(default_factory=list)
    answers: dict[str, list[int]] = field(default_factory=dict)


class AnswerSoFar:
    """A job's answer as its chunks told it: where it goes on, and with `run` (the GPU function) the stream of its rest
    (web/calls.py's Resumable)."""

    def __init__(self, job: GpuJob, run: Callable[[GpuJob], Iterator[ReplyChunk]] | None = None) -> None:
        self._job, self._run, self._so_far = job, run, Resume()

    def seen(self, chunk: ReplyChunk) -> None:
        if chunk.error_type or chunk.progress:  # a prompt cut at a chunk goes on from its cached part
            return
        so_far = self._so_far
        so_far.tokens += chunk.tokens
        so_far.stats = chunk.stats
        so_far.drafted_by += chunk.drafted_by
        if chunk.finish_reason is not None:  # the next phase starts afresh
            self._so_far = Resume(so_far.phase + 1, answers={**so_far.answers, chunk.phase: so_far.tokens})

    def resume(self) -> Resume | None:
        """Where the answer goes on (a copy, which the chunks still to come leave alone), or None when it is over."""
        return deepcopy(self._so_far) if self._so_far.phase < len(self._job.phases) else None

    def rest(self) -> Callable[[], Iterator[ReplyChunk]] | None:
        resume, run = self.resume(), self._run
        return None if resume is None or run is None else lambda: run(replace(self._job, resume=resume))


# A resumed answer's statistics keep its first turn's prompt figures and the newest turn's description of how it
# decodes; every other count, time and per-position count is added up, and the derived figures computed again.
FIRST_TURN_STATS = ("n_prompt", "n_reused", "n_prefilled", "prefill_ms")
NEWEST_STATS = ("speculative", "method", "draft_capacity", "draft_length", "verify_mode", "controller",
                "checkpoint_restored_at", "draft_lengths", "drafted_by")  # fmt: skip


def resumed_stats(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """An answer's statistics after it resumed: the resumed turn's (`now`) joined to its turns' before."""
    if not before:
        return now
    names = [f.name for f in fields(Stats)]
    stats = Stats(**{name: now[name] for name in names if name in now})
    for name in (name for name in names if name in before and name not in NEWEST_STATS):
        earlier, value = before[name], getattr(stats, name)
        if name in FIRST_TURN_STATS:
            setattr(stats, name, earlier)
        elif isinstance(value, list):  # a count per position
            setattr(stats, name, [a + b for a, b in zip_longest(earlier, value, fillvalue=0)])
        else:
            setattr(stats, name, earlier + value)
    if stats.checkpoint_restored_at is None:
        stats.checkpoint_restored_at = before.get("checkpoint_restored_at")
    return {**now, **{k: v for k, v in stats.to_dict().items() if k in now or k not in ("draft_lengths", "drafted_by")}}


def owner_of(client: str, session: str) -> str:
    """The cache owner of a client's session (opaque keys): the engine shares parked states out by the client part."""
    return f"{client}/{session}"


def client_of_owner(owner: Any) -> Any:
    """The client part of an owner_of owner (an owner of another form is its own client)."""
    return owner.split("/", 1)[0] if isinstance(owner, str) else owner


def info_digest(info: dict[str, Any]) -> str:
    """An engine description's digest: the host sends its own only when it differs from the web process's."""
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:16]
