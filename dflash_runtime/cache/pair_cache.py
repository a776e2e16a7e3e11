"""What the pair's two caches hold, and the one rule for going back in them.

The target cache holds `tokens` at positions 0..len-1; each drafter (drafting.py) holds what its method read from the
same positions, or keeps it pending. Going back (a rejected draft, or a new request that shares only a prefix) cuts
the target and every drafter. The drafters' caches and a dense target's cache are attention only: any suffix can go.

A recurrent (hybrid) target can go back through its rollback snapshots only while they describe the state: the
snapshots are written by a decode for the last min(n_rows, n_rs_seq + 1) states of that decode, so after a decode of
n rows the state can move back by at most min(n - 1, n_rs_seq) tokens, once. `llama_memory_seq_rm` cannot tell: it
also accepts rollbacks into snapshots left by an older decode, and the state is then silently wrong. Anything deeper
restores the newest context checkpoint at or below the target position, or starts over; either way the cache keeps
fewer tokens than asked and the caller prefills the rest. A rollback through the snapshots takes effect at the
sequence's next decode; until then it is pending (`pending_rollback`), which a draft tree's paths must know when
they share the sequence's state (spares.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..drafters.drafting import Drafter
from ..errors import RollbackError
from ..native.memory import SequenceMemory
from ..native.states import WHOLE, load_seq, save_seq
from .checkpoints import Checkpoint, CheckpointCosts, CheckpointStore


def reusable_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """How many `cached` tokens `prompt` starts with, leaving at least its last token to decode (its logits are
    needed)."""
    limit = min(len(cached), len(prompt) - 1)
    n = 0
    while n < limit and cached[n] == prompt[n]:
        n += 1
    return n


@dataclass
class ParkedCache:
    """A copy of everything the caches held for one owner: tokens, the target's state, each drafter's, checkpoints."""

    tokens: list[int]
    public_len: int
    target: np.ndarray
    drafters: list[Any]
    checkpoints: list[Checkpoint]
    nbytes: int


class PairCache:
    """One sequence of the engine (`seq`): its tokens, and its part of the target's and every drafter's state."""

    def __init__(self, target_ctx: Any, drafters: Sequence[Drafter], *, recurrent: bool, n_rs_seq: int,
                 checkpoints: CheckpointStore | None, seq: int = 0) -> None:
        self.seq = seq
        self._target_ctx = target_ctx
        self._target = SequenceMemory(target_ctx, "target", seq)
        self.drafters = list(drafters)
        self.recurrent = recurrent
        self._n_rs_seq = n_rs_seq
        self.checkpoints = checkpoints if recurrent else None
        self.tokens: list[int] = []
        self.public_len = 0  # leading tokens that any owner may reuse (see sessions.py)
        self._rollback_window = 0  # tokens the recurrent snapshots can take back right now
        # A rollback through the snapshots takes effect at the sequence's next decode: its size until then, and
        # whether it is known (a target decode without this sequence may have applied it, see pending_rollback).
        self._pending = 0
        self._pending_known = True

    def __len__(self) -> int:
        return len(self.tokens)

    def decoded(self, tokens: Sequence[int]) -> None:
        """Record a successful target decode of `tokens` at the end of the cache."""
        self.tokens.extend(tokens)
        self._rollback_window = min(len(tokens) - 1, self._n_rs_seq)
        self._pending, self._pending_known = 0, True

    def beside_decode(self) -> None:
        """A target decode ran without this sequence: libllama may have applied its pending rollback there (a decode
        also moves the recurrent cells in the range of its own, which applies their pending rollbacks)."""
        if self._pending:
            self._pending_known = False

    @property
    def pending_rollback(self) -> int | None:
        """Tokens a hybrid target's recurrent state still goes back at this sequence's next decode (libllama applies
        a rollback through the snapshots then), 0 for none or a dense target; None when that is not known."""
        return self._pending if self._pending_known else None

    def can_roll_back(self, n_tokens: int) -> bool:
        """Whether the last `n_tokens` tokens can be removed without a checkpoint or a new prefill."""
        return not self.recurrent or n_tokens <= self._rollback_window

    def keep(self, n: int, costs: CheckpointCosts) -> int:
        """Cut both caches to at most `n` tokens; returns how many they keep (less than n after a checkpoint
        restore, 0 after starting over). Raises RollbackError only if libllama refuses what this rule allows."""
        have = len(self.tokens)
        if n >= have:
            return have
        if self.can_roll_back(have - n):
            self._cut_target(n)
            self._pending = have - n if self.recurrent else 0
        else:
            n = self._restore_at_or_below(n, costs)
        self._cut_draft(n)
        return n

    def roll_back(self, n: int) -> None:
        """Cut a rejected draft's rows: both caches end at `n` tokens, through the snapshots (a verify batch of k + 1
        rows leaves k tokens to take back), or RollbackError when the target was opened with fewer snapshots."""
        have = len(self.tokens)
        if n >= have:
            return
        if not self.can_roll_back(have - n):
            self.clear()
            raise RollbackError(
                f"the target cannot roll back {have - n} tokens: a hybrid target needs n_rs_seq ≥ the draft length "
                f"(it has {self._n_rs_seq}); both caches were cleared"
            )
        self._cut_target(n)
        self._pending = have - n if self.recurrent else 0
        self._cut_draft(n)

    def shared(self, prompt: Sequence[int]) -> int:
        return reusable_prefix(self.tokens, prompt)

    def reuse(self, prompt: Sequence[int], costs: CheckpointCosts, limit: int | None = None) -> int:
        """Keep the longest cached prefix of `prompt` (at most `limit` tokens); returns the number kept."""
        n = self.shared(prompt)
        return self.keep(n if limit is None else min(n, limit), costs)

    def clear(self) -> None:
        self._target.clear()
        for drafter in self.drafters:
            drafter.clear(self.seq)
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self.tokens = []
        self.public_len = 0
        self._rollback_window = 0
        self._pending, self._pending_known = 0, True

    # -- parking: one owner's caches set aside while another's run (sessions.py) ---------------------------------

    def park(self) -> ParkedCache:
        """A copy of the caches' whole state; the caches themselves are left as they are."""
        target = save_seq(self._target_ctx, WHOLE, seq=self.seq)
        drafters = [d.save(self.seq) for d in self.drafters]
        checkpoints = self.checkpoints.items() if self.checkpoints is not None else []
        nbytes = target.nbytes + sum(d.state_bytes(s) for d, s in zip(self.drafters, drafters, strict=True))
        nbytes += sum(c.data.nbytes for c in checkpoints)
        return ParkedCache(list(self.tokens), self.public_len, target, drafters, checkpoints, nbytes)

    def unpark(self, parked: ParkedCache) -> None:
        """Bring back a parked state in place of the current one."""
        try:
            load_seq(self._target_ctx, parked.target, WHOLE, self.seq)
            for drafter, state in zip(self.drafters, parked.drafters, strict=True):
                drafter.restore(self.seq, state)
        except BaseException:
            self.clear()
            raise
        if self.checkpoints is not None:
            self.checkpoints.replace(parked.checkpoints)
        self.tokens = list(parked.tokens)
        self.public_len = parked.public_len
        self._rollback_window = 0  # the snapshots describe no decode of this state
        self._pending, self._pending_known = 0, True  # a state load leaves no rollback pending

    @property
    def checkpointing(self) -> bool:
        return self.checkpoints is not None and self.checkpoints.policy.enabled

    def interval_due(self) -> bool:
        """Whether a checkpoint is due because the last one is an interval behind."""
        store = self.checkpoints
        if store is None or not self.checkpointing or not self.tokens:
            return False
        return len(self.tokens) - store.last_position() >= store.policy.interval

    def save_checkpoint(self, costs: CheckpointCosts) -> None:
        if self.checkpointing and self.tokens:
            assert self.checkpoints is not None
            self.checkpoints.save(len(self.tokens), costs)

    # -- internals ----------------------------------------------------------------------------------------------

    def _cut_target(self, n: int) -> None:
        if not self._target.remove_from(n):
            had = len(self.tokens)
            self.clear()
            raise RollbackError(
                f"the target cache refused to roll back from {had} to {n} tokens; both caches were cleared"
            )
        del self.tokens[n:]
        self.public_len = min(self.public_len, n)
        self._rollback_window = 0  # one partial rollback per decode
        if self.checkpoints is not None:
            self.checkpoints.drop_above(n)

    def _restore_at_or_below(self, n: int, costs: CheckpointCosts) -> int:
        checkpoint = self.checkpoints.newest_at_or_below(n) if self.checkpoints is not None else None
        if checkpoint is None or checkpoint.n_tokens == 0:
            self._clear_target()
            return 0
        assert self.checkpoints is not None
        self.checkpoints.restore(checkpoint, costs)
        # The recurrent part now ends at the checkpoint: removing the attention suffix is a plain cut.
        self._rollback_window = 0
        self._pending, self._pending_known = 0, True
        self._cut_target(checkpoint.n_tokens)
        return checkpoint.n_tokens

    def _clear_target(self) -> None:
        self._target.clear()
        self.tokens = []
        self.public_len = 0
        self._rollback_window = 0
        self._pending, self._pending_known = 0, True
        if self.checkpoints is not None:
            self.checkpoints.clear()

    def _cut_draft(self, n: int) -> None:
        try:
            for drafter in self.drafters:
                drafter.keep(self.seq, n)
        except RollbackError as error:
            self.clear()
            raise RollbackError(f"{error}; both caches were cleared") from None
