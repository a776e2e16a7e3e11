"""`python -m dflash_runtime bench --concurrency`: c streams at once on one engine opened with parallel sequences,
on a generated hybrid pair with an MTP head and a DFlash 2 draft (plain, DFlash and MTP). The figures must agree
with each other; no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dflash_runtime.cli.bench_concurrency import distinct_prompts
from dflash_runtime.testing.tiny_models import tiny_pair

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash_runtime", "bench", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_concurrency_bench_reports_consistent_figures(tmp_path: Path) -> None:
    pair = tiny_pair("hybrid", "dflash2", mtp_layers=1)
    assert pair.draft is not None
    out_json = tmp_path / "concurrency.json"
    out = run_bench("--target", str(pair.target), "--draft", str(pair.draft), "--methods", "plain", "dflash", "mtp",
                    "--concurrency", "1,2", "--max-tokens", "24", "--draft-length", "3", "--n-ctx", "512",
                    "--json", str(out_json))
    assert out.returncode == 0, out.stderr
    assert "rows/decode" in out.stdout and "ttft ms" in out.stdout
    # One unmeasured round first at each count, and the table says that each figure rests on one run (--runs 1).
    assert "one unmeasured round" in out.stdout and "Every figure rests on one run" in out.stdout
    result = json.loads(out_json.read_text())
    assert result["config"]["concurrency"] == [1, 2]
    assert len(set(result["config"]["prompts"])) == 2  # distinct prompts
    (bench,) = result["pairs"].values()
    assert bench["parallel"] == 2  # one engine for the whole run, opened for the largest concurrency
    levels = bench["concurrency"]
    assert set(levels) == {"plain", "dflash 3", "mtp 3"}
    for mode, per_c in levels.items():
        assert [lv["streams"] for lv in per_c] == [1, 2]
        assert per_c[0]["scaling"] == 1.0
        for lv in per_c:
            streams = lv["per_stream"]
            assert [s["prompt"] for s in streams] == list(range(lv["streams"]))
            assert lv["tokens"] == sum(s["tokens"] for s in streams) > 0
            assert all(s["tokens"] == s["n_generated"] for s in streams)  # events' tokens = the request's count
            assert lv["tok_s"] > 0 and lv["stream_tok_s_median"] > 0 and lv["wall_s"] > 0
            assert 0 < lv["ttft_ms_median"] <= lv["ttft_ms_max"]
            assert lv["decodes"] > 0 and lv["rows_per_decode"] >= 1 and lv["step_ms"] > 0
            # every decode row is a prompt token or a step's row: at least one row per stream step and prompt token
            assert lv["rows"] >= lv["stream_steps"] + sum(s["n_prefilled"] for s in streams)
            if mode != "plain":
                assert sum(s["drafted"] for s in streams) > 0
        alone, two = per_c
        # one stream: its decodes are its own (at least one prefill decode besides its steps)
        assert alone["decodes"] >= alone["stream_steps"] + 1
        # two streams: unshared, each would need a prefill decode besides its steps; fewer means some decode held
        # rows of both streams
        assert two["decodes"] < two["stream_steps"] + 2, (mode, two["decodes"], two["stream_steps"])


def test_distinct_prompts_repeat_the_base_marked_by_round() -> None:
    assert distinct_prompts(["a", "b"], 5) == ["a", "b", "a (2)", "b (2)", "a (3)"]
    assert distinct_prompts(["a", "b", "c"], 2) == ["a", "b"]


def test_concurrency_takes_counts_of_one_or_more(tmp_path: Path) -> None:
    pair = tiny_pair("dense", "dflash2")
    out = run_bench("--target", str(pair.target), "--draft", str(pair.draft), "--concurrency", "0,2")
    assert out.returncode == 2 and "--concurrency takes counts ≥ 1" in out.stderr
