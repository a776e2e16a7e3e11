"""The DFlash method: target features injected into a linked draft context, one block drafted per round.

`DFlashDrafter` is the method behind the drafter interface (drafting.py): it owns the feature bridge (target layer
taps → draft KV, per sequence) and decides when rows are injected. `BlockDrafter` drafts one block per sequence:
every drafting sequence's `[id_last, mask × n]` decoded in a single pass of the draft context (llama.cpp sizes the
draft's outputs `n_parallel × (n_max + 1)` for the same reason).

Greedy (temperature 0, and sample-and-match verification): DFlash 2 walks its candidate lattice greedily over the
selector's transition scores, DFlash v1 takes the argmax of the draft logits at each mask position.

Stochastic (rejection-sampling verification at temperature > 0): each drafted token is sampled from a distribution
q that is recorded with it, because the verifier's guarantee rests on exactly those probabilities. DFlash 2 samples
its lattice walk: at position i, q(· | previous) is the request's sampler (top-k, top-p, min-p, temperature) over the
K candidates scored from the candidate actually sampled at i − 1. DFlash v1 samples each mask position from the
request's sampler over the draft logits.

`DFLASH_FILE` is what the method declares to the pair: a draft of architecture `dflash` (files/validation.py checks it
against its target), the target's layer taps turned on before its first decode, and a draft context linked to the
target's through `ctx_other`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from llama_cpp import llama_cpp as ll

from ..errors import DecodeError, PairMismatchError
from ..files.gguf_meta import GGUFInfo
from ..files.validation import DraftSpec, validate_pair
from ..native.batches import TokenBatch, logits_row
from ..native.ext import DFlashApi, dflash_api
from ..native.memory import SequenceMemory
from ..native.states import WHOLE, load_seq, save_seq
from ..pair import LinkedPair, Threads
from .drafting import DFLASH, DraftAsk, Implementation, Rows, TokenView
from .features import FeatureBridge
from .proposal import DraftSampling, Proposal, draw


class BlockPass:
    """Blocks `[id_last, mask × (width − 1)]` of several sequences in one decode of the draft context, each at its
    ask's pos0; the blocks' cells are removed afterwards: their K/V must go before the verify rows' features are
    injected at the same positions. The draft graph takes blocks of one size (as llama.cpp drafts every slot with
    n_max), except where a sequence's context ends first: a block never reaches past its sequence's cells (a
    neighbour's longer ask would take it there), as the context's end cuts the draft."""

    def __init__(self, draft_ctx: Any, block_size: int, mask_token_id: int, n_seq: int) -> None:
        self._ctx = draft_ctx
        self._n_ctx = int(ll.llama_n_ctx_seq(draft_ctx))  # cells of each sequence's KV stream
        self._memories = [SequenceMemory(draft_ctx, "draft", seq) for seq in range(n_seq)]
        self._batch = TokenBatch(block_size * n_seq)
        self._block = np.full(block_size, mask_token_id, dtype=np.int32)
        self._mask = mask_token_id

    @contextlib.contextmanager
    def decoded(self, asks: Sequence[DraftAsk], width: int, outputs: str) -> Iterator[list[int]]:
        """The asks' blocks, `width` rows each where the sequence's cells hold them, decoded together; yields the
        batch row of each block's anchor, for reading the block's outputs before leaving (`n_rows`: the batch's rows).
        A failed removal is raised only when nothing else is being raised: it must not hide a decode error."""
        batch = self._batch
        batch.clear()
        rows = []
        for ask in asks:
            block = self._block[:min(width, self._n_ctx - ask.pos0)]
            block[0] = ask.id_last
            block[1:] = self._mask
            rows.append(batch.add(block, ask.pos0, ask.seq, outputs=outputs))
        refused = []
        try:
            batch.decode(self._ctx, "draft block")
            yield rows
        finally:
            refused = [a for a in asks if not self._memories[a.seq].remove_from(a.pos0)]
        if refused:
            raise self._memories[refused[0].seq].refused(f"drop its block at position {refused[0].pos0}")

    @property
    def n_rows(self) -> int:
        """The rows of the last decode (its blocks' rows)."""
        return self._batch.n_rows

    def free(self) -> None:
        self._batch.free()


class BlockDrafter:
    def __init__(self, api: DFlashApi, draft_ctx: Any, spec: DraftSpec, n_embd_draft: int, n_vocab: int,
                 n_seq: int = 1) -> None:
        self._api = api
        self._ctx = draft_ctx
        self._pass = BlockPass(draft_ctx, spec.block_size, spec.mask_token_id, n_seq)
        self._spec = spec
        self._n_embd = n_embd_draft
        self._n_vocab = n_vocab
        self._k = spec.selector_top_k
        # DFlash 2: each ask's lattice rows of the last draft_blocks (candidates and transition scores), for trees
        self.lattices: list[np.ndarray] = []

    def draft(self, id_last: int, pos0: int, n_max: int, *, n_min: int = 0, p_min: float = 0.0,
              sampling: DraftSampling | None = None) -> Proposal:
        """Draft up to n_max tokens following id_last (decoded at pos0 of sequence 0)."""
        return self.draft_blocks([DraftAsk(0, id_last, pos0, n_max, n_min, p_min, sampling)])[0]

    def draft_blocks(self, asks: Sequence[DraftAsk], *, trees: bool = False) -> list[Proposal]:
        """Each ask's block in one decode (`BlockPass`): each is as long as the longest ask's draft before the room
        left cut it (llama.cpp drafts n_max and truncates, and a block's rows see one another), and an ask reads the
        first n positions of its own. `trees`: an ask for a tree gets its lattice rows (`lattices`) and no walk (the
        tree draws its own spine, dflash_tree.py)."""
        width = max(a.width for a in asks)
        with self._pass.decoded(asks, width + 1, "none" if self._spec.is_dflash2 else "all") as rows:
            if self._spec.is_dflash2:
                lattice = self._lattice(self._pass.n_rows)
                tree = [trees and a.tree_nodes > 0 for a in asks]
                out = [Proposal.start(a.sampling) if t else self._walk_lattice(lattice[r + 1:r + 1 + a.n], a)
                       for a, r, t in zip(asks, rows, tree, strict=True)]
                width = self._k + self._k * self._k
                self.lattices = [lattice[r + 1:r + 1 + a.n, :width].copy() if t else lattice[:0, :width]
                                 for a, r, t in zip(asks, rows, tree, strict=True)]
            else:
                out = [self._per_position(r, a) for a, r in zip(asks, rows, strict=True)]
        return [p.at_least(a.n_min, a.sampling) for p, a in zip(out, asks, strict=True)]

    def _lattice(self, n_rows: int) -> np.ndarray:
        ptr = self._api.get_embeddings_nextn(self._ctx)
        if not ptr:
            raise DecodeError("the DFlash 2 selector produced no lattice (nextn embeddings are off?)")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self._n_embd))

    def _walk_lattice(self, rows: np.ndarray, ask: DraftAsk) -> Proposal:
        """Rows of one block's mask positions: [candidate ids (K) | transition scores K×K, predecessor-major]."""
        k, n_max, p_min, sampling = self._k, ask.n, ask.p_min, ask.sampling
        cands = rows[:, :k].astype(np.int64)
        scores = rows[:, k:k + k * k].reshape(n_max, k, k)
        out = Proposal.start(sampling)
        pred = 0
        for i in range(n_max):
            s = scores[i, pred]
            if sampling is None:
                best = int(np.argmax(s))
                if p_min > 0.0 and 1.0 / float(np.exp(s - s[best]).sum()) < p_min:
                    break
                out.tokens.append(int(cands[i, best]))
                pred = best
                continue
            ids, probs = sampling.distribution(s.astype(np.float32), cands[i].astype(np.int32))
            if p_min > 0.0 and float(probs.max()) < p_min:
                break
            pick = draw(probs, sampling.rng)
            token = int(ids[pick])
            out.tokens.append(token)
            out.q.append((ids, probs))  # type: ignore[union-attr]
            pred = int(np.flatnonzero(cands[i] == token)[0])
        return out

    def _per_position(self, row0: int, ask: DraftAsk) -> Proposal:
        out = Proposal.start(ask.sampling)
        for i in range(1, ask.n + 1):
            logits = logits_row(self._ctx, row0 + i, self._n_vocab, f"the draft produced no logits for block row {i}")
            if out.add_from_logits(logits, ask.p_min, ask.sampling) is None:
                break
        return out

    def free(self) -> None:
        self._pass.free()


class BlockDrafting(Protocol):
    """What drafts a block per sequence in the draft context (`BlockDrafter`, or DSpark's blocks)."""

    lattices: list[np.ndarray]

    def draft_blocks(self, asks: Sequence[DraftAsk]) -> list[Proposal]: ...

    def free(self) -> None: ...


class DFlashDrafter:
    """DFlash / DFlash 2 behind the drafter interface, for every sequence. Features of every target decode are copied
    at once (they are valid until the next decode); they reach the draft cache at once when `eager`, else when
    drafting resumes or the sequence's pending buffer is full. Another method on a DFlash draft (DSpark) passes the
    block drafting its draft does, and its name."""

    def __init__(self, api: DFlashApi, target_ctx: Any, draft_ctx: Any, spec: DraftSpec, *, n_embd: int,
                 n_embd_draft: int, n_vocab: int, n_ubatch: int, capacity: int, n_seq: int = 1,
                 block: BlockDrafting | None = None, method: str = DFLASH) -> None:
        self.method = method
        self.capacity = capacity
        self.spec = spec
        self._ctx = draft_ctx
        self._memories = [SequenceMemory(draft_ctx, "draft", seq) for seq in range(n_seq)]
        self.bridge = FeatureBridge(api, target_ctx, draft_ctx, spec.target_layer_ids, n_embd, n_ubatch, n_seq)
        self._block = block if block is not None else BlockDrafter(api, draft_ctx, spec, n_embd_draft, n_vocab, n_seq)

    def process(self, rows: Sequence[Rows]) -> None:
        bridge = self.bridge
        bridge.capture(rows)
        due = [r.seq for r in rows if r.eager or bridge.n_pending(r.seq) >= bridge.capacity]
        if due:
            bridge.flush(due)

    def catch_up(self, seqs: Sequence[int]) -> None:
        self.bridge.flush(seqs)

    def adopt(self, rows: Rows) -> bool:
        """A draft tree's path accepted off its spine: its rows' features, taken ahead of the sequence's own cells
        (features.py), so that the next step drafts after the path."""
        self.bridge.adopt(rows)
        return True

    def begin(self, seq: int) -> None:
        pass  # the features come with every decode (process)

    def draft(self, asks: Sequence[DraftAsk], *, trees: bool = False) -> list[Proposal]:
        """Each ask's draft; with `trees` (the tree method drafting through this one) an ask for a tree gets its
        block's lattice rows (`lattices`) instead of a walk — DFlash 2's own block drafting has them."""
        if trees and isinstance(self._block, BlockDrafter):
            return self._block.draft_blocks(asks, trees=True)
        return self._block.draft_blocks(asks)

    @property
    def lattices(self) -> list[np.ndarray]:
        """DFlash 2: the lattice rows of each ask of the last `draft(..., trees=True)` that asked for a tree (empty
        otherwise)."""
        return self._block.lattices

    def accept(self, seq: int, n_accepted: int) -> None:
        pass  # the rejected rows go with keep()

    def keep(self, seq: int, n: int) -> None:
        self.bridge.drop_from(seq, n)
        # Attention only: removing a suffix, even an empty one, always succeeds there; the result is still checked.
        self._memories[seq].cut(n)

    def clear(self, seq: int) -> None:
        self.bridge.forget(seq)
        self._memories[seq].clear()

    def save(self, seq: int) -> np.ndarray:
        self.bridge.flush([seq])  # pending rows become draft cache cells, which the copy then holds
        return save_seq(self._ctx, WHOLE, seq=seq)

    def restore(self, seq: int, state: np.ndarray) -> None:
        self.bridge.forget(seq)
        self._memories[seq].clear()
        load_seq(self._ctx, state, WHOLE, seq)

    def state_bytes(self, state: np.ndarray) -> int:
        return int(state.nbytes)

    def free(self) -> None:
        self._block.free()
        self.bridge.free()


class DFlashFile:
    """A DFlash / DFlash 2 draft, as the pair opens it (pair.DraftFile)."""

    needs = "draft"
    kind = "a DFlash draft (architecture 'dflash')"
    runs_alone = False  # no embeddings or output head of its own: it reads its target's

    def validate(self, target: GGUFInfo, draft: GGUFInfo, capacity: int) -> DraftSpec:
        return validate_pair(target, draft, capacity)

    def prepare_target(self, pair: LinkedPair) -> None:
        # Taps must be on before the first decode: enabling them re-reserves the compute graph.
        for lid in pair.spec.target_layer_ids:
            dflash_api().set_embeddings_layer_inp(pair.target_ctx, lid, True)

    def open_context(self, pair: LinkedPair, threads: Threads) -> Any:
        spec, api, model = pair.spec, dflash_api(), pair.draft_model
        # One injection chunk per target ubatch, and every sequence's block in one ubatch; a block attends to its own
        # sequence's cells only. Blocks of one size from consecutive sequences share a ubatch.
        params = pair.side_context_params(threads)

        def selector_read(ctx: Any) -> None:
            top_k = int(api.model_dflash_selector_top_k(model))
            if top_k != spec.selector_top_k:
                raise PairMismatchError(f"libllama reads selector_top_k={top_k}, the header {spec.selector_top_k}")

        ctx = pair.linked_draft_context(params, "draft", spec.target_layer_ids, selector_read)
        # DFlash 2 reads its candidate lattice from the nextn rows; v1 reads logits (masked nextn).
        api.set_embeddings_nextn(ctx, True, not spec.is_dflash2)
        ll.llama_set_causal_attn(ctx, spec.causal)
        return ctx

    def describe(self, spec: DraftSpec) -> dict[str, Any]:
        return {"draft_kind": spec.kind, "block_size": spec.block_size,
                "target_layer_ids": list(spec.target_layer_ids)}


_OPENED: weakref.WeakKeyDictionary[LinkedPair, DFlashDrafter] = weakref.WeakKeyDictionary()


def linked_drafter(pair: LinkedPair, n_seq: int, capacity: int, **block: Any) -> DFlashDrafter:
    """The drafter of the pair's DFlash draft context (`block`: another method's block drafting and name)."""
    return DFlashDrafter(dflash_api(), pair.target_ctx, pair.draft_ctx, pair.spec, n_embd=pair.n_embd,
                         n_embd_draft=pair.n_embd_draft, n_vocab=pair.n_vocab,
                         n_ubatch=pair.n_ubatch, capacity=capacity, n_seq=n_seq, **block)


def open_drafter(pair: LinkedPair, views: Sequence[TokenView], capacity: int) -> DFlashDrafter:
    drafter = linked_drafter(pair, len(views), capacity)
    _OPENED[pair] = drafter
    return drafter


def opened_drafter(pair: LinkedPair) -> DFlashDrafter:
    """The DFlash drafter opened for this pair: one draft context has one drafter, which the tree method drafts
    through (dflash_tree.py) rather than feeding the draft twice."""
    drafter = _OPENED.get(pair)
    if drafter is None:
        raise RuntimeError("the DFlash drafter must be opened before a method that drafts through it")
    return drafter


IMPLEMENTATION = Implementation(open_drafter, draft_file=DFlashFile())
