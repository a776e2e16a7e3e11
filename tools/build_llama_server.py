#!/usr/bin/env python3
"""Build llama.cpp's `llama-server` and the lookup tools the tests compare the engine with, from the wheel's own
sources: the pinned llama-cpp-python sdist (the copy the wheel recipe keeps, else downloaded and checked against
its sha256), with the wheel's CPU kernel patch and instruction set (prebuilt_wheels/build_wheel.py), so that both
sides compute the same graphs with the same kernels (see tools/compare_llama_server.py).

Only the targets the tests run are built — `llama-server`, `llama-lookup-create` (a static lookup cache from a text)
and `llama-lookup-merge` —, statically linked, into OUT (`OUT/llama-server`, ...), with `OUT/manifest.json`: the
configuration key (the sdist, the kernel patch, the CMake options, the targets, the compiler and the machine) and
each binary's sha256. A run whose key and binaries match the manifest builds nothing. The build tree is removed after
a successful build (an interrupted one is kept, and the next run resumes it).

    python tools/build_llama_server.py --out-dir OUT [--sdist-dir DIR] [--jobs N] [--dry-run]

Nothing is shared with the wheel's build: the wheel's tree is gone once the wheel is built, and it is compiled as
shared libraries with loadable backends (position-independent code, other link options), which a static server
cannot reuse; llama.cpp's CMake has no switch to build its tools against an installed libllama either.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "prebuilt_wheels"))
import build_wheel as recipe  # noqa: E402  (the wheel recipe: its sdist, kernel patch and CPU flags)

TARGETS = ("llama-server", "llama-lookup-create", "llama-lookup-merge")
MANIFEST = "manifest.json"
DEFAULT_SDIST_DIR = Path.home() / ".cache" / "dflash-space" / "wheels-dl" / "build" / "sdist"  # run.sh's cache


def cmake_args() -> list[str]:
    """The wheel's CPU variant's kernels (Release, llamafile's sgemm, x86-64-v3 spelled out), a static build of the
    server and the examples' tools, nothing else."""
    return [
        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", *recipe.cpu_isa_args(),
        "-DGGML_LLAMAFILE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
    ]  # fmt: skip


def compiler() -> str:
    """The C++ compiler CMake will take, by its version line (part of the key: another compiler, other code)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise recipe.RecipeError(f"no C++ compiler ({cxx}): {error}") from error
    return out.splitlines()[0].strip()


def key_material(cxx: str) -> dict[str, object]:
    return {
        "sdist_sha256": recipe.SDIST_SHA256,
        "kernel_patch": hashlib.sha256(json.dumps(recipe.KERNEL_PATCH).encode()).hexdigest(),
        "cmake_args": cmake_args(),
        "targets": list(TARGETS),
        "compiler": cxx,
        "machine": platform.machine(),
    }


def config_key(material: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def up_to_date(out_dir: Path, key: str) -> bool:
    """Whether OUT holds this configuration's binaries, as its manifest describes them."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    binaries = manifest.get("binaries", {})
    return manifest.get("key") == key and set(binaries) == set(TARGETS) and all(
        (out_dir / name).is_file() and recipe.file_sha256(out_dir / name) == digest
        for name, digest in binaries.items())


def tools() -> tuple[str, str]:
    found = shutil.which("cmake"), shutil.which("ninja")
    if not all(found):
        raise recipe.RecipeError("cmake and ninja are needed on PATH (`python -m pip install cmake ninja`)")
    return found[0] or "cmake", found[1] or "ninja"


def sdist(sdist_dir: Path) -> Path:
    """The pinned sdist, from the wheel recipe's cache or downloaded there, checked against its sha256."""
    path = sdist_dir / recipe.SDIST_NAME
    if not path.is_file():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(sdist_dir),
               f"{recipe.PACKAGE}=={recipe.VERSION}"]
        print("+", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    actual = recipe.file_sha256(path)
    if actual != recipe.SDIST_SHA256:
        raise recipe.RecipeError(f"{path}: sha256 {actual} is not the pinned {recipe.SDIST_SHA256}")
    return path


def build(out_dir: Path, sdist_dir: Path, jobs: int, material: dict[str, object]) -> float:
    """Configure and build the targets; the binaries and the manifest into `out_dir`. Returns the build's seconds."""
    cmake, ninja = tools()
    work = out_dir / "build"
    source = work / "src" / recipe.SDIST_NAME.removesuffix(".tar.gz")
    started = time.monotonic()
    recipe.unpack_sdist(sdist(sdist_dir), source)
    recipe.patch_cpu_kernels(source)
    tree = work / "cmake"
    configure = [cmake, "-S", str(source / "vendor" / "llama.cpp"), "-B", str(tree), "-G", "Ninja",
                 f"-DCMAKE_MAKE_PROGRAM={ninja}", *cmake_args()]
    compile_ = [cmake, "--build", str(tree), "--target", *TARGETS, "-j", str(jobs)]
    for cmd in (configure, compile_):
        print("+", shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    binaries = {}
    for name in TARGETS:
        built = tree / "bin" / name
        shutil.copy2(built, out_dir / name)
        binaries[name] = recipe.file_sha256(out_dir / name)
    seconds = time.monotonic() - started
    manifest = {"key": config_key(material), "material": material, "binaries": binaries, "jobs": jobs,
                "build_seconds": round(seconds, 1)}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="where the binaries and manifest.json go")
    parser.add_argument("--sdist-dir", type=Path, default=DEFAULT_SDIST_DIR,
                        help=f"where {recipe.SDIST_NAME} is, or is downloaded to (default: the wheel cache's)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    parser.add_argument("--dry-run", action="store_true", help="print the configuration and whether it is built")
    args = parser.parse_args(argv)
    out_dir = args.out_dir.resolve()
    try:
        material = key_material(compiler())
        key = config_key(material)
        current = up_to_date(out_dir, key)
        if args.dry_run:
            print(json.dumps({"key": key, "material": material, "up_to_date": current}, indent=2))
            return 0
        if current:
            print(f"up to date: {out_dir / TARGETS[0]} (configuration {key[:12]}); skipping the build")
            return 0
        out_dir.mkdir(parents=True, exist_ok=True)
        seconds = build(out_dir, args.sdist_dir, args.jobs, material)
    except (recipe.RecipeError, subprocess.CalledProcessError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"built {', '.join(TARGETS)} in {out_dir} ({seconds / 60:.1f} min with {args.jobs} jobs; configuration "
          f"{key[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
