"""What crosses between the web process and the GPU worker, as plain data (pickled into the ZeroGPU worker and back):
the job (`GpuJob`: the checked request, the pair, its phases, the GPU time asked), each step's `ReplyChunk`, the cache
owner's key, and the digest of the engine description the web process holds. Both sides import it; it imports
neither."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

from .. import methods as draft_methods
from .requests import ChatRequest
from .setup.presets import PairPreset, ResolvedPair

# Each phase's decoding: None for the request's own `speculative` and method; True for speculative with the request's
# method; False for plain decoding; a method name for speculative decoding with that method (an A/B comparison).
PHASES: dict[str, bool | str | None] = {"chat": None, "speculative": True, "plain": False,
                                        **{m: m for m in draft_methods.runnable(lambda needs: True)}}  # fmt: skip

@dataclass(frozen=True)
class GpuJob:
    """Everything the GPU function needs (plain data: it is pickled into the ZeroGPU worker)."""

    request: ChatRequest
    preset: PairPreset
    files: ResolvedPair
    phases: tuple[str, ...] = ("chat",)  # e.g. ("dflash", "mtp", "plain") for an A/B comparison
    gpu_seconds: int = 60  # the duration asked of ZeroGPU, decided in the web process
    # Whose text this is (an opaque key per visitor's session): the engine reuses cached tokens only for the same
    # owner, beyond the prompt's public prefix. Empty: a fresh owner, nothing of anybody else's is reused.
    cache_owner: str = ""
    engine_info_seen: str = ""  # the digest of the engine description the web process holds (see info_digest)

    def __post_init__(self) -> None:
        unknown = [phase for phase in self.phases if phase not in PHASES]
        if unknown or not self.phases:
            raise ValueError(f"phases must be some of {list(PHASES)}, got {self.phases}")

    def speculative_phases(self) -> tuple[bool, ...]:
        return tuple(phase_decoding(self.request, p)[0] for p in self.phases)


def phase_decoding(request: ChatRequest, phase: str) -> tuple[bool, str | None]:
    """(speculative, method) of one phase: method None means the request's own."""
    decoding = PHASES[phase]
    if decoding is None:
        return request.speculative, None
    if isinstance(decoding, str):
        return True, decoding
    return decoding, None


@dataclass
class ReplyChunk:
    """What a streaming reply sends after each engine step (plain data: it crosses the ZeroGPU process line). Its
    size does not grow with the answer: the text and everything that accumulates come as what this step added, and
    what does not change within a reply comes once."""

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
    # Divergence.to_dict() (dflash_runtime.divergence): where, and whether a near-tie or a fault.
    divergences: dict[str, dict[str, Any]] = field(default_factory=dict)

    def then(self, newer: ReplyChunk) -> ReplyChunk:
        """This chunk and the `newer` one after it as one (for a reader that skips chunks a newer one replaced):
        what accumulates is joined, what comes once is kept."""
        return replace(
            newer,
            delta=self.delta + newer.delta,
            notice=newer.notice or self.notice,
            engine_info=newer.engine_info or self.engine_info,
            worker={**self.worker, **newer.worker},
            source_runs=[*self.source_runs, *newer.source_runs],
            draft_lengths=[*self.draft_lengths, *newer.draft_lengths],
            divergences={**self.divergences, **newer.divergences},
        )

    def given_up(self) -> ReplyChunk:
        """This chunk as the last of its answer, which ends here to give its sequence to another client's waiting
        answer (see jobs.EngineSlot): what it carries stays, its statistics say why it stopped."""
        if self.finish_reason is not None:
            return self
        return replace(self, finish_reason="shared", finish_detail=SHARED_DETAIL)


SHARED_DETAIL = "cut short: another visitor was waiting while you had answers on several of the engine's sequences"


def owner_of(client: str, session: str) -> str:
    """The cache owner of a session of a client (both opaque hex keys): the engine shares its parked states out by
    the client part (see client_of_owner)."""
    return f"{client}/{session}"


def client_of_owner(owner: Any) -> Any:
    """The client part of a cache owner made by owner_of (an owner of another form is its own client)."""
    return owner.split("/", 1)[0] if isinstance(owner, str) else owner


def info_digest(info: dict[str, Any]) -> str:
    """A short digest of an engine description: the web process says which one it holds, the host sends its own only
    when it differs."""
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:16]
