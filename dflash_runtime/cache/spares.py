"""The target's spare sequences, which the paths of a draft tree borrow for one step, and how a path gets its
request's state there: on the device, through libllama's own sequence copy.

`llama_memory_seq_cp` gives the path's sequence the request's attention cells (across KV streams libllama copies the
stream at the next decode) and, on a hybrid target, a share of the request's recurrent cell: at the next decode,
each sequence of a shared cell gets a cell of its own, its state gathered on the device from the shared one. What
the copy cannot carry is a rollback still pending: a rollback through the snapshots (`llama_memory_seq_rm` of a
rejected draft) only marks the sequence — its cell's state moves back to the snapshot when the sequence is next
decoded (libllama reads a per-sequence snapshot index then, `rs_idx`, and resets it). A sequence that shares the cell
without that mark starts from the rejected tokens' state (tests/test_spares.py shows it). So the path's sequence is
given the same mark first: a sequence that owns a cell of its own (the one its last decode left it) removes its last
r positions — libllama accepts one such rollback between two decodes and refuses a second, which confirms it — and
then shares the request's cell; the mark, which the copy leaves alone, makes the next decode gather the snapshot
for it too. No state passes through host memory. Where that cannot be done exactly — the path's sequence has no cell
of its own, or a target decode without the request ran since its rollback (libllama may have applied the rollback
there, see PairCache.pending_rollback) — the recurrent state is copied through host memory, and the bytes are
counted (`fork` returns them).

The spare sequences keep their cells between steps (their contents are never read: the next fork replaces them);
`prime` gives each one a cell of its own when no request holds a pending rollback (the engine's opening, a reset).
Were `llama_memory_recurrent::seq_cp` to copy the source's snapshot index to the destination, a bare copy would be
exact, in every case, and neither the own cells nor the host copy would be needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import RollbackError
from ..native.batches import TokenBatch
from ..native.memory import SequenceMemory
from ..native.states import PARTIAL_ONLY, load_seq, save_seq
from .pair_cache import PairCache

PRIME_TOKEN = 0  # any token: a primed cell's contents are never read


class SpareSequences:
    def __init__(self, target_ctx: Any, seqs: Sequence[int], *, recurrent: bool, n_rs_seq: int) -> None:
        self.seqs = tuple(seqs)
        self._ctx = target_ctx
        self._recurrent = recurrent
        self._n_rs_seq = n_rs_seq
        self._memories = {seq: SequenceMemory(target_ctx, "tree path", seq) for seq in self.seqs}
        # the position of the recurrent cell each one owns (where its last decode ended), None: it owns none
        self._own: dict[int, int | None] = dict.fromkeys(self.seqs)
        self._batch = TokenBatch(len(self.seqs)) if recurrent and self.seqs else None

    def fork(self, source: PairCache, seqs: Sequence[int]) -> int:
        """Give each of `seqs` the target state of `source`'s sequence, exactly; the bytes of state this moved
        through host memory (0 where libllama copies it on the device)."""
        pending = source.pending_rollback if self._recurrent else 0
        device = [seq for seq in seqs if pending == 0 or (pending is not None and self._can_carry(seq, pending))]
        for seq in device:
            if pending:
                self._carry(seq, pending)
                self._memories[seq].share_from(source.seq)
            else:
                self._memories[seq].copy_from(source.seq)
            self._own[seq] = None  # it shares the source's cell until its next decode
        host = [seq for seq in seqs if seq not in device]
        if not host:
            return 0
        state = save_seq(self._ctx, PARTIAL_ONLY, seq=source.seq)  # reads through a pending rollback
        for seq in host:
            self._memories[seq].copy_from(source.seq)
            load_seq(self._ctx, state, PARTIAL_ONLY, seq)
            self._own[seq] = None
        return state.nbytes * (1 + len(host))

    def decoded(self, seq: int, last: int) -> None:
        """A target decode held `seq`'s rows up to position `last`: it owns a cell of its own, ending there."""
        self._own[seq] = last

    def drop(self, seqs: Sequence[int]) -> None:
        """Empty these sequences (a step that forked them did not decode)."""
        for seq in seqs:
            self._own[seq] = None
            self._memories[seq].clear()

    def prime(self) -> None:
        """Give every spare sequence of a hybrid target a cell of its own: one row each, decoded at a position no
        rollback reaches down to position 0 (see _carry). Only while no sequence of the context holds a pending
        rollback — a decode may apply other sequences' pending rollbacks (see the module's docstring)."""
        if self._batch is None:
            return
        self.drop(self.seqs)
        batch, last = self._batch, self._n_rs_seq + 1
        batch.clear()
        for seq in self.seqs:
            batch.add([PRIME_TOKEN], last, seq, outputs="none")
        batch.decode(self._ctx, "spare sequences")
        for seq in self.seqs:
            self._own[seq] = last

    def free(self) -> None:
        if self._batch is not None:
            self._batch.free()
            self._batch = None

    def _can_carry(self, seq: int, rollback: int) -> bool:
        own = self._own[seq]
        return own is not None and own > rollback  # the check's second removal must start above position 0

    def _carry(self, seq: int, rollback: int) -> None:
        """Mark `seq`'s own cell with a pending rollback of `rollback` tokens (its last `rollback` positions
        removed), and check that libllama took it: a second rollback before the next decode must be refused."""
        own = self._own[seq]
        assert own is not None
        memory = self._memories[seq]
        if not memory.remove_from(own - rollback + 1) or memory.remove_from(own - rollback):
            self.drop([seq])
            raise RollbackError(f"libllama did not take a rollback of {rollback} tokens to the tree path's sequence")


__all__ = ["SpareSequences"]
