"""app.py with a deliberately broken verifier (one wrong draft token kept per request): what the Space's A/B page
says about a real fault. Only for tests: `python tests/broken_verifier_app.py` from the repository root."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_divergence import BrokenMatch  # noqa: E402

from dflash_runtime import engine  # noqa: E402
from dflash_runtime.decoding.verify import Verifiers  # noqa: E402

engine.Verifiers = lambda: Verifiers(match=BrokenMatch())  # type: ignore[assignment]  # every engine's default
runpy.run_path(str(ROOT / "app.py"), run_name="__main__")
