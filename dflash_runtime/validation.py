"""Checks that a draft fits its target, each failure with its own message, before libllama runs: a DFlash draft's
(`validate_pair`), and the vocabulary any draft shares with its target (`check_vocab`)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PairMismatchError
from .gguf_meta import GGUFInfo

DEFAULT_BLOCK_SIZE = 16  # llama.cpp's default when dflash.block_size is absent


@dataclass(frozen=True)
class DraftSpec:
    """What the engine needs to know about a validated draft."""

    target_layer_ids: tuple[int, ...]
    block_size: int
    selector_top_k: int
    causal: bool
    mask_token_id: int

    @property
    def is_dflash2(self) -> bool:
        return self.selector_top_k > 0

    @property
    def kind(self) -> str:
        return kind_of_selector(self.selector_top_k)

    @property
    def block_capacity(self) -> int:
        """A block is [id_last, mask × n]: at most block_size − 1 drafted tokens."""
        return self.block_size - 1


def kind_of_selector(selector_top_k: int) -> str:
    """A DFlash draft's kind: "dflash2" (a candidate lattice, read through a selector) or "dflash1"."""
    return "dflash2" if selector_top_k > 0 else "dflash1"


def dflash_kind(draft: GGUFInfo) -> str:
    """A DFlash draft's kind from its header, as `DraftSpec.kind` names it once validated."""
    return kind_of_selector(int(draft.key("selector_top_k", 0)))


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
    )
    check_draft_capacity(draft_capacity, spec)
    return spec


def check_draft_capacity(draft_capacity: int, spec: DraftSpec) -> None:
    if spec.block_capacity < 1:
        raise PairMismatchError(f"draft block_size {spec.block_size} leaves no room for a drafted token")
    if not 1 <= draft_capacity <= spec.block_capacity:
        raise PairMismatchError(
            f"a draft capacity of {draft_capacity} tokens is outside 1..{spec.block_capacity} "
            f"(block_size {spec.block_size} − 1 for this draft)"
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
