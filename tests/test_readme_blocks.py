"""Every `python` and `bash` block of README.md runs as written, on generated models.

Each block runs in a fresh folder of its own, as a separate process (a Python file, or `bash -e`), with the project
importable as `pip install -e .` makes it, and with the file names the blocks use (`target.gguf`,
`Qwen3.8-27B-NVFP4-MTP-Q8attn.gguf`, ...) linked to a generated tiny pair. The two blocks that talk to a running
Space get an offline demo started by the test: their address `http://127.0.0.1:7860` becomes that server's (the one
substitution, printed). A block that cannot run here says so in its fence (```bash no-run) with its reason in the
HTML comment above; those are counted and printed, never skipped silently, and their number stays small. Any other
fenced block (a diagram, a table, output) must not look like code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app

from dflash_runtime.testing.tiny_models import tiny_pair

README = REPO_ROOT / "README.md"
RUNNABLE = ("python", "bash")
NO_RUN = "no-run"
MAX_NO_RUN = 11  # builds, servers that run until stopped, uploads, CI itself, a GPU, llama-server: keep it small
LOCAL_SPACE = "http://127.0.0.1:7860"
# The names the blocks give the model files, and which file of a tiny pair each one is.
TARGET_NAMES = ("target.gguf", "Qwen3.8-27B-NVFP4-MTP-Q8attn.gguf")
DRAFT_NAMES = ("draft-dflash2.gguf", "Qwen3.8-27B-DFlash2-Q4_K_M.gguf")
MAX_LOG_LINES = 10  # what a block may write to stderr: a warning or two, never llama.cpp's loading log
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    language: str
    flags: tuple[str, ...]
    reason: str | None  # the `<!-- no-run: ... -->` comment right above the fence
    code: str

    @property
    def runs(self) -> bool:
        return self.language in RUNNABLE and NO_RUN not in self.flags

    @property
    def name(self) -> str:
        return f"{self.language}-line-{self.line}"


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = re.match(r"^<!-- no-run: (.+) -->$", lines[i - 1]) if i else None
        blocks.append(Block(i + 1, opening.group(1), tuple(opening.group(2).split()),
                            above.group(1) if above else None, "\n".join(lines[i + 1 : end]) + "\n"))  # fmt: skip
        i = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))
TO_RUN = [block for block in BLOCKS if block.runs]


def test_the_readme_says_which_blocks_do_not_run_and_why() -> None:
    not_run = [block for block in BLOCKS if block.language in RUNNABLE and not block.runs]
    print(f"\nREADME.md: {len(BLOCKS)} fenced blocks, {len(TO_RUN)} run, {len(not_run)} marked no-run:")
    for block in not_run:
        print(f"  line {block.line} ({block.language} no-run): {block.reason}")
    assert all(block.reason for block in not_run), [b.line for b in not_run if not b.reason]
    assert all(block.reason is None for block in TO_RUN), "a no-run reason above a block that runs"
    assert len(not_run) <= MAX_NO_RUN, "more blocks left unrun than the few that cannot run here"
    assert len(TO_RUN) >= 7, "the blocks that show the API, the CLI and the Space's client run"
    for block in BLOCKS:
        if block.language not in RUNNABLE:  # diagrams, tables, output: no code hidden from the test
            assert block.language == "", f"line {block.line}: a ```{block.language} block neither runs nor is text"
            code_like = [ln for ln in block.code.splitlines() if re.match(r"\s*(python|pip|from |import |\$ )", ln)]
            assert not code_like, f"line {block.line}: code in a block that does not run: {code_like}"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pair = tiny_pair("dense", "dflash2")
    assert pair.draft is not None
    return {**dict.fromkeys(TARGET_NAMES, pair.target), **dict.fromkeys(DRAFT_NAMES, pair.draft)}


@pytest.fixture(scope="module")
def space() -> Iterator[RunningApp]:
    with running_app({"DFLASH_DEMO": "tiny", "DFLASH_N_CTX": "2048"},
                     REPO_ROOT / "test-artifacts" / "readme_blocks_server.log") as app:  # fmt: skip
        yield app


def block_env() -> dict[str, str]:
    """This interpreter's environment, the project importable from anywhere (as `pip install -e .` makes it)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.parametrize("block", TO_RUN, ids=[block.name for block in TO_RUN])
def test_a_readme_block_runs_as_written(block: Block, models: dict[str, Path], tmp_path: Path,
                                        request: pytest.FixtureRequest) -> None:  # fmt: skip
    for name, path in models.items():
        (tmp_path / name).symlink_to(path)
    code = block.code
    if LOCAL_SPACE in code:
        url = request.getfixturevalue("space").url.rstrip("/")
        print(f"line {block.line}: {LOCAL_SPACE} -> {url} (the test's offline demo)")
        code = code.replace(LOCAL_SPACE, url)
    script = tmp_path / ("block.py" if block.language == "python" else "block.sh")
    script.write_text(code, encoding="utf-8")
    command = [sys.executable, str(script)] if block.language == "python" else ["bash", "-e", str(script)]
    done = subprocess.run(command, cwd=tmp_path, env=block_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    print(done.stdout[-4000:])
    assert done.returncode == 0, f"README line {block.line} failed:\n{done.stderr[-4000:]}"
    log = [line for line in done.stderr.splitlines() if line.strip()]
    shown = "\n".join(log[:40])
    assert len(log) <= MAX_LOG_LINES, f"README line {block.line} writes {len(log)} lines of log:\n{shown}"
    assert done.stdout.strip(), f"README line {block.line} shows nothing"
