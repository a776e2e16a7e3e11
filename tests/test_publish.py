"""`build_wheel.py publish`: the wheel and its manifest go to a Hub model repo in one commit (the real huggingface_hub
client against a local fake of the Hub), and requirements.txt points at that commit with the wheel's sha256."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from hub_repo_fake import FakeHubRepos, FakeRepo

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "prebuilt_wheels" / "build_wheel.py"
WHEEL = "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
REPO = "space-owner/dflash-wheels"
URL_LINE = "llama-cpp-python @ https://h.example/o/r/resolve/{commit}/cuda/" + WHEEL + "#sha256=" + "ab" * 32
CUDA = {"nvidia-cuda-runtime": ">=13.0,<14", "nvidia-cublas": ">=13.0,<14"}


def recipe_modules() -> tuple[ModuleType, ModuleType]:
    """(build_wheel, publish_wheel), imported the way the script imports them (from prebuilt_wheels/)."""
    sys.path.insert(0, str(RECIPE.parent))
    try:
        import build_wheel
        import publish_wheel
    finally:
        sys.path.remove(str(RECIPE.parent))
    return build_wheel, publish_wheel


@pytest.fixture(scope="module")
def publishing() -> ModuleType:
    return recipe_modules()[1]


@pytest.fixture
def hub() -> FakeHubRepos:
    server = FakeHubRepos().start()
    yield server
    server.stop()


def built_wheel(out_dir: Path, variant: str, payload: bytes) -> dict:
    """A wheel and the manifest the recipe writes for it (the recipe's own code, a small wheel)."""
    recipe = recipe_modules()[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / WHEEL
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llama_cpp/__init__.py", '__version__ = "0.3.36"\n')
        archive.writestr("llama_cpp/lib/libllama.so", b"not an ELF file")
        archive.writestr("llama_cpp/lib/libggml-cpu.so", payload)  # large payloads travel as LFS files
    nvcc = out_dir / "nvcc"  # prints a version; nothing is compiled
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    args = ["--cpu"] if variant == "cpu" else ["--nvcc", str(nvcc)]
    plan = recipe.make_plan(recipe.parse_args([*args, "--out-dir", str(out_dir)]), missing=[])
    manifest = recipe.build_manifest(plan, wheel, ("0c1e57098", "test"))
    recipe.write_manifest(out_dir, manifest)
    return manifest


def run_publish(hub: FakeHubRepos, out_dir: Path, requirements: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(requirements.parent / "hf-home")}
    command = [sys.executable, str(RECIPE), "publish", "--repo", REPO, "--no-build", "--out-dir", str(out_dir)]
    command += ["--endpoint", hub.endpoint, "--token", "hf_test", "--requirements", str(requirements), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


# ---------------------------------------------------------------- requirements.txt


def test_rewrite_keeps_every_other_line_and_is_idempotent(publishing: ModuleType) -> None:
    original = (ROOT / "requirements.txt").read_text()
    line = URL_LINE.format(commit="1" * 40)
    once = publishing.rewrite_requirements(original, line, CUDA)
    assert publishing.rewrite_requirements(once, line, CUDA) == once
    new_lines = once.splitlines()
    at = new_lines.index(line)
    assert new_lines[at + 1 : at + 3] == ["nvidia-cuda-runtime>=13.0,<14", "nvidia-cublas>=13.0,<14"]
    kept = [ln for ln in original.splitlines() if publishing.requirement_name(ln) != "llama-cpp-python"]
    assert [ln for ln in new_lines if ln not in (line, *new_lines[at + 1 : at + 3])] == kept
    assert any(ln.startswith("#") and "llama-cpp-python" in ln for ln in kept), "comments naming it are kept"


def test_rewrite_replaces_a_published_line_and_drops_cuda_packages_for_a_cpu_wheel(publishing: ModuleType) -> None:
    first = URL_LINE.format(commit="1" * 40)
    text = f"# top\ngguf>=0.17\n{first}\nnvidia-cublas==13.0.*  # old pin\nnumpy\nLLAMA_CPP_PYTHON==0.3.35\n"
    second = URL_LINE.format(commit="2" * 40).replace("/cuda/", "/cpu/")
    assert publishing.rewrite_requirements(text, second, {}) == f"# top\ngguf>=0.17\n{second}\nnumpy\n"
    cuda = publishing.rewrite_requirements(text, first, CUDA)
    assert cuda == f"# top\ngguf>=0.17\n{first}\nnvidia-cuda-runtime>=13.0,<14\nnvidia-cublas>=13.0,<14\nnumpy\n"
    assert publishing.rewrite_requirements("numpy\n", first, {}) == f"numpy\n{first}\n"


# ---------------------------------------------------------------- publish against the fake Hub


def test_publish_pins_the_upload_commit_and_the_wheel_hash(
    publishing: ModuleType, hub: FakeHubRepos, tmp_path: Path
) -> None:
    manifest = built_wheel(tmp_path / "dist", "cpu", os.urandom(64 * 1024))
    requirements = tmp_path / "space" / "requirements.txt"
    requirements.parent.mkdir()
    requirements.write_text((ROOT / "requirements.txt").read_text())
    result = run_publish(hub, tmp_path / "dist", requirements, "--cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    commit, files = hub.repos[REPO].commits[-1]
    sha256 = manifest["wheel"]["sha256"]
    url = f"{hub.endpoint}/{REPO}/resolve/{commit}/cpu/{WHEEL}"
    assert f"llama-cpp-python @ {url}#sha256={sha256}" in requirements.read_text().splitlines()
    named = {publishing.requirement_name(line) for line in requirements.read_text().splitlines()}
    assert "nvidia-cublas" not in named and "nvidia-cuda-runtime" not in named
    assert files[f"cpu/{WHEEL}"].lfs and not files["cpu/manifest.json"].lfs  # the wheel went through LFS
    assert json.loads(files["cpu/manifest.json"].data) == manifest
    with urllib.request.urlopen(url, timeout=30) as response:  # redirected to the storage host, as on the Hub
        assert response.url.startswith(hub.storage)
        assert hashlib.sha256(response.read()).hexdigest() == sha256
    record = json.loads((requirements.parent / "prebuilt_wheels/published/cpu/manifest.json").read_text())
    assert record["published"] == {"repo": REPO, "commit": commit, "url": url} and record["wheel"]["sha256"] == sha256
    assert hub.repos[REPO].private is False


def test_publishing_the_cuda_wheel_adds_the_runtime_and_a_new_commit_wins(hub: FakeHubRepos, tmp_path: Path) -> None:
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("numpy>=1.26\nllama-cpp-python==0.3.36\ngradio==6.31.0\n")
    built_wheel(tmp_path / "cpu", "cpu", os.urandom(16 * 1024))
    assert run_publish(hub, tmp_path / "cpu", requirements, "--cpu").returncode == 0
    manifest = built_wheel(tmp_path / "cuda", "cuda", os.urandom(16 * 1024))
    result = run_publish(hub, tmp_path / "cuda", requirements)
    assert result.returncode == 0, result.stderr[-3000:]
    commit = hub.repos[REPO].commits[-1][0]
    assert len(hub.repos[REPO].commits) == 2
    url = f"{hub.endpoint}/{REPO}/resolve/{commit}/cuda/{WHEEL}"
    line = f"llama-cpp-python @ {url}#sha256={manifest['wheel']['sha256']}"
    assert requirements.read_text() == (
        f"numpy>=1.26\n{line}\nnvidia-cuda-runtime>=13.0,<14\nnvidia-cublas>=13.0,<14\ngradio==6.31.0\n"
    )
    both = {f"{variant}/{name}" for variant in ("cpu", "cuda") for name in (WHEEL, "manifest.json")}
    assert set(hub.repos[REPO].commits[-1][1]) == both


def test_a_wheel_that_is_not_its_manifest_is_not_published(hub: FakeHubRepos, tmp_path: Path) -> None:
    built_wheel(tmp_path / "dist", "cpu", b"built")
    with zipfile.ZipFile(tmp_path / "dist" / WHEEL, "a") as archive:
        archive.writestr("llama_cpp/extra.py", "")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("llama-cpp-python==0.3.36\n")
    result = run_publish(hub, tmp_path / "dist", requirements, "--cpu")
    assert result.returncode == 2 and "does not have the sha256 its manifest records" in result.stderr
    assert hub.requests == [] and requirements.read_text() == "llama-cpp-python==0.3.36\n"


def test_a_private_repo_is_refused(hub: FakeHubRepos, tmp_path: Path) -> None:
    hub.repos[REPO] = FakeRepo(private=True)
    built_wheel(tmp_path / "dist", "cpu", b"built")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("llama-cpp-python==0.3.36\n")
    result = run_publish(hub, tmp_path / "dist", requirements, "--cpu")
    assert result.returncode == 2 and "is private" in result.stderr and "make it public" in result.stderr
    assert hub.repos[REPO].commits == [] and requirements.read_text() == "llama-cpp-python==0.3.36\n"


def test_a_rejected_token_is_a_clear_error(hub: FakeHubRepos, tmp_path: Path) -> None:
    hub.rejected_token = "hf_test"
    built_wheel(tmp_path / "dist", "cpu", b"built")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("llama-cpp-python==0.3.36\n")
    result = run_publish(hub, tmp_path / "dist", requirements, "--cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: the Hub at {hub.endpoint} refused the upload to {REPO}" in result.stderr
    assert "Invalid credentials" in result.stderr and requirements.read_text() == "llama-cpp-python==0.3.36\n"


def test_the_wrong_variant_or_a_bad_repo_name_is_refused(hub: FakeHubRepos, tmp_path: Path) -> None:
    built_wheel(tmp_path / "dist", "cpu", b"built")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("llama-cpp-python==0.3.36\n")
    result = run_publish(hub, tmp_path / "dist", requirements)
    assert result.returncode == 2 and "describes a cpu wheel, not cuda" in result.stderr
    command = [sys.executable, str(RECIPE), "publish", "--repo", "no-owner", "--no-build", "--cpu"]
    command += ["--out-dir", str(tmp_path / "dist"), "--requirements", str(requirements)]
    bad = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--repo must be OWNER/NAME" in bad.stderr
    assert hub.requests == []


def test_requirement_for_prints_the_line_for_a_base_url(tmp_path: Path) -> None:
    manifest = built_wheel(tmp_path / "dist", "cpu", b"built")
    base = "https://huggingface.co/o/r/resolve/" + "3" * 40 + "/cpu/"
    command = [sys.executable, str(RECIPE), "--cpu", "--out-dir", str(tmp_path / "dist"), "--requirement-for", base]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == f"llama-cpp-python @ {base}{WHEEL}#sha256={manifest['wheel']['sha256']}"
