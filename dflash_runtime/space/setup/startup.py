"""Start-up self-check of the native build: CUDA runtime preload, llama_cpp import, and what the build can do.

Importing this module touches neither CUDA nor llama_cpp. `run_startup_check()` gathers the facts that need no GPU
in the calling process and, by default, probes llama_cpp and the GPUs in a child process: a ZeroGPU web process
must never initialise CUDA (ggml caches its device list, and a forked GPU worker would inherit an empty one).

The manifest read here is the one written by prebuilt_wheels/build_wheel.py next to the wheel it built.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CUDA_MAJOR = 13
# Dependency order: cublasLt needs cudart, cublas needs both.
CUDA_LIBRARIES = ("cudart", "cublasLt", "cublas")
PIP_PACKAGE_OF = {"cudart": "nvidia-cuda-runtime", "cublasLt": "nvidia-cublas", "cublas": "nvidia-cublas"}
DISTRIBUTION = "llama_cpp_python"
MANIFEST_NAME = "manifest.json"
MANIFEST_FIELDS = (
    "package", "version", "variant", "config_key", "llama_cpp_commit", "cuda_version", "cuda_architectures",
    "python_tag", "cmake_args", "wheel", "native_libraries",
)  # fmt: skip
PROJECT_ROOT = Path(__file__).resolve().parents[2]
CUDA_ATTR_CC_MAJOR, CUDA_ATTR_CC_MINOR = 75, 76  # cudaDevAttrComputeCapabilityMajor / Minor
GGML_DEVICE_TYPES = ("CPU", "GPU", "IGPU", "ACCEL", "META")
PROBE_TIMEOUT_S = 180

_preloaded: list[ctypes.CDLL] = []  # handles stay referenced so the libraries stay loaded


# ---------------------------------------------------------------- CUDA runtime libraries from pip


@dataclass(frozen=True)
class CudaLibrarySearch:
    ordered: list[Path]  # found libraries, in load order
    missing: list[str]  # short names (cudart, cublasLt, cublas)
    install_hint: str | None  # the pip command that brings the missing ones


def cuda_library_dirs(root: Path, major: int = CUDA_MAJOR) -> list[Path]:
    """Where NVIDIA's pip wheels put the libraries under a site-packages root (CUDA 13 layout, then CUDA 12's)."""
    nvidia = root / "nvidia"
    return [nvidia / f"cu{major}" / "lib", nvidia / "cuda_runtime" / "lib", nvidia / "cublas" / "lib"]


def install_hint(missing: Iterable[str], major: int = CUDA_MAJOR) -> str | None:
    packages = list(dict.fromkeys(PIP_PACKAGE_OF[name] for name in missing))
    return " ".join(["pip install", *(f"'{pkg}=={major}.*'" for pkg in packages)]) if packages else None


def find_cuda_libraries(roots: Iterable[Path], major: int = CUDA_MAJOR) -> CudaLibrarySearch:
    """Find libcudart / libcublasLt / libcublas .so.<major> under the given roots, ordered for loading."""
    roots = list(roots)
    found: dict[str, Path] = {}
    for name in CUDA_LIBRARIES:
        filename = f"lib{name}.so.{major}"
        hits = (d / filename for root in roots for d in cuda_library_dirs(root, major))
        hit = next((path for path in hits if path.is_file()), None)
        if hit is not None:
            found[name] = hit
    missing = [name for name in CUDA_LIBRARIES if name not in found]
    return CudaLibrarySearch([found[n] for n in CUDA_LIBRARIES if n in found], missing, install_hint(missing, major))


def default_search_roots() -> list[Path]:
    """site-packages directories of this interpreter (venv, system, user) and sys.path entries that look like them."""
    candidates = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    candidates.append(site.getusersitepackages())
    candidates += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return [Path(p) for p in dict.fromkeys(candidates) if p and Path(p).is_dir()]


def preload_cuda_libraries(search: CudaLibrarySearch) -> tuple[list[str], list[str]]:
    """dlopen the found libraries RTLD_GLOBAL, in order, so libggml-cuda resolves them by soname.

    Returns (loaded paths, errors).
    """
    loaded, errors = [], []
    for path in search.ordered:
        try:
            _preloaded.append(ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL))
            loaded.append(str(path))
        except OSError as error:
            errors.append(f"{path.name}: {error}")
    return loaded, errors


# ---------------------------------------------------------------- the installed llama_cpp, without importing it


def installed_package_dir() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_cuda_build(package_dir: Path | None) -> bool:
    return package_dir is not None and (package_dir / "lib" / "libggml-cuda.so").exists()


def installed_record_hashes(distribution: str = DISTRIBUTION) -> dict[str, str]:
    """RECORD entries (path -> urlsafe-base64 sha256) of the installed distribution."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    return {str(f).replace(os.sep, "/"): f.hash.value for f in files if f.hash and f.hash.mode == "sha256"}


