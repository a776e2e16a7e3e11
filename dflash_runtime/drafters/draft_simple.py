"""The draft-simple method: a small autoregressive model of the target's vocabulary drafts, as llama.cpp's
`--spec-type draft-simple` (`common_speculative_impl_draft_simple` in `common/speculative.cpp`) does.

The draft model has a context of its own, a KV stream per sequence, n_ctx cells each (as the target's). It reads
each sequence's tokens — the target cache's, through the views it is opened with — and decodes what it lacks before
a draft (`catch_up`), or at once after a target decode when a request drafts with it (`process` of eager rows, as
llama.cpp's `process` decodes every target batch into the draft). A draft decodes id_last at pos0 and goes on token
by token: n drafted tokens cost n small decodes, row i of every drafting sequence in the same decode. Greedy, each
step takes the draft's top token while its confidence over the top 10 candidates is at least p_min (llama.cpp's
draft sampler is a top-k 10 sampler, and it cuts the draft below p_min); above temperature 0 with rejection sampling
each token is sampled from the request's sampler over the draft's logits, its q recorded. The drafted cells are
removed afterwards: the accepted tokens come back with the sequence's tokens.

A hybrid (recurrent) draft model — the small models of the Qwen3.5 family, the classic draft of a Qwen3.5/3.8
target — is rolled back exactly (memory.DraftSequence): the recurrent state where drafting began is copied and
restored after the draft, and the target's rows are decoded into it only when it drafts (never a rejected row).

What it opens (`DraftModelFile`): any model file with the target's vocabulary (size, tokenizer model and special
tokens) that no other method claims first (its registry line claims any model, at the lowest priority), in a plain
context of its own. Its memory per sequence is that cache (files/footprint.py's `draft_kv`: n_ctx cells of its layers).
It takes no options of its own: the request's draft length, n_min and p_min apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as ll

from ..errors import PairMismatchError
from ..files.gguf_meta import GGUFInfo
from ..files.validation import check_vocab
from ..native.batches import TokenBatch, logits_row
from ..native.memory import DraftSequence
from ..pair import LinkedPair, Threads, new_context
from .drafting import DraftAsk, Implementation, Rows
from .proposal import Proposal

DRAFT_SIMPLE = "draft-simple"


@dataclass(frozen=True)
class DraftModelSpec:
    """What the engine knows of a validated draft model."""

    arch: str
    n_layer: int


class DraftModelFile:
    """A same-vocabulary model as a draft (pair.DraftFile)."""

    needs = "draft-model"
    kind = "a model of the target's vocabulary (draft-simple)"
    runs_alone = True

    def validate(self, target: GGUFInfo, draft: GGUFInfo, capacity: int) -> DraftModelSpec:
        check_vocab(target, draft, "a draft model must use its target's tokenizer")
        if capacity < 1:
            raise PairMismatchError(f"a draft capacity of {capacity} tokens leaves no room for a drafted token")
        return DraftModelSpec(draft.arch, draft.n_layer)

    def prepare_target(self, pair: LinkedPair) -> None:
        pass  # the draft reads tokens only

    def open_context(self, pair: LinkedPair, threads: Threads) -> Any:
        # A prompt chunk of the target catches up in one decode; every sequence's draft row in one ubatch.
        params = pair.side_context_params(threads)
        if pair.n_gpu_layers == 0:
            params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED  # a row's numbers do not depend on its batch
        return new_context(pair.draft_model, params, "draft model")

    def describe(self, spec: DraftModelSpec) -> dict[str, Any]:
        return {"draft_kind": DRAFT_SIMPLE, "block_size": None, "target_layer_ids": []}


@dataclass
class _Parked:
    kv: np.ndarray
    n_fed: int


class DraftSimpleDrafter:
    method = DRAFT_SIMPLE

    def __init__(self, draft_ctx: Any, views: Sequence[Sequence[int]], *, n_vocab: int, n_batch: int,
                 capacity: int, recurrent: bool = False) -> None:
        self.capacity = capacity
        self._ctx = draft_ctx
        self._views = views  # each sequence's target-cache tokens (read only)
        self._seqs = [DraftSequence(draft_ctx, "draft", seq, recurrent=recurrent) for seq in range(len(views))]
        self._recurrent = recurrent
        self._n_vocab = n_vocab
        self._batch = TokenBatch(n_batch)

    def process(self, rows: Sequence[Rows]) -> None:
        for r in rows:
            self._seqs[r.seq].known(r.pos0, len(r.tokens))
        # A recurrent draft takes the rows when it drafts: a rejected row fed now would cost a roll back to the mark.
        eager = [r.seq for r in rows if r.eager and not self._recurrent]
        if eager:
            self.catch_up(eager)

    def begin(self, seq: int) -> None:
        pass  # the prompt came with the target's decodes (process)

    def catch_up(self, seqs: Sequence[int]) -> None:
        """Decode the tokens the draft context lacks, for these sequences together, a batch at a time."""
        batch = self._batch
        while True:
            batch.clear()
            fed = []
            for seq in seqs:
                state = self._seqs[seq]
                stop = min(state.n_known, state.n_fed + batch.capacity - batch.n_rows)
                if stop <= state.n_fed:
                    continue
                batch.add([int(t) for t in self._views[seq][state.n_fed:stop]], state.n_fed, seq, outputs="none")
                fed.append((state, stop))
                if batch.n_rows == batch.capacity:
                    break
            if not fed:
                return
            batch.decode(self._ctx, "draft model catch-up")
            for state, stop in fed:
                state.n_fed = stop

    def draft(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """Every ask's draft in the same decodes: step i decodes the i-th row of each ask still drafting."""
        self.catch_up([a.seq for a in asks])
        for ask in asks:
            self._seqs[ask.seq].drafting()
        out = [Proposal.start(a.sampling) for a in asks]
        current = [a.id_last for a in asks]
        going = [i for i, a in enumerate(asks) if a.n > 0]
        batch = self._batch
        try:
            step = 0
            while going:
                batch.clear()
                for i in going:
                    batch.add([current[i]], asks[i].pos0 + step, asks[i].seq, outputs="all")
                batch.decode(self._ctx, "draft model step")
                still = []
                for row, i in enumerate(going):
                    ask = asks[i]
                    logits = logits_row(self._ctx, row, self._n_vocab, "the draft model produced no logits")
                    token = out[i].add_from_logits(logits, ask.p_min, ask.sampling)
                    if token is None:
                        continue
                    current[i] = token
                    if step + 1 < ask.n:
                        still.append(i)
                going = still
                step += 1
        finally:
            refused = [a for a in asks if not self._seqs[a.seq].drop_drafts(a.pos0)]
        if refused:
            raise self._seqs[refused[0].seq].memory.refused(f"drop its drafts at position {refused[0].pos0}")
        return [p.at_least(a.n_min, a.sampling) for p, a in zip(out, asks, strict=True)]

    def accept(self, seq: int, n_accepted: int) -> None:
        pass  # the accepted tokens come with the sequence's tokens; keep() drops the rest

    def keep(self, seq: int, n: int) -> None:
        self._seqs[seq].keep(n)

    def clear(self, seq: int) -> None:
        self._seqs[seq].clear()

    def save(self, seq: int) -> _Parked:
        self.catch_up([seq])
        return _Parked(self._seqs[seq].save(), self._seqs[seq].n_fed)

    def restore(self, seq: int, parked: _Parked) -> None:
        self._seqs[seq].restore(parked.kv, parked.n_fed)

    def state_bytes(self, state: _Parked) -> int:
        return int(state.kv.nbytes)

    def free(self) -> None:
        self._batch.free()


def open_drafter(pair: LinkedPair, views: Sequence[Sequence[int]], capacity: int) -> DraftSimpleDrafter:
    n_batch = max(pair.n_ubatch, pair.parallel * (pair.draft_capacity + 1))  # the draft context's (open_context)
    recurrent = bool(ll.llama_model_is_recurrent(pair.draft_model) or ll.llama_model_is_hybrid(pair.draft_model))
    return DraftSimpleDrafter(pair.draft_ctx, views, n_vocab=pair.n_vocab, n_batch=n_batch, capacity=capacity,
                              recurrent=recurrent)


IMPLEMENTATION = Implementation(open_drafter, draft_file=DraftModelFile())
