"""The DSpark method (llama.cpp's `--spec-type draft-dspark`): a DFlash draft with a semi-autoregressive Markov head
and, optionally, a confidence head. The target's features reach the draft as for DFlash (dflash.py's drafter and
feature bridge); what differs is the block and how it is read.

- The Markov head (libllama's graph, src/models/dflash.cpp) adds to each block row's logits a bias `w2 · w1[prev]`
  that depends on the token before it: the anchor for the first drafted row, then the argmax of the row before, so
  the block's guesses follow one another instead of each standing alone.
- Anchor-first layout (`dflash.sample_from_anchor`, true unless the file says otherwise): the block is
  `[id_last, mask × (n − 1)]` and row i drafts token i + 1, so a block of n rows drafts n tokens and a draft may be as
  long as the block (`block_size`). A file with a bonus anchor (EAGLE-3-style exports) drafts from the mask rows,
  `[id_last, mask × n]`, as DFlash does.
- The confidence head scores each drafted row (sigmoid, libllama writes it to the row's nextn embedding); with
  `p_min > 0` the draft stops at the first row scored below it: the draft's length is the draft's own call. A draft
  without a confidence head is never cut (llama-server refuses `--spec-draft-p-min > 0` for such a file; here p_min is
  a request's and may be meant for another method of its method list). Unlike DFlash, p_min does not cut on the draft
  token's probability.

At temperature 0 each row drafts its argmax (llama.cpp's top-10 sampler's first candidate). Above it, with
rejection-sampling verification, each row's token is drawn from the request's sampler over that row's logits and that
distribution q is recorded with it. The Markov bias of row i is the graph's, conditioned on row i − 1's argmax
(llama.cpp takes each row's argmax inside the graph): a function of the context alone, so q is exactly what the
token was drawn from and the verifier's guarantee holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import DecodeError, PairMismatchError
from ..files.gguf_meta import GGUFInfo
from ..files.validation import DSPARK_KIND, DraftSpec
from ..native.batches import logits_row
from ..native.ext import DFlashApi, dflash_api
from ..pair import LinkedPair, Threads
from .dflash import BlockPass, DFlashDrafter, DFlashFile, linked_drafter
from .drafting import DraftAsk, Implementation, TokenView
from .proposal import Proposal

DSPARK = DSPARK_KIND  # the method's name, and what the pair holds with a DSpark draft open


class SparkBlocks:
    """Every drafting sequence's DSpark block in one decode of the draft context (`BlockPass`), read row by row."""

    def __init__(self, api: DFlashApi, draft_ctx: Any, spec: DraftSpec, n_embd_draft: int, n_vocab: int,
                 n_seq: int) -> None:
        self._api = api
        self._ctx = draft_ctx
        self._spec = spec
        self._pass = BlockPass(draft_ctx, spec.block_size, spec.mask_token_id, n_seq)
        self._n_embd = n_embd_draft
        self._n_vocab = n_vocab
        self._first = 0 if spec.sample_from_anchor else 1  # the block row that drafts the first token
        self.lattices: list[np.ndarray] = []  # no candidate lattice: a DSpark draft is not drafted as a tree

    def draft_blocks(self, asks: Sequence[DraftAsk]) -> list[Proposal]:
        """Blocks as long as the longest ask's draft before the room cut it (plus a bonus anchor): llama.cpp drafts
        every slot with one n_max and truncates, and a block's rows see one another. An ask reads the first n drafting
        rows of its own."""
        width = max(a.width for a in asks) + self._first
        with self._pass.decoded(asks, width, "all") as rows:
            cut = self._spec.confidence_head and any(a.p_min > 0.0 for a in asks)
            confidence = self._confidences(self._pass.n_rows) if cut else None
            out = [self._read(r + self._first, a, confidence) for a, r in zip(asks, rows, strict=True)]
        return [p.at_least(a.n_min, a.sampling) for p, a in zip(out, asks, strict=True)]

    def _read(self, row0: int, ask: DraftAsk, confidence: np.ndarray | None) -> Proposal:
        out = Proposal.start(ask.sampling)
        for row in range(row0, row0 + ask.n):
            if confidence is not None and ask.p_min > 0.0 and confidence[row] < ask.p_min:
                break
            out.add_from_logits(self._logits(row), 0.0, ask.sampling)
        return out

    def _logits(self, row: int) -> np.ndarray:
        return logits_row(self._ctx, row, self._n_vocab, f"the DSpark draft produced no logits for block row {row}")

    def _confidences(self, n_rows: int) -> np.ndarray:
        """Each row's confidence: libllama broadcasts it over the row's nextn embedding, so its first float."""
        ptr = self._api.get_embeddings_nextn(self._ctx)
        if not ptr:
            raise DecodeError("the DSpark confidence head wrote no scores (nextn embeddings are off?)")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self._n_embd))[:, 0]

    def free(self) -> None:
        self._pass.free()


class DSparkFile:
    """A DSpark draft, as the pair opens it (pair.DraftFile): a DFlash draft (its checks, the target's layer taps, a
    draft context linked to the target's) whose header also holds a Markov head."""

    needs = DSPARK
    kind = "a DSpark draft (architecture 'dflash' with a Markov head, markov_w1)"
    runs_alone = False  # no embeddings or output head of its own: it reads its target's

    def __init__(self) -> None:
        self._dflash = DFlashFile()

    def validate(self, target: GGUFInfo, draft: GGUFInfo, capacity: int) -> DraftSpec:
        spec = self._dflash.validate(target, draft, capacity)
        if not spec.is_dspark:
            raise PairMismatchError(f"{draft.path.name} is a DFlash draft without a Markov head (markov_w1.weight): "
                                    "not a DSpark draft")
        return spec

    def prepare_target(self, pair: LinkedPair) -> None:
        self._dflash.prepare_target(pair)

    def open_context(self, pair: LinkedPair, threads: Threads) -> Any:
        return self._dflash.open_context(pair, threads)

    def describe(self, spec: DraftSpec) -> dict[str, Any]:
        return {**self._dflash.describe(spec), "confidence_head": spec.confidence_head}


def open_drafter(pair: LinkedPair, views: Sequence[TokenView], capacity: int) -> DFlashDrafter:
    blocks = SparkBlocks(dflash_api(), pair.draft_ctx, pair.spec, pair.n_embd_draft, pair.n_vocab, len(views))
    return linked_drafter(pair, len(views), capacity, block=blocks, method=DSPARK)


IMPLEMENTATION = Implementation(open_drafter, draft_file=DSparkFile())
