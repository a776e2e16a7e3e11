"""The target's vocabulary (libllama's `llama_vocab_*` and token text calls), owned in one place: the rest of the
core asks this for tokens and text, never libllama."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable
from typing import Any

from llama_cpp import llama_cpp as ll

from ..errors import RequestError

CONTROL_ATTRS = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_UNKNOWN
LSTRIP, RSTRIP = ll.LLAMA_TOKEN_ATTR_LSTRIP, ll.LLAMA_TOKEN_ATTR_RSTRIP


class Vocabulary:
    """A model's vocabulary: valid while its model is open (the pair frees both together)."""

    def __init__(self, vocab: Any) -> None:
        self.handle = vocab
        self.n_tokens = int(ll.llama_vocab_n_tokens(vocab))
        self._local = threading.local()  # a piece buffer per thread: requests and engine calls may overlap

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        while True:
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self.handle, raw, len(raw), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            if n == -(2**31):
                raise RequestError("the text is too long to tokenize")
            cap = -n  # too small: -n tokens are needed

    def piece(self, token: int) -> bytes:
        """The bytes of one token, special tokens rendered (so <think> reaches the UI)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = ctypes.create_string_buffer(256)
        n = ll.llama_token_to_piece(self.handle, token, buf, len(buf), 0, True)
        if n < 0:  # buffer too small: -n is the size needed
            big = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.handle, token, big, len(big), 0, True)
            return big.raw[:n]
        return buf.raw[:n]

    def piece_text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", "replace")

    def text(self, tokens: Iterable[int]) -> str:
        """Token ids → text, piece by piece, special tokens rendered."""
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def detokenize(self, tokens: Iterable[int], *, special: bool) -> bytes:
        """Token ids → bytes as libllama joins them (`Llama.detokenize`), special tokens only when `special`."""
        ids = list(tokens)
        if not ids:
            return b""
        array = (ll.llama_token * len(ids))(*ids)
        size = 8 * len(ids) + 16
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = ll.llama_detokenize(self.handle, array, len(ids), buffer, size, False, special)
            if n >= 0:
                return buffer.raw[:n]
            size = -n  # too small: -n bytes are needed

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self.handle, token))

    def attrs(self, token: int) -> int:
        return int(ll.llama_vocab_get_attr(self.handle, token))

    @property
    def bos(self) -> int:
        return int(ll.llama_vocab_bos(self.handle))

    @property
    def eos(self) -> int:
        return int(ll.llama_vocab_eos(self.handle))

    @property
    def nl(self) -> int:
        return int(ll.llama_vocab_nl(self.handle))
