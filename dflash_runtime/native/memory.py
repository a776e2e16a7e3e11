"""One sequence's cache in a context (libllama's `llama_memory_*`; a context holds `parallel` sequences, by id), with
the error a refused cut raises: the target, each drafter and the checkpoints cut through this, never through
libllama. `DraftSequence`: the bookkeeping every drafter with a context of its own shares for one sequence."""

from __future__ import annotations

from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from ..errors import RollbackError
from .states import PARTIAL_ONLY, WHOLE, load_seq, save_seq


class SequenceMemory:
    def __init__(self, ctx: Any, name: str, seq: int = 0) -> None:
        self._mem = ll.llama_get_memory(ctx)
        self.name = name  # "target", "draft", "MTP": how errors name this cache
        self.seq = seq

    def remove_from(self, pos: int) -> bool:
        """Remove positions ≥ pos; False when libllama refuses (a hybrid state beyond its snapshots)."""
        return bool(ll.llama_memory_seq_rm(self._mem, self.seq, pos, -1))

    def refused(self, doing: str) -> RollbackError:
        return RollbackError(f"the {self.name} cache refused to {doing}")

    def cut(self, n: int) -> None:
        """Keep positions < n, or raise RollbackError."""
        if not self.remove_from(n):
            raise self.refused(f"roll back to {n} tokens")

    def copy_from(self, seq: int) -> None:
        """Hold sequence `seq`'s cells instead of this one's (emptied first). Across KV streams libllama copies the
        whole stream's buffer at the next decode; a recurrent cell is shared, without a rollback `seq` still has
        pending (cache/spares.py)."""
        self.clear()
        self.share_from(seq)

    def share_from(self, seq: int) -> None:
        """Hold sequence `seq`'s cells instead of this one's, as `copy_from`, keeping this sequence's own pending
        rollback (the snapshot a shared recurrent cell is read from at the next decode, cache/spares.py)."""
        ll.llama_memory_seq_cp(self._mem, seq, self.seq, -1, -1)

    def clear(self) -> None:
        """Remove every position of this sequence (the other sequences of the context keep theirs)."""
        if not ll.llama_memory_seq_rm(self._mem, self.seq, -1, -1):
            raise self.refused("clear")


class DraftSequence:
    """What a drafter with a context of its own (draft-simple's model, MTP's head, EAGLE-3's decoder) keeps of one
    sequence there: how far the target's cache is known (`n_known`) and how far it went into the context (`n_fed`),
    and the one way of going back in it — after a cut of the target's cache (`keep`), after its own drafted cells
    (`drafting`, `drop_drafts`), for parking (`save`, `restore`).

    An attention-only context cuts any suffix. A recurrent (hybrid) context cannot cut its recurrent state, and its
    one-row draft decodes, token by token, leave nothing a snapshot could undo, so, as the target's checkpoints do, it
    keeps a copy of the recurrent state where drafting began (`PARTIAL_ONLY`) and restores it: the drafts are dropped
    exactly, and so is anything fed after that point later; a cut below it starts the sequence over (the drafter then
    decodes the target's tokens again)."""

    def __init__(self, ctx: Any, name: str, seq: int, *, recurrent: bool = False, lag: int = 0) -> None:
        self.memory = SequenceMemory(ctx, name, seq)
        self._ctx = ctx
        self.seq = seq
        self.recurrent = recurrent
        self.lag = lag  # cell p holds what follows position p + lag - 1 (EAGLE-3: 1, drafters/row_drafter.py)
        self.n_known = 0  # the target cache's length as the last decode left it
        self.n_fed = 0  # positions decoded into the drafter's context
        self._mark: tuple[int, np.ndarray] | None = None  # (n_fed, recurrent state) where drafting last began

    def known(self, pos0: int, n: int) -> None:
        """A target decode held this sequence's positions pos0..pos0+n-1: anything of ours from pos0 on is stale."""
        self.keep(pos0)
        self.n_known = pos0 + n

    def keep(self, n: int) -> None:
        """The target's cache was cut to n tokens: so is ours (RollbackError where libllama refuses)."""
        self.n_known = min(self.n_known, n)
        cells = max(n - self.lag, 0)
        if self.n_fed <= cells:
            return
        if not self.recurrent:
            self.memory.cut(cells)
            self.n_fed = cells
        elif self._mark is not None and self._mark[0] <= cells:
            self._back_to_mark()
        else:
            self.clear()

    def drafting(self) -> None:
        """Drafted cells are about to follow position n_fed: a recurrent state is copied to come back to."""
        if self.recurrent:
            self._mark = (self.n_fed, save_seq(self._ctx, PARTIAL_ONLY, seq=self.seq))

    def drop_drafts(self, pos0: int) -> bool:
        """Remove the drafted cells from pos0 on (where drafting began); False when libllama refuses."""
        if self.recurrent and self._mark is not None:
            load_seq(self._ctx, self._mark[1], PARTIAL_ONLY, self.seq)
        removed = self.memory.remove_from(pos0)
        self.n_fed = min(self.n_fed, pos0)
        return removed

    def clear(self) -> None:
        self.memory.clear()
        self.n_known = self.n_fed = 0
        self._mark = None

    def save(self) -> np.ndarray:
        """A copy of everything the sequence holds in the context (its cells up to n_fed)."""
        return save_seq(self._ctx, WHOLE, seq=self.seq)

    def restore(self, data: np.ndarray, n: int) -> None:
        """Bring back a `save` copy made when n target tokens were known, in place of what the sequence holds."""
        self.clear()
        load_seq(self._ctx, data, WHOLE, self.seq)
        self.n_known = n
        self.n_fed = max(n - self.lag, 0)

    def _back_to_mark(self) -> None:
        assert self._mark is not None
        n, state = self._mark
        load_seq(self._ctx, state, PARTIAL_ONLY, self.seq)
        self.memory.cut(n)  # the recurrent state now ends at n: removing the attention suffix is a plain cut
        self.n_fed = n
