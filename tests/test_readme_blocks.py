"""Every `python` and `bash` block of README.md and of every docs/*.md runs as written, on generated models.

Each block runs in a fresh folder of its own, as a separate process in a fresh shell's environment (tests/doc_shell.py:
the project's `.venv` in the folder, nothing activated, so a block says `.venv/bin/python` or activates it; a `python`
block runs in `.venv/bin/python`, a `bash` block with plain `bash`, so that one of several commands stops at a failure
only by its own `set -e`), with the file names the blocks use (`target.gguf`, `Qwen3.8-27B-NVFP4-MTP-Q8attn.gguf`, ...)
linked to a generated tiny pair. The blocks that talk to a running Space
get an offline demo started by the test: their address `http://127.0.0.1:7860` becomes that server's (the one
substitution, printed). A block that cannot run here says so in its fence (```bash no-run) with its reason in the
HTML comment above; those are counted and printed, never skipped silently, and their number stays small. Any other
fenced block (a diagram, a table, output) must not look like code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from app_fixtures import REPO_ROOT, RunningApp, running_app
from doc_shell import run_block

from dflash_runtime.testing.tiny_models import tiny_pair

README = REPO_ROOT / "README.md"
# The quick start and every page it links to: a page added under docs/ is picked up without naming it here.
DOCUMENTS = (README, *sorted((REPO_ROOT / "docs").glob("*.md")))
RUNNABLE = ("python", "bash")
NO_RUN = "no-run"
MAX_NO_RUN_README = 1  # the quick start's two commands (a server that runs until stopped, and CI itself)
MAX_NO_RUN_PER_PAGE = 4  # builds, servers that run until stopped, uploads, a GPU, llama-server: keep it small
LOCAL_SPACE = "http://127.0.0.1:7860"
# The names the blocks give the model files, and which file of a tiny pair each one is.
TARGET_NAMES = ("target.gguf", "Qwen3.8-27B-NVFP4-MTP-Q8attn.gguf")
DRAFT_NAMES = ("draft-dflash2.gguf", "Qwen3.8-27B-DFlash2-Q4_K_M.gguf")
MAX_LOG_LINES = 10  # what a block may write to stderr: a warning or two, never llama.cpp's loading log
TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    document: str  # its file, relative to the repository: README.md, docs/space.md, ...
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
        return f"{self.document}:{self.language}-line-{self.line}"


def readme_blocks(text: str, document: str = "README.md") -> list[Block]:
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = re.match(r"^<!-- no-run: (.+) -->$", lines[i - 1]) if i else None
        blocks.append(Block(document, i + 1, opening.group(1), tuple(opening.group(2).split()),
                            above.group(1) if above else None, "\n".join(lines[i + 1 : end]) + "\n"))  # fmt: skip
        i = end + 1
    return blocks


def relative(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


BLOCKS = [block for path in DOCUMENTS for block in readme_blocks(path.read_text(encoding="utf-8"), relative(path))]
TO_RUN = [block for block in BLOCKS if block.runs]
# Prose a block may be shown as (```text, ```console, a diagram without a language): none of it runs.
TEXT_LANGUAGES = ("", "text", "console")


@pytest.mark.parametrize("document", DOCUMENTS, ids=relative)
def test_a_page_says_which_blocks_do_not_run_and_why(document: Path) -> None:
    name = relative(document)
    blocks = [block for block in BLOCKS if block.document == name]
    runs = [block for block in blocks if block.runs]
    not_run = [block for block in blocks if block.language in RUNNABLE and not block.runs]
    print(f"\n{name}: {len(blocks)} fenced blocks, {len(runs)} run, {len(not_run)} marked no-run:")
    for block in not_run:
        print(f"  line {block.line} ({block.language} no-run): {block.reason}")
    assert all(block.reason for block in not_run), [b.line for b in not_run if not b.reason]
    assert all(block.reason is None for block in runs), "a no-run reason above a block that runs"
    most = MAX_NO_RUN_README if document == README else MAX_NO_RUN_PER_PAGE
    assert len(not_run) <= most, f"{name}: more blocks left unrun than the few that cannot run here"
    for block in blocks:
        if block.language not in RUNNABLE:  # diagrams, tables, output: no code hidden from the test
            assert block.language in TEXT_LANGUAGES, \
                f"{name} line {block.line}: a ```{block.language} block neither runs nor is text"  # fmt: skip
            if block.language == "console":  # a transcript: its commands are what a reader types elsewhere
                continue
            code_like = [ln for ln in block.code.splitlines() if re.match(r"\s*(python|pip|from |import |\$ )", ln)]
            assert not code_like, f"{name} line {block.line}: code in a block that does not run: {code_like}"


def test_the_quick_start_is_short_and_its_examples_run() -> None:
    text = README.read_text(encoding="utf-8")
    words = len(text.split())  # the Space's front matter included
    print(f"\nREADME.md: {words} words")
    assert words <= 2500, f"README.md has {words} words: the quick start is read in five minutes"
    first_lines = "\n".join(text.splitlines()[:30])
    assert "bash run.sh" in first_lines and "bash .ci/run" in first_lines, "the two commands open the README"
    readme_runs = [block for block in TO_RUN if block.document == "README.md"]
    assert len(readme_runs) >= 2, "the Python API and the API client examples run"
    assert len(TO_RUN) >= 7, "the blocks that show the API, the CLI and the Space's client run"
    for path in DOCUMENTS[1:]:  # every page is reachable from the quick start or from another page
        linked = any(f"({relative(path) if page == README else path.name}" in page.read_text(encoding="utf-8")
                     for page in DOCUMENTS if page != path)  # fmt: skip
        assert linked, f"{relative(path)} is linked from nowhere"


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


def substituted(block: Block, request: pytest.FixtureRequest) -> str:
    """The block's code, a running Space's address put in place of the local one it names (printed)."""
    if LOCAL_SPACE not in block.code:
        return block.code
    url = request.getfixturevalue("space").url.rstrip("/")
    print(f"{block.document} line {block.line}: {LOCAL_SPACE} -> {url} (the test's offline demo)")
    return block.code.replace(LOCAL_SPACE, url)


def linked_models(folder: Path, models: dict[str, Path]) -> Path:
    for name, path in models.items():
        (folder / name).symlink_to(path)
    return folder


@pytest.mark.parametrize("block", TO_RUN, ids=[block.name for block in TO_RUN])
def test_a_readme_block_runs_as_written(block: Block, models: dict[str, Path], tmp_path: Path,
                                        request: pytest.FixtureRequest) -> None:  # fmt: skip
    done = run_block(block.language, substituted(block, request), linked_models(tmp_path, models), TIMEOUT_S)
    print(done.stdout[-4000:])
    assert done.returncode == 0, f"{block.document} line {block.line} failed:\n{done.stderr[-4000:]}"
    log = [line for line in done.stderr.splitlines() if line.strip()]
    shown = "\n".join(log[:40])
    assert len(log) <= MAX_LOG_LINES, f"{block.document} line {block.line} writes {len(log)} lines of log:\n{shown}"
    assert done.stdout.strip(), f"{block.document} line {block.line} shows nothing"
    if "gradio_api/call/chat" in block.code:  # a stream read without doubling its last item: /generate's text
        complete = re.search(r"^event: complete\ndata: (.*)$", done.stdout, re.MULTILINE)
        assert complete, done.stdout[-2000:]
        answer = json.loads(complete.group(1))[0]
        assert done.stdout.endswith(answer + "\n"), "the streamed text joined is not /generate's answer"


def commands(code: str) -> list[str]:
    """A bash block's commands: its lines but comments, blank ones and the continuations of a line ending in `\\`."""
    found, continued = [], False
    for line in code.splitlines():
        if not continued and line.strip() and not line.lstrip().startswith("#"):
            found.append(line.strip())
        continued = line.rstrip().endswith("\\")
    return found


