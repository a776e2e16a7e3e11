"""tools/build_llama_server.py, the llama-server CI builds for the comparison tests: its configuration is the wheel's
CPU kernels, and a build is redone only when its configuration or its binaries changed. (The build itself runs in
CI's own step, .ci/run: minutes of CPU; no build here.)"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_llama_server", ROOT / "tools" / "build_llama_server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def dry_run(tool: ModuleType, out: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert tool.main(["--out-dir", str(out), "--dry-run"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_server_gets_the_wheels_cpu_kernels(tool: ModuleType, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    recipe = tool.recipe
    plan = dry_run(tool, tmp_path, capsys)
    material = plan["material"]
    assert material["sdist_sha256"] == recipe.SDIST_SHA256
    assert material["kernel_patch"] == hashlib.sha256(json.dumps(recipe.KERNEL_PATCH).encode()).hexdigest()
    args = set(material["cmake_args"])
    wheel = set(recipe.BuildConfig("cpu", [], "", []).cmake_args())  # the CPU wheel's CMake options
    kernels = {a for a in args if a.startswith("-DGGML_")} | {"-DCMAKE_BUILD_TYPE=Release"}
    assert kernels <= wheel and {"-DGGML_LLAMAFILE=ON", "-DGGML_NATIVE=OFF", *recipe.cpu_isa_args()} <= kernels
    assert material["targets"] == ["llama-server", "llama-lookup-create", "llama-lookup-merge"]
    assert plan["up_to_date"] is False


def test_a_build_is_redone_only_when_its_configuration_or_binaries_changed(tool: ModuleType, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    key = dry_run(tool, tmp_path, capsys)["key"]
    binaries = {}
    for name in tool.TARGETS:
        (tmp_path / name).write_bytes(name.encode())
        binaries[name] = hashlib.sha256(name.encode()).hexdigest()
    (tmp_path / "manifest.json").write_text(json.dumps({"key": key, "binaries": binaries}))
    assert tool.main(["--out-dir", str(tmp_path)]) == 0  # nothing built: it would need the sdist and minutes
    assert capsys.readouterr().out.startswith(f"up to date: {tmp_path / 'llama-server'}")
    (tmp_path / "llama-lookup-merge").write_bytes(b"another build")
    assert dry_run(tool, tmp_path, capsys)["up_to_date"] is False
    (tmp_path / "llama-lookup-merge").write_bytes(b"llama-lookup-merge")
    (tmp_path / "manifest.json").write_text(json.dumps({"key": "0" * 64, "binaries": binaries}))
    assert dry_run(tool, tmp_path, capsys)["up_to_date"] is False  # another configuration's binaries
