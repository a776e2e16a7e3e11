"""GGUF header facts needed to validate a target/draft pair before libllama loads anything.

Reading the header lets every mismatch get its own message instead of a NULL context or, for a layer id past the
target's last layer, an abort of the whole process. The reader here walks the header itself and keeps only what
validation reads: scalars, small numeric arrays, tensor shapes and types. Big arrays are counted and stepped over
(a numeric one in one seek, a string array by its length prefixes), so a real vocabulary of 248k tokens and as many
merges costs a fraction of a second instead of the half-minute `gguf.GGUFReader` spends decoding them.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelFileError

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
    tensor_types: dict[str, int] = field(default_factory=dict, repr=False)  # ggml type ids (gguf.GGMLQuantizationType)

    def key(self, name: str, default: Any = None) -> Any:
        """An `<arch>.name` key, e.g. key("block_size")."""
        return self.keys.get(f"{self.arch}.{name}", default)

    @property
    def n_nextn(self) -> int:
        """The nextn (MTP) layers after the trunk."""
        return int(self.key("nextn_predict_layers", 0) or 0)

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


# GGUF value types (gguf-py's GGUFValueType): struct format of the fixed-size ones; 8 = string, 9 = array.
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
SMALL_ARRAY = 64  # numeric arrays up to this length are decoded (layer lists, rope sections); longer ones counted


class _Header:
    """A cursor over a memory-mapped GGUF header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = self.buf[self.pos:end].decode("utf-8", "replace")
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _FIXED:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.take(_FIXED[vtype])

    def array(self) -> Any:
        etype, count = self.take("<I"), self.take("<Q")
        if etype == _STRING:
            unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
            for _ in itertools.repeat(None, count):  # step over the strings: only their length prefixes are read
                (n,) = unpack(buf, pos)
                pos += 8 + n
            if pos > len(self.buf):
                raise ValueError("a string array runs past the end of the file")
            self.pos = pos
            return count  # element count only
        if etype == _ARRAY:
            for _ in range(count):
                self.array()
            return count
        if etype not in _FIXED:
            raise ValueError(f"unsupported GGUF array element type {etype}")
        size = struct.calcsize(_FIXED[etype])
        if count > SMALL_ARRAY:
            self.pos += count * size
            if self.pos > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            return count
        values = [self.take(_FIXED[etype]) for _ in range(count)]
        return [int(v) if float(v).is_integer() else float(v) for v in values]


# ggml type id -> (values per block, bytes per block), as gguf-py's GGML_QUANT_SIZES (a test keeps them equal):
# a table here, so that reading a header never imports the gguf package (about a second on a busy machine).
GGML_TYPE_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66),
    17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136),
    24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54),
    35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}


def _tensor_bytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    if ggml_type not in GGML_TYPE_SIZES:
        raise ValueError(f"unknown ggml tensor type {ggml_type}")
    block, size = GGML_TYPE_SIZES[ggml_type]
    n = 1
    for d in shape:
        n *= d
    return n // block * size


def _check_data(keys: dict[str, Any], header_end: int, file_size: int,
                tensors: list[tuple[str, int, tuple[int, ...], int]]) -> None:
    """Every tensor's data lies inside the file (a truncated download fails here, not in libllama)."""
    alignment = int(keys.get("general.alignment", 32))
    data_start = -(-header_end // alignment) * alignment
    for name, ggml_type, shape, offset in tensors:
        if data_start + offset + _tensor_bytes(ggml_type, shape) > file_size:
            raise ValueError(f"tensor {name} runs past the end of the file ({file_size} bytes)")


def _read_header(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], dict[str, int]]:
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        head = _Header(buf)
        head.take("<I")  # magic, checked already
        version = head.take("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = head.take("<Q"), head.take("<Q")
        keys: dict[str, Any] = {}
        for _ in range(n_kv):
            name = head.string()
            keys[name] = head.value(head.take("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = head.string()
            n_dims = head.take("<I")
            shape = tuple(head.take("<Q") for _ in range(n_dims))
            tensors.append((name, head.take("<I"), shape, head.take("<Q")))
        _check_data(keys, head.pos, len(buf), tensors)
        return keys, {t[0]: t[2] for t in tensors}, {t[0]: t[1] for t in tensors}


def read_gguf(path: str | Path) -> GGUFInfo:
    """Parse a GGUF header; ModelFileError for a missing, foreign or truncated file. A file is read once while it is
    unchanged (same path, size, modification time and inode): the registry, the pair, the memory plan and the Space
    all ask for the same headers during one load. The info is shared: read it, never change it."""
    path = Path(path)
    _check_file(path)
    stat = path.stat()
    return _read_unchanged(path, stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=16)
def _read_unchanged(path: Path, size: int, mtime_ns: int, inode: int) -> GGUFInfo:
    try:
        keys, shapes, types = _read_header(path)
    except (ValueError, OSError, struct.error, OverflowError) as exc:
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
        tensor_types=types,
    )


SAMPLING_KEYS = (("temp", "temperature", float), ("top_k", "top_k", int), ("top_p", "top_p", float),
                 ("min_p", "min_p", float))  # fmt: skip


def sampling_defaults(read: Callable[[str], Any]) -> dict[str, float | int]:
    """A model's recommended sampling (`general.sampling.*`, the keys llama.cpp applies as defaults), given how to
    read one key (libllama's metadata string, or a header value): only the keys present and valid."""
    out: dict[str, float | int] = {}
    for key, name, kind in SAMPLING_KEYS:
        try:
            value = float(read(f"general.sampling.{key}"))
        except (TypeError, ValueError):
            continue
        # Stored as float32: 0.6 reads 0.6000000238; keep what the model's card says.
        out[name] = int(value) if kind is int else round(value, 6)
    return out
