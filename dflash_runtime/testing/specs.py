"""What a tiny model pair is made of: frozen specs, their defaults per size family, overrides and checks.

A spec holds every parameter that shapes a file, so its digest names the cached file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .heads import HEADS, PHRASE_TOP_K, words_top_k
from .tokenizer import IM_END, build_vocab
from .words import word_chain

# Bump whenever the bytes written for an unchanged spec change (weights recipe, vocabulary, keys).
GENERATOR_VERSION = 2

TARGET_ARCHS = {"dense": "qwen3", "hybrid": "qwen35"}
DRAFT_KINDS = ("dflash2", "dflash1", "eagle3", "dspark")
EAGLE3_TAPS = 3  # an EAGLE-3 draft reads three target layers (low, middle, high)
DIMS = ("tiny", "scaled")
WEIGHT_TYPES = ("f32", "f16")


@dataclass(frozen=True)
class HybridDims:
    """Gated DeltaNet + attention sizes of a `qwen35` target."""

    n_rot: int
    full_attention_interval: int
    ssm_conv_kernel: int
    ssm_state_size: int
    ssm_group_count: int
    ssm_time_step_rank: int


@dataclass(frozen=True)
class TargetSpec:
    kind: str
    head: str
    seed: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    weight_type: str
    hybrid: HybridDims | None = None
    bos_template: bool = False  # the vocabulary adds BOS and the chat template writes it (the draft follows)
    # multi-token-prediction (nextn) blocks after the n_layer trunk blocks (hybrid targets only); left out of the
    # digest when 0, so files written before it existed keep their names and bytes
    mtp_layers: int = 0

    @property
    def arch(self) -> str:
        return TARGET_ARCHS[self.kind]

    @property
    def block_count(self) -> int:
        """The header's block_count: libllama counts the nextn blocks in it and runs n_layer of them as the trunk."""
        return self.n_layer + self.mtp_layers


@dataclass(frozen=True)
class DraftSpec:
    kind: str
    seed: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_ctx: int
    weight_type: str
    target_layers: tuple[int, ...]
    block_size: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    mrope: bool
    # tokenizer variations, used only by deliberately broken drafts
    eos_token: str = IM_END
    with_mask: bool = True
    extra_tokens: int = 0
    # DSpark (a DFlash v1 draft with a Markov head): the head's rank, an optional confidence head, and whether the
    # block's anchor row drafts (llama.cpp's converter: true for DFlash-lineage exports). Left out of the digest and
    # the record of every other kind, so their files keep their names and bytes.
    markov_rank: int = 0
    confidence_head: bool = False
    sample_from_anchor: bool = True

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def block_count(self) -> int:
        return self.n_layer

    @property
    def is_dflash2(self) -> bool:
        return self.kind == "dflash2"

    @property
    def is_eagle3(self) -> bool:
        return self.kind == "eagle3"

    @property
    def is_dspark(self) -> bool:
        return self.kind == "dspark"


DSPARK_FIELDS = ("markov_rank", "confidence_head", "sample_from_anchor")


