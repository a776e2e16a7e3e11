"""The CPU wheel's kernel patch: llamafile's sgemm for every row count (the exact CPU configuration, see
docs/numerics.md), applied once to the sources it knows, refused on others, and part of the CPU build's key."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "prebuilt_wheels" / "build_wheel.py"


@pytest.fixture(scope="module")
def recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_wheel_kernels", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def fake_sources(root: Path, recipe: ModuleType) -> Path:
    for name, old, _ in recipe.KERNEL_PATCH:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"// before\n{old}// after\n")
    return root


def test_the_patch_applies_once(recipe: ModuleType, tmp_path: Path) -> None:
    src = fake_sources(tmp_path / "src", recipe)
    recipe.patch_cpu_kernels(src)
    sgemm = (src / recipe.KERNEL_PATCH[0][0]).read_text()
    assert "if (n < 2)" not in sgemm and "sgemm for every row count" in sgemm
    features = (src / recipe.KERNEL_PATCH[1][0]).read_text()
    assert '"SGEMM_ALL_ROWS", "1"' in features and features.count('"LLAMAFILE", "1"') == 1
    recipe.patch_cpu_kernels(src)  # a resumed build patches the same tree again
    assert (src / recipe.KERNEL_PATCH[0][0]).read_text() == sgemm
    assert (src / recipe.KERNEL_PATCH[1][0]).read_text() == features


def test_the_patch_refuses_sources_it_does_not_know(recipe: ModuleType, tmp_path: Path) -> None:
    src = fake_sources(tmp_path / "src", recipe)
    (src / recipe.KERNEL_PATCH[0][0]).write_text("bool llamafile_sgemm(...) { if (n < 4) return false; }\n")
    with pytest.raises(recipe.RecipeError, match="the kernel patch cannot apply"):
        recipe.patch_cpu_kernels(src)


def test_the_cpu_build_takes_llamafile_with_the_patch_in_its_key(recipe: ModuleType, tmp_path: Path) -> None:
    args = recipe.parse_args(["--cpu", "--out-dir", str(tmp_path / "out"), "--build-root", str(tmp_path / "b")])
    config = recipe.make_plan(args).config
    assert "-DGGML_LLAMAFILE=ON" in config.cmake_args() and "-DGGML_LLAMAFILE=OFF" not in config.cmake_args()
    key = config.key()
    assert config.key_material()["kernel_patch"]
    recipe.KERNEL_PATCH, saved = (*recipe.KERNEL_PATCH, ("x", "a", "b")), recipe.KERNEL_PATCH
    try:
        assert config.key() != key, "another kernel patch is another build"
    finally:
        recipe.KERNEL_PATCH = saved
