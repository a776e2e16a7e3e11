"""GGUF header facts needed to validate a target/draft pair before libllama loads anything.

Reading the header is cheap (the `gguf` reader memory-maps the file) and lets every mismatch get its own message
instead of a NULL context or, for a layer id past the target's last layer, an abort of the whole process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"

# Special-token keys a draft must share with its target (the draft's own mask token is compared separately).
SPECIAL_TOKEN_KEYS = ("bos", "eos", "eot", "eom", "padding", "unknown", "seperator", "sep", "cls")


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    arch: str
    n_embd: int
    n_layer: int
    n_vocab: int
    tokenizer_model: str
    special_tokens: dict[str, int]
    mask_token_id: int | None
    keys: dict[str, Any] = field(repr=False)
    tensor_shapes: dict[str, tuple[int, ...]] = field(repr=False)

    def key(self, name: str, default: Any = None) -> Any:
        """An `<arch>.name` key, e.g. key("block_size")."""
        return self.keys.get(f"{self.arch}.{name}", default)

    @property
    def is_hybrid(self) -> bool:
        return f"{self.arch}.ssm.conv_kernel" in self.keys or f"{self.arch}.full_attention_interval" in self.keys


def _check_file(path: Path) -> None:
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelFileError(f"not a file: {path}")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")


def _scalar_keys(reader: Any) -> dict[str, Any]:
    """Scalars and small numeric arrays; the big tokenizer arrays are counted, not decoded."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for name, fld in reader.fields.items():
        if fld.types and fld.types[0] == GGUFValueType.ARRAY:
            if len(fld.types) > 1 and fld.types[1] == GGUFValueType.STRING:
                out[name] = len(fld.data)  # element count only
            elif len(fld.data) <= 64:
                out[name] = [int(v) if float(v).is_integer() else float(v) for v in fld.contents()]
            else:
                out[name] = len(fld.data)
        else:
            out[name] = fld.contents()
    return out


def read_gguf(path: str | Path) -> GGUFInfo:
    """Parse a GGUF header; ModelFileError for a missing, foreign or truncated file."""
    path = Path(path)
    _check_file(path)
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        keys = _scalar_keys(reader)
        shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    arch = str(keys.get("general.architecture", ""))
    if not arch:
        raise ModelFileError(f"{path} has no general.architecture key")
    special = {k: int(keys[f"tokenizer.ggml.{k}_token_id"])
               for k in SPECIAL_TOKEN_KEYS if f"tokenizer.ggml.{k}_token_id" in keys}
    mask = keys.get("tokenizer.ggml.mask_token_id")
    return GGUFInfo(
        path=path,
        arch=arch,
        n_embd=int(keys.get(f"{arch}.embedding_length", 0)),
        n_layer=int(keys.get(f"{arch}.block_count", 0)),
        n_vocab=int(keys.get("tokenizer.ggml.tokens", 0)),
        tokenizer_model=str(keys.get("tokenizer.ggml.model", "")),
        special_tokens=special,
        mask_token_id=None if mask is None else int(mask),
        keys=keys,
        tensor_shapes=shapes,
    )
