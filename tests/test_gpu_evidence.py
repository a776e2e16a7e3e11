"""tools/gpu_evidence.py in its CPU mode, as a GPU run would start it: the wheel installed into a fresh folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import llama_cpp

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("lossless", "verify_rows", "checkpoints", "speed", "host_overhead", "trees", "streams")


def installed_wheel() -> Path:
    """The llama-cpp-python wheel this environment was installed from: the manifest's, beside it."""
    manifest = Path(os.environ.get("DFLASH_WHEEL_MANIFEST", REPO / "prebuilt_wheels" / "dist" / "cpu"))
    manifest = manifest / "manifest.json" if manifest.is_dir() else manifest
    assert manifest.is_file(), f"no wheel manifest at {manifest}: set DFLASH_WHEEL_MANIFEST (CI does)"
    wheel = manifest.parent / json.loads(manifest.read_text())["wheel"]["filename"]
    assert wheel.is_file(), wheel
    return wheel


def carried_wheels(folder: Path) -> Path:
    """What a GPU run carries (the wheel and its manifest), less the pure-Python gguf and diskcache, which this
    environment has."""
    folder.mkdir()
    wheel = installed_wheel()
    shutil.copy(wheel, folder)
    shutil.copy(wheel.parent / "manifest.json", folder)
    return folder


def test_cpu_mode_writes_every_section_and_finds_no_mismatch(tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    wheels = carried_wheels(tmp_path / "carry")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_evidence.py"), "--cpu", "--out", str(out),
                          "--wheels", str(wheels), "--work", str(tmp_path / "work"),
                          "--models", str(tmp_path / "models")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "gpu-evidence.json").read_text())
    for section in SECTIONS:
        assert section in result and "error" not in result[section] and not result[section].get("skipped"), section
    env_info = result["environment"]
    # the measured llama_cpp is the freshly installed copy, not this environment's
    assert env_info["llama_cpp_path"].startswith(str(tmp_path / "work" / "site"))
    assert Path(llama_cpp.__file__).parent != Path(env_info["llama_cpp_path"])
    assert env_info["mode"] == "cpu" and "CPU" in env_info["backends_registered"]
    assert env_info["startup"]["manifest"]["matches"], env_info["startup_status"]

    loss = result["lossless"]
    assert loss["mismatch_count"] == 0 and loss["mismatches"] == []
    assert loss["near_ties"] == 0 and loss["faults"] == 0, "a batch-invariant CPU build: no difference at all"
    combos = {(r["target"], r["method"], str(r["draft_length"])) for r in loss["rows"]}
    lengths = ("1", "3", "7", "auto")
    assert combos == ({("dense", "dflash", n) for n in lengths} | {("hybrid", m, n) for m in ("dflash", "mtp")
                                                                  for n in lengths})
    assert all(r["requests"] == 8 and r["generated"] > 0 for r in loss["rows"])
    assert any(r["accepted"] < r["drafted"] for r in loss["rows"])  # rejected drafts were verified too
    assert any(r["checkpoint_restores"] for r in loss["rows"] if r["target"] == "hybrid")

    rows = result["verify_rows"]["targets"]["large-dense-const"]["rows"]
    assert [r["rows"] for r in rows] == list(range(1, 17)) and all(r["median_ms"] > 0 for r in rows)
    ck = result["checkpoints"]
    assert ck["bytes"] > 0 and ck["rounds"][0]["restored_at"] and ck["restore_ms"] > 0
    speed = result["speed"]["pairs"]
    assert {"large-dense-const", "large-dense-phrase"} <= set(speed)
    const = speed["large-dense-const"]["modes"]
    assert const["plain"]["tok_s"] > 0 and const["dflash 3"]["acceptance_rate"] > 0.9
    assert speed["large-dense-const"]["plain_bandwidth_gb_s"] > 0
    assert all(0 <= r["host_share"] <= 1 for r in result["host_overhead"]["rows"])
    tree_pairs = result["trees"]["pairs"]
    tree_rows = [r for p in tree_pairs.values() for r in p["rows"]]
    assert {r["mode"] for r in tree_rows} == {"linear", "linear-q", "tree", "tree-auto"} and len(tree_rows) == 21
    assert all(r["mismatches"] == 0 and r["accepted_per_verify"] >= 1 for r in tree_rows)
    hybrid = tree_pairs["small-hybrid-phrase-mtp"]  # its paths' forks: on the device, none through host memory
    assert hybrid["target"] == "hybrid" and hybrid["forks"] > 0 and hybrid["fork_host_bytes"] == 0
    assert all(r["host_bytes_per_tree"] == 0 for r in hybrid["rows"])
    streams = result["streams"]["rows"]
    assert [r["streams"] for r in streams] == [1, 2, 4, 8] and all(r["parallel"] == 8 for r in streams)
    assert streams[-1]["rows_per_decode"] > streams[0]["rows_per_decode"]  # the 8 streams shared their decodes
    assert all(r["tokens"] > 0 and r["aggregate_tok_s"] > 0 for r in streams)

    table = (out / "gpu-evidence.md").read_text()
    for title in ("## Lossless", "## Verify rows", "## Checkpoints", "## Speed", "## Host time", "## Streams"):
        assert title in table
    assert "| dense | dflash | 7 |" in table
