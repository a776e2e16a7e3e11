"""Target layer taps → draft KV injection, for every sequence of the engine.

After every target decode the tapped layer inputs are valid only until the next decode, so they are copied at once,
one memcpy per layer and sequence, into that sequence's host buffer of rows `[layer_0 | layer_1 | ...]` (libllama
hands them back in the batch's own row order). Rows are injected into the draft right away, or kept pending (rounds
that do not draft) and injected when drafting resumes: the pending rows of every sequence that drafts go in one
draft decode.

A sequence's rows may also come ahead of its own cells (`adopt`): the rows of a draft tree's path accepted off its
spine, decoded in a spare target sequence after exactly the sequence's tokens, are the rows the sequence's own decode
of those tokens would give. Taken at once, they let the next step draft after the path; that step's decode holds the
path's tokens again (before id_last), and the bridge does not take those rows twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import DecodeError
from ..native.batches import FeatureBatch
from ..native.ext import DFlashApi
from .drafting import Rows


class _Pending:
    """One sequence's feature rows not yet in the draft cache, in position order."""

    def __init__(self, capacity: int, row_width: int) -> None:
        self.rows = np.empty((capacity, row_width), dtype=np.float32)
        self.positions = np.empty(capacity, dtype=np.int32)
        self.n = 0


class FeatureBridge:
    def __init__(self, api: DFlashApi, target_ctx: Any, draft_ctx: Any, layer_ids: tuple[int, ...], n_embd: int,
                 capacity: int, n_seq: int = 1) -> None:
        self._api = api
        self._target_ctx = target_ctx
        self._layer_ids = layer_ids
        self._n_embd = n_embd
        self.row_width = len(layer_ids) * n_embd
        self.capacity = capacity  # pending rows per sequence, and rows per injection decode
        self._batch = FeatureBatch(draft_ctx, self.row_width, capacity)
        self._pending = [_Pending(capacity, self.row_width) for _ in range(n_seq)]
        self._ahead: dict[int, tuple[int, int]] = {}  # per sequence: the positions [start, stop) adopted ahead

    def n_pending(self, seq: int) -> int:
        return self._pending[seq].n

    def adopt(self, rows: Rows) -> None:
        """Take rows of the last target decode ahead of the sequence's own cells (see the module's docstring); its
        next decode's rows at those positions are then not taken again."""
        self.capture([rows])
        self._ahead[rows.seq] = (rows.pos0, rows.pos0 + len(rows.tokens))

    def capture(self, rows: Sequence[Rows]) -> None:
        """Copy the features of the last target decode, each sequence's rows into its pending buffer (but the rows it
        holds already, adopted ahead)."""
        if not rows:
            return
        n_batch_rows = max(r.row0 + len(r.tokens) for r in rows)
        w = self._n_embd
        layers = []
        for lid in self._layer_ids:
            ptr = self._api.get_embeddings_layer_inp(self._target_ctx, lid)
            if not ptr:
                raise DecodeError(f"target layer {lid} features were not extracted (taps not enabled?)")
            layers.append(np.ctypeslib.as_array(ptr, shape=(n_batch_rows, w)))
        for r in rows:
            start, stop = self._ahead.pop(r.seq, (r.pos0, r.pos0))
            held = max(0, min(stop, r.pos0 + len(r.tokens)) - r.pos0) if r.pos0 >= start else 0
            n, row0, pos0 = len(r.tokens) - held, r.row0 + held, r.pos0 + held
            pending = self._pending[r.seq]
            if pending.n + n > self.capacity:
                self.flush([r.seq])
            dst = pending.rows[pending.n:pending.n + n]
            for k, src in enumerate(layers):
                dst[:, k * w:(k + 1) * w] = src[row0:row0 + n]
            pending.positions[pending.n:pending.n + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
            pending.n += n

    def flush(self, seqs: Sequence[int]) -> None:
        """Inject the pending rows of these sequences into the draft cache, together (as few decodes as fit)."""
        parts = [(seq, self._pending[seq]) for seq in seqs if self._pending[seq].n]
        while parts:
            take, used = [], 0
            while parts and used + parts[0][1].n <= self.capacity:
                take.append(parts.pop(0))
                used += take[-1][1].n
            if not take:  # cannot happen: a buffer never holds more than one decode's rows
                take = [parts.pop(0)]
            rows = np.concatenate([p.rows[:p.n] for _, p in take]) if len(take) > 1 else take[0][1].rows[:take[0][1].n]
            positions = np.concatenate([p.positions[:p.n] for _, p in take])
            seq_ids = np.concatenate([np.full(p.n, seq, dtype=np.int32) for seq, p in take])
            for _, p in take:
                p.n = 0
            self._batch.decode(np.ascontiguousarray(rows), positions, seq_ids)

    def drop_from(self, seq: int, pos: int) -> None:
        """Forget a sequence's pending rows at positions ≥ pos (they were rolled back on the target)."""
        pending = self._pending[seq]
        if pending.n:
            pending.n = int(np.searchsorted(pending.positions[:pending.n], pos))
        start, stop = self._ahead.pop(seq, (pos, pos))
        if pos > start:
            self._ahead[seq] = (start, min(stop, pos))

    def forget(self, seq: int) -> None:
        self._pending[seq].n = 0
        self._ahead.pop(seq, None)

    def free(self) -> None:
        self._batch.free()
