"""Checks that a draft fits its target, each failure with its own message, before libllama runs: a DFlash draft's
(`validate_pair`, a DSpark draft's included: a DFlash draft with a Markov head), and the vocabulary any draft shares
with its target (`check_vocab`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PairMismatchError
from .gguf_meta import GGUFInfo

DEFAULT_BLOCK_SIZE = 16  # llama.cpp's default when dflash.block_size is absent
# DSpark's heads, as llama.cpp's converter names them: the Markov head's tensor marks a DSpark draft (llama.cpp tells
# draft-dspark from draft-dflash by it), the confidence head is optional.
MARKOV_HEAD, CONFIDENCE_HEAD = "markov_w1.weight", "conf_proj.weight"


@dataclass(frozen=True)
class DraftSpec:
    """What the engine needs to know about a validated draft."""

    target_layer_ids: tuple[int, ...]
    block_size: int
    selector_top_k: int
    causal: bool
    mask_token_id: int
    # DSpark: a Markov head (its rank; 0: none), whether the block's anchor row drafts the first token (else it is a
    # bonus anchor, as in DFlash, and the mask rows draft), and whether a confidence head scores each position.
    markov_rank: int = 0
    sample_from_anchor: bool = True
    confidence_head: bool = False

    @property
    def is_dflash2(self) -> bool:
        return self.selector_top_k > 0

    @property
    def is_dspark(self) -> bool:
        return self.markov_rank > 0

    @property
    def kind(self) -> str:
        return DSPARK_KIND if self.is_dspark else kind_of_selector(self.selector_top_k)

    @property
    def anchor_drafts(self) -> bool:
        """A DSpark block that drafts from its anchor row: [id_last, mask × (n − 1)] yields n tokens."""
        return self.is_dspark and self.sample_from_anchor

    @property
    def block_capacity(self) -> int:
        """A block is [id_last, mask × n]: at most block_size − 1 drafted tokens; anchor-first, block_size."""
        return self.block_size if self.anchor_drafts else self.block_size - 1


DSPARK_KIND = "dspark"


def kind_of_selector(selector_top_k: int) -> str:
    """A DFlash draft's kind: "dflash2" (a candidate lattice, read through a selector) or "dflash1"."""
    return "dflash2" if selector_top_k > 0 else "dflash1"


def dflash_kind(draft: GGUFInfo) -> str:
    """A DFlash draft's kind from its header, as `DraftSpec.kind` names it once validated ("dspark": a Markov head)."""
    return DSPARK_KIND if has_markov_head(draft) else kind_of_selector(int(draft.key("selector_top_k", 0)))


def has_markov_head(draft: GGUFInfo) -> bool:
    """Whether a file is a DSpark draft: a DFlash draft with a Markov head."""
    return draft.arch == "dflash" and MARKOV_HEAD in draft.tensor_shapes


def validate_pair(target: GGUFInfo, draft: GGUFInfo, draft_capacity: int) -> DraftSpec:
    if draft.arch != "dflash":
        raise PairMismatchError(
            f"{draft.path.name} is not a DFlash draft: its architecture is '{draft.arch}', expected 'dflash'"
        )
    if target.arch == "dflash":
        raise PairMismatchError(f"{target.path.name} is a DFlash draft, not a target model: pass it as the draft")
    check_vocab(target, draft, "a DFlash draft must use its target's tokenizer")
    layer_ids = _check_layers(target, draft)
    if draft.n_embd != target.n_embd:
        raise PairMismatchError(
            f"draft {draft.path.name} expects a target of width {draft.n_embd} (dflash.embedding_length), "
            f"but {target.path.name} has n_embd {target.n_embd}: the draft borrows the target's embeddings and head"
        )
    fc = draft.tensor_shapes.get("fc.weight")
    expected_in = len(layer_ids) * target.n_embd
    if fc is not None and fc[0] != expected_in:
        raise PairMismatchError(
            f"draft fc.weight takes {fc[0]} features per token, but {len(layer_ids)} tapped layers × target width "
            f"{target.n_embd} = {expected_in}"
        )
    if draft.mask_token_id is None:
        raise PairMismatchError(f"draft {draft.path.name} has no mask token (tokenizer.ggml.mask_token_id)")
    block_size = int(draft.key("block_size", DEFAULT_BLOCK_SIZE))
    spec = DraftSpec(
        target_layer_ids=layer_ids,
        block_size=block_size,
        selector_top_k=int(draft.key("selector_top_k", 0)),
        causal=bool(draft.key("attention.causal", False)),
        mask_token_id=draft.mask_token_id,
        **(_dspark_heads(draft) if has_markov_head(draft) else {}),
    )
    check_draft_capacity(draft_capacity, spec)
    return spec


