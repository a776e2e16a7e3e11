#!/usr/bin/env python3
"""Build a llama-cpp-python 0.3.36 wheel (CUDA for chosen GPU architectures, or CPU) from the PyPI sdist.

The wheel and a manifest JSON (versions, llama.cpp commit, CUDA version, architectures, flags, sha256s) land in
the output directory. A rebuild whose configuration matches an existing wheel + manifest there is skipped.
Standard library only, so it runs before anything else is installed. See prebuilt_wheels/README.md.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The sdist carries the submodule's git metadata; its CHANGELOG names the short commit as a fallback.
COMMIT_MEMBER = f"llama_cpp_python-{VERSION}/.git/modules/vendor/llama.cpp/HEAD"
CHANGELOG_MEMBER = f"llama_cpp_python-{VERSION}/CHANGELOG.md"
PKG_INFO_MEMBER = f"llama_cpp_python-{VERSION}/PKG-INFO"

DEFAULT_ARCHS = ("120a-real",)
# Upstream's default K-V type pairs for the FlashAttention vector kernels (commas: CMake turns them into a list).
DEFAULT_FA_QUANTS = "q4_0-q4_0,q8_0-q8_0,f16-f16,bf16-bf16"
MIN_CUDA_FOR_BLACKWELL = (12, 8)
# llama_cpp/lib/ -> site-packages/nvidia/cu13/lib (nvidia-cuda-runtime, nvidia-cublas). `\$` survives Ninja's shell.
CUDA_PIP_RPATH = r"\$ORIGIN/../../nvidia/cu{major}/lib"
CUDA_RUNTIME_PACKAGES = ("nvidia-cuda-runtime", "nvidia-cublas")
CUDA_LIBRARY_PREFIXES = ("libcudart", "libcublas", "libcublasLt", "libcuda.")
# The DFlash functions of llama.cpp's src/llama-ext.h that the runtime binds (exported with C++ linkage).
DFLASH_FUNCTIONS = (
    "llama_set_embeddings_layer_inp",
    "llama_get_embeddings_layer_inp",
    "llama_model_dflash_selector_top_k",
    "llama_model_target_layer_ids",
    "llama_model_target_layer_ids_n",
)
MANIFEST_NAME = "manifest.json"
SLIM_DROP_TREES = ("lib/", "include/", "bin/")
FULL_VERSION_SO = re.compile(r"\.so\.\d+\.\d+\.\d+$")
MANIFEST_SCHEMA = 4  # 2: loadable_backends, backend_modules; 3: source_patch; 4: rpc_server
# The one change to llama-cpp-python's Python sources: llama_cpp loads its own backend modules (see
# llama_cpp_patch/_backend_modules.py) through a hook right after llama_cpp.py makes its binding decorator.
PATCH_MODULE = "llama_cpp/_backend_modules.py"
PATCH_TARGET = "llama_cpp/llama_cpp.py"
PATCH_ANCHOR = "ctypes_function = ctypes_function_for_shared_library(_lib)\n"
PATCH_HOOK = (
    "# dflash-space wheel: the bindings that need ggml's backends load the modules in _base_path first\n"
    "from llama_cpp._backend_modules import loading_backends_first as _loading_backends_first  # noqa: E402\n"
    "\n"
    "ctypes_function = _loading_backends_first(ctypes_function, _lib, _base_path)\n"
)

# x86-64-v3, spelled out: ggml enables these by default only when GGML_NATIVE's own default is on, which
# SOURCE_DATE_EPOCH or cross-compiling turns off (then the CPU code silently falls back to SSE2).
X86_ISA_ARGS = (
    "-DGGML_SSE42=ON",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
)
# The RPC backend and its server, built into every variant: remote machines' devices join a pair's device list
# (dflash_runtime.native.rpc). The backend module goes to a folder of its own: ggml loads every module it finds in
# llama_cpp/lib, and a registered RPC backend makes libllama report GPU offload on any machine, so a process opts in
# by loading it (llama_cpp/lib/rpc/). llama-cpp-python builds none of llama.cpp's tools: its CMakeLists gets the
# server's one target, installed beside the libraries (RUNPATH $ORIGIN).
RPC_SERVER = "ggml-rpc-server"
RPC_SERVER_MEMBER = f"llama_cpp/lib/{RPC_SERVER}"
RPC_MODULE_MEMBER = "llama_cpp/lib/rpc/libggml-rpc.so"
RPC_CMAKE_TARGET = "CMakeLists.txt"
RPC_CMAKE_ANCHOR = "    llama_cpp_python_install_target(ggml-rpc)\n"
RPC_CMAKE_HOOK = (
    "    # dflash-space wheel: the RPC backend in llama_cpp/lib/rpc (loaded on request only), its server in lib\n"
    "    if (TARGET ggml-rpc)\n"
    '        set_target_properties(ggml-rpc PROPERTIES INSTALL_RPATH "$ORIGIN/.." BUILD_WITH_INSTALL_RPATH TRUE)\n'
    "        install(TARGETS ggml-rpc LIBRARY DESTINATION ${SKBUILD_PLATLIB_DIR}/llama_cpp/lib/rpc)\n"
    "    endif()\n"
    f"    if (GGML_RPC AND NOT TARGET {RPC_SERVER})\n"
    "        add_subdirectory(vendor/llama.cpp/tools/rpc)\n"
    "    endif()\n"
    f"    llama_cpp_python_install_target({RPC_SERVER})\n"
)
# The CPU kernels' one change: upstream's llamafile sgemm declines one-row products on x86 (they go to ggml's own dot
# products, which sum in another order), so a row decoded alone differs from the same row in a batch. Taking every
# row count (as upstream already does on POWER) gives one order whatever the batch; the CPU backend then lists the
# feature SGEMM_ALL_ROWS, which dflash_runtime.pair reads (batch_invariant). CPU variant only. (file, old, new)
_LLAMAFILE_FEATURE = '            features.push_back({ "LLAMAFILE", "1" });\n'
KERNEL_PATCH = (
    ("vendor/llama.cpp/ggml/src/ggml-cpu/llamafile/sgemm.cpp",
     "    // only enable sgemm for prompt processing\n"
     "#if !defined(__MMA__)\n    if (n < 2)\n        return false;\n#endif\n",
     "    // dflash-space wheel: sgemm for every row count, one summation order whatever the batch\n"),
    ("vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.cpp",
     _LLAMAFILE_FEATURE,
     _LLAMAFILE_FEATURE + '            features.push_back({ "SGEMM_ALL_ROWS", "1" });\n'),
)
HERE = Path(__file__).resolve().parent
PATCH_MODULE_SOURCE = HERE / "llama_cpp_patch" / "_backend_modules.py"
ARCH_PATTERN = re.compile(r"^\d{2,3}[af]?(-real|-virtual)?$")


class RecipeError(RuntimeError):
    """A build precondition failed; the message says what to do."""


@dataclass(frozen=True)
class CudaToolchain:
    nvcc: str
    version: str  # e.g. "13.0.88"
    version_text: str  # first line of `nvcc --version` naming the release


@dataclass(frozen=True)
class CudaShim:
    """cuBLAS and a driver stub for CMake when the toolkit lacks them (an nvcc-only install).

    It lives inside the CMake build tree: CMake would otherwise copy its directory into the libraries' RUNPATH.
    """

    cublas_include: Path | None = None
    cublas_lib_dir: Path | None = None
    needs_driver_stub: bool = False
    root: Path | None = None  # set once the build directory is known

    def describe(self) -> dict[str, object]:
        return {"cublas_from": str(self.cublas_lib_dir) if self.cublas_lib_dir else None,
                "driver_stub": self.needs_driver_stub}  # fmt: skip

    def cmake_args(self) -> list[str]:
        root = self.root or Path("<build>/cmake/cuda-shim")
        args: list[str] = []
        if self.cublas_include is not None:
            args.append(f"-DCMAKE_CUDA_FLAGS=-I{root / 'include'}")
        if self.cublas_lib_dir is not None:
            args.append(f"-DCUDA_cublas_LIBRARY={root / 'lib' / 'libcublas.so'}")
            args.append(f"-DCUDA_cublasLt_LIBRARY={root / 'lib' / 'libcublasLt.so'}")
        if self.needs_driver_stub:
            args.append(f"-DCUDA_cuda_driver_LIBRARY={root / 'lib' / 'libcuda.so'}")
        return args


def cpu_isa_args(machine: str | None = None) -> list[str]:
    return list(X86_ISA_ARGS) if (machine or platform.machine()).lower() in ("x86_64", "amd64") else []


@dataclass
class BuildConfig:
    variant: str  # "cuda" or "cpu"
    archs: list[str]
    fa_quants: str
    extra_cmake_args: list[str]
    slim: bool = True
    cuda: CudaToolchain | None = None
    shim: CudaShim | None = None

    def cmake_args(self, with_shim: bool = True) -> list[str]:
        common = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=OFF",
            *cpu_isa_args(),
            "-DGGML_BACKEND_DL=ON",  # each backend a module under llama_cpp/lib, loaded at run time
            "-DGGML_RPC=ON",  # remote devices over TCP (libggml-rpc.so) and ggml-rpc-server: RPC_CMAKE_HOOK
            "-DLLAVA_BUILD=OFF",
        ]
        if self.variant == "cpu":
            # llamafile's sgemm, patched to take every row count (see SGEMM_PATCH): one summation order for any
            # batch, so a row's numbers do not depend on it and answers are exact across requests, at sgemm's speed
            # (dflash_runtime.pair: batch_invariant; docs/numerics.md).
            return [*common, "-DGGML_CUDA=OFF", "-DGGML_LLAMAFILE=ON", *self.extra_cmake_args]
        major = self.cuda.version.split(".")[0] if self.cuda else "13"
        cuda = [
            "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(self.archs)}",
            "-DGGML_CUDA_FA=ON",
            f"-DGGML_CUDA_FA_QUANTS={self.fa_quants}",
            "-DGGML_CUDA_NCCL=OFF",  # single-GPU Spaces; avoids a hidden runtime dependency on libnccl
            # Backend modules are MODULE libraries: CMake links them with the module flags, not the shared ones.
            f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath,{CUDA_PIP_RPATH.format(major=major)}",
            f"-DCMAKE_MODULE_LINKER_FLAGS=-Wl,-rpath,{CUDA_PIP_RPATH.format(major=major)}",
        ]
        if self.cuda:
            cuda.append(f"-DCMAKE_CUDA_COMPILER={self.cuda.nvcc}")
        shim_args = self.shim.cmake_args() if self.shim and with_shim else []
        return common + cuda + shim_args + self.extra_cmake_args

    def key_material(self) -> dict[str, object]:
        return {
            "package": PACKAGE,
            "version": VERSION,
            "sdist_sha256": SDIST_SHA256,
            "variant": self.variant,
            "cmake_args": self.cmake_args(with_shim=False),  # shim paths depend on the build directory
            "cuda_shim": self.shim.describe() if self.shim else None,
            "cuda_version": self.cuda.version if self.cuda else None,
            "machine": platform.machine(),
            "slim": self.slim,
            "manifest_schema": MANIFEST_SCHEMA,  # a manifest with new fields needs a new build in the cache
            "source_patch": source_patch_digest(),
            "kernel_patch": hashlib.sha256(json.dumps(KERNEL_PATCH).encode()).hexdigest() if self.variant == "cpu"
            else None,
        }

    def key(self) -> str:
        """Identifies the wheel: a wheel + manifest with this key is not built again."""
        material = json.dumps(self.key_material(), sort_keys=True).encode()
        return hashlib.sha256(material).hexdigest()

    def compile_key(self) -> str:
        """Identifies the compiled tree (packaging options such as slim do not change it)."""
        material = {k: v for k, v in self.key_material().items() if k not in ("slim", "manifest_schema")}
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@dataclass
class BuildPlan:
    config: BuildConfig
    sdist: Path
    sdist_cached: bool
    out_dir: Path
    build_dir: Path
    jobs: int
    python: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def source_dir(self) -> Path:
        """The unpacked sdist: a fixed path per configuration, so an interrupted build resumes where it stopped."""
        return self.build_dir / "src" / SDIST_NAME.removesuffix(".tar.gz")

    @property
    def wheel_dir(self) -> Path:
        return self.build_dir / "wheel"

    def pip_command(self) -> list[str]:
        return [
            self.python, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-v",
            "-w", str(self.wheel_dir),
            "-C", f"build-dir={self.build_dir / 'cmake'}",
            "-C", "cmake.build-type=Release",
            str(self.source_dir),
        ]  # fmt: skip

    def download_command(self) -> list[str]:
        return [
            self.python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            "-d", str(self.sdist.parent), f"{PACKAGE}=={VERSION}",
        ]  # fmt: skip


# ---------------------------------------------------------------- inputs


def parse_archs(values: list[str] | None) -> list[str]:
    """`--arch 120a-real --arch 90-real` or `--arch 120a-real,90-real;89-real` -> ['120a-real', '90-real', ...]."""
    raw = values or list(DEFAULT_ARCHS)
    archs = [a for v in raw for a in re.split(r"[,;\s]+", v.strip()) if a]
    bad = [a for a in archs if not ARCH_PATTERN.match(a)]
    if bad:
        raise RecipeError(f"not a CUDA architecture: {', '.join(bad)} (expected e.g. 120a-real, 90-real, 86)")
    return list(dict.fromkeys(archs))


def find_nvcc(explicit: str | None) -> str | None:
    """--nvcc when given (and nothing else), else $CUDACXX, $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, PATH."""
    if explicit:
        return str(Path(explicit).resolve()) if Path(explicit).is_file() else None
    candidates = [os.environ.get("CUDACXX")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    candidates.append(shutil.which("nvcc"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return str(Path(candidate).resolve())
    return None


def cuda_toolchain(nvcc: str) -> CudaToolchain:
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+\.\d+), V(\d+\.\d+\.\d+)", text)
    if not match:
        raise RecipeError(f"cannot read the CUDA version from `{nvcc} --version`:\n{text}")
    line = next(ln for ln in text.splitlines() if "release" in ln)
    return CudaToolchain(nvcc=nvcc, version=match.group(2), version_text=line.strip())


def require_blackwell_capable(cuda: CudaToolchain, archs: list[str]) -> None:
    major, minor = (int(x) for x in cuda.version.split(".")[:2])
    if any(a.startswith("12") for a in archs) and (major, minor) < MIN_CUDA_FOR_BLACKWELL:
        raise RecipeError(f"CUDA {cuda.version} cannot build sm_12x code: install CUDA >= 12.8 (13.x recommended)")


def _toolkit_has(root: Path, relative_names: list[str]) -> bool:
    return any((root / name).exists() for name in relative_names)


def _pip_cuda_root(major: str) -> Path | None:
    """nvidia/cu<major> of a pip-installed nvidia-cublas seen by this interpreter."""
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia" / f"cu{major}"
        if (root / "include" / "cublas_v2.h").is_file() and (root / "lib" / f"libcublas.so.{major}").is_file():
            return root
    return None


def _driver_library(toolkit: Path) -> Path | None:
    for candidate in ("lib64/stubs/libcuda.so", "targets/x86_64-linux/lib/stubs/libcuda.so", "lib/stubs/libcuda.so"):
        if (toolkit / candidate).is_file():
            return toolkit / candidate
    return None


def plan_cuda_shim(cuda: CudaToolchain) -> CudaShim | None:
    """What CMake needs besides nvcc: cuBLAS (toolkit or pip nvidia-cublas) and a libcuda to link against."""
    toolkit = Path(cuda.nvcc).parent.parent
    major, minor = cuda.version.split(".")[:2]
    has_cublas = _toolkit_has(toolkit, ["include/cublas_v2.h", "targets/x86_64-linux/include/cublas_v2.h"])
    has_driver = _driver_library(toolkit) is not None
    if has_cublas and has_driver:
        return None
    if has_cublas:
        return CudaShim(needs_driver_stub=True)
    pip_root = _pip_cuda_root(major)
    if pip_root is None:
        raise RecipeError(
            f"the CUDA toolkit at {toolkit} has no cuBLAS: install the full toolkit, or "
            f"`{sys.executable} -m pip install 'nvidia-cublas=={major}.{minor}.*'` to build against that package"
        )
    return CudaShim(pip_root / "include", pip_root / "lib", needs_driver_stub=not has_driver)


def driver_stub_source(cuda_h: Path, compiler: str) -> str:
    """C source defining every driver API function that cuda.h declares (after its versioning macros), as the
    toolkit's own stubs/libcuda.so does: linking against it records libcuda.so.1 as needed; the real driver
    provides the functions at run time. (An empty stub would be dropped by --as-needed, leaving cu* unresolved.)"""
    expanded = subprocess.run(
        [compiler, "-E", "-P", "-x", "c", f"-I{cuda_h.parent}", str(cuda_h)], capture_output=True, text=True, check=True
    ).stdout
    names = sorted(set(re.findall(r"\bCUresult\s+(cu\w+)\s*\(", expanded)))
    if not names:
        raise RecipeError(f"no driver API declarations found in {cuda_h}")
    return "".join(f"void {name}(void) {{}}\n" for name in names)


def materialize_shim(shim: CudaShim, cuda: CudaToolchain) -> None:
    """Symlink cuBLAS into the shim and, when the toolkit has no stubs/libcuda.so, build one (SONAME libcuda.so.1)."""
    major = cuda.version.split(".")[0]
    include, lib = shim.root / "include", shim.root / "lib"
    include.mkdir(parents=True, exist_ok=True)
    lib.mkdir(parents=True, exist_ok=True)
    if shim.cublas_include is not None and shim.cublas_lib_dir is not None:
        for header in shim.cublas_include.glob("cublas*.h"):
            _relink(include / header.name, header)
        for name in ("libcublas", "libcublasLt"):
            _relink(lib / f"{name}.so", shim.cublas_lib_dir / f"{name}.so.{major}")
    if shim.needs_driver_stub and not (lib / "libcuda.so").exists():
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RecipeError("no C compiler to make the libcuda link stub (install gcc)")
        toolkit = Path(cuda.nvcc).parent.parent
        cuda_h = next((p for p in (toolkit / "include" / "cuda.h", toolkit / "targets/x86_64-linux/include/cuda.h")
                       if p.is_file()), None)  # fmt: skip
        if cuda_h is None:
            raise RecipeError(f"no cuda.h under {toolkit} to make the libcuda link stub from")
        stub_cmd = [compiler, "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(lib / "libcuda.so"), "-x", "c", "-"]
        subprocess.run(stub_cmd, input=driver_stub_source(cuda_h, compiler), text=True, check=True)


def _relink(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


# ---------------------------------------------------------------- sdist


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(plan: BuildPlan) -> None:
    if not plan.sdist.is_file():
        plan.sdist.parent.mkdir(parents=True, exist_ok=True)
        print("+", shlex.join(plan.download_command()), flush=True)
        subprocess.run(plan.download_command(), check=True)
    actual = file_sha256(plan.sdist)
    if actual != SDIST_SHA256:
        raise RecipeError(f"{plan.sdist}: sha256 {actual} is not the pinned {SDIST_SHA256} of {PACKAGE} {VERSION}")


def read_llama_cpp_commit(sdist: Path) -> tuple[str, str]:
    """The vendored llama.cpp commit and where it was read (the sdist ships no vendor/llama.cpp/.git directory)."""
    with tarfile.open(sdist) as archive:
        found: dict[str, str] = {}
        for member in archive:
            if member.name in (COMMIT_MEMBER, CHANGELOG_MEMBER) and member.isfile():
                found[member.name] = archive.extractfile(member).read().decode("utf-8", "replace")
            if len(found) == 2:
                break
    head = found.get(COMMIT_MEMBER, "").strip()
    if re.fullmatch(r"[0-9a-f]{40}", head):
        return head, f"sdist {COMMIT_MEMBER.split('/', 1)[1]}"
    match = re.search(r"ggml-org/llama\.cpp@([0-9a-f]{7,40})", found.get(CHANGELOG_MEMBER, ""))
    if match:
        return match.group(1), f"sdist CHANGELOG.md entry of {VERSION}"
    return "unknown", "not found in the sdist"


def unpack_sdist(sdist: Path, source_dir: Path) -> None:
    """Unpack once per configuration; the CMake install step also writes into llama_cpp/lib there, so clear it."""
    marker = source_dir / ".sdist-sha256"
    if not (marker.is_file() and marker.read_text().strip() == SDIST_SHA256):
        shutil.rmtree(source_dir, ignore_errors=True)
        with tarfile.open(sdist) as archive:
            if hasattr(tarfile, "tar_filter"):  # Python >= 3.10.12 checks member paths
                archive.extractall(source_dir.parent, filter="tar")
            else:
                archive.extractall(source_dir.parent)
        marker.write_text(SDIST_SHA256 + "\n")
    shutil.rmtree(source_dir / "llama_cpp" / "lib", ignore_errors=True)


def patch_cpu_kernels(source_dir: Path) -> None:
    """Apply KERNEL_PATCH to the unpacked sources (applying it twice, as a resumed build does, changes nothing)."""
    for name, old, new in KERNEL_PATCH:
        target = source_dir / name
        text = target.read_text()
        if new not in text:
            if text.count(old) != 1:
                raise RecipeError(f"{target} has not exactly one {old.strip()!r}: the kernel patch cannot apply")
            target.write_text(text.replace(old, new))


def source_patch_digest() -> str:
    """sha256 of what the source patch adds (the module, the anchor, the hook): part of the configuration key, so
    a cached wheel built without this patch, or with another version of it, is rebuilt."""
    material = PATCH_MODULE_SOURCE.read_bytes() + PATCH_ANCHOR.encode() + PATCH_HOOK.encode()
    material += (RPC_CMAKE_ANCHOR + RPC_CMAKE_HOOK).encode()
    return hashlib.sha256(material).hexdigest()


def patch_sources(source_dir: Path) -> None:
    """Add the backend-module loader to the unpacked llama_cpp package (every variant; applying it twice, as a
    resumed build does, changes nothing)."""
    target = source_dir / PATCH_TARGET
    text = target.read_text()
    if PATCH_ANCHOR + PATCH_HOOK not in text:
        if text.count(PATCH_ANCHOR) != 1:
            raise RecipeError(f"{target} has not exactly one line `{PATCH_ANCHOR.strip()}`: the patch cannot apply")
        target.write_text(text.replace(PATCH_ANCHOR, PATCH_ANCHOR + PATCH_HOOK))
    shutil.copyfile(PATCH_MODULE_SOURCE, source_dir / PATCH_MODULE)


def patch_rpc_server(source_dir: Path) -> None:
    """Install the RPC backend in its own folder and build ggml-rpc-server beside the libraries (in place of
    llama-cpp-python's install line for the backend; idempotent like the loader patch)."""
    target = source_dir / RPC_CMAKE_TARGET
    text = target.read_text()
    if RPC_CMAKE_HOOK in text:
        return
    if text.count(RPC_CMAKE_ANCHOR) != 1:
        raise RecipeError(f"{target} has not exactly one line `{RPC_CMAKE_ANCHOR.strip()}`: the patch cannot apply")
    target.write_text(text.replace(RPC_CMAKE_ANCHOR, RPC_CMAKE_HOOK))


def wheel_rpc_server(wheel: Path) -> dict[str, object]:
    """The RPC server as the wheel carries it (path, sha256, whether its stored mode is executable). Raises when
    the wheel has none."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        missing = [name for name in (RPC_SERVER_MEMBER, RPC_MODULE_MEMBER) if name not in names]
        if missing:
            raise RecipeError(f"{wheel.name} lacks {', '.join(missing)}: no manifest written")
        info = archive.getinfo(RPC_SERVER_MEMBER)
        data = archive.read(info)
    return {"path": RPC_SERVER_MEMBER, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
            "executable": bool((info.external_attr >> 16) & 0o111), "backend_module": RPC_MODULE_MEMBER}  # fmt: skip


def wheel_source_patch(wheel: Path) -> dict[str, object]:
    """The patch as the wheel carries it: its digest and the sha256 of the two files. Raises when it is missing."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        missing = [name for name in (PATCH_MODULE, PATCH_TARGET) if name not in names]
        if missing:
            raise RecipeError(f"{wheel.name} lacks {', '.join(missing)}: the source patch is not in it")
        files = {name: archive.read(name) for name in (PATCH_MODULE, PATCH_TARGET)}
    if PATCH_HOOK.encode() not in files[PATCH_TARGET] or files[PATCH_MODULE] != PATCH_MODULE_SOURCE.read_bytes():
        raise RecipeError(f"{wheel.name}: {PATCH_TARGET} or {PATCH_MODULE} is not what the source patch writes")
    return {"digest": source_patch_digest(), "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}


def source_date_epoch(sdist: Path) -> str:
    """The sdist's own PKG-INFO date: libraries and metadata in the wheel get it instead of the build time."""
    with tarfile.open(sdist) as archive:
        return str(int(archive.getmember(PKG_INFO_MEMBER).mtime))


# ---------------------------------------------------------------- wheel inspection


def native_library_hashes(wheel: Path) -> dict[str, str]:
    """sha256 of each shared library under llama_cpp/lib/ in the wheel (what startup compares after install)."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: hashlib.sha256(archive.read(name)).hexdigest()
            for name in sorted(archive.namelist())
            if name.startswith("llama_cpp/lib/") and ".so" in name
        }


def backend_modules(native_libraries: Iterable[str]) -> list[str]:
    """Backend modules among the wheel's libraries: libggml-<backend>.so, which with GGML_BACKEND_DL are loaded at
    run time from llama_cpp/lib itself (a module has no versioned name; libggml-base is a plain library; the RPC
    module in lib/rpc loads on request only)."""
    names = [Path(n).name for n in native_libraries if Path(n).parent.name == "lib"]
    return sorted(
        n for n in names
        if n.startswith("libggml-") and n.endswith(".so") and not n.startswith("libggml-base")
    )  # fmt: skip


def wheel_tags(wheel: Path) -> dict[str, str]:
    parts = wheel.name[: -len(".whl")].split("-")
    return {"python_tag": parts[-3], "abi_tag": parts[-2], "platform_tag": parts[-1]}


def bundled_cuda_libraries(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return [n for n in archive.namelist() if Path(n).name.startswith(CUDA_LIBRARY_PREFIXES)]


def dynamic_symbols(wheel: Path, member: str = "llama_cpp/lib/libllama.so") -> list[str] | None:
    """Defined dynamic symbols of a library in the wheel (None without binutils' nm or for a non-ELF file)."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as tmp:
        lib = Path(archive.extract(member, tmp))
        out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


def dflash_symbols(symbols: list[str]) -> dict[str, str | None]:
    """Each DFlash function -> its exported symbol (plain C name or Itanium-mangled C++ name), None when absent."""
    found: dict[str, str | None] = {}
    for name in DFLASH_FUNCTIONS:
        mangled = f"_Z{len(name)}{name}"
        found[name] = next((s for s in symbols if s == name or s.startswith(mangled)), None)
    return found


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim_dropped(name: str) -> bool:
    """Copies nobody loads: CMake's own install tree (lib/, include/, bin/ at the wheel root: C headers, CMake and
    pkg-config files, a second set of the libraries) and the fully versioned names in llama_cpp/lib/, which are
    neither what llama_cpp opens (libX.so) nor what the loader resolves (the SONAME libX.so.0)."""
    return name.startswith(SLIM_DROP_TREES) or (
        name.startswith("llama_cpp/lib/") and bool(FULL_VERSION_SO.search(name))
    )


def slim_wheel(wheel: Path) -> list[str]:
    """Rewrite the wheel in place without the unused copies (a wheel stores each symlinked name as a full file)."""
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        infos = src.infolist()
        record = next(i for i in infos if i.filename.endswith(".dist-info/RECORD"))
        dropped = [i.filename for i in infos if slim_dropped(i.filename)]
        lines = []
        for info in infos:
            if info is record or info.filename in dropped:
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            lines.append(f"{info.filename},{record_hash(data)},{len(data)}")
        lines.append(f"{record.filename},,")
        dst.writestr(record, "\n".join(lines) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(wheel)
    return dropped


# ---------------------------------------------------------------- manifest


def build_manifest(plan: BuildPlan, wheel: Path, commit: tuple[str, str]) -> dict[str, object]:
    config = plan.config
    symbols = dynamic_symbols(wheel)
    libraries = native_library_hashes(wheel)
    loadable = "-DGGML_BACKEND_DL=ON" in config.cmake_args()
    return {
        "schema": MANIFEST_SCHEMA,
        "package": PACKAGE,
        "version": VERSION,
        "variant": config.variant,
        "config_key": config.key(),
        "llama_cpp_commit": commit[0],
        "llama_cpp_commit_source": commit[1],
        "sdist": {"filename": SDIST_NAME, "sha256": SDIST_SHA256},
        "cuda_version": config.cuda.version if config.cuda else None,
        "nvcc_version": config.cuda.version_text if config.cuda else None,
        "cuda_architectures": config.archs if config.variant == "cuda" else [],
        "cuda_runtime_packages": list(CUDA_RUNTIME_PACKAGES) if config.variant == "cuda" else [],
        **wheel_tags(wheel),
        "cmake_args": config.cmake_args(),
        "build_env": {k: v for k, v in plan.env.items() if k != "CMAKE_ARGS"},
        "wheel": {"filename": wheel.name, "sha256": file_sha256(wheel), "size": wheel.stat().st_size},
        "native_libraries": libraries,
        "loadable_backends": loadable,
        "backend_modules": backend_modules(libraries) if loadable else [],
        "bundled_cuda_libraries": bundled_cuda_libraries(wheel),
        "dflash_symbols": dflash_symbols(symbols) if symbols is not None else None,
        "built_on": {
            "machine": platform.machine(),
            "libc": "-".join(platform.libc_ver()),
            "python": sys.version.split()[0],
        },
        "built_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def write_manifest(out_dir: Path, manifest: dict[str, object]) -> Path:
    path = out_dir / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def load_manifest(out_dir: Path) -> dict[str, object] | None:
    try:
        return json.loads((out_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def existing_build(out_dir: Path, config_key: str) -> Path | None:
    """The wheel in out_dir when its manifest has this configuration and its sha256 still matches."""
    manifest = load_manifest(out_dir)
    if not manifest or manifest.get("config_key") != config_key:
        return None
    wheel_info = manifest.get("wheel") or {}
    wheel = out_dir / str(wheel_info.get("filename", ""))
    if wheel.is_file() and file_sha256(wheel) == wheel_info.get("sha256"):
        return wheel
    return None


# ---------------------------------------------------------------- plan and run


def host_prerequisites() -> tuple[list[str], list[str]]:
    """(missing, notes) about the host tools: a C/C++ compiler is needed; scikit-build-core fetches CMake and Ninja
    from PyPI when they are absent or too old, so those are notes."""
    missing = [f"no {what} ({' or '.join(names)}) on PATH: install gcc and g++"
               for what, names in (("C compiler", ("cc", "gcc")), ("C++ compiler", ("c++", "g++")))
               if not any(shutil.which(n) for n in names)]  # fmt: skip
    notes = [f"{tool} not on PATH: scikit-build-core will fetch it from PyPI" for tool in ("cmake", "ninja")
             if shutil.which(tool) is None]  # fmt: skip
    return missing, notes


def plan_cuda(config: BuildConfig, nvcc_arg: str | None, missing: list[str] | None) -> None:
    """Find nvcc and what CMake needs besides it. Each failure raises, or with `missing` (a dry run) is recorded
    there and the plan goes on with what is known."""

    def record(error: RecipeError) -> None:
        if missing is None:
            raise error
        missing.append(str(error))

    nvcc = find_nvcc(nvcc_arg)
    if nvcc is None:
        where = f"at {nvcc_arg}" if nvcc_arg else "(--nvcc, $CUDACXX, $CUDA_HOME, /usr/local/cuda, PATH)"
        record(RecipeError(f"no nvcc found {where}: install CUDA >= 12.8 (13.x recommended)"))
        return
    config.cuda = cuda_toolchain(nvcc)
    try:
        require_blackwell_capable(config.cuda, config.archs)
    except RecipeError as error:
        record(error)
    try:
        config.shim = plan_cuda_shim(config.cuda)
    except RecipeError as error:
        record(error)


def make_plan(args: argparse.Namespace, missing: list[str] | None = None) -> BuildPlan:
    """The build plan. Missing prerequisites raise RecipeError, or are appended to `missing` when it is given."""
    variant = "cpu" if args.cpu else "cuda"
    archs = parse_archs(args.arch) if variant == "cuda" else []
    build_root = Path(args.build_root).resolve()
    config = BuildConfig(variant, archs, args.fa_quants, list(args.cmake_arg or []), slim=not args.no_slim)
    if variant == "cuda":
        plan_cuda(config, args.nvcc, missing)
    sdist = Path(args.sdist).resolve() if args.sdist else build_root / "sdist" / SDIST_NAME
    out_dir = Path(args.out_dir or HERE / "dist" / variant).resolve()
    build_dir = build_root / f"{variant}-{config.compile_key()[:12]}"
    if config.shim:
        config.shim = dataclasses.replace(config.shim, root=build_dir / "cmake" / "cuda-shim")
    plan = BuildPlan(config, sdist, sdist.is_file(), out_dir, build_dir, args.jobs, args.python)
    plan.env = {
        "CMAKE_ARGS": shlex.join(config.cmake_args()),
        "CMAKE_BUILD_PARALLEL_LEVEL": str(args.jobs),
        "CMAKE_GENERATOR": "Ninja",
    }
    return plan


def render_invocation(plan: BuildPlan) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    lines = []
    if not plan.sdist_cached:
        lines.append(shlex.join(plan.download_command()))
    lines.append(f"tar xzf {shlex.quote(str(plan.sdist))} -C {shlex.quote(str(plan.source_dir.parent))}")
    lines.append(f"# source patch {source_patch_digest()[:12]}: copy {PATCH_MODULE_SOURCE.relative_to(HERE.parent)} "
                 f"to {PATCH_MODULE}, add its hook to {PATCH_TARGET}")  # fmt: skip
    lines.append(f"# in {RPC_CMAKE_TARGET}: ggml-rpc installed in llama_cpp/lib/rpc, {RPC_SERVER} built into lib")
    epoch = source_date_epoch(plan.sdist) if plan.sdist_cached else "<mtime of the sdist's PKG-INFO>"
    lines.append(f"env {env} SOURCE_DATE_EPOCH={epoch} \\\n  {shlex.join(plan.pip_command())}")
    return "\n".join(lines)


def describe(plan: BuildPlan) -> str:
    config = plan.config
    parts = [f"variant: {config.variant}", f"config key: {config.key()}", f"output: {plan.out_dir}"]
    if config.cuda:
        parts.append(f"CUDA {config.cuda.version} ({config.cuda.nvcc}), architectures: {';'.join(config.archs)}")
    elif config.variant == "cuda":
        parts.append(f"CUDA: not found, architectures: {';'.join(config.archs)}")
    if config.shim:
        parts.append(
            f"CUDA shim for CMake: {config.shim.root} (cuBLAS from {config.shim.cublas_lib_dir or 'toolkit'}"
            f"{', generated libcuda link stub' if config.shim.needs_driver_stub else ''})"
        )
    return "\n".join(parts)


def expected_modules(config: BuildConfig) -> list[str]:
    """The CPU module always (the fallback where no GPU backend loads), and the CUDA one for the CUDA variant."""
    return ["libggml-cpu.so", "libggml-cuda.so"] if config.variant == "cuda" else ["libggml-cpu.so"]


def run_build(plan: BuildPlan) -> Path:
    fetch_sdist(plan)
    commit = read_llama_cpp_commit(plan.sdist)
    if plan.config.shim:
        materialize_shim(plan.config.shim, plan.config.cuda)
    unpack_sdist(plan.sdist, plan.source_dir)
    patch_sources(plan.source_dir)
    patch_rpc_server(plan.source_dir)
    if plan.config.variant == "cpu":
        patch_cpu_kernels(plan.source_dir)
    plan.env["SOURCE_DATE_EPOCH"] = source_date_epoch(plan.sdist)
    shutil.rmtree(plan.wheel_dir, ignore_errors=True)
    command = plan.pip_command()
    print("+", " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items()), shlex.join(command), flush=True)
    subprocess.run(command, env={**os.environ, **plan.env}, check=True)
    built = next(plan.wheel_dir.glob("*.whl"))
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    for old in plan.out_dir.glob("llama_cpp_python-*.whl"):
        old.unlink()
    wheel = Path(shutil.move(str(built), plan.out_dir / built.name))
    dropped = slim_wheel(wheel) if plan.config.slim else []
    manifest = build_manifest(plan, wheel, commit)
    manifest["slim_dropped"] = dropped
    manifest["source_patch"] = wheel_source_patch(wheel)  # raises when the wheel lacks it: no manifest written
    manifest["rpc_server"] = wheel_rpc_server(wheel)
    missing = [name for name, symbol in (manifest["dflash_symbols"] or {}).items() if symbol is None]
    if missing:
        raise RecipeError(
            f"{wheel.name} does not export the DFlash functions {', '.join(missing)}: no manifest written"
        )
    absent = sorted(set(expected_modules(plan.config)) - set(manifest["backend_modules"]))
    if manifest["loadable_backends"] and absent:
        raise RecipeError(f"{wheel.name} lacks the backend modules {', '.join(absent)}: no manifest written")
    write_manifest(plan.out_dir, manifest)
    return wheel


def build_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu", action="store_true", help="CPU-only variant (CUDA off)")
    parser.add_argument(
        "--arch",
        action="append",
        help=f"CUDA architectures, repeatable or comma-separated (default {','.join(DEFAULT_ARCHS)})",
    )
    parser.add_argument(
        "--fa-quants",
        default=DEFAULT_FA_QUANTS,
        help="FlashAttention K-V type pairs to compile, or 'all' (default: upstream's set)",
    )
    parser.add_argument("--out-dir", help="wheel + manifest.json directory (default prebuilt_wheels/dist/<variant>)")
    parser.add_argument("--build-root", default=str(HERE / "build"), help="sdist cache and build trees")
    parser.add_argument("--sdist", help=f"a local {SDIST_NAME} (checked against the pinned sha256)")
    parser.add_argument("--nvcc", help="nvcc to use (default: $CUDACXX, $CUDA_HOME/bin/nvcc, /usr/local/cuda, PATH)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    parser.add_argument("--python", default=sys.executable, help="interpreter whose pip builds the wheel")
    parser.add_argument("--cmake-arg", action="append", help="extra -D option for CMake (repeatable)")
    parser.add_argument("--force", action="store_true", help="build even when a matching wheel exists")
    parser.add_argument("--no-slim", action="store_true", help="keep the wheel exactly as scikit-build-core wrote it")
    parser.add_argument(
        "--keep-build",
        action="store_true",
        help="keep the unpacked sources and CMake tree after a successful build (an interrupted "
        "build always keeps them, and the next run resumes)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=f"Build {PACKAGE}=={VERSION} wheels (CUDA or CPU) from the PyPI sdist, with a manifest.",
        epilog="Other GPUs: --arch 120a-real,90-real,89-real,86-real (Blackwell, Hopper, Ada, Ampere). "
        "`build_wheel.py publish --help`: build, upload to a Hub model repo and point requirements.txt at it.",
    )
    build_options(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and the build invocation, say which prerequisites are missing, build nothing "
        "(exit status 1 when one is missing)",
    )
    parser.add_argument(
        "--requirement-for",
        metavar="BASE_URL",
        help="print the requirements.txt line for the built wheel uploaded under BASE_URL, and exit",
    )
    return parser.parse_args(argv)


def parse_publish_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"{Path(sys.argv[0]).name} publish",
        description="Build the wheel (skipped when up to date), upload it with its manifest to a public Hub model "
        "repository in one commit, and rewrite requirements.txt to that commit's URL with the wheel's sha256 "
        "(plus the CUDA runtime packages for the CUDA variant).",
    )
    parser.add_argument("--repo", required=True, help="OWNER/NAME of the Hub model repository (created if needed)")
    parser.add_argument("--endpoint", help="Hub endpoint (default $HF_ENDPOINT, else https://huggingface.co)")
    parser.add_argument("--token", help="Hub token with write access (default $HF_TOKEN or the saved login)")
    parser.add_argument(
        "--requirements",
        default=str(HERE.parent / "requirements.txt"),
        help="the requirements file to rewrite (default: the repository's requirements.txt); the manifest is "
        "kept beside it under prebuilt_wheels/published/<variant>/",
    )
    parser.add_argument("--no-build", action="store_true", help="publish the wheel already in --out-dir")
    build_options(parser)
    return parser.parse_args(argv)


def requirement_line(out_dir: Path, base_url: str) -> str:
    """`llama-cpp-python @ URL#sha256=...`: pip checks the hash fragment of a direct URL."""
    manifest = load_manifest(out_dir)
    if not manifest:
        raise RecipeError(f"no {MANIFEST_NAME} in {out_dir}: build the wheel first")
    wheel = manifest["wheel"]
    return f"{PACKAGE} @ {base_url.rstrip('/')}/{wheel['filename']}#sha256={wheel['sha256']}"


def build(args: argparse.Namespace) -> BuildPlan:
    """Build the wheel unless one with this configuration is in the output directory already."""
    plan = make_plan(args)
    print(describe(plan))
    existing = None if args.force else existing_build(plan.out_dir, plan.config.key())
    if existing is not None:
        print(f"up to date: {existing} (same configuration, sha256 matches {MANIFEST_NAME}); skipping the build")
        return plan
    wheel = run_build(plan)
    if not args.keep_build:
        shutil.rmtree(plan.build_dir, ignore_errors=True)
    print(f"built {wheel} ({wheel.stat().st_size / 2**20:.1f} MiB); manifest {plan.out_dir / MANIFEST_NAME}")
    return plan


def dry_run(args: argparse.Namespace) -> int:
    missing: list[str] = []
    plan = make_plan(args, missing)
    host_missing, notes = host_prerequisites()
    missing += host_missing
    print(describe(plan))
    print(render_invocation(plan))
    for note in notes:
        print(f"note: {note}")
    for item in missing:
        print(f"missing: {item}")
    return 1 if missing else 0


def publish_command(argv: list[str]) -> int:
    args = parse_publish_args(argv)
    variant = "cpu" if args.cpu else "cuda"
    out_dir = Path(args.out_dir or HERE / "dist" / variant).resolve()
    if not args.no_build:
        out_dir = build(args).out_dir
    sys.modules.setdefault("build_wheel", sys.modules[__name__])  # one RecipeError when run as a script
    from publish_wheel import publish

    requirements = Path(args.requirements).resolve()
    published = publish(out_dir, variant, args.repo, requirements, endpoint=args.endpoint, token=args.token)
    print(f"uploaded {published.path_in_repo} to {published.repo} at commit {published.commit}")
    print(f"{requirements}: {published.requirement}")
    print("commit requirements.txt and prebuilt_wheels/published/ and push them to the Space")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["publish"]:
            return publish_command(argv[1:])
        args = parse_args(argv)
        if args.requirement_for:
            variant = "cpu" if args.cpu else "cuda"
            print(requirement_line(Path(args.out_dir or HERE / "dist" / variant), args.requirement_for))
            return 0
        if args.dry_run:
            return dry_run(args)
        build(args)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
