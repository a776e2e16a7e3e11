"""ggml's backend modules, loaded from this package's library folder the first time libllama needs them.

This wheel builds ggml's backends as loadable modules (`GGML_BACKEND_DL`): `libggml-cpu.so` (and `libggml-cuda.so`)
under `llama_cpp/lib/`, linked by nothing. libllama registers none by itself and, when asked, looks for modules only
next to the Python executable and in the working directory, so a plain `Llama(model_path=...)` would fail with
"no backends are loaded". `llama_cpp.llama_cpp` therefore routes the bindings that need a backend (`NEEDS_BACKENDS`)
through `loading_backends_first`, and their first call loads the modules from the folder libllama was opened from.

Nothing is loaded at import: loading the CUDA module initialises the CUDA driver, which a process that forks workers
(ZeroGPU's web process) must not do. A module that cannot load (the CUDA one without the NVIDIA driver) is skipped
by ggml, so the same wheel runs on a CPU. Added to llama-cpp-python's sources by the dflash-space wheel recipe
(prebuilt_wheels/build_wheel.py); callers that open models through other means can call `load_backend_modules()`.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The bindings whose C functions need a registered backend: model loading (it refuses to start without one), context
# creation, and the calls that ask ggml for devices or CPU features (libllama's own fallback for these,
# ggml_backend_load_all(), searches only the executable's folder and the working directory).
NEEDS_BACKENDS = frozenset({
    "llama_backend_init",
    "llama_numa_init",
    "llama_load_model_from_file",
    "llama_model_load_from_file",
    "llama_model_load_from_splits",
    "llama_model_load_from_file_ptr",
    "llama_model_init_from_user",
    "llama_init_from_model",
    "llama_new_context_with_model",
    "llama_supports_gpu_offload",
    "llama_supports_rpc",
    "llama_print_system_info",
})
# libggml-base is a library that libggml links, not a backend module.
_NOT_MODULES = ("libggml-base",)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_dir: Path | None = None
_done = False
_from_folder = False
_wrapped: set[str] = set()  # the names in NEEDS_BACKENDS that llama_cpp has bound through loading_backends_first


def library_dir() -> Path | None:
    """The folder the modules are loaded from (libllama's own), once llama_cpp.llama_cpp has been imported."""
    return _lib_dir


def backend_modules(folder: Path | None = None) -> list[str]:
    """File names of the backend modules in the folder (`libggml-cpu.so`, ...). Reads the folder, loads nothing."""
    folder = folder if folder is not None else _lib_dir
    if folder is None or not folder.is_dir():
        return []
    names = (p.name for p in folder.iterdir() if p.name.startswith("libggml-") and p.name.endswith(".so"))
    return sorted(n for n in names if not n.startswith(_NOT_MODULES))


def wrapped_bindings() -> frozenset[str]:
    """The bindings that load the backends first (NEEDS_BACKENDS, less any that this llama_cpp does not bind)."""
    return frozenset(_wrapped)


def backends_loaded() -> bool:
    """Whether `load_backend_modules()` has run in this process (through it or a binding in NEEDS_BACKENDS)."""
    return _done


def load_backend_modules() -> bool:
    """Load ggml's backend modules from the library folder unless a backend is registered already. Runs once per
    process (thread-safe); later calls return at once. True when the modules were loaded from the folder (the
    registry was empty), False when backends were registered by other means (linked in, or loaded by the caller)."""
    global _done, _from_folder
    if _done:
        return _from_folder
    with _lock:
        if _done:
            return _from_folder
        if _lib is None or _lib_dir is None:
            raise RuntimeError("llama_cpp.llama_cpp has not bound libllama yet: import llama_cpp first")
        # Through libllama's handle: the symbols resolve in the libggml libllama is linked to (its registry).
        reg_count = _lib["ggml_backend_reg_count"]
        reg_count.argtypes, reg_count.restype = [], ctypes.c_size_t
        if reg_count() == 0:
            load_all = _lib["ggml_backend_load_all_from_path"]
            load_all.argtypes, load_all.restype = [ctypes.c_char_p], None
            load_all(str(_lib_dir).encode())
            _from_folder = True
            if reg_count() == 0:
                modules = ", ".join(backend_modules()) or "none"
                warnings.warn(
                    f"no ggml backend could be loaded from {_lib_dir} (backend modules there: {modules}); "
                    "llama.cpp cannot open a model",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _done = True
        return _from_folder


def loading_backends_first(ctypes_function: Callable[..., Any], lib: ctypes.CDLL, lib_dir: Path) -> Callable[..., Any]:
    """Wrap llama_cpp's `ctypes_function` decorator factory: a binding named in NEEDS_BACKENDS becomes a function
    that calls `load_backend_modules()` before the C function; every other binding stays the ctypes function."""
    global _lib, _lib_dir
    _lib, _lib_dir = lib, Path(lib_dir)

    def factory(name: str, argtypes: list[Any], restype: Any, enabled: bool = True) -> Callable[[Any], Any]:
        decorate = ctypes_function(name, argtypes, restype, enabled)
        if name not in NEEDS_BACKENDS or not enabled:
            return decorate

        def decorator(f: Any) -> Any:
            native = decorate(f)

            @functools.wraps(f)
            def call(*args: Any) -> Any:
                load_backend_modules()
                return native(*args)

            call.native = native  # type: ignore[attr-defined]
            _wrapped.add(name)
            return call

        return decorator

    return factory
