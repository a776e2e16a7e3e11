"""Deterministic tiny GGUF model pairs (target + DFlash draft) for tests, benchmarks and the offline demo.

Targets: `dense` (arch qwen3) and `hybrid` (arch qwen35: Gated DeltaNet + gated attention, IMROPE). A hybrid
target may carry a Qwen3.5 MTP (nextn) block after its trunk (`mtp_layers=1`), which llama.cpp drafts with
(`--spec-type draft-mtp`); it predicts as well as the head allows (see heads.py).
Drafts: `dflash2` (dynamic conv + candidate selector) and `dflash1`, both arch `dflash`; `dspark` (arch `dflash`: the
`dflash1` draft with a DSpark Markov head, and with `confidence_head=True` a confidence head too, as the converter
writes a DSpark checkpoint; `sample_from_anchor=False` for a bonus-anchor export); `eagle3` (arch `eagle3`, as
the converter writes an EAGLE-3 checkpoint: see writers.write_eagle3_draft); or none (`draft=None`:
the target alone, e.g. a hybrid target with MTP). `tiny_draft_model(pair)` writes a draft for llama.cpp's
`draft-simple`: a small dense model of the same vocabulary and head.
Heads (see heads.py): `random` (≈0 % acceptance), `shaped` (one accepted token per step), `const`
(≈100 %), `regime` (≈100 % once the context ends in REGIME_TOKEN, ≈0 % otherwise), `soft`, `markov`, `phrase`, and
`words` (English words of a small Markov chain, words.py; at width 512 a DFlash 2 draft keeps about as many tokens per
verify as published DFlash 2 runs: the offline demo's pair).

Files are generated once into a cache, named by a digest of every parameter and the generator version,
written to a temporary file and renamed, so concurrent generators never expose a partial file.

    python -m dflash_runtime.testing.tiny_models --out DIR [--target dense|hybrid]
        [--draft dflash2|dflash1|dspark|eagle3|none] [--head random|shaped|const|regime|...] [--n-embd N]
        [--dims tiny|scaled] [--seed S] [--mtp-layers 0|1] [--confidence-head]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from .heads import CONST_TOKEN, HEADS, REGIME_TOKEN, SHAPED_TOKENS
from .specs import DIMS, DRAFT_KINDS, TARGET_ARCHS, DraftSpec, PairSpec, resolve_pair_spec
from .tokenizer import ENDOFTEXT
from .writers import SPEC_KEY, TARGET_WRITERS, write_draft

__all__ = [
    "BROKEN_KINDS",
    "CONST_TOKEN",
    "REGIME_TOKEN",
    "SHAPED_TOKENS",
    "TinyPair",
    "default_cache_dir",
    "tiny_draft_model",
    "tiny_pair",
    "write_broken_draft",
]

CACHE_ENV = "DFLASH_TINY_CACHE"


@dataclass(frozen=True)
class TinyPair:
    target: Path
    draft: Path | None  # None: the target alone
    target_arch: str  # "qwen3" | "qwen35"
    draft_kind: str | None  # "dflash2" | "dflash1" | "dspark" | "eagle3" | None
    spec: PairSpec | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def mtp_layers(self) -> int:
        """MTP (nextn) blocks the target carries, from the spec or else the target file's header."""
        if self.spec is not None:
            return self.spec.target.mtp_layers
        field = gguf.GGUFReader(self.target).get_field(f"{self.target_arch}.nextn_predict_layers")
        return 0 if field is None else int(field.contents())


