"""The start-up self-check: CUDA library search and order, architectures, and the real check on this machine."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_runtime.space.setup import startup

CUDA13_FILES = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnvblas.so.13", "libcudadevrt.a")


def fake_site(root: Path, files: tuple[str, ...], subdir: str = "nvidia/cu13/lib") -> Path:
    lib = root / subdir
    lib.mkdir(parents=True, exist_ok=True)
    for name in files:
        (lib / name).write_bytes(b"")
    return root


# ---------------------------------------------------------------- library search


def test_finds_cuda13_libraries_in_dependency_order(tmp_path: Path) -> None:
    root = fake_site(tmp_path / "site-packages", CUDA13_FILES)
    search = startup.find_cuda_libraries([root])
    lib = root / "nvidia" / "cu13" / "lib"
    assert search.ordered == [lib / "libcudart.so.13", lib / "libcublasLt.so.13", lib / "libcublas.so.13"]
    assert search.missing == [] and search.install_hint is None


def test_libraries_spread_over_roots_and_first_root_wins(tmp_path: Path) -> None:
    first = fake_site(tmp_path / "a", ("libcublas.so.13", "libcublasLt.so.13"))
    second = fake_site(tmp_path / "b", ("libcudart.so.13", "libcublas.so.13"))
    search = startup.find_cuda_libraries([first, second])
    assert [p.parent.parent.parent.parent.name for p in search.ordered] == ["b", "a", "a"]
    assert [p.name for p in search.ordered] == ["libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13"]


def test_cuda12_layout_and_wrong_major(tmp_path: Path) -> None:
    root = fake_site(tmp_path / "s", ("libcudart.so.12",), "nvidia/cuda_runtime/lib")
    fake_site(root, ("libcublas.so.12", "libcublasLt.so.12"), "nvidia/cublas/lib")
    assert [p.name for p in startup.find_cuda_libraries([root], major=12).ordered] == [
        "libcudart.so.12", "libcublasLt.so.12", "libcublas.so.12",
    ]  # fmt: skip
    assert startup.find_cuda_libraries([root]).missing == ["cudart", "cublasLt", "cublas"]


def test_nothing_found_says_what_to_install(tmp_path: Path) -> None:
    search = startup.find_cuda_libraries([tmp_path])
    assert search.ordered == [] and search.missing == ["cudart", "cublasLt", "cublas"]
    assert search.install_hint == "pip install 'nvidia-cuda-runtime==13.*' 'nvidia-cublas==13.*'"


def test_only_the_missing_package_is_suggested(tmp_path: Path) -> None:
    root = fake_site(tmp_path / "s", ("libcudart.so.13",))
    assert startup.find_cuda_libraries([root]).install_hint == "pip install 'nvidia-cublas==13.*'"


def test_preload_reports_unloadable_files_without_raising(tmp_path: Path) -> None:
    root = fake_site(tmp_path / "s", CUDA13_FILES)  # empty files: not ELF
    loaded, errors = startup.preload_cuda_libraries(startup.find_cuda_libraries([root]))
    assert loaded == [] and len(errors) == 3 and errors[0].startswith("libcudart.so.13")


def test_preload_loads_a_real_library_globally() -> None:
    libc = ctypes.util.find_library("c")
    assert libc, "libc must be findable on Linux"
    loaded, errors = startup.preload_cuda_libraries(startup.CudaLibrarySearch([Path(libc)], [], None))
    assert errors == [] and loaded == [libc]


# ---------------------------------------------------------------- architectures


@pytest.mark.parametrize(
    ("arch", "capability", "runs"),
    [
        ("120a-real", (12, 0), True),
        ("120a-real", (12, 1), False),
        ("120a-real", (9, 0), False),
        ("sm_120a", (12, 0), True),
        ("86-real", (8, 9), True),
        ("86-real", (9, 0), False),
        ("90-virtual", (12, 0), True),
        ("90", (10, 0), True),
        ("120f-real", (12, 1), True),
        ("89-real", (8, 6), False),
    ],
)
def test_arch_coverage(arch: str, capability: tuple[int, int], runs: bool) -> None:
    assert startup.arch_runs_on(arch, capability) is runs


def test_uncovered_gpu_is_said_plainly() -> None:
    devices = [{"index": 0, "name": "NVIDIA H200", "compute_capability": [9, 0]}]
    problems = startup.architecture_problems(devices, ["120a-real"])
    assert len(problems) == 1
    assert "compute capability 9.0" in problems[0] and "120a-real" in problems[0] and "--arch 90-real" in problems[0]
    assert startup.architecture_problems(devices, ["120a-real", "90-real"]) == []


def test_cuobjdump_listing_parsed() -> None:
    listing = "ELF file    1: libggml-cuda.1.sm_120a.cubin\nELF file    2: libggml-cuda.2.sm_90.cubin\n"
    assert startup.parse_cuobjdump_elf(listing) == ["sm_120a", "sm_90"]


def test_status_line_names_problems() -> None:
    info = {
        "installed_version": "0.3.36", "llama_cpp_version": "0.3.36", "package_dir": "/x", "cuda_build": True,
        "wheel_architectures": ["120a-real"], "gpu_offload": True,
        "cuda_devices": [{"index": 0, "name": "NVIDIA H200", "compute_capability": [9, 0]}],
        "cuda_libraries_missing": [], "dflash_missing_symbols": ["llama_model_target_layer_ids"],
        "manifest": {"matches": True, "problems": []},
    }  # fmt: skip
    info["problems"] = startup.problems_of(info)
    line = startup.status_line(info)
    assert "CUDA build, 120a-real" in line and "NVIDIA H200 (compute 9.0)" in line
    assert "DFlash symbols MISSING (llama_model_target_layer_ids)" in line and "do not cover" in line
    assert "\n" not in line and not startup.is_healthy(info)


# ---------------------------------------------------------------- this machine (CPU build of llama-cpp-python)


def test_module_import_loads_neither_llama_cpp_nor_cuda() -> None:
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(Path(startup.__file__))!r})\n"
        "m = sys.modules['s'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('llama_cpp' in sys.modules, 'libcudart' in maps, 'libllama' in maps)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False", "False"]


def test_startup_check_on_cpu_machine_reports_no_gpu_offload(tmp_path: Path) -> None:
    line, info = startup.run_startup_check(roots=[tmp_path], manifest_dirs=[tmp_path])
    assert info["llama_cpp_version"] == "0.3.36"
    assert info["gpu_offload"] is False and info["cuda_devices"] == []
    assert "no GPU offload" in line and "import failed" not in line
    assert any(d["type"] == "CPU" for d in info["devices"])
    assert info["dflash_missing_symbols"] == [] and "DFlash symbols present" in line
    assert info["manifest"]["matches"] is None and "no wheel manifest found" in line
    assert Path(info["library_path"]).name == "libllama.so"
    assert info["ok"] is True


def test_in_process_probe_agrees_with_child(tmp_path: Path) -> None:
    child_line, child = startup.run_startup_check(roots=[tmp_path], manifest_dirs=[tmp_path])
    here_line, here = startup.run_startup_check(in_child=False, roots=[tmp_path], manifest_dirs=[tmp_path])
    assert here_line == child_line
    assert here["devices"] == child["devices"] and here["gpu_offload"] == child["gpu_offload"]


def test_manifests_found_next_to_wheels_not_deep_in_build_trees(tmp_path: Path) -> None:
    shipped = tmp_path / "prebuilt_wheels" / "dist" / "cuda" / "manifest.json"
    deep = tmp_path / "prebuilt_wheels" / "build" / "cuda-x" / "src" / "manifest.json"
    for path in (shipped, deep):
        path.parent.mkdir(parents=True)
        path.write_text("{}")
    explicit = tmp_path / "elsewhere.json"
    explicit.write_text("{}")
    found = startup.find_manifests([tmp_path / "prebuilt_wheels", explicit])
    assert found == [shipped.resolve(), explicit.resolve()]


@pytest.mark.parametrize(
    ("error", "missing", "hint"),
    [
        ("OSError: libcuda.so.1: cannot open shared object file", [], "no NVIDIA driver"),
        ("OSError: libcudart.so.13: cannot open shared object file", ["cudart"], "pip install 'nvidia-cuda-runtime"),
        ("OSError: something else", [], ""),
    ],
)
def test_import_failure_says_what_to_do(error: str, missing: list[str], hint: str) -> None:
    info = {
        "installed_version": "0.3.36", "package_dir": "/x", "cuda_build": True, "import_error": error,
        "cuda_libraries_missing": missing, "cuda_install_hint": startup.install_hint(missing),
    }  # fmt: skip
    line = startup.status_line(info)
    assert line.startswith("llama-cpp-python 0.3.36 (CUDA build): import failed: " + error)
    assert hint in line and not startup.is_healthy({**info, "manifest": {"matches": None}})


def test_the_manifest_run_sh_recorded_and_its_wheel_cache_are_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `bash run.sh`, `.venv/bin/python app.py` runs without run.sh's environment: the start-up check finds the
    manifest run.sh recorded in the venv, and run.sh's wheel cache, not only DFLASH_WHEEL_MANIFEST."""
    venv, cache = tmp_path / "venv", tmp_path / "wheels-dl"
    manifest = cache / "cpu" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    (cache / "build" / "cpu-1" / "x").mkdir(parents=True)
    (cache / "build" / "cpu-1" / "x" / "manifest.json").write_text("{}")  # a build tree's: never a wheel's manifest
    assert startup.recorded_manifest(venv) is None  # a venv run.sh did not set up
    (venv / startup.RECORDED_MANIFEST).parent.mkdir(parents=True)
    (venv / startup.RECORDED_MANIFEST).write_text(f"{manifest}\n")
    assert startup.recorded_manifest(venv) == manifest
    monkeypatch.delenv("DFLASH_WHEEL_MANIFEST", raising=False)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setenv("DFLASH_WHEEL_CACHE", str(tmp_path / "elsewhere"))
    assert startup.find_manifests(startup.default_manifest_dirs())[0] == manifest.resolve()  # recorded
    (venv / startup.RECORDED_MANIFEST).unlink()
    monkeypatch.setenv("DFLASH_WHEEL_CACHE", str(cache))
    found = startup.find_manifests(startup.default_manifest_dirs())
    ours = [path for path in found if path.is_relative_to(tmp_path.resolve())]
    assert ours == [manifest.resolve()]  # the cache's variant folder, not its build trees