@dataclass(frozen=True)
class PairSpec:
    """A target and its DFlash draft; `draft` is None for a target alone (e.g. one that drafts with its MTP block)."""

    target: TargetSpec
    draft: DraftSpec | None
    version: int = field(default=GENERATOR_VERSION)

    def target_digest(self) -> str:
        return _digest(self._target_dict())

    def target_json(self) -> str:
        """What the target file records: the target alone, as one target serves every draft kind."""
        return json.dumps(self._target_dict(), sort_keys=True)

    def _target_dict(self) -> dict[str, Any]:
        return {"version": self.version, "target": _target_fields(self.target)}

    def draft_digest(self) -> str:
        if self.draft is None:
            raise ValueError("a target-only spec has no draft")
        return _digest(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {"target": _target_fields(self.target), "draft": _draft_fields(self.draft), "version": self.version}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PairSpec:
        data = json.loads(text)
        target = dict(data["target"])
        hybrid = target.pop("hybrid")
        draft = None
        if data.get("draft") is not None:
            fields = dict(data["draft"])
            fields["target_layers"] = tuple(fields["target_layers"])
            draft = DraftSpec(**fields)
        return cls(
            target=TargetSpec(**target, hybrid=HybridDims(**hybrid) if hybrid else None),
            draft=draft,
            version=data["version"],
        )


def _target_fields(target: TargetSpec) -> dict[str, Any]:
    fields = dataclasses.asdict(target)
    if not fields["mtp_layers"]:
        del fields["mtp_layers"]  # digests and records of targets without an MTP block stay as they were
    return fields


def _draft_fields(draft: DraftSpec | None) -> dict[str, Any] | None:
    if draft is None:
        return None
    fields = dataclasses.asdict(draft)
    if not draft.is_dspark:
        for name in DSPARK_FIELDS:
            del fields[name]  # digests and records of the other kinds stay as they were
    return fields


def _digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _size_defaults(dims: str, n_embd: int) -> dict[str, Any]:
    """Tiny: fixed small sizes for fast tests. Scaled: Qwen3-like shapes derived from n_embd, for benchmarks."""
    if dims == "tiny":
        return dict(
            n_layer=4,
            n_ff=256,
            n_head=4,
            n_head_kv=2,
            n_ctx=4096,
            weight_type="f32",
            n_rot=16,
            full_attention_interval=2,
            ssm_conv_kernel=4,
            ssm_state_size=16,
            ssm_group_count=2,
            ssm_time_step_rank=4,
            draft_layers=2,
            n_taps=2,
        )
    n_head = max(2, n_embd // 128)
    ssm_heads = max(2, n_embd // 128)
    return dict(
        n_layer=8,
        n_ff=3 * n_embd,
        n_head=n_head,
        n_head_kv=max(1, n_head // 2),
        n_ctx=8192,
        weight_type="f32",
        n_rot=64,
        full_attention_interval=4,
        ssm_conv_kernel=4,
        ssm_state_size=128,
        ssm_group_count=max(1, ssm_heads // 2),
        ssm_time_step_rank=ssm_heads,
        draft_layers=2,
        n_taps=4,
    )


DRAFT_DEFAULTS: dict[str, Any] = dict(
    block_size=8,
    conv_kernel_size=3,
    conv_group_size=16,
    selector_rank=16,
    selector_top_k=4,
    markov_rank=16,
    confidence_head=False,
    sample_from_anchor=True,
)

OVERRIDABLE = frozenset(
    [*_size_defaults("tiny", 128), *DRAFT_DEFAULTS, "head_dim", "target_layers", "bos_template", "mtp_layers"]
) - {"n_taps"}
MAX_MTP_LAYERS = 1  # libllama's qwen35 MTP graph runs a single nextn block


def _default_head_dim(target: str, dims: str, n_embd: int, n_head: int) -> int:
    """Scaled models use Qwen's 128; tiny dense heads split n_embd, tiny hybrid attention uses 32."""
    if dims == "scaled":
        return 128
    return 32 if target == "hybrid" else n_embd // n_head


def spread_layers(n_layer: int, count: int) -> tuple[int, ...]:
    """`count` layer-input ids spread over 1 .. n_layer - 1 (taps must stay below the target's n_layer)."""
    count = max(1, min(count, n_layer - 1))
    if count == 1:
        return (n_layer - 1,)
    return tuple(sorted({round(1 + i * (n_layer - 2) / (count - 1)) for i in range(count)}))


def resolve_pair_spec(
    target: str, draft: str | None, *, head: str, n_embd: int, dims: str, seed: int, overrides: dict[str, Any]
) -> PairSpec:
    """Defaults of the size family, then overrides; raises ValueError/TypeError on anything unknown or inconsistent.
    `draft=None`: the target alone."""
    _check_choice("target", target, tuple(TARGET_ARCHS))
    if draft is not None:
        _check_choice("draft", draft, DRAFT_KINDS)
    _check_choice("head", head, HEADS)
    _check_choice("dims", dims, DIMS)
    unknown = sorted(set(overrides) - OVERRIDABLE)
    if unknown:
        raise TypeError(f"unknown tiny model override(s) {unknown}; known: {sorted(OVERRIDABLE)}")
    spark = sorted(set(overrides) & set(DSPARK_FIELDS))
    if spark and draft != "dspark":
        raise ValueError(f"invalid tiny model spec: {spark} shape a dspark draft, not {draft!r}")
    head_defaults: dict[str, Any] = {"selector_top_k": PHRASE_TOP_K} if head == "phrase" else {}
    if head == "words":  # candidates: as many as the lattice fits; the selector's and Markov head's rank: one per token
        chain_length = len(word_chain(build_vocab()).ids)
        head_defaults = {"selector_top_k": words_top_k(n_embd), "selector_rank": chain_length,
                         "markov_rank": chain_length}
    sizes = {**_size_defaults(dims, n_embd), **DRAFT_DEFAULTS, **head_defaults, **overrides}
    if "head_dim" not in overrides:
        sizes["head_dim"] = _default_head_dim(target, dims, n_embd, sizes["n_head"])
    spec = PairSpec(
        target=_target_spec(target, head, seed, n_embd, sizes),
        draft=None if draft is None else _draft_spec(draft, seed, n_embd, sizes, mrope=target == "hybrid"),
    )
    validate(spec)
    return spec


_Spec = TypeVar("_Spec", TargetSpec, DraftSpec)


def _target_spec(kind: str, head: str, seed: int, n_embd: int, sizes: dict[str, Any]) -> TargetSpec:
    hybrid = None
    if kind == "hybrid":
        hybrid = HybridDims(**{f.name: int(sizes[f.name]) for f in dataclasses.fields(HybridDims)})
    return _from_sizes(TargetSpec, sizes, kind=kind, head=head, seed=seed, n_embd=n_embd, hybrid=hybrid)


def _draft_spec(kind: str, seed: int, n_embd: int, sizes: dict[str, Any], *, mrope: bool) -> DraftSpec:
    """An EAGLE-3 draft is one decoder layer reading three taps, positioned by plain RoPE (its own)."""
    eagle3 = kind == "eagle3"
    n_taps = EAGLE3_TAPS if eagle3 else sizes["n_taps"]
    taps = sizes.get("target_layers") or spread_layers(sizes["n_layer"], n_taps)
    # the DSpark heads' sizes only on a DSpark draft: every other kind keeps the fields' defaults
    spark = {} if kind == "dspark" else {f.name: f.default for f in dataclasses.fields(DraftSpec)
                                         if f.name in DSPARK_FIELDS}
    return _from_sizes(
        DraftSpec,
        sizes,
        kind=kind,
        seed=seed,
        n_embd=n_embd,
        n_layer=1 if eagle3 else sizes["draft_layers"],
        target_layers=tuple(int(t) for t in taps),
        mrope=mrope and not eagle3,
        **spark,
    )


def _from_sizes(cls: type[_Spec], sizes: dict[str, Any], **given: Any) -> _Spec:
    """`cls(**given)`, every other field of `cls` found in `sizes` copied from there (the rest keep their defaults)."""
    copied = {f.name: sizes[f.name] for f in dataclasses.fields(cls) if f.name not in given and f.name in sizes}
    return cls(**copied, **given)


def validate(spec: PairSpec) -> None:
    """Consistency a valid pair needs (deliberately broken drafts bypass this)."""
    t, d = spec.target, spec.draft
    _require(t.weight_type in WEIGHT_TYPES, f"weight_type must be one of {WEIGHT_TYPES}")
    _require(t.n_head % t.n_head_kv == 0, "n_head must be a multiple of n_head_kv")
    _require(t.head_dim > 0 and t.head_dim % 2 == 0, "head_dim must be even and positive (RoPE)")
    _require(0 <= t.mtp_layers <= MAX_MTP_LAYERS, f"mtp_layers must lie in [0, {MAX_MTP_LAYERS}]")
    _require(t.mtp_layers == 0 or t.hybrid is not None, "only hybrid (qwen35) targets carry an MTP block")
    if t.hybrid is not None:
        h = t.hybrid
        _require(h.n_rot % 2 == 0 and h.n_rot <= t.head_dim, "n_rot must be even and <= head_dim")
        _require(h.ssm_time_step_rank % h.ssm_group_count == 0, "ssm_time_step_rank must be a multiple of groups")
        _require(h.full_attention_interval >= 1, "full_attention_interval must be >= 1")
    if d is not None:
        _validate_draft(t, d)


def _validate_draft(t: TargetSpec, d: DraftSpec) -> None:
    _require(d.n_embd % d.n_head == 0, "the draft's n_embd must be a multiple of n_head")
    _require(d.head_dim % 2 == 0, "the draft's head dim (n_embd / n_head) must be even for RoPE")
    _require(len(d.target_layers) > 0, "target_layers must not be empty")
    # taps read trunk layers: the nextn blocks after them never run in the target's pass; an EAGLE-3 draft may also
    # read the last hidden row (id n_layer, through the nextn embeddings: qwen35 targets without an MTP block)
    top = t.n_layer + (d.is_eagle3 and t.hybrid is not None and not t.mtp_layers)
    _require(all(0 <= i < top for i in d.target_layers), f"target_layers must lie in [0, {top})")
    _require(d.block_size >= 2, "block_size must be at least 2 (one drafted token)")
    if d.is_eagle3:
        _require(len(d.target_layers) == EAGLE3_TAPS, f"an EAGLE-3 draft reads exactly {EAGLE3_TAPS} target layers")
    if d.is_dspark:
        _require(d.markov_rank >= 1, "markov_rank must be at least 1")
    if d.is_dflash2:
        _require(d.n_embd % d.conv_group_size == 0, "n_embd must be a multiple of conv_group_size")
        top_k = d.selector_top_k
        _require(top_k > 0 and d.n_embd >= top_k * (top_k + 1), "n_embd must be >= selector_top_k * (top_k + 1)")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"invalid tiny model spec: {message}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, not {value!r}")
