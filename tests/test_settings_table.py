"""The public layer's settings are one table (dflash_runtime/space/setup/settings.py): each with its variable, its
default and why; docs/settings.md shows that very table; each variable is read, and a bad value names it; nothing in
the Space reads one of them anywhere else."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from dflash_runtime.space.setup.settings import PublicSettings, queue_size, settings_table

ROOT = Path(__file__).resolve().parents[1]


def test_docs_show_the_table_itself() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text()
    found = re.search(r"<!-- the table of dflash_runtime/space/setup/settings.py[^>]*-->\n(.*?)\n<!-- end of the "
                      r"table -->", doc, re.S)  # fmt: skip
    assert found is not None and found.group(1) == settings_table(), "regenerate: settings_table()"


def test_every_setting_has_its_variable_default_and_why_and_is_read() -> None:
    rows = fields(PublicSettings)
    assert len({f.metadata["env"] for f in rows}) == len(rows) and all(f.metadata["why"] for f in rows)
    env = {f.metadata["env"]: str(int(f.default) + 1) if f.type in ("int", int) else "7.25" for f in rows}
    read = PublicSettings.from_env(env)
    for f in rows:
        assert getattr(read, f.name) == type(f.default)(float(env[f.metadata["env"]])), f.name
    assert PublicSettings.from_env({"SPACE_ID": "a/b"}).trusted_proxy_hops == 1, "behind Hugging Face's proxy"
    assert PublicSettings.from_env({"DFLASH_TOTAL_JOBS": "500"}, queue_size=64).total_jobs == 64
    assert PublicSettings.from_env({"DFLASH_READER_PROBE_BYTES_S": "0"}).probe_bytes_s == 0, "0 turns the floor off"
    with pytest.raises(ValueError, match="DFLASH_CLIENT_JOBS must be a positive number"):
        PublicSettings.from_env({"DFLASH_CLIENT_JOBS": "0"})
    with pytest.raises(ValueError, match="DFLASH_QUANTUM_S must be a number"):
        PublicSettings.from_env({"DFLASH_QUANTUM_S": "soon"})
    with pytest.raises(ValueError, match="DFLASH_CLIENT_JOBS must be a whole number"):
        PublicSettings.from_env({"DFLASH_CLIENT_JOBS": "0.5"})  # a count is never rounded down to 0
    assert queue_size({}) == 64 and queue_size({"DFLASH_QUEUE_SIZE": "32"}) == 32


def test_nothing_else_reads_the_tables_variables() -> None:
    names = {f.metadata["env"] for f in fields(PublicSettings)}
    table = ROOT / "dflash_runtime" / "space" / "setup" / "settings.py"
    elsewhere = {(path.name, name) for path in (ROOT / "dflash_runtime").rglob("*.py") if path != table
                 for name in names if f'"{name}"' in path.read_text()}  # fmt: skip
    assert elsewhere == set()