def default_cache_dir() -> Path:
    """$DFLASH_TINY_CACHE, else <repo>/.cache/tiny-models in a writable checkout, else the user cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    repo = Path(__file__).resolve().parents[2]
    is_checkout = (repo / ".git").exists() or (repo / "pyproject.toml").exists()
    if is_checkout and os.access(repo, os.W_OK):
        return repo / ".cache" / "tiny-models"
    return Path.home() / ".cache" / "dflash-runtime" / "tiny-models"


def tiny_pair(
    target: str = "dense",
    draft: str | None = "dflash2",
    *,
    head: str = "shaped",
    n_embd: int = 128,
    dims: str = "tiny",
    seed: int = 0,
    cache_dir: Path | None = None,
    **overrides: Any,
) -> TinyPair:
    """The pair's files, generated on first use. Overrides: any size of specs.OVERRIDABLE (e.g. n_layer=6,
    draft_layers=1, block_size=16, target_layers=(1, 2), weight_type="f16", mtp_layers=1; a dspark draft's
    confidence_head=True, sample_from_anchor=False, markov_rank=8).

    `draft=None` writes the target alone (`pair.draft is None`). `mtp_layers=1` (hybrid only) appends an MTP block
    to the target: `tiny_pair("hybrid", None, mtp_layers=1)` is a target that drafts with it, and
    `tiny_pair("hybrid", "dflash2", mtp_layers=1)` pairs that target with a DFlash draft (whose taps stay in the
    trunk). File names carry `-mtp1` after the width."""
    spec = resolve_pair_spec(target, draft, head=head, n_embd=n_embd, dims=dims, seed=seed, overrides=overrides)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stem = f"{target}-{head}-e{n_embd}" + (f"-mtp{spec.target.mtp_layers}" if spec.target.mtp_layers else "")
    target_path = _ensure(
        cache / f"target-{stem}-{spec.target_digest()}.gguf", lambda path: TARGET_WRITERS[target](path, spec)
    )
    draft_path = None
    if draft is not None:
        draft_path = _ensure(
            cache / f"draft-{draft}-{stem}-{spec.draft_digest()}.gguf", lambda path: write_draft(path, spec)
        )
    return TinyPair(target=target_path, draft=draft_path, target_arch=spec.target.arch, draft_kind=draft, spec=spec)


def tiny_draft_model(pair: TinyPair, *, n_layer: int | None = None, kind: str = "dense",
                     cache_dir: Path | None = None) -> Path:
    """A draft for the `draft-simple` method (llama.cpp's `--spec-type draft-simple`) of `pair`'s target: a dense
    (qwen3) model, or with `kind="hybrid"` a hybrid (qwen35: Gated DeltaNet + attention, as the small models of the
    Qwen3.5 family) one, of `n_layer` layers (1 dense, 2 hybrid: one recurrent, one attention) with the target's
    vocabulary, head, width and seed. Where the head decides (every head but `random`, see heads.py) it predicts
    what the target says; elsewhere its own layers differ."""
    if pair.spec is None:
        raise ValueError("tiny_draft_model needs a pair generated here (its spec)")
    t = pair.spec.target
    n_layer = n_layer if n_layer is not None else (2 if kind == "hybrid" else 1)
    spec = resolve_pair_spec(kind, None, head=t.head, n_embd=t.n_embd, dims="tiny", seed=t.seed,
                             overrides={"n_layer": n_layer, "bos_template": t.bos_template})
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    prefix = "draft-simple" if kind == "dense" else f"draft-simple-{kind}"
    name = f"{prefix}-{t.head}-e{t.n_embd}-l{n_layer}-{spec.target_digest()}.gguf"
    return _ensure(cache / name, lambda path: TARGET_WRITERS[kind](path, spec))


def pair_paths(spec: Mapping[str, Any]) -> tuple[Path, Path]:
    """`tiny_pair(**spec)`'s target and draft paths (how the Space's offline demo is handed its files)."""
    pair = tiny_pair(**spec)
    if pair.draft is None:
        raise ValueError(f"the spec {dict(spec)} has no draft")
    return pair.target, pair.draft


def _ensure(path: Path, write: Callable[[Path], None]) -> Path:
    if not path.exists():
        _write_atomically(path, write)
    return path


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# Each broken draft differs from the pair's valid draft in exactly one way.
_DRAFT_BREAKS: dict[str, Callable[[PairSpec], dict[str, Any]]] = {
    "vocab_size": lambda spec: {"extra_tokens": 1},
    "special_tokens": lambda spec: {"eos_token": ENDOFTEXT},
    "no_mask": lambda spec: {"with_mask": False},
    "layer_out_of_range": lambda spec: {"target_layers": (*_draft(spec).target_layers[:-1], spec.target.n_layer)},
    "width": lambda spec: {"n_embd": 2 * _draft(spec).n_embd},
    "bad_block_size": lambda spec: {"block_size": 1},
}
BROKEN_KINDS = ("not_gguf", "arch_not_dflash", *_DRAFT_BREAKS)


def _draft(spec: PairSpec) -> DraftSpec:
    if spec.draft is None:
        raise ValueError("a target-only spec has no draft to break")
    return spec.draft


def write_broken_draft(kind: str, path: Path, *, target: TinyPair) -> Path:
    """Write at `path` a draft for `target` that a runtime must refuse, broken in the way `kind` names:
    not_gguf (text file), arch_not_dflash (the target file itself), vocab_size (one extra token),
    special_tokens (EOS = <|endoftext|>), no_mask (no mask_token_id), layer_out_of_range (a tap id equal to
    the target's n_layer), width (embedding_length twice the target's, fc sized to match), bad_block_size (1)."""
    if kind not in BROKEN_KINDS:
        raise ValueError(f"kind must be one of {BROKEN_KINDS}, not {kind!r}")
    if target.draft is None:
        raise ValueError("write_broken_draft needs a pair with a draft to break")
    path = Path(path)
    if kind == "not_gguf":
        _write_atomically(path, lambda tmp: tmp.write_text("this is a text file, not a GGUF model\n"))
    elif kind == "arch_not_dflash":
        _write_atomically(path, lambda tmp: shutil.copyfile(target.target, tmp))
    else:
        spec = target.spec or read_pair_spec(target.draft)
        broken_draft = dataclasses.replace(_draft(spec), **_DRAFT_BREAKS[kind](spec))
        broken = dataclasses.replace(spec, draft=broken_draft)
        _write_atomically(path, lambda tmp: write_draft(tmp, broken))
    return path


def read_pair_spec(draft_path: Path) -> PairSpec:
    """The spec a generated draft records in its metadata."""
    field = gguf.GGUFReader(draft_path).get_field(SPEC_KEY)
    if field is None:
        raise ValueError(f"{draft_path} is not a generated tiny draft (no {SPEC_KEY} key)")
    return PairSpec.from_json(field.contents())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_runtime.testing.tiny_models",
        description="Generate (or find in the cache) a tiny target + draft pair; prints the target's path, then the "
        "draft's, one a line.",
    )
    parser.add_argument("--out", type=Path, default=None,
                        help=f"cache directory the files go to (default: ${CACHE_ENV}, else .cache/tiny-models)")
    parser.add_argument("--target", choices=tuple(TARGET_ARCHS), default="dense")
    parser.add_argument("--draft", choices=(*DRAFT_KINDS, "none"), default="dflash2", help="none: the target alone")
    parser.add_argument("--head", choices=HEADS, default="shaped")
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--dims", choices=DIMS, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp-layers", type=int, default=0, help="MTP (nextn) blocks after a hybrid target's trunk")
    parser.add_argument("--confidence-head", action="store_true", help="a dspark draft with a confidence head")
    args = parser.parse_args(argv)
    extra: dict[str, Any] = {"mtp_layers": args.mtp_layers} if args.mtp_layers else {}
    if args.confidence_head:
        extra["confidence_head"] = True
    pair = tiny_pair(
        args.target,
        None if args.draft == "none" else args.draft,
        head=args.head,
        n_embd=args.n_embd,
        dims=args.dims,
        seed=args.seed,
        cache_dir=args.out,
        **extra,
    )
    print(pair.target)
    if pair.draft is not None:
        print(pair.draft)


if __name__ == "__main__":
    main()