# ---------------------------------------------------------------- manifests


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def record_digest(hex_sha256: str) -> str:
    """A hex sha256 in RECORD's encoding (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(bytes.fromhex(hex_sha256)).rstrip(b"=").decode()


def validate_manifest(manifest: dict[str, Any]) -> list[str]:
    problems = [f"manifest lacks '{name}'" for name in MANIFEST_FIELDS if name not in manifest]
    wheel = manifest.get("wheel")
    if isinstance(wheel, dict) and not re.fullmatch(r"[0-9a-f]{64}", str(wheel.get("sha256", ""))):
        problems.append("manifest wheel.sha256 is not a sha256")
    return problems


def verify_wheel_file(manifest: dict[str, Any], manifest_dir: Path) -> list[str]:
    """Compare the wheel shipped next to the manifest (when there) with the manifest's sha256."""
    wheel_info = manifest.get("wheel") or {}
    wheel = manifest_dir / str(wheel_info.get("filename", ""))
    if not wheel_info.get("filename") or not wheel.is_file():
        return []
    actual, expected = file_sha256(wheel), str(wheel_info.get("sha256"))
    if actual != expected:
        return [f"{wheel.name}: sha256 {actual[:16]}… is not the manifest's {expected[:16]}… (altered or rebuilt)"]
    return []


def verify_installed(manifest: dict[str, Any], record: dict[str, str], version: str | None) -> list[str]:
    """Compare the installed native libraries (RECORD hashes) with the manifest's."""
    problems = []
    if version != manifest.get("version"):
        problems.append(f"installed llama-cpp-python {version} is not the manifest's {manifest.get('version')}")
    expected: dict[str, str] = manifest.get("native_libraries") or {}
    for name, hex_sha in sorted(expected.items()):
        if name not in record:
            problems.append(f"{name} is not installed")
        elif record[name] != record_digest(hex_sha):
            problems.append(f"installed {name} differs from the manifest's")
    extra = sorted(n for n in record if n.startswith("llama_cpp/lib/") and ".so" in n and n not in expected)
    problems += [f"installed {name} is not in the manifest" for name in extra]
    return problems


def find_manifests(search_dirs: Iterable[Path]) -> list[Path]:
    """Manifest files given directly, or in a directory and up to two levels below it (prebuilt_wheels/dist/cuda/)."""
    found: list[Path] = []
    for directory in search_dirs:
        if directory.is_file():
            found.append(directory)
        elif directory.is_dir():
            for pattern in (MANIFEST_NAME, f"*/{MANIFEST_NAME}", f"*/*/{MANIFEST_NAME}"):
                found += sorted(directory.glob(pattern))
    return list(dict.fromkeys(p.resolve() for p in found))


# Where run.sh records, inside the venv it set up, the manifest of the wheel it installed and checked: the app started
# later from that venv (`.venv/bin/python app.py`, the tests by hand) finds it without run.sh's environment.
RECORDED_MANIFEST = Path(".dflash-run") / "wheel-manifest"
WHEEL_VARIANTS = ("cpu", "cuda")  # run.sh's wheel cache keeps each variant's wheel and manifest in a folder of its own


def recorded_manifest(prefix: Path | None = None) -> Path | None:
    """The manifest run.sh recorded in the venv at `prefix` (this interpreter's by default), if it did."""
    record = Path(sys.prefix if prefix is None else prefix) / RECORDED_MANIFEST
    try:
        text = record.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return Path(text) if text else None


