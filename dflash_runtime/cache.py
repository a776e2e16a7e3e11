"""What the pair's two caches hold, and the one rule for going back in them.

The target cache holds `tokens` at positions 0..len-1; the draft cache holds the target features of the same
positions, except rows still pending in the feature bridge. Going back (a rejected draft, or a new request that
shares only a prefix) cuts both. The draft cache and a dense target's cache are attention only: any suffix can go.

A recurrent (hybrid) target can go back through its rollback snapshots only while they describe the state: the
snapshots are written by a decode for the last min(n_rows, n_rs_seq + 1) states of that decode, so after a decode of
n rows the state can move back by at most min(n - 1, n_rs_seq) tokens, once. `llama_memory_seq_rm` cannot tell: it
also accepts rollbacks into snapshots left by an older decode, and the state is then silently wrong. Anything deeper
restores the newest context checkpoint at or below the target position, or starts over; either way the cache keeps
fewer tokens than asked and the caller prefills the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_cpp import llama_cpp as ll

from .checkpoints import CheckpointCosts, CheckpointStore
from .errors import RollbackError
from .features import FeatureBridge


class PairCache:
    def __init__(self, target_ctx: Any, draft_ctx: Any | None, bridge: FeatureBridge | None, *, recurrent: bool,
                 n_rs_seq: int, checkpoints: CheckpointStore | None) -> None:
        self._target = ll.llama_get_memory(target_ctx)
        self._draft = ll.llama_get_memory(draft_ctx) if draft_ctx is not None else None
        self._bridge = bridge
        self.recurrent = recurrent
        self._n_rs_seq = n_rs_seq
        self.checkpoints = checkpoints if recurrent else None
        self.tokens: list[int] = []
        self._rollback_window = 0  # tokens the recurrent snapshots can take back right now

    def __len__(self) -> int:
        return len(self.tokens)

    def decoded(self, tokens: Sequence[int]) -> None:
        """Record a successful target decode of `tokens` at the end of the cache."""
        self.tokens.extend(tokens)
        self._rollback_window = min(len(tokens) - 1, self._n_rs_seq)

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
        self._cut_draft(n)

    def reuse(self, prompt: Sequence[int], costs: CheckpointCosts) -> int:
        """Keep the longest cached prefix of `prompt`, leaving at least its last token to decode (its logits are
        needed); returns the number of prompt tokens kept."""
        limit = min(len(self.tokens), len(prompt) - 1)
        n = 0
        while n < limit and self.tokens[n] == prompt[n]:
            n += 1
        return self.keep(n, costs)

    def clear(self) -> None:
        ll.llama_memory_clear(self._target, True)
        if self._draft is not None:
            ll.llama_memory_clear(self._draft, True)
        if self._bridge is not None:
            self._bridge.n_pending = 0
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self.tokens = []
        self._rollback_window = 0

    @property
    def checkpointing(self) -> bool:
        return self.checkpoints is not None and self.checkpoints.policy.enabled

    def checkpoint_due(self, *, prompt_end: bool) -> bool:
        """Whether to save a checkpoint of the current state now: just before a prompt's last token (so that the
        same prompt, or a conversation that continues it, finds one), or an interval after the previous one."""
        store = self.checkpoints
        if store is None or not self.checkpointing or not self.tokens:
            return False
        return prompt_end or len(self.tokens) - store.last_position() >= store.policy.interval

    def save_checkpoint(self, costs: CheckpointCosts) -> None:
        assert self.checkpoints is not None
        self.checkpoints.save(len(self.tokens), costs)

    # -- internals ----------------------------------------------------------------------------------------------

    def _cut_target(self, n: int) -> None:
        if not ll.llama_memory_seq_rm(self._target, 0, n, -1):
            had = len(self.tokens)
            self.clear()
            raise RollbackError(
                f"the target cache refused to roll back from {had} to {n} tokens; both caches were cleared"
            )
        del self.tokens[n:]
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
        self._cut_target(checkpoint.n_tokens)
        return checkpoint.n_tokens

    def _clear_target(self) -> None:
        ll.llama_memory_clear(self._target, True)
        self.tokens = []
        self._rollback_window = 0
        if self.checkpoints is not None:
            self.checkpoints.clear()

    def _cut_draft(self, n: int) -> None:
        if self._bridge is not None:
            self._bridge.drop_from(n)
        # Attention only: removing a suffix, even an empty one, always succeeds there; the result is still checked.
        if self._draft is not None and not ll.llama_memory_seq_rm(self._draft, 0, n, -1):
            self.clear()
            raise RollbackError(f"the draft cache refused to roll back to {n} tokens; both caches were cleared")
