"""The wheel recipe (prebuilt_wheels/build_wheel.py): invocation, manifest, skip logic. No real wheel is built."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from dflash_runtime.space.setup import startup

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "prebuilt_wheels" / "build_wheel.py"
WHEEL_NAME = "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
FAKE_LIBS = {
    "llama_cpp/lib/libllama.so": b"fake libllama",
    "llama_cpp/lib/libggml.so.0": b"fake libggml",
    "llama_cpp/lib/libggml-cuda.so": b"fake cuda kernels",
}


@pytest.fixture(scope="module")
def recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_wheel", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def fake_toolkit(tmp_path: Path, release: str = "13.0", version: str = "13.0.88") -> Path:
    """A CUDA toolkit directory with an nvcc that prints a version, cuBLAS headers and a driver stub."""
    root = tmp_path / "cuda"
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{version}'\n")
    nvcc.chmod(0o755)
    (root / "include").mkdir()
    (root / "include" / "cublas_v2.h").write_text("")
    (root / "lib64" / "stubs").mkdir(parents=True)
    (root / "lib64" / "stubs" / "libcuda.so").write_text("")
    return nvcc


def run_recipe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RECIPE), *args], capture_output=True, text=True, timeout=120)


def make_fake_wheel(directory: Path, libs: dict[str, bytes] = FAKE_LIBS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llama_cpp/__init__.py", '__version__ = "0.3.36"\n')
        for name, data in libs.items():
            archive.writestr(name, data)
    return wheel


def record_of(libs: dict[str, bytes]) -> dict[str, str]:
    """What pip would write into the installed RECORD for these files."""
    return {n: base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode() for n, d in libs.items()}


def cpu_plan(recipe: ModuleType, out_dir: Path, tmp_path: Path):
    args = recipe.parse_args(["--cpu", "--out-dir", str(out_dir), "--build-root", str(tmp_path / "build")])
    return recipe.make_plan(args)


# ---------------------------------------------------------------- invocation


def test_help_describes_architectures() -> None:
    result = run_recipe("--help")
    assert result.returncode == 0
    assert "--arch" in result.stdout and "--dry-run" in result.stdout and "90-real" in result.stdout


def test_dry_run_prints_cuda_invocation_with_architectures(tmp_path: Path) -> None:
    nvcc = fake_toolkit(tmp_path)
    result = run_recipe(
        "--dry-run", "--nvcc", str(nvcc), "--arch", "120a-real,90-real", "--arch", "86-real",
        "--build-root", str(tmp_path / "build"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "-DCMAKE_CUDA_ARCHITECTURES=120a-real;90-real;86-real" in out
    for flag in ("-DGGML_CUDA=ON", "-DGGML_NATIVE=OFF", "-DLLAVA_BUILD=OFF", "-DGGML_CUDA_FA=ON", "Release"):
        assert flag in out
    assert r"'-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath,\$ORIGIN/../../nvidia/cu13/lib'" in out
    assert r"'-DCMAKE_MODULE_LINKER_FLAGS=-Wl,-rpath,\$ORIGIN/../../nvidia/cu13/lib'" in out  # backend modules
    assert "-DGGML_BACKEND_DL=ON" in out
    assert "pip wheel" in out and "pip download --no-binary :all: --no-deps" in out
    assert "CUDA 13.0.88" in out
    assert not (tmp_path / "build").exists(), "a dry run must not write anything"


def test_dry_run_cpu_variant_has_cuda_off(tmp_path: Path) -> None:
    result = run_recipe("--dry-run", "--cpu", "--build-root", str(tmp_path / "build"))
    assert result.returncode == 0, result.stderr
    assert "-DGGML_CUDA=OFF" in result.stdout and "-DGGML_NATIVE=OFF" in result.stdout
    assert "CMAKE_CUDA_ARCHITECTURES" not in result.stdout


def test_default_architecture_is_blackwell(recipe: ModuleType) -> None:
    assert recipe.parse_archs(None) == ["120a-real"]
    assert recipe.parse_archs(["120a-real;89-real", "86"]) == ["120a-real", "89-real", "86"]
    with pytest.raises(recipe.RecipeError, match="sm_x"):
        recipe.parse_archs(["sm_x"])


def test_old_cuda_cannot_build_blackwell(recipe: ModuleType, tmp_path: Path) -> None:
    nvcc = fake_toolkit(tmp_path, "12.4", "12.4.131")
    result = run_recipe("--dry-run", "--nvcc", str(nvcc), "--build-root", str(tmp_path / "build"))
    assert result.returncode == 1 and "pip wheel" in result.stdout, "the plan is printed all the same"
    assert "missing: CUDA 12.4.131 cannot build sm_12x code: install CUDA >= 12.8" in result.stdout
    build = run_recipe("--nvcc", str(nvcc), "--build-root", str(tmp_path / "build"))
    assert build.returncode == 2 and "CUDA >= 12.8" in build.stderr and not (tmp_path / "build").exists()


def test_dry_run_without_any_toolchain_prints_the_plan_and_what_is_missing(tmp_path: Path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = {"PATH": str(empty), "CUDA_HOME": str(tmp_path / "no-cuda"), "HOME": str(tmp_path)}
    command = [sys.executable, str(RECIPE), "--dry-run", "--nvcc", str(tmp_path / "no-cuda" / "bin" / "nvcc")]
    result = subprocess.run([*command, "--build-root", str(tmp_path / "build")], capture_output=True, text=True,
                            env=env, timeout=120)  # fmt: skip
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert "variant: cuda" in out and "CUDA: not found, architectures: 120a-real" in out
    assert "-DCMAKE_CUDA_ARCHITECTURES=120a-real" in out and "pip wheel" in out and "pip download" in out
    missing = [line for line in out.splitlines() if line.startswith("missing: ")]
    assert len(missing) == 3 and "no nvcc found at" in missing[0]
    assert "C compiler" in missing[1] and "C++ compiler" in missing[2]
    assert "note: cmake not on PATH: scikit-build-core will fetch it from PyPI" in out
    assert not (tmp_path / "build").exists()


def test_dry_run_names_missing_cublas(tmp_path: Path) -> None:
    nvcc = fake_toolkit(tmp_path)
    (tmp_path / "cuda" / "include" / "cublas_v2.h").unlink()
    command = [sys.executable, "-S", str(RECIPE), "--dry-run", "--nvcc", str(nvcc)]  # -S: no site-packages cuBLAS
    result = subprocess.run([*command, "--build-root", str(tmp_path / "build")], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 1 and "CUDA 13.0.88" in result.stdout and "pip wheel" in result.stdout
    assert "missing: the CUDA toolkit at" in result.stdout and "nvidia-cublas==13.0.*" in result.stdout


def test_dry_run_with_everything_present_exits_zero(tmp_path: Path) -> None:
    result = run_recipe("--dry-run", "--nvcc", str(fake_toolkit(tmp_path)), "--build-root", str(tmp_path / "build"))
    assert result.returncode == 0 and "missing:" not in result.stdout


def test_nvcc_only_toolkit_uses_pip_cublas(recipe: ModuleType, tmp_path: Path, monkeypatch) -> None:
    nvcc = fake_toolkit(tmp_path)
    (tmp_path / "cuda" / "include" / "cublas_v2.h").unlink()
    (tmp_path / "cuda" / "lib64" / "stubs" / "libcuda.so").unlink()
    site_dir = tmp_path / "site"
    (site_dir / "nvidia" / "cu13" / "include").mkdir(parents=True)
    (site_dir / "nvidia" / "cu13" / "lib").mkdir()
    (site_dir / "nvidia" / "cu13" / "include" / "cublas_v2.h").write_text("")
    (site_dir / "nvidia" / "cu13" / "lib" / "libcublas.so.13").write_text("")
    monkeypatch.setattr(sys, "path", [str(site_dir), *sys.path])
    shim = recipe.plan_cuda_shim(recipe.cuda_toolchain(str(nvcc)))
    assert shim.cublas_lib_dir == site_dir / "nvidia" / "cu13" / "lib" and shim.needs_driver_stub
    plan_args = recipe.parse_args(["--nvcc", str(nvcc), "--build-root", str(tmp_path / "build")])
    plan = recipe.make_plan(plan_args)
    args = plan.config.cmake_args()
    shim_root = plan.build_dir / "cmake" / "cuda-shim"  # inside the CMake tree: kept out of the RUNPATH
    assert f"-DCUDA_cublas_LIBRARY={shim_root}/lib/libcublas.so" in args
    assert f"-DCUDA_cuda_driver_LIBRARY={shim_root}/lib/libcuda.so" in args
    assert f"-DCMAKE_CUDA_FLAGS=-I{shim_root}/include" in args


def test_nvcc_only_toolkit_without_pip_cublas_says_what_to_install(
    recipe: ModuleType, tmp_path: Path, monkeypatch
) -> None:
    nvcc = fake_toolkit(tmp_path)
    (tmp_path / "cuda" / "include" / "cublas_v2.h").unlink()
    monkeypatch.setattr(sys, "path", [str(tmp_path / "nothing-here")])
    with pytest.raises(recipe.RecipeError, match=r"nvidia-cublas==13\.0\.\*"):
        recipe.plan_cuda_shim(recipe.cuda_toolchain(str(nvcc)))


def test_driver_stub_defines_the_api_after_versioning_macros(recipe: ModuleType, tmp_path: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is needed to build llama-cpp-python at all"
    cuda_h = tmp_path / "cuda.h"
    cuda_h.write_text(
        "typedef int CUresult;\n#define cuMemAlloc cuMemAlloc_v2\n"
        "CUresult cuInit(unsigned int flags);\nCUresult cuMemAlloc(void **p, unsigned long n);\n"
        "const char *notAnApi(void);\n"
    )
    source = recipe.driver_stub_source(cuda_h, compiler)
    assert source.splitlines() == ["void cuInit(void) {}", "void cuMemAlloc_v2(void) {}"]


# ---------------------------------------------------------------- sdist facts


def fake_sdist(path: Path, members: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_llama_cpp_commit_from_sdist_git_metadata(recipe: ModuleType, tmp_path: Path) -> None:
    commit = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    sdist = fake_sdist(tmp_path / "a.tar.gz", {".git/modules/vendor/llama.cpp/HEAD": commit + "\n"})
    assert recipe.read_llama_cpp_commit(sdist) == (commit, "sdist .git/modules/vendor/llama.cpp/HEAD")


def test_llama_cpp_commit_falls_back_to_changelog(recipe: ModuleType, tmp_path: Path) -> None:
    changelog = "## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n"
    sdist = fake_sdist(tmp_path / "b.tar.gz", {"CHANGELOG.md": changelog})
    commit, source = recipe.read_llama_cpp_commit(sdist)
    assert commit == "0c1e57098" and "CHANGELOG" in source


# ---------------------------------------------------------------- manifest and skip logic


def written_manifest(recipe: ModuleType, tmp_path: Path) -> tuple[Path, dict]:
    out_dir = tmp_path / "dist"
    wheel = make_fake_wheel(out_dir)
    plan = cpu_plan(recipe, out_dir, tmp_path)
    manifest = recipe.build_manifest(plan, wheel, ("0c1e57098", "test"))
    path = recipe.write_manifest(out_dir, manifest)
    return path, json.loads(path.read_text())


def test_manifest_fields_and_hashes(recipe: ModuleType, tmp_path: Path) -> None:
    path, manifest = written_manifest(recipe, tmp_path)
    wheel = path.parent / WHEEL_NAME
    assert startup.validate_manifest(manifest) == []
    assert manifest["version"] == "0.3.36" and manifest["variant"] == "cpu"
    assert manifest["python_tag"] == "py3" and manifest["platform_tag"] == "linux_x86_64"
    assert manifest["wheel"]["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert manifest["native_libraries"] == {n: hashlib.sha256(d).hexdigest() for n, d in FAKE_LIBS.items()}
    assert "-DGGML_NATIVE=OFF" in manifest["cmake_args"]
    assert manifest["bundled_cuda_libraries"] == []
    assert startup.verify_wheel_file(manifest, path.parent) == []


def test_manifest_lists_the_backend_modules(recipe: ModuleType, tmp_path: Path) -> None:
    libs = {
        **FAKE_LIBS, "llama_cpp/lib/libggml-base.so": b"base", "llama_cpp/lib/libggml-base.so.0": b"base",
        "llama_cpp/lib/libggml-cpu.so": b"cpu module",
    }  # fmt: skip
    wheel = make_fake_wheel(tmp_path / "dist", libs)
    plan = cpu_plan(recipe, tmp_path / "dist", tmp_path)
    assert "-DGGML_BACKEND_DL=ON" in plan.config.cmake_args()
    manifest = recipe.build_manifest(plan, wheel, ("0c1e57098", "test"))
    assert manifest["loadable_backends"] is True
    assert manifest["backend_modules"] == ["libggml-cpu.so", "libggml-cuda.so"]
    assert recipe.expected_modules(plan.config) == ["libggml-cpu.so"]


def test_tampered_wheel_is_reported(recipe: ModuleType, tmp_path: Path) -> None:
    path, manifest = written_manifest(recipe, tmp_path)
    wheel = path.parent / WHEEL_NAME
    with wheel.open("ab") as stream:
        stream.write(b"\0")
    problems = startup.verify_wheel_file(manifest, path.parent)
    assert len(problems) == 1 and "sha256" in problems[0] and WHEEL_NAME in problems[0]
    check = startup.check_manifests([path], record_of(FAKE_LIBS), "0.3.36")
    assert check.matches is False and check.problems == problems


def test_installed_libraries_checked_against_manifest(recipe: ModuleType, tmp_path: Path) -> None:
    path, manifest = written_manifest(recipe, tmp_path)
    record = record_of(FAKE_LIBS)
    assert startup.verify_installed(manifest, record, "0.3.36") == []
    assert startup.check_manifests([path], record, "0.3.36").matches is True
    altered = {**record, "llama_cpp/lib/libllama.so": record_of({"x": b"other build"})["x"]}
    expected = ["installed llama_cpp/lib/libllama.so differs from the manifest's"]
    assert startup.verify_installed(manifest, altered, "0.3.36") == expected
    extra = {**record, "llama_cpp/lib/libggml-vulkan.so": "abc"}
    assert "not in the manifest" in startup.verify_installed(manifest, extra, "0.3.36")[0]
    assert "0.3.35" in startup.verify_installed(manifest, record, "0.3.35")[0]


def test_matching_build_is_skipped_and_tampered_one_rebuilt(recipe: ModuleType, tmp_path: Path) -> None:
    path, manifest = written_manifest(recipe, tmp_path)
    out_dir = path.parent
    args = ["--cpu", "--out-dir", str(out_dir), "--build-root", str(tmp_path / "build")]
    result = run_recipe(*args)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout
    assert recipe.existing_build(out_dir, manifest["config_key"]) == out_dir / WHEEL_NAME
    assert recipe.existing_build(out_dir, "another configuration") is None
    (out_dir / WHEEL_NAME).write_bytes(b"truncated")
    assert recipe.existing_build(out_dir, manifest["config_key"]) is None


def test_configuration_key_follows_flags(recipe: ModuleType, tmp_path: Path) -> None:
    plain = cpu_plan(recipe, tmp_path / "d", tmp_path).config.key()
    args = recipe.parse_args(["--cpu", "--cmake-arg=-DGGML_AVX512=ON", "--build-root", str(tmp_path / "build")])
    assert recipe.make_plan(args).config.key() != plain
    assert cpu_plan(recipe, tmp_path / "other", tmp_path).config.key() == plain


def test_slim_drops_unused_copies_and_rewrites_record(recipe: ModuleType, tmp_path: Path) -> None:
    files = {  # make_fake_wheel adds llama_cpp/__init__.py
        "llama_cpp/lib/libllama.so": b"L",
        "llama_cpp/lib/libllama.so.0": b"L",
        "llama_cpp/lib/libllama.so.0.5.0": b"L",
        "lib/libllama.so": b"L",
        "lib/cmake/llama/llama-config.cmake": b"cmake",
        "include/llama.h": b"header",
        "llama_cpp_python-0.3.36.dist-info/METADATA": b"Name: llama_cpp_python\n",
        "llama_cpp_python-0.3.36.dist-info/RECORD": b"stale",
    }
    wheel = make_fake_wheel(tmp_path, files)
    dropped = recipe.slim_wheel(wheel)
    assert set(dropped) == {
        "llama_cpp/lib/libllama.so.0.5.0", "lib/libllama.so", "lib/cmake/llama/llama-config.cmake", "include/llama.h",
    }  # fmt: skip
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = archive.read("llama_cpp_python-0.3.36.dist-info/RECORD").decode().splitlines()
        contents = {n: archive.read(n) for n in names}
    assert names[-1].endswith("RECORD") and not set(dropped) & set(names)
    assert record[-1] == "llama_cpp_python-0.3.36.dist-info/RECORD,,"
    for line in record[:-1]:
        name, digest, size = line.rsplit(",", 2)
        assert digest == "sha256=" + record_of({name: contents[name]})[name] and int(size) == len(contents[name])
    assert {line.split(",")[0] for line in record} == set(names)


def test_slim_flag_changes_wheel_key_not_compiled_tree(recipe: ModuleType, tmp_path: Path) -> None:
    slim = cpu_plan(recipe, tmp_path / "d", tmp_path)
    args = recipe.parse_args(["--cpu", "--no-slim", "--build-root", str(tmp_path / "build")])
    full = recipe.make_plan(args)
    assert full.config.key() != slim.config.key()
    assert full.build_dir == slim.build_dir


def test_cpu_code_is_portable_x86_64_v3(recipe: ModuleType) -> None:
    """GGML_NATIVE=OFF alone can fall back to SSE2 (ggml ties its ISA defaults to GGML_NATIVE's default)."""
    assert "-DGGML_AVX2=ON" in recipe.cpu_isa_args("x86_64") and "-DGGML_FMA=ON" in recipe.cpu_isa_args("AMD64")
    assert not any("AVX512" in a for a in recipe.cpu_isa_args("x86_64"))
    assert recipe.cpu_isa_args("aarch64") == []


# ---------------------------------------------------------------- source patch: llama_cpp loads its backend modules


def fake_package(root: Path, llama_cpp_py: str) -> Path:
    (root / "llama_cpp").mkdir(parents=True)
    (root / "llama_cpp" / "llama_cpp.py").write_text(llama_cpp_py)
    return root


def test_source_patch_adds_the_loader_once(recipe: ModuleType, tmp_path: Path) -> None:
    source = "_lib = load_shared_library(_lib_base_name, _base_path)\n\n" + recipe.PATCH_ANCHOR + "\n\ndef f(): ...\n"
    src = fake_package(tmp_path / "src", source)
    recipe.patch_sources(src)
    patched = (src / "llama_cpp" / "llama_cpp.py").read_text()
    assert patched == source.replace(recipe.PATCH_ANCHOR, recipe.PATCH_ANCHOR + recipe.PATCH_HOOK)
    assert (src / recipe.PATCH_MODULE).read_bytes() == recipe.PATCH_MODULE_SOURCE.read_bytes()
    recipe.patch_sources(src)  # a resumed build patches the same tree again
    assert (src / "llama_cpp" / "llama_cpp.py").read_text() == patched


def test_source_patch_refuses_sources_it_does_not_know(recipe: ModuleType, tmp_path: Path) -> None:
    src = fake_package(tmp_path / "src", "ctypes_function = something_else(_lib)\n")
    with pytest.raises(recipe.RecipeError, match="the patch cannot apply"):
        recipe.patch_sources(src)


def test_source_patch_is_part_of_every_variants_configuration(
    recipe: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA wheel gets the same patch as the CPU wheel CI tests, and another version of the patch rebuilds
    both (a cached wheel without it is not reused)."""
    nvcc = fake_toolkit(tmp_path)
    cuda = recipe.make_plan(recipe.parse_args(["--nvcc", str(nvcc), "--build-root", str(tmp_path / "build")]))
    cpu = cpu_plan(recipe, tmp_path / "d", tmp_path)
    digest = recipe.source_patch_digest()
    assert cuda.config.key_material()["source_patch"] == cpu.config.key_material()["source_patch"] == digest
    for variant in (["--nvcc", str(nvcc)], ["--cpu"]):
        result = run_recipe("--dry-run", *variant, "--build-root", str(tmp_path / "build"))
        assert f"# source patch {digest[:12]}: copy prebuilt_wheels/llama_cpp_patch/_backend_modules.py" in (
            result.stdout
        )
    keys = {plan.config.variant: (plan.config.key(), plan.config.compile_key()) for plan in (cuda, cpu)}
    changed = tmp_path / "_backend_modules.py"
    changed.write_bytes(recipe.PATCH_MODULE_SOURCE.read_bytes() + b"# another version\n")
    monkeypatch.setattr(recipe, "PATCH_MODULE_SOURCE", changed)
    for plan in (cuda, cpu):
        key, compile_key = keys[plan.config.variant]
        assert plan.config.key() != key and plan.config.compile_key() != compile_key


def test_wheel_without_the_source_patch_gets_no_manifest(recipe: ModuleType, tmp_path: Path) -> None:
    wheel = make_fake_wheel(tmp_path / "dist")
    with pytest.raises(recipe.RecipeError, match="the source patch is not in it"):
        recipe.wheel_source_patch(wheel)
    hooked = "x = 1\n" + recipe.PATCH_ANCHOR + recipe.PATCH_HOOK
    module = recipe.PATCH_MODULE_SOURCE.read_bytes()
    patched = make_fake_wheel(tmp_path / "ok", {**FAKE_LIBS, recipe.PATCH_TARGET: hooked.encode(),
                                                recipe.PATCH_MODULE: module})  # fmt: skip
    facts = recipe.wheel_source_patch(patched)
    assert facts["digest"] == recipe.source_patch_digest()
    assert facts["files"][recipe.PATCH_MODULE] == hashlib.sha256(module).hexdigest()
    unhooked = make_fake_wheel(tmp_path / "bad", {**FAKE_LIBS, recipe.PATCH_TARGET: b"x = 1\n",
                                                  recipe.PATCH_MODULE: module})  # fmt: skip
    with pytest.raises(recipe.RecipeError, match="is not what the source patch writes"):
        recipe.wheel_source_patch(unhooked)
