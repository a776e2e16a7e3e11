"""Drafting token by token with one-row decodes of (token, row) pairs in a context of the drafter's own, each decode fed
the token and the row the one before it output: the target's MTP head (the row is the target's nextn hidden row) and
EAGLE-3's decoder (its g row), as llama.cpp's `draft-mtp` and `draft-eagle3` drive them.

A sequence's cell p holds (token_{p+lag}, row_{p+lag-1}): MTP's lag is 0 (token p with the target's row before it,
a zero row before the first), EAGLE-3's is 1 (the token after p with p's own g row), so the cells reach
`n_known - lag`. The rows are kept per sequence and position in host memory, so that after any cut of the caches the
row before the cut is at hand, and the rows of plain decoding reach the context later, in one batch, only when a
request drafts (`catch_up`). A draft decodes the seed (id_last, row_{pos0-1}) at pos0 - lag, then each drafted
token with the row the context output for it, every drafting sequence's step i in the same decode: n drafts cost n
small decodes. The seed's and the drafts' cells are removed afterwards (the verify rows come next, through the
drafter's `process`), as in llama.cpp.

`RowDrafter` is the whole drafter (the `Drafter` protocol); a method adds only where its rows come from (a
`RowSource`: MTP reads the target's nextn rows, EAGLE-3 encodes three tapped layers into g rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from llama_cpp import llama_cpp_ext as lx

from ..errors import DecodeError
from ..native.batches import TokenRowBatch, logits_row
from ..native.memory import DraftSequence
from .drafting import DraftAsk, Rows
from .proposal import Proposal


@dataclass
class Parked:
    """A sequence's cells in the context and its rows, for `RowDecoder.restore`."""

    kv: np.ndarray
    rows: np.ndarray


class RowTable:
    """One sequence's rows by position, grown on demand."""

    def __init__(self, width: int) -> None:
        self.data = np.zeros((256, width), dtype=np.float32)

    def put(self, pos0: int, rows: np.ndarray) -> None:
        n = pos0 + len(rows)
        if n > len(self.data):
            data = np.zeros((max(n, 2 * len(self.data)), self.data.shape[1]), dtype=np.float32)
            data[:len(self.data)] = self.data
            self.data = data
        self.data[pos0:n] = rows