def wheel_cache_dirs() -> list[Path]:
    """run.sh's (and CI's) wheel cache, one folder per variant: $DFLASH_WHEEL_CACHE, else its default."""
    cache = os.environ.get("DFLASH_WHEEL_CACHE") or str(Path.home() / ".cache" / "dflash-space" / "wheels-dl")
    return [Path(cache) / variant for variant in WHEEL_VARIANTS]


def default_manifest_dirs() -> list[Path]:
    """Where the start-up check looks, in this order: DFLASH_WHEEL_MANIFEST, the manifest run.sh recorded in this
    venv, the recipe's own output (prebuilt_wheels/), run.sh's wheel cache."""
    explicit = os.environ.get("DFLASH_WHEEL_MANIFEST")
    dirs = [Path(explicit)] if explicit else []
    recorded = recorded_manifest()
    if recorded is not None:
        dirs.append(recorded)
    return [*dirs, PROJECT_ROOT / "prebuilt_wheels", Path.cwd() / "prebuilt_wheels", *wheel_cache_dirs()]


@dataclass
class ManifestCheck:
    path: str | None = None
    matches: bool | None = None  # None: no manifest to compare with
    problems: list[str] = field(default_factory=list)
    architectures: list[str] = field(default_factory=list)


def check_manifests(paths: list[Path], record: dict[str, str], version: str | None) -> ManifestCheck:
    """The first manifest that matches the installed build wins; otherwise report the closest one's problems."""
    checks = []
    for path in paths:
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            checks.append(ManifestCheck(str(path), False, [f"unreadable manifest: {error}"]))
            continue
        problems = validate_manifest(manifest) + verify_wheel_file(manifest, path.parent)
        problems += verify_installed(manifest, record, version)
        check = ManifestCheck(str(path), not problems, problems, list(manifest.get("cuda_architectures") or []))
        if check.matches:
            return check
        checks.append(check)
    return min(checks, key=lambda c: len(c.problems)) if checks else ManifestCheck()


# ---------------------------------------------------------------- architectures


