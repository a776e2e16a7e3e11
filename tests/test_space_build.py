"""The Spaces build order, simulated: requirements.txt as `build_wheel.py publish` writes it, installed on its own into
a fresh venv by pip with the platform's gradio and `spaces`, the wheel downloaded from a local fake of the Hub; then
the repository copied in and app.py started; /info reports the build it got.

The Spaces builder runs `pip install -r requirements.txt gradio==<sdk_version> spaces` with requirements.txt
bind-mounted alone, then copies the repository. packages.txt (apt) is not run here: test_space_config checks that
it names what the wheel needs, and CI's machine has those packages. The CPU twin stands in for the CUDA wheel (same
recipe, same publish path); the CUDA wheel itself is measured in prebuilt_wheels/README.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from app_fixtures import REPO_ROOT, running_app
from gradio_client import Client
from hub_repo_fake import FakeHubRepos

RECIPE = REPO_ROOT / "prebuilt_wheels" / "build_wheel.py"
WHEEL_REPO = "space-owner/dflash-wheels"
PIP_TIMEOUT_S = 900  # a fresh CI machine downloads gradio and its dependencies once


def built_cpu_wheel() -> Path:
    """The directory of the recipe's CPU wheel and its manifest (CI: $DFLASH_WHEEL_MANIFEST)."""
    explicit = os.environ.get("DFLASH_WHEEL_MANIFEST")
    candidates = [Path(explicit)] if explicit else []
    candidates.append(REPO_ROOT / "prebuilt_wheels" / "dist" / "cpu" / "manifest.json")
    for candidate in candidates:
        manifest = candidate if candidate.is_file() else candidate / "manifest.json"
        if manifest.is_file() and json.loads(manifest.read_text()).get("variant") == "cpu":
            return manifest.parent
    raise AssertionError(f"no CPU wheel manifest in {candidates}: python prebuilt_wheels/build_wheel.py --cpu")


def pip(venv: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)


def sdk_version() -> str:
    return re.search(r"^sdk_version: (\S+)$", (REPO_ROOT / "README.md").read_text(), re.MULTILINE).group(1)


def spaces_pin() -> str:
    """The platform installs `spaces`; the same version as the rest of the tests use."""
    lines = (REPO_ROOT / "requirements-dev.txt").read_text().splitlines()
    return next(line for line in lines if line.startswith("spaces"))


def repository_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [name for name in out.stdout.splitlines() if (REPO_ROOT / name).is_file()]


@pytest.fixture(scope="module")
def space(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("space-build")
    hub = FakeHubRepos().start()
    try:
        checkout = tmp / "checkout"  # the owner's working tree: publish rewrites its requirements.txt
        checkout.mkdir()
        shutil.copy(REPO_ROOT / "requirements.txt", checkout / "requirements.txt")
        command = [sys.executable, str(RECIPE), "publish", "--repo", WHEEL_REPO, "--cpu", "--no-build"]
        command += ["--out-dir", str(built_cpu_wheel()), "--endpoint", hub.endpoint, "--token", "hf_test"]
        command += ["--requirements", str(checkout / "requirements.txt")]
        env = {**os.environ, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp / "hf-home")}
        published = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert published.returncode == 0, published.stderr[-3000:]
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        yield {"hub": hub, "tmp": tmp, "checkout": checkout, "venv": venv}
    finally:
        hub.stop()


def test_a_wrong_wheel_hash_fails_the_install(space: dict) -> None:
    text = (space["checkout"] / "requirements.txt").read_text()
    sha256 = re.search(r"#sha256=([0-9a-f]{64})", text).group(1)
    wrong = sha256[:-1] + ("0" if sha256[-1] != "0" else "1")
    alone = space["tmp"] / "wrong-hash"
    alone.mkdir()
    (alone / "requirements.txt").write_text(text.replace(sha256, wrong))
    result = pip(space["venv"], alone, "--no-deps", "-r", "requirements.txt")
    assert result.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in result.stderr and wrong in result.stderr
    assert not list((space["venv"] / "lib").glob("python*/site-packages/llama_cpp"))


def test_requirements_alone_then_the_repository_give_a_working_space(space: dict) -> None:
    build = space["tmp"] / "build"
    build.mkdir()
    shutil.copy(space["checkout"] / "requirements.txt", build / "requirements.txt")  # bind-mounted alone
    result = pip(space["venv"], build, "-r", "requirements.txt", f"gradio=={sdk_version()}", spaces_pin())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    requests = [path for method, path in space["hub"].requests if method == "GET"]
    assert any(path.endswith(".whl") for path in requests), "the wheel came from the fake Hub"
    for name in repository_files():  # then the repository, with the owner's published manifest
        target = build / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name != "requirements.txt":
            shutil.copy(REPO_ROOT / name, target)
    shutil.copytree(space["checkout"] / "prebuilt_wheels" / "published", build / "prebuilt_wheels" / "published")
    tiny_cache = os.environ.get("DFLASH_TINY_CACHE") or str(REPO_ROOT / ".cache" / "tiny-models")
    env = {"DFLASH_DEMO": "tiny", "DFLASH_TINY_CACHE": tiny_cache}
    python = str(space["venv"] / "bin" / "python")
    with running_app(env, space["tmp"] / "app.log", python=python, app_dir=build) as app:
        info = Client(app.url, verbose=False).predict(api_name="/info")
    build_info = info["build"]
    assert build_info["llama_cpp_version"] == "0.3.36" and build_info["cuda_build"] is False
    assert build_info["dflash_missing_symbols"] == [] and build_info["ok"] is True
    status = build_info["status"]
    assert "(CPU build)" in status and "backends (loadable): CPU" in status, status
    assert "installed build matches its wheel manifest" in status, status
    assert str(build / "app.py") in " ".join(app.process.args)
