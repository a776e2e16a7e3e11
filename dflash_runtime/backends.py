"""ggml's compute backends, loaded once per process, only where generation runs.

A llama-cpp-python build with loadable backends (`GGML_BACKEND_DL`) keeps each backend (CPU, CUDA) in a module of its
own under `llama_cpp/lib/`; libllama registers none by itself and looks for modules only next to the Python
executable and in the working directory. `load_backends()` loads them from the wheel's library folder instead: a
module that cannot load (the CUDA backend on a machine without the NVIDIA driver) is skipped, so the same wheel runs
on a CPU. A build with backends linked in registers them itself and loads nothing here.

Loading the CUDA backend initialises the CUDA driver. On ZeroGPU that must happen in the GPU worker only, never in the
web process it is forked from: nothing else in this package calls `load_backends()` before a model is opened.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

_lock = threading.Lock()
_loaded = False


def library_dir() -> Path:
    """llama_cpp/lib of the installed llama-cpp-python (where its native libraries and backend modules live)."""
    import llama_cpp

    return Path(llama_cpp.__file__).resolve().parent / "lib"


def backends_loaded() -> bool:
    """Whether this process has loaded ggml's backends through `load_backends()`."""
    return _loaded


def load_backends() -> None:
    """Register ggml's backends (idempotent, thread-safe) and initialise libllama's backend state."""
    global _loaded
    with _lock:
        if _loaded:
            return
        from llama_cpp import _ggml
        from llama_cpp import llama_cpp as ll

        lib = _ggml.libggml
        lib.ggml_backend_reg_count.argtypes, lib.ggml_backend_reg_count.restype = [], ctypes.c_size_t
        lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        lib.ggml_backend_load_all_from_path.restype = None
        if lib.ggml_backend_reg_count() == 0:  # loadable backends: nothing registered until loaded
            lib.ggml_backend_load_all_from_path(str(library_dir()).encode())
        ll.llama_backend_init()
        _loaded = True


def mapped_native_libraries() -> list[str]:
    """File names of the llama.cpp / ggml / CUDA libraries mapped into this process (from /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    names = {line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/" in line}
    prefixes = ("libggml", "libllama", "libcuda", "libcudart", "libcublas", "libnvidia")
    return sorted(name for name in names if name.startswith(prefixes))
