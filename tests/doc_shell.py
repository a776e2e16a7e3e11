"""A fresh shell, as a reader has one after `bash run.sh`: in a folder with the project's `.venv`, nothing activated.

The documentation's blocks run here as written: a `bash` block with `bash` (its own `set -e` stops it at a failure),
a `python` block with `.venv/bin/python`, the interpreter the pages name. The environment keeps what any login shell
has (HOME, the locale, the system PATH without the venv's bin folder) and nothing a test session set up: no
VIRTUAL_ENV, no PYTHONPATH, no DFLASH_* setting (but the tiny models' cache folder, where the test session keeps it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

KEPT = ("HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TMPDIR", "DFLASH_TINY_CACHE")
VENV = Path(sys.prefix)


def fresh_env() -> dict[str, str]:
    """A login shell's environment: the venv's bin folder off PATH, nothing activated."""
    venv_bin = (VENV / "bin").resolve()
    path = [p for p in os.environ.get("PATH", os.defpath).split(os.pathsep) if p and Path(p).resolve() != venv_bin]
    return {**{k: os.environ[k] for k in KEPT if k in os.environ}, "PATH": os.pathsep.join(path)}


def reader_folder(folder: Path) -> Path:
    """`folder` set up as the checkout's root looks to a reader: the project's `.venv` in it (linked)."""
    if sys.prefix == sys.base_prefix:
        raise RuntimeError("the documentation's blocks run in the project's venv: run the tests from .venv")
    link = folder / ".venv"
    if not link.exists():
        link.symlink_to(VENV, target_is_directory=True)
    return folder


def run_block(language: str, code: str, folder: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """One block, as written, in `folder` (see `reader_folder`), in a fresh shell's environment."""
    reader_folder(folder)
    script = folder / ("block.py" if language == "python" else "block.sh")
    script.write_text(code, encoding="utf-8")
    command = [".venv/bin/python", script.name] if language == "python" else ["bash", script.name]
    return subprocess.run(command, cwd=folder, env=fresh_env(), capture_output=True, text=True, timeout=timeout_s)
