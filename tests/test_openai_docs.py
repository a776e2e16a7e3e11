"""docs/openai-api.md's blocks run as written, in a fresh shell (tests/doc_shell.py: the project's `.venv` in an
otherwise empty folder, nothing activated): the bash block (it generates a pair, starts `.venv/bin/python -m
dflash_runtime serve` on it, asks with curl, stops it); the openai-client block (marked no-run: it needs a server left
running) in `.venv/bin/python` against a server this test starts as the bash block does, its address put in place of
the doc's (the one substitution, printed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from app_fixtures import REPO_ROOT
from doc_shell import run_block
from openai_clients import running_serve

DOC = REPO_ROOT / "docs" / "openai-api.md"
DOC_SERVER = "http://127.0.0.1:8080"
TIMEOUT_S = 300


def blocks(language: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("openai-doc")  # empty: the block makes what it uses


def served_model(code: str) -> str:
    """The id the bash block starts the server with (`--model`), which its requests must use."""
    found = re.search(r"--model (\S+)", code)
    assert found, "the block names the model id it serves"
    return found.group(1)


def test_the_curl_block_gets_a_chat_answer_from_serve(folder: Path) -> None:
    (code,) = blocks("bash")
    done = run_block("bash", code, folder, TIMEOUT_S)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stderr[-3000:] + (folder / "serve.log").read_text()[-3000:]
    models, answer = (json.loads(line) for line in done.stdout.splitlines() if line.strip())
    model = served_model(code)
    assert [m["id"] for m in models["data"]] == [model] and answer["model"] == model
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == answer["timings"]["predicted_n"] > 0
    assert "--fail-with-body" in code and " -sf " not in code, "an error answer is printed, not swallowed"


def test_the_openai_client_block_runs_against_serve(folder: Path) -> None:
    (bash,) = blocks("bash")
    (code,) = blocks("python")
    pair = subprocess.run([sys.executable, "-m", "dflash_runtime.testing.tiny_models"], capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=True).stdout.split()  # fmt: skip
    target, draft = map(Path, pair)
    with running_serve(target, draft, REPO_ROOT / "test-artifacts" / "openai_docs_serve.log", "--model",
                       served_model(bash)) as server:  # fmt: skip
        print(f"{DOC_SERVER} -> {server.url} (the test's server)")
        done = run_block("python", code.replace(DOC_SERVER, server.url), folder, TIMEOUT_S)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "completion_tokens=32" in done.stdout and "'drafted'" in done.stdout