def parse_arch(arch: str) -> tuple[int, str, str]:
    """'120a-real' -> (120, 'a', 'real'); 'sm_86' -> (86, '', 'real'); '90' -> (90, '', 'both')."""
    text = arch.strip().lower()
    kind = "real" if text.startswith("sm_") else "virtual" if text.startswith("compute_") else "both"
    match = re.fullmatch(r"(?:sm_|compute_)?(\d+)([af]?)(?:-(real|virtual))?", text)
    if not match:
        raise ValueError(f"not a CUDA architecture: {arch}")
    return int(match.group(1)), match.group(2), match.group(3) or kind


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether code compiled for `arch` runs on a GPU of this compute capability.

    Arch-specific ('a') code runs on that exact chip; family ('f') and plain SASS on later minors of the same major;
    PTX (virtual, or no suffix) is JIT-compiled for any later GPU.
    """
    number, suffix, kind = parse_arch(arch)
    target = divmod(number, 10)
    if suffix == "a":
        return capability == target
    if suffix == "f" or kind == "real":
        return capability[0] == target[0] and capability[1] >= target[1]
    return capability >= target


def architecture_problems(devices: list[dict[str, Any]], archs: list[str]) -> list[str]:
    problems = []
    for device in devices:
        capability = tuple(device["compute_capability"])
        if archs and not any(arch_runs_on(a, capability) for a in archs):
            cc = f"{capability[0]}.{capability[1]}"
            problems.append(
                f"GPU {device['index']} ({device.get('name') or 'CUDA device'}) has compute capability {cc}, "
                f"which this wheel's architectures ({', '.join(archs)}) do not cover: "
                f"rebuild with --arch {capability[0]}{capability[1]}-real added"
            )
    return problems


def parse_cuobjdump_elf(listing: str) -> list[str]:
    """`cuobjdump --list-elf` lines such as 'ELF file 1: libggml-cuda.1.sm_120a.cubin' -> ['sm_120a']."""
    return sorted(set(re.findall(r"\bsm_\d+[af]?\b", listing)))


def find_cuobjdump(roots: Iterable[Path], major: int = CUDA_MAJOR) -> str | None:
    candidates = [shutil.which("cuobjdump")]
    candidates += [str(Path(h) / "bin" / "cuobjdump") for h in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if h]
    candidates += [str(root / "nvidia" / f"cu{major}" / "bin" / "cuobjdump") for root in roots]
    return next((c for c in candidates if c and Path(c).is_file()), None)


def compiled_architectures(library: Path, cuobjdump: str | None) -> list[str] | None:
    """SASS architectures inside libggml-cuda.so, read by cuobjdump (None when cuobjdump is not available)."""
    if cuobjdump is None or not library.is_file():
        return None
    try:
        out = subprocess.run([cuobjdump, "--list-elf", str(library)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_cuobjdump_elf(out.stdout) if out.returncode == 0 else None


# ---------------------------------------------------------------- the probe (touches CUDA: child process by default)


def _ggml_devices() -> list[dict[str, Any]]:
    """ggml's backend devices, through the libggml that libllama uses (llama_cpp binds no device enumeration)."""
    from dflash_runtime.native.backends import ggml_library

    lib = ggml_library()
    count_fn, get_fn = lib.ggml_backend_dev_count, lib.ggml_backend_dev_get
    count_fn.restype, get_fn.argtypes, get_fn.restype = ctypes.c_size_t, [ctypes.c_size_t], ctypes.c_void_p
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.c_void_p], ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
    memory_args = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.argtypes, lib.ggml_backend_dev_memory.restype = memory_args, None
    devices = []
    for index in range(count_fn()):
        dev = get_fn(index)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = lib.ggml_backend_dev_type(dev)
        devices.append({
            "name": (lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
            "description": (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
            "type": GGML_DEVICE_TYPES[kind] if 0 <= kind < len(GGML_DEVICE_TYPES) else str(kind),
            "memory_total_mib": total.value // 2**20,
        })  # fmt: skip
    return devices


def _cuda_devices(major: int = CUDA_MAJOR) -> list[dict[str, Any]]:
    """Compute capability of each visible CUDA device, through the (already loaded) CUDA runtime."""
    try:
        cudart = ctypes.CDLL(f"libcudart.so.{major}")
    except OSError:
        return []
    count = ctypes.c_int()
    if cudart.cudaGetDeviceCount(ctypes.byref(count)) != 0:
        return []
    devices = []
    for index in range(count.value):
        cc_major, cc_minor = ctypes.c_int(), ctypes.c_int()
        cudart.cudaDeviceGetAttribute(ctypes.byref(cc_major), CUDA_ATTR_CC_MAJOR, index)
        cudart.cudaDeviceGetAttribute(ctypes.byref(cc_minor), CUDA_ATTR_CC_MINOR, index)
        devices.append({"index": index, "compute_capability": [cc_major.value, cc_minor.value]})
    return devices


def _dflash_missing_symbols() -> list[str] | None:
    try:
        from dflash_runtime.native.ext import missing_symbols
    except ImportError:
        return None
    return list(missing_symbols())


def _backends() -> dict[str, Any]:
    """Load ggml's backends as a model load would, and report them (modules, registered, skipped and why)."""
    try:
        from dflash_runtime.native.backends import backend_report
    except ImportError as error:
        return {"backends_error": f"{type(error).__name__}: {error}"}
    try:
        report = backend_report()
    except (AttributeError, OSError) as error:  # a libggml without the registry functions
        return {"backends_error": f"{type(error).__name__}: {error}"}
    return {
        "loadable_backends": report.loadable,
        "backend_modules": report.modules,
        "backends_registered": report.registered,
        "backends_skipped": report.skipped,
    }


def probe(roots: list[Path] | None = None) -> dict[str, Any]:
    """Preload the CUDA runtime, import llama_cpp and ask it what it can do. Initialises CUDA on a CUDA build."""
    search = find_cuda_libraries(roots if roots is not None else default_search_roots())
    loaded, preload_errors = preload_cuda_libraries(search)
    info: dict[str, Any] = {"preloaded": loaded, "preload_errors": preload_errors}
    try:
        import llama_cpp
    except Exception as error:  # a broken native build raises OSError, RuntimeError, ...
        return {**info, "import_error": f"{type(error).__name__}: {error}"}
    info["llama_cpp_version"] = getattr(llama_cpp, "__version__", None)
    info["library_path"] = str(getattr(llama_cpp.llama_cpp._lib, "_name", ""))
    info.update(_backends())  # before any device question: a loadable-backends build has none until then
    info["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    try:
        info["devices"] = _ggml_devices()
    except (AttributeError, OSError) as error:
        info["devices"], info["devices_error"] = [], f"{type(error).__name__}: {error}"
    gpu_names = [d["description"] or d["name"] for d in info["devices"] if d["type"] in ("GPU", "IGPU")]
    cuda = _cuda_devices() if info["gpu_offload"] else []
    for device, name in zip(cuda, gpu_names, strict=False):
        device["name"] = name
    info["cuda_devices"] = cuda
    info["dflash_missing_symbols"] = _dflash_missing_symbols()
    return info


def probe_in_child(timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Run probe() in a fresh interpreter (this file loaded by path, so no package __init__ runs before the preload)."""
    code = (
        "import importlib.util, json, sys\n"
        f"sys.path.append({str(PROJECT_ROOT)!r})\n"
        f"spec = importlib.util.spec_from_file_location('dflash_startup_probe', {str(Path(__file__).resolve())!r})\n"
        "module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print(json.dumps(module.probe()))\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"probe_error": f"the probe did not finish within {timeout_s:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"probe_error": f"the probe exited with status {out.returncode}: {tail}"}
    return json.loads(lines[-1])


# ---------------------------------------------------------------- the check


def static_facts(roots: list[Path], manifest_dirs: list[Path]) -> dict[str, Any]:
    """Everything that needs no GPU and no llama_cpp import."""
    package_dir = installed_package_dir()
    version = installed_version()
    search = find_cuda_libraries(roots)
    manifest = check_manifests(find_manifests(manifest_dirs), installed_record_hashes(), version)
    cuda_build = is_cuda_build(package_dir)
    compiled = None
    if cuda_build:
        compiled = compiled_architectures(package_dir / "lib" / "libggml-cuda.so", find_cuobjdump(roots))
    return {
        "installed_version": version,
        "package_dir": str(package_dir) if package_dir else None,
        "cuda_build": cuda_build,
        "cuda_libraries": [str(p) for p in search.ordered],
        "cuda_libraries_missing": search.missing,
        "cuda_install_hint": search.install_hint,
        "manifest": asdict(manifest),
        "wheel_architectures": manifest.architectures,
        "compiled_architectures": compiled,
        "nvidia_device_node": Path("/dev/nvidia0").exists(),  # a file check: a GPU is attached to this process
    }


def _build_label(info: dict[str, Any]) -> str:
    if not info.get("cuda_build"):
        return "CPU build"
    archs = info.get("compiled_architectures") or info.get("wheel_architectures")
    return f"CUDA build, {', '.join(archs)}" if archs else "CUDA build"


def _gpu_phrase(info: dict[str, Any]) -> str:
    if not info.get("gpu_offload"):
        cuda_skipped = (info.get("backends_skipped") or {}).get("libggml-cuda.so")
        if info.get("cuda_build") and cuda_skipped:
            return f"no GPU offload: the CUDA backend did not load ({cuda_skipped}); runs on the CPU"
        if info.get("cuda_build"):
            return "no GPU offload: no CUDA device visible to this process (ZeroGPU attaches one inside GPU calls)"
        return "no GPU offload (runs on the CPU)"
    gpus = info.get("cuda_devices") or []
    names = [
        f"{d.get('name') or 'GPU'} (compute {d['compute_capability'][0]}.{d['compute_capability'][1]})" for d in gpus
    ]
    return f"GPU offload on, {len(gpus)} GPU(s): {', '.join(names)}" if gpus else "GPU offload on, no GPU visible"


def _dflash_phrase(missing: list[str] | None) -> str:
    if missing is None:
        return "DFlash symbols not checked"
    return f"DFlash symbols MISSING ({', '.join(missing)})" if missing else "DFlash symbols present"


def _manifest_phrase(manifest: dict[str, Any]) -> str:
    if manifest["matches"] is None:
        # A build from source has none; a wheel of the recipe has one beside it, which the app finds under
        # prebuilt_wheels/, in run.sh's wheel cache, where run.sh recorded it or where DFLASH_WHEEL_MANIFEST points.
        return ("no wheel manifest found: built from source, or a wheel whose manifest.json is elsewhere "
                "(set DFLASH_WHEEL_MANIFEST to it)")
    if manifest["matches"]:
        return "installed build matches its wheel manifest"
    problems = manifest["problems"]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"wheel manifest mismatch with {manifest['path']}: {problems[0]}{more}"


def problems_of(info: dict[str, Any]) -> list[str]:
    problems = []
    if info.get("cuda_build") and info.get("cuda_libraries_missing"):
        problems.append(f"CUDA runtime libraries not found: {info['cuda_install_hint']}")
    cuda_skipped = (info.get("backends_skipped") or {}).get("libggml-cuda.so")
    if info.get("cuda_build") and cuda_skipped and info.get("nvidia_device_node"):
        problems.append(f"this machine has an NVIDIA GPU, but the CUDA backend did not load: {cuda_skipped}")
    if info.get("backends_error"):
        problems.append(f"ggml's backends could not be loaded: {info['backends_error']}")
    elif info.get("backends_registered") == []:
        reasons = "; ".join(f"{m}: {why}" for m, why in (info.get("backends_skipped") or {}).items())
        problems.append(f"no ggml backend registered ({reasons or 'no backend module in llama_cpp/lib'})")
    archs = info.get("wheel_architectures") or info.get("compiled_architectures") or []
    problems += architecture_problems(info.get("cuda_devices") or [], archs)
    return problems


def _import_hint(error: str, info: dict[str, Any]) -> str:
    if "libcuda.so" in error:
        return " (no NVIDIA driver on this machine: a CUDA build needs a GPU machine, use the CPU wheel elsewhere)"
    if info.get("cuda_libraries_missing") and re.search(r"libcu(dart|blas)", error):
        return f" ({info['cuda_install_hint']})"
    return ""


def status_line(info: dict[str, Any]) -> str:
    head = f"llama-cpp-python {info.get('llama_cpp_version') or info.get('installed_version')} ({_build_label(info)})"
    if info.get("installed_version") is None and info.get("package_dir") is None:
        return "llama-cpp-python is not installed: pip install -r requirements.txt"
    if "import_error" in info or "probe_error" in info:
        error = info.get("import_error") or info.get("probe_error")
        return f"{head}: import failed: {error}{_import_hint(error, info)}"
    parts = [_gpu_phrase(info), _dflash_phrase(info.get("dflash_missing_symbols")), _manifest_phrase(info["manifest"])]
    if info.get("backends_registered") is not None:
        kind = "loadable" if info.get("loadable_backends") else "linked"
        parts.insert(1, f"backends ({kind}): {', '.join(info['backends_registered']) or 'none'}")
    parts += info.get("problems") or []
    return f"{head}: " + "; ".join(parts)


def is_healthy(info: dict[str, Any]) -> bool:
    return (
        "import_error" not in info
        and "probe_error" not in info
        and info.get("dflash_missing_symbols") == []
        and info["manifest"]["matches"] is not False
        and not info.get("problems")
    )


def run_startup_check(
    in_child: bool = True, roots: list[Path] | None = None, manifest_dirs: list[Path] | None = None
) -> tuple[str, dict[str, Any]]:
    """One status line and an info dict about the native build.

    Also preloads the CUDA runtime libraries into this process (dlopen only: no CUDA call), so a later
    `import llama_cpp` here resolves them. With in_child=False the probe runs here and initialises CUDA.
    """
    roots = roots if roots is not None else default_search_roots()
    info = static_facts(roots, manifest_dirs if manifest_dirs is not None else default_manifest_dirs())
    info["preloaded_here"], info["preload_errors_here"] = preload_cuda_libraries(find_cuda_libraries(roots))
    info.update(probe_in_child() if in_child else probe(roots))
    info["problems"] = problems_of(info)
    info["ok"] = is_healthy(info)
    return status_line(info), info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check the installed llama-cpp-python build for DFlash.")
    parser.add_argument("--json", action="store_true", help="print the details as JSON after the status line")
    parser.add_argument("--in-process", action="store_true", help="probe in this process (initialises CUDA)")
    args = parser.parse_args(argv)
    line, info = run_startup_check(in_child=not args.in_process)
    print(line)
    if args.json:
        print(json.dumps(info, indent=2))
    return 0 if info["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