class RowDecoder:
    """What a (token, row) drafter keeps and decodes in its context, for every sequence: the cells
    (`memory.DraftSequence`, with the lag), the rows, the catch-up and the draft, token by token."""

    def __init__(self, ctx: Any, name: str, views: Sequence[Sequence[int]], *, width: int, n_vocab: int,
                 n_batch: int, capacity: int, lag: int) -> None:
        self.name = name
        self._ctx = ctx
        self._views = views  # each sequence's target-cache tokens (read only)
        self._lag = lag
        self._width = width
        self._n_vocab = n_vocab
        self._n_batch = n_batch
        self.seqs = [DraftSequence(ctx, name, seq, lag=lag) for seq in range(len(views))]
        self.rows = [RowTable(width) for _ in views]
        self._zero = np.zeros(width, dtype=np.float32)  # row_{-1}: what llama.cpp pairs with the first token
        self._draft_rows = np.zeros((len(views), capacity + 1, width), dtype=np.float32)  # the drafts' own rows
        self._batch = TokenRowBatch(ctx, name, width)

    def known(self, seq: int, pos0: int, rows: np.ndarray) -> None:
        """A target decode held these positions of the sequence, with these rows: ours from pos0 on are stale."""
        self.seqs[seq].known(pos0, len(rows))
        self.rows[seq].put(pos0, rows)

    def row(self, seq: int, p: int) -> np.ndarray:
        return self.rows[seq].data[p] if p >= 0 else self._zero

    def catch_up(self, seqs: Sequence[int]) -> None:
        """Decode the cells the context lacks, for these sequences together, in batches of n_batch rows."""
        lag = self._lag
        while True:
            self._batch.clear()
            room, fed = self._n_batch, []
            for seq in seqs:
                state = self.seqs[seq]
                stop = min(state.n_known - lag, state.n_fed + room)
                if stop <= state.n_fed:
                    continue
                tokens = self._views[seq]
                for p in range(state.n_fed, stop):
                    self._batch.add(seq, int(tokens[p + lag]), p, self.row(seq, p + lag - 1), output=False)
                room -= stop - state.n_fed
                fed.append((state, stop))
                if room == 0:
                    break
            if not fed:
                return
            self._batch.process(f"{self.name} catch-up at {fed[0][0].n_fed}")
            for state, stop in fed:
                state.n_fed = stop

    def draft(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """Every ask's draft in the same decodes: step i decodes the i-th cell of each ask still drafting."""
        self.catch_up([a.seq for a in asks])
        for a in asks:
            if a.pos0 < self._lag or self.seqs[a.seq].n_known != a.pos0:
                raise DecodeError(f"the {self.name} drafter holds {self.seqs[a.seq].n_known} target rows of "
                                  f"sequence {a.seq}, a draft after position {a.pos0 - 1} needs them all")
        out = [Proposal.start(a.sampling) for a in asks]
        current = [(a.id_last, self.row(a.seq, a.pos0 - 1)) for a in asks]
        going = [i for i, a in enumerate(asks) if a.n > 0]
        try:
            step = 0
            while going:
                self._batch.clear()
                for i in going:
                    token, row = current[i]
                    self._batch.add(asks[i].seq, token, asks[i].pos0 - self._lag + step, row, output=True)
                self._batch.process(f"{self.name} draft step")
                still = []
                for k, i in enumerate(going):
                    ask = asks[i]
                    token = out[i].add_from_logits(self._logits(k), ask.p_min, ask.sampling)
                    if token is None or step + 1 >= ask.n:
                        continue
                    rows = self._draft_rows[ask.seq]
                    rows[step + 1] = self._output_row(k)
                    current[i] = (token, rows[step + 1])
                    still.append(i)
                going = still
                step += 1
        finally:
            refused = [a for a in asks if not self.seqs[a.seq].drop_drafts(a.pos0 - self._lag)]
        if refused:
            raise self.seqs[refused[0].seq].memory.refused(
                f"drop its drafts at position {refused[0].pos0 - self._lag}")
        return [p.at_least(a.n_min, a.sampling) for p, a in zip(out, asks, strict=True)]

    def save(self, seq: int) -> Parked:
        self.catch_up([seq])
        state = self.seqs[seq]
        return Parked(state.save(), self.rows[seq].data[:state.n_known].copy())

    def restore(self, seq: int, parked: Parked) -> None:
        self.seqs[seq].restore(parked.kv, len(parked.rows))
        self.rows[seq].put(0, parked.rows)

    def free(self) -> None:
        self._batch.free()

    def _logits(self, k: int) -> np.ndarray:
        return logits_row(self._ctx, k, self._n_vocab, f"the {self.name} drafter produced no logits")

    def _output_row(self, k: int) -> np.ndarray:
        ptr = lx.llama_get_embeddings_nextn_ith(self._ctx, k)
        if not ptr:
            raise DecodeError(f"the {self.name} drafter produced no row for its next cell")
        return np.ctypeslib.as_array(ptr, shape=(self._width,))


class RowSource(Protocol):
    """Where a row drafter's rows come from: after each target decode, the row of every position it held."""

    def rows(self, decoded: Sequence[Rows]) -> list[np.ndarray]:
        """For each `Rows` of the last target decode, its positions' rows (len(tokens) × width)."""
        ...

    def free(self) -> None: ...


class RowDrafter:
    """A drafter of (token, row) decodes, token by token: `decoder` keeps and decodes, `source` gives the rows."""

    def __init__(self, method: str, decoder: RowDecoder, source: RowSource, capacity: int) -> None:
        self.method = method
        self.capacity = capacity
        self._decoder = decoder
        self._source = source

    # -- the target's rows --------------------------------------------------------------------------------------

    def process(self, rows: Sequence[Rows]) -> None:
        if not rows:
            return
        for r in rows:
            self.keep(r.seq, r.pos0)  # what followed pos0 is stale before the source reads anything
        for r, values in zip(rows, self._source.rows(rows), strict=True):
            self._decoder.known(r.seq, r.pos0, values)
        eager = [r.seq for r in rows if r.eager]
        if eager:
            self.catch_up(eager)

    def begin(self, seq: int) -> None:
        pass  # the rows come with every decode (process)

    def catch_up(self, seqs: Sequence[int]) -> None:
        self._decoder.catch_up(seqs)

    # -- drafting -----------------------------------------------------------------------------------------------

    def draft(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        return self._decoder.draft(asks)

    def accept(self, seq: int, n_accepted: int) -> None:
        pass  # the row of every kept position is held; keep() drops the rest

    # -- the cache ----------------------------------------------------------------------------------------------

    def keep(self, seq: int, n: int) -> None:
        self._decoder.seqs[seq].keep(n)

    def clear(self, seq: int) -> None:
        self._decoder.seqs[seq].clear()

    def save(self, seq: int) -> Parked:
        return self._decoder.save(seq)

    def restore(self, seq: int, state: Parked) -> None:
        self._decoder.restore(seq, state)

    def state_bytes(self, state: Parked) -> int:
        return int(state.kv.nbytes + state.rows.nbytes)

    def free(self) -> None:
        self._decoder.free()
        self._source.free()
