"""Context checkpoints: copies of a recurrent target's state, to go back further than its rollback snapshots reach.

A hybrid target's attention cache can be cut at any position, its recurrent state cannot: the state after a prefix
exists only where it was saved. As llama.cpp's server does (`--ctx-checkpoints`), the engine saves the recurrent
part of the state (`llama_state_seq_get_data_ext` with `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`) at chosen positions and,
when a later request shares a prefix, restores the newest checkpoint at or below the shared prefix and prefills only
from there. Copies live in host memory: the on-device flag keeps a single state per sequence, not a set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..native.states import PARTIAL_ONLY, load_seq, save_seq, state_size

DEFAULT_MAX_COUNT = 8
DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_INTERVAL = 1024
MARKED_CONTROLS = 3  # control tokens near a prompt's end after which a checkpoint is saved


@dataclass(frozen=True)
class CheckpointPolicy:
    """How many checkpoints to keep (count and bytes) and how often to save one while decoding."""

    max_count: int = DEFAULT_MAX_COUNT
    max_bytes: int = DEFAULT_MAX_BYTES
    interval: int = DEFAULT_INTERVAL  # tokens between two checkpoints saved mid-prompt or mid-answer

    def __post_init__(self) -> None:
        if self.max_count < 0 or self.max_bytes < 0 or self.interval < 1:
            raise ValueError(f"checkpoint limits must be ≥ 0 and the interval ≥ 1 (got {self})")

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0


@dataclass
class Checkpoint:
    n_tokens: int  # the state after tokens[0:n_tokens]
    data: np.ndarray


@dataclass
class CheckpointCosts:
    """What checkpoints cost and gave, for one request's statistics."""

    saved: int = 0
    saved_bytes: int = 0
    save_ms: float = 0.0
    restored_at: int | None = None
    restore_ms: float = 0.0
    timeline: list[int] = field(default_factory=list)  # positions saved during the request


class CheckpointStore:
    """Bounded checkpoints of one sequence's recurrent state, oldest evicted first."""

    def __init__(self, ctx: Any, policy: CheckpointPolicy, seq: int = 0) -> None:
        self._ctx = ctx
        self.policy = policy
        self.seq = seq
        self._items: list[Checkpoint] = []

    @property
    def positions(self) -> list[int]:
        return [c.n_tokens for c in self._items]

    @property
    def total_bytes(self) -> int:
        return sum(c.data.nbytes for c in self._items)

    def last_position(self) -> int:
        return max(self.positions, default=0)

    def save(self, n_tokens: int, costs: CheckpointCosts) -> None:
        """Copy the current recurrent state, which must be the state after `n_tokens` tokens."""
        if not self.policy.enabled or n_tokens in self.positions:
            return
        t0 = time.perf_counter()
        size = state_size(self._ctx, PARTIAL_ONLY, self.seq)
        if size == 0 or size > self.policy.max_bytes:
            return  # nothing to keep, or one copy would not fit the budget
        data = save_seq(self._ctx, PARTIAL_ONLY, size, self.seq)
        while self._items and (
            len(self._items) >= self.policy.max_count or self.total_bytes + size > self.policy.max_bytes
        ):
            self._items.pop(0)
        self._items.append(Checkpoint(n_tokens, data))
        costs.saved += 1
        costs.saved_bytes += size
        costs.save_ms += (time.perf_counter() - t0) * 1000.0
        costs.timeline.append(n_tokens)

    def newest_at_or_below(self, n_tokens: int) -> Checkpoint | None:
        fits = [c for c in self._items if c.n_tokens <= n_tokens]
        return max(fits, key=lambda c: c.n_tokens, default=None)

    def restore(self, checkpoint: Checkpoint, costs: CheckpointCosts) -> None:
        """Replace the recurrent state with the checkpoint's (the attention part is left to the caller to cut)."""
        t0 = time.perf_counter()
        load_seq(self._ctx, checkpoint.data, PARTIAL_ONLY, self.seq)
        costs.restored_at = checkpoint.n_tokens
        costs.restore_ms += (time.perf_counter() - t0) * 1000.0

    def items(self) -> list[Checkpoint]:
        return list(self._items)

    def replace(self, items: list[Checkpoint]) -> None:
        self._items = list(items)

    def drop_above(self, n_tokens: int) -> None:
        """Forget checkpoints past `n_tokens`: the tokens after that position are about to change."""
        self._items = [c for c in self._items if c.n_tokens <= n_tokens]

    def clear(self) -> None:
        self._items = []

    def describe(self) -> dict[str, Any]:
        return {
            "max_count": self.policy.max_count,
            "max_bytes": self.policy.max_bytes,
            "interval": self.policy.interval,
            "count": len(self._items),
            "bytes": self.total_bytes,
            "positions": self.positions,
        }


def prompt_marks(prompt: Sequence[int], controls: frozenset[int], public_prefix: int = 0) -> list[int]:
    """Positions of a prompt where a checkpoint serves later requests, in order.

    Chat templates may re-render history (Qwen3.5's drops earlier turns' thinking blocks), so the next turn's prompt
    can leave this one a few tokens after a message boundary, not at its end: checkpoints go right after each of the
    last few control tokens (`<|im_start|>` of the generation header, `<|im_end|>` of the last message), just before
    the last token (the same prompt again, or a continuation of it), and at the end of a public prefix (where
    another visitor's conversation may start).
    """
    end = len(prompt)
    marks = {end - 1}
    found = 0
    for i in range(end - 2, -1, -1):
        if prompt[i] in controls:
            marks.add(i + 1)
            found += 1
            if found == MARKED_CONTROLS:
                break
    if 0 < public_prefix < end:
        marks.add(public_prefix)
    return sorted(m for m in marks if 0 < m < end)
