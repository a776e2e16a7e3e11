"""ggml's compute backends, loaded once per process, only where generation runs.

A llama-cpp-python build with loadable backends (`GGML_BACKEND_DL`) keeps each backend (CPU, CUDA) in a module of its
own under `llama_cpp/lib/`; libllama registers none by itself and looks for modules only next to the Python
executable and in the working directory. `load_backends()` loads them from the wheel's library folder instead: a
module that cannot load (the CUDA backend on a machine without the NVIDIA driver) is skipped, so the same wheel runs
on a CPU. A build with backends linked in registers them itself and loads nothing here.

The project's wheel (prebuilt_wheels/) carries that loader itself, `llama_cpp._backend_modules`, which its bindings
that need a backend call first (so plain `llama_cpp.Llama` works). Where it exists, `load_backends()` goes through
it: one loader and one lock per process, whoever opens a model first. Other builds get the same loading from here.

Loading the CUDA backend initialises the CUDA driver. On ZeroGPU that must happen in the GPU worker only, never in the
web process it is forked from: nothing else in this package calls `load_backends()` before a model is opened.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

_lock = threading.Lock()
_loaded = False
_from_modules = False  # whether load_backends() found nothing registered and loaded the modules
# libggml.so (the registry) and libggml-base.so are linked libraries, not backend modules.
_NOT_MODULES = ("libggml-base",)


def library_dir() -> Path:
    """llama_cpp/lib of the installed llama-cpp-python (where its native libraries and backend modules live): the
    folder the wheel's loader loads from where it has one (libllama's own, `$LLAMA_CPP_LIB_PATH` when set)."""
    import llama_cpp

    loader = wheel_loader()
    folder = loader.library_dir() if loader is not None else None
    return Path(folder) if folder is not None else Path(llama_cpp.__file__).resolve().parent / "lib"


def ggml_library() -> ctypes.CDLL:
    """ggml's registry functions as libllama sees them: looked up through libllama's handle, so they resolve in the
    libggml that libllama is linked to. (The wheel stores `libggml.so` and `libggml.so.0` as two copies of one file;
    llama_cpp's `_ggml` module loads the first, libllama the second, and each copy keeps its own backend registry.)"""
    from llama_cpp import llama_cpp as ll

    return ll._lib


def wheel_loader() -> ModuleType | None:
    """The wheel's own backend loader (`llama_cpp._backend_modules`), None for a build without it (or one whose
    llama_cpp.py lacks the hook that binds it to libllama). Imports llama_cpp, which loads no backend."""
    try:
        from llama_cpp import _backend_modules  # the package's import binds libllama: the hook has run
    except ImportError:
        return None
    return _backend_modules if _backend_modules.library_dir() is not None else None


def backends_loaded() -> bool:
    """Whether this process has loaded ggml's backends: through `load_backends()`, or through the wheel's own loader
    (a plain `llama_cpp.Llama`). Loads nothing; imports llama_cpp only once something has imported it."""
    if _loaded:
        return True
    if "llama_cpp._backend_modules" not in sys.modules:
        return False
    return bool(sys.modules["llama_cpp._backend_modules"].backends_loaded())


def load_backends() -> None:
    """Register ggml's backends (idempotent, thread-safe) and initialise libllama's backend state."""
    global _loaded, _from_modules
    with _lock:
        if _loaded:
            return
        from llama_cpp import llama_cpp as ll

        loader = wheel_loader()
        if loader is not None:
            _from_modules = loader.load_backend_modules()
        else:
            lib = ggml_library()
            lib.ggml_backend_reg_count.argtypes, lib.ggml_backend_reg_count.restype = [], ctypes.c_size_t
            lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
            lib.ggml_backend_load_all_from_path.restype = None
            if lib.ggml_backend_reg_count() == 0:  # loadable backends: nothing registered until loaded
                lib.ggml_backend_load_all_from_path(str(library_dir()).encode())
                _from_modules = True
        ll.llama_backend_init()
        _loaded = True


def backend_modules(lib_dir: Path | None = None) -> list[str]:
    """File names of the backend libraries in the wheel's library folder (`libggml-cpu.so`, `libggml-cuda.so`, ...).

    Reads the folder only: nothing is loaded. (A build with the backends linked in has such files too, as libraries
    libggml needs; `backend_report()` tells the two kinds of build apart.)
    """
    folder = lib_dir if lib_dir is not None else library_dir()
    if not folder.is_dir():
        return []
    names = (p.name for p in folder.iterdir() if p.is_file() and p.name.startswith("libggml-") and p.suffix == ".so")
    return sorted(n for n in names if not n.startswith(_NOT_MODULES))


def module_kind(module: str) -> str:
    """'libggml-cuda.so' -> 'cuda'; CPU variants ('libggml-cpu-haswell.so') -> 'cpu': the backend's name, lowercase."""
    return module.removeprefix("libggml-").removesuffix(".so").split("-")[0].lower()


def registered_backends() -> list[str]:
    """Names of the backends registered with ggml in this process (e.g. ['CPU'] or ['CUDA', 'CPU'])."""
    lib = ggml_library()
    lib.ggml_backend_reg_count.argtypes, lib.ggml_backend_reg_count.restype = [], ctypes.c_size_t
    lib.ggml_backend_reg_get.argtypes, lib.ggml_backend_reg_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.ggml_backend_reg_name.argtypes, lib.ggml_backend_reg_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    regs = (lib.ggml_backend_reg_get(i) for i in range(lib.ggml_backend_reg_count()))
    return [(lib.ggml_backend_reg_name(reg) or b"?").decode(errors="replace") for reg in regs]


# ggml_backend_dev_type, in ggml-backend.h's order
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


@dataclass(frozen=True)
class DeviceMemory:
    """One ggml device and its memory as the backend reports it (for a GPU: the driver's free and total)."""

    name: str  # "CUDA0", "CPU"
    description: str  # e.g. "NVIDIA H200"
    kind: str  # one of DEVICE_KINDS
    free: int
    total: int


def device_memory() -> list[DeviceMemory]:
    """Every device ggml registered in this process and its free / total memory, after loading the backends (see
    `load_backends`: call it only where a model may run). ggml reports the CPU's memory as all free; the host's
    free memory is `host_memory_available()`."""
    load_backends()
    lib = ggml_library()
    lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.c_void_p], ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        if not dev:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = lib.ggml_backend_dev_type(dev)
        devices.append(DeviceMemory(
            name=(lib.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
            description=(lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
            kind=DEVICE_KINDS[kind] if 0 <= kind < len(DEVICE_KINDS) else "unknown",
            free=int(free.value), total=int(total.value)))
    return devices


def offload_devices() -> list[tuple[str, int]]:
    """(name, ggml_backend_dev_t) of the local devices libllama offloads layers to by default: the GPUs (integrated
    ones only without a discrete one), in ggml's order. After loading the backends."""
    load_backends()
    lib = ggml_library()
    lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
    lib.ggml_backend_dev_name.argtypes, lib.ggml_backend_dev_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    found: dict[str, list[tuple[str, int]]] = {"gpu": [], "igpu": []}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(dev) if dev else -1
        if 0 <= kind < len(DEVICE_KINDS) and DEVICE_KINDS[kind] in found:
            found[DEVICE_KINDS[kind]].append(((lib.ggml_backend_dev_name(dev) or b"?").decode(), int(dev)))
    return found["gpu"] or found["igpu"]


def host_memory_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes of physical host memory."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes of host memory available to new allocations without swapping (Linux's MemAvailable; elsewhere the
    physical pages the system calls available)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class FreeMemory:
    """Where a pair's caches go and what is free there before it is opened: the GPUs' memory when layers are
    offloaded to a GPU (`on_gpu`; host memory then holds the context checkpoints), else the host's."""

    where: str
    free: int
    on_gpu: bool
    host_free: int


def free_memory(n_gpu_layers: int) -> FreeMemory:
    """The memory a pair opened with `n_gpu_layers` would use, and how much of it is free now (loads the backends:
    call it only where a model may run)."""
    host = host_memory_available()
    gpus = [d for d in device_memory() if d.kind == "gpu"] if n_gpu_layers != 0 else []
    if not gpus:
        return FreeMemory("host memory", host, False, host)
    where = " + ".join(f"{d.name} ({d.description})" if d.description else d.name for d in gpus)
    return FreeMemory(where, sum(d.free for d in gpus), True, host)


@dataclass
class BackendReport:
    """What `load_backends()` found: the modules on disk, the backends registered, and why the others were skipped."""

    modules: list[str] = field(default_factory=list)  # backend modules in llama_cpp/lib (empty: backends linked in)
    registered: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module -> the loader's reason

    @property
    def loadable(self) -> bool:
        return bool(self.modules)


def backend_report(lib_dir: Path | None = None) -> BackendReport:
    """Load the backends (see `load_backends`) and say which modules registered and why the others did not.

    ggml skips a module that fails to load without a word (release builds); to name the reason, each skipped module
    is opened once more here, which repeats the loader's error (e.g. `libcuda.so.1: cannot open shared object file`
    for the CUDA module on a machine without the NVIDIA driver). Loads backends: call it only where a model may run
    (the start-up probe runs it in a child process).
    """
    load_backends()
    if not _from_modules:  # backends linked into libggml: registered at load, nothing was skipped
        return BackendReport(registered=registered_backends())
    folder = lib_dir if lib_dir is not None else library_dir()
    report = BackendReport(modules=backend_modules(folder), registered=registered_backends())
    names = {name.lower() for name in report.registered}
    for module in report.modules:
        if module_kind(module) in names:
            continue
        try:
            ctypes.CDLL(str(folder / module), mode=ctypes.RTLD_LOCAL)
        except OSError as error:
            report.skipped[module] = str(error).removeprefix(f"{folder / module}: ")
        else:
            report.skipped[module] = "loads, but its backend did not register (not supported on this machine)"
    return report


def mapped_native_libraries() -> list[str]:
    """File names of the llama.cpp / ggml / CUDA libraries mapped into this process (from /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    names = {line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/" in line}
    prefixes = ("libggml", "libllama", "libcuda", "libcudart", "libcublas", "libnvidia")
    return sorted(name for name in names if name.startswith(prefixes))