def _dspark_heads(draft: GGUFInfo) -> dict[str, object]:
    """A DSpark draft's heads, checked where libllama would abort the process or read what no head wrote."""
    name = draft.path.name
    if "dflash.block_size" not in draft.keys:  # the Markov head's graph asserts it (src/models/dflash.cpp)
        raise PairMismatchError(f"DSpark draft {name} has no dflash.block_size: its Markov head needs it")
    if "selector_hidden.weight" in draft.tensor_shapes:
        raise PairMismatchError(f"{name} has both a Markov head and a DFlash 2 selector: llama.cpp drafts such a file "
                                "as DFlash 2, not as DSpark")
    shapes = draft.tensor_shapes
    rank = int(shapes[MARKOV_HEAD][0])
    w2 = shapes.get("markov_w2.weight")
    if w2 is None or int(w2[0]) != rank or rank < 1:
        raise PairMismatchError(f"DSpark draft {name}: markov_w2.weight {w2} does not match markov_w1.weight "
                                f"{shapes[MARKOV_HEAD]}")
    confidence = CONFIDENCE_HEAD in shapes
    said = draft.key("has_confidence_head")
    if said is not None and bool(said) != confidence:
        raise PairMismatchError(f"DSpark draft {name} says has_confidence_head={bool(said)}, but its tensors "
                                f"{'hold' if confidence else 'lack'} {CONFIDENCE_HEAD}")
    if confidence and tuple(shapes[CONFIDENCE_HEAD])[:1] != (draft.n_embd + rank,):
        raise PairMismatchError(f"DSpark draft {name}: {CONFIDENCE_HEAD} {shapes[CONFIDENCE_HEAD]} does not read "
                                f"n_embd + rank = {draft.n_embd + rank} features")
    anchor = draft.key("sample_from_anchor")
    return {"markov_rank": rank, "sample_from_anchor": True if anchor is None else bool(anchor),
            "confidence_head": confidence}


def check_draft_capacity(draft_capacity: int, spec: DraftSpec) -> None:
    if spec.block_capacity < 1:
        raise PairMismatchError(f"draft block_size {spec.block_size} leaves no room for a drafted token")
    if not 1 <= draft_capacity <= spec.block_capacity:
        raise PairMismatchError(
            f"a draft capacity of {draft_capacity} tokens is outside 1..{spec.block_capacity} "
            f"(block_size {spec.block_size}{'' if spec.anchor_drafts else ' − 1'} for this draft)"
        )


def check_vocab(target: GGUFInfo, draft: GGUFInfo, rule: str) -> None:
    """The draft's vocabulary is the target's: its size, tokenizer model and special tokens (`rule` says why)."""
    if target.n_vocab != draft.n_vocab:
        raise PairMismatchError(
            f"vocabulary mismatch: target has {target.n_vocab} tokens, draft has {draft.n_vocab}; {rule}"
        )
    if target.tokenizer_model != draft.tokenizer_model:
        raise PairMismatchError(
            f"tokenizer mismatch: target '{target.tokenizer_model}', draft '{draft.tokenizer_model}'"
        )
    for name in sorted(set(target.special_tokens) | set(draft.special_tokens)):
        t, d = target.special_tokens.get(name), draft.special_tokens.get(name)
        if t is not None and d is not None and t != d:
            raise PairMismatchError(f"special token mismatch: target {name} id {t}, draft {name} id {d}")


def _check_layers(target: GGUFInfo, draft: GGUFInfo) -> tuple[int, ...]:
    raw = draft.keys.get("dflash.target_layers")
    if not isinstance(raw, list) or not raw:
        raise PairMismatchError(f"draft {draft.path.name} has no dflash.target_layers")
    ids = tuple(int(x) for x in raw)
    # An MTP (nextn) layer is appended after the trunk: the draft reads trunk layers only.
    trunk = target.n_layer - int(target.keys.get(f"{target.arch}.nextn_predict_layers", 0) or 0)
    bad = [i for i in ids if not 0 <= i < trunk]
    if bad:
        raise PairMismatchError(
            f"draft taps target layers {list(ids)}, but {bad} are outside the target's layers 0..{trunk - 1}"
        )
    return ids
