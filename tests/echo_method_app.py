"""app.py with a test-only draft method registered (tests/echo_method.py), nothing of the Space changed: what the
Space shows of a method comes from the registry. Only for tests: `python tests/echo_method_app.py`."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import echo_method  # noqa: E402

echo_method.register()
runpy.run_path(str(ROOT / "app.py"), run_name="__main__")