# A bare interpreter or installer at the start of a command (or in `$(...)`): in a fresh shell not the venv's.
BARE_PYTHON = re.compile(r"(?:^|[\s;&|(])(?:python3?|pip3?) ")
ACTIVATES = re.compile(r"^(?:\.|source) \.venv/bin/activate\b", re.MULTILINE)


@pytest.mark.parametrize("block", [b for b in TO_RUN if b.language == "bash"], ids=lambda b: b.name)
def test_a_bash_block_stops_at_a_failure_and_names_the_venv(block: Block) -> None:
    """What a fresh shell needs of a block read as a script: with several commands, `set -e` first, so that it
    exits non-zero at the first failing one (not with the last echo's 0); the venv's interpreter named
    (`.venv/bin/python`), or the venv activated in the block."""
    lines = commands(block.code)
    if len(lines) > 1:
        assert lines[0].startswith("set -e"), f"{block.name}: several commands and no `set -e` first"
    if not ACTIVATES.search(block.code):
        bare = [line for line in lines if BARE_PYTHON.search(line)]
        assert not bare, f"{block.name}: a bare python or pip, not the venv's in a fresh shell: {bare}"


CLIENT_CALL = "api_name=\"/chat\""
BAD_MAX_TOKENS = "max_tokens=-5"


def test_the_readme_client_block_shows_the_servers_error(models: dict[str, Path], tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:  # fmt: skip
    """The README's gradio_client block with a value the server refuses: it exits non-zero with the server's own
    message (not a NameError of a loop that got no item)."""
    (block,) = [b for b in TO_RUN if b.document == "README.md" and CLIENT_CALL in b.code]
    code, n = re.subn(r"max_tokens=\d+", BAD_MAX_TOKENS, substituted(block, request))
    assert n == 1, "the block names max_tokens once"
    done = run_block(block.language, code, linked_models(tmp_path, models), TIMEOUT_S)
    print(done.stdout[-2000:], done.stderr[-2000:])
    assert done.returncode != 0, "a refused request ends the block with an error"
    assert "max_tokens must be an integer in 1..4096, got -5" in done.stderr, done.stderr[-2000:]
    assert "NameError" not in done.stderr


def test_the_deploy_text_is_true_of_requirements_as_committed() -> None:
    """What the README says a Space built from this repository installs follows requirements.txt as committed: no
    wheel URL there, no published wheel claimed (a duplicate builds a CPU wheel from source); and the README says
    that no GPU has run the code, naming the prepared check."""
    requirements = (REPO_ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines()
    (line,) = [ln for ln in requirements if ln.startswith("llama-cpp-python")]
    readme = " ".join(README.read_text(encoding="utf-8").split())
    deploy = " ".join((REPO_ROOT / "docs" / "deploy.md").read_text(encoding="utf-8").split())
    if "@ https://" not in line:  # no wheel published from this repository yet
        assert f"the plain `{line}`" in readme and "names no CUDA wheel" in readme, line
        assert "inherits the published CUDA wheel" not in readme
        assert f"its llama-cpp-python line is `{line}`" in deploy and "names no wheel" in deploy
    assert "No GPU has run this code yet." in readme
    assert "`tools/gpu_evidence.py`" in readme and (REPO_ROOT / "tools" / "gpu_evidence.py").is_file()
