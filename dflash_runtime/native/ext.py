"""ctypes bindings of the DFlash ext functions of libllama that llama-cpp-python does not bind.

They are declared with C++ linkage in llama.cpp's `src/llama-ext.h`, so the shared library exports them under
mangled names; the plain name is tried first for builds that export them as C.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp
from llama_cpp import llama_cpp as _llama

from ..errors import MissingSymbolsError

_ctx_p = _llama.llama_context_p_ctypes
_model_p = _llama.llama_model_p_ctypes


@dataclass(frozen=True)
class _Signature:
    names: tuple[str, ...]
    argtypes: list[Any]
    restype: Any


_SIGNATURES: dict[str, _Signature] = {
    "llama_set_embeddings_layer_inp": _Signature(
        ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"),
        [_ctx_p, ctypes.c_uint32, ctypes.c_bool],
        None,
    ),
    "llama_get_embeddings_layer_inp": _Signature(
        ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj"),
        [_ctx_p, ctypes.c_uint32],
        ctypes.POINTER(ctypes.c_float),
    ),
    "llama_model_dflash_selector_top_k": _Signature(
        ("llama_model_dflash_selector_top_k", "_Z33llama_model_dflash_selector_top_kPK11llama_model"),
        [_model_p],
        ctypes.c_int32,
    ),
    "llama_model_target_layer_ids": _Signature(
        ("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model"),
        [_model_p],
        ctypes.POINTER(ctypes.c_int32),
    ),
    "llama_model_target_layer_ids_n": _Signature(
        ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model"),
        [_model_p],
        ctypes.c_uint32,
    ),
}

# Bound by llama-cpp-python 0.3.36 itself (llama_cpp_ext / llama_cpp); checked so an older build fails early.
_BOUND_ELSEWHERE = ("llama_set_embeddings_nextn", "llama_get_embeddings_nextn", "llama_get_ctx_other")


def library() -> ctypes.CDLL:
    """The libllama that llama_cpp loaded (never a second copy: contexts must come from the same library)."""
    return _llama._lib


def library_path() -> str:
    return str(getattr(library(), "_name", "?"))


def _resolve(lib: ctypes.CDLL, sig: _Signature) -> Any | None:
    for name in sig.names:
        try:
            fn = getattr(lib, name)
        except AttributeError:
            continue
        fn.argtypes = sig.argtypes
        fn.restype = sig.restype
        return fn
    return None


def missing_symbols(lib: ctypes.CDLL | None = None) -> list[str]:
    """Names of the DFlash functions absent from `lib` (default: the loaded libllama)."""
    lib = lib or library()
    missing = [name for name, sig in _SIGNATURES.items() if _resolve(lib, sig) is None]
    try:
        from llama_cpp import llama_cpp_ext  # noqa: F401  (raises if its own ext symbols are missing)
    except (ImportError, AttributeError):
        missing.extend(_BOUND_ELSEWHERE)
    return missing


def _missing_error(missing: list[str]) -> MissingSymbolsError:
    return MissingSymbolsError(
        f"this llama-cpp-python build lacks the DFlash functions {', '.join(missing)} "
        f"(llama_cpp {llama_cpp.__version__}, library {library_path()}). "
        "Install llama-cpp-python==0.3.36 (pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36) "
        "or a wheel from this project's prebuilt_wheels/ recipe."
    )


class DFlashApi:
    """The DFlash ext functions plus the llama-cpp-python ext bindings they work with, resolved once."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        lib = lib or library()
        missing = missing_symbols(lib)
        if missing:
            raise _missing_error(missing)
        from llama_cpp import llama_cpp_ext

        fns = {name: _resolve(lib, sig) for name, sig in _SIGNATURES.items()}
        self.set_embeddings_layer_inp = fns["llama_set_embeddings_layer_inp"]
        self.get_embeddings_layer_inp = fns["llama_get_embeddings_layer_inp"]
        self.model_dflash_selector_top_k = fns["llama_model_dflash_selector_top_k"]
        self._target_layer_ids = fns["llama_model_target_layer_ids"]
        self._target_layer_ids_n = fns["llama_model_target_layer_ids_n"]
        self.set_embeddings_nextn = llama_cpp_ext.llama_set_embeddings_nextn
        self.get_embeddings_nextn = llama_cpp_ext.llama_get_embeddings_nextn
        self.get_ctx_other = llama_cpp_ext.llama_get_ctx_other

    def target_layer_ids(self, model: Any) -> list[int]:
        n = int(self._target_layer_ids_n(model))
        ptr = self._target_layer_ids(model)
        return [int(ptr[i]) for i in range(n)] if n and ptr else []


_api: DFlashApi | None = None


def dflash_api() -> DFlashApi:
    """The process-wide bound API; raises MissingSymbolsError on a build without DFlash."""
    global _api
    if _api is None:
        _api = DFlashApi()
    return _api
