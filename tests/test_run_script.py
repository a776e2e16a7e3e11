"""`bash run.sh` from a clean copy of the checkout to a Space that answers a /chat call, then a second start that
skips every setup step and serves its page within seconds, then `.venv/bin/python app.py` on its own, whose start-up
check finds the wheel's manifest where run.sh recorded it.

The first run makes a new .venv and installs the requirements from the package index for real (pip's own cache is
shared); llama-cpp-python comes from the wheel cache that CI's recipe step fills (DFLASH_WHEEL_CACHE), so nothing is
compiled here when CI has run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from app_fixtures import REPO_ROOT, running_app
from gradio_client import Client
from space_client import chat_args, expected_answer, reference_engine, stream_chat

from dflash_runtime.testing.tiny_models import default_cache_dir

FIRST_RUN_TIMEOUT_S = 900.0  # a new venv: pip installs gradio, numpy, ... (minutes on 2 shared cores)
SECOND_RUN_LIMIT_S = 30.0
SECOND_RUN_TIMEOUT_S = 120.0  # bounded even when it is too slow: the assertion then says by how much
PROMPT = "hello from a fresh clone"
MAX_TOKENS = 24
LOGS = REPO_ROOT / "test-artifacts"
SKIPPED_STEPS = (
    "venv: reusing .venv",
    "up to date:",  # the wheel recipe's own check
    "already installed, skipping",  # the wheel
    "unchanged since the last install, skipping",  # the requirements
    "dflash_runtime already installed from this checkout, skipping",
)


def clean_clone(destination: Path) -> Path:
    """The checkout's files as a fresh clone has them: tracked and untracked-but-not-ignored ones, so no .venv, no
    caches, no build output (and the working tree as it is, committed or not)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT, capture_output=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        source = REPO_ROOT / name
        if source.is_file():  # a tracked file deleted from the working tree is listed too
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def run_sh_env() -> dict[str, str]:
    """The offline demo, llama-cpp-python's CPU wheel from CI's cache, the suite's generated models."""
    return {
        "DFLASH_WHEEL_CACHE": os.environ.get(
            "DFLASH_WHEEL_CACHE", str(Path.home() / ".cache" / "dflash-space" / "wheels-dl")
        ),
        "DFLASH_WHEEL_VARIANT": "cpu",  # the wheel CI builds, also where nvcc and a GPU would choose CUDA
        "DFLASH_DEMO": "tiny",
        "DFLASH_DEMO_PAIR": "dense",
        "DFLASH_TINY_CACHE": str(default_cache_dir()),
    }


@pytest.mark.slow
def test_run_sh_from_a_clean_clone_serves_the_space_restarts_in_seconds_and_leaves_a_checked_venv(
    tmp_path: Path,
) -> None:
    clone = clean_clone(tmp_path / "clone")
    command = ["bash", str(clone / "run.sh")]
    try:
        started = time.monotonic()
        with running_app(run_sh_env(), LOGS / "run_sh_first.log", command=command, app_dir=clone,
                         timeout_s=FIRST_RUN_TIMEOUT_S) as first:  # fmt: skip
            first_s = time.monotonic() - started
            text, stats = stream_chat(Client(first.url, verbose=False), **chat_args(PROMPT, max_tokens=MAX_TOKENS))[-1]
            first_log = first.log()
        with reference_engine(n_ctx=1024) as engine:
            assert text == expected_answer(engine, [{"role": "user", "content": PROMPT}], MAX_TOKENS)
        assert stats["n_generated"] > 0
        assert "venv: creating .venv" in first_log
        assert "llama-cpp-python variant: cpu (DFLASH_WHEEL_VARIANT=cpu)" in first_log
        assert "llama-cpp-python: installing" in first_log  # from the cache: no build line unless it was missing
        # run.sh's check, then the app's own start-up check, both against the cached wheel's manifest
        assert first_log.count("installed build matches its wheel manifest") == 2, first_log

        started = time.monotonic()
        with running_app(run_sh_env(), LOGS / "run_sh_second.log", command=command, app_dir=clone,
                         timeout_s=SECOND_RUN_TIMEOUT_S) as second:  # fmt: skip
            second_s = time.monotonic() - started
            second_log = second.log()
        print(f"bash run.sh in a clean clone: first run to a served page {first_s:.1f} s, second {second_s:.1f} s")
        missing = [line for line in SKIPPED_STEPS if line not in second_log]
        assert not missing, f"steps not skipped on the second run: {missing}\n{second_log}"
        steps = [line for line in second_log.splitlines() if line.startswith("[run.sh]")]
        assert not [line for line in steps if "installing" in line or "creating" in line], second_log
        assert second_s < SECOND_RUN_LIMIT_S, f"the second run took {second_s:.1f} s to serve its page"

        # run.sh stopped, the app started from its venv without run.sh's environment (no DFLASH_WHEEL_MANIFEST, no
        # DFLASH_WHEEL_CACHE, another HOME: no default cache either): the start-up check finds the manifest run.sh
        # recorded, and says the build matches, not "no wheel manifest found".
        alone = {**run_sh_env(), "HOME": str(tmp_path / "home")}
        del alone["DFLASH_WHEEL_CACHE"], alone["DFLASH_WHEEL_VARIANT"]
        with running_app(alone, LOGS / "run_sh_then_app.log", command=[str(clone / ".venv" / "bin" / "python"),
                         str(clone / "app.py")], app_dir=clone, timeout_s=SECOND_RUN_TIMEOUT_S) as app:  # fmt: skip
            app_log = app.log()
        assert "no wheel manifest found" not in app_log, app_log
        assert "installed build matches its wheel manifest" in app_log, app_log
    finally:
        shutil.rmtree(clone, ignore_errors=True)  # its venv is large
