"""`python -m dflash_runtime generate | bench` on generated models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pairs import pair_files


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash_runtime", *args], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])


def test_generate_prints_text_then_stats() -> None:
    files = pair_files("hybrid", "dflash2")
    out = run_cli("generate", "--target", str(files.target), "--draft", str(files.draft), "--prompt", "hello world",
                  "--max-tokens", "12", "--draft-length", "4", "--n-ctx", "512", "--json")
    assert out.returncode == 0, out.stderr
    text, _, rest = out.stdout.partition("[finish: length")
    assert "hello" in text
    stats = json.loads(rest.split("]", 1)[1])
    assert stats["n_generated"] == 12 and stats["drafted"] > 0


def test_bench_writes_json_and_a_table(tmp_path: Path) -> None:
    files = pair_files("dense", "dflash2")
    out_json = tmp_path / "bench.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    out = run_cli("bench", "--target", str(files.target), "--draft", str(files.draft), "--prompts", str(prompts),
                  "--max-tokens", "8", "--draft-length", "1,3,auto", "--runs", "2", "--n-ctx", "512",
                  "--json", str(out_json))
    assert out.returncode == 0, out.stderr
    assert "vs plain" in out.stdout and "host ms/step" in out.stdout
    assert "warmed up with one unmeasured request" in out.stdout and "the median of 2 runs" in out.stdout
    result = json.loads(out_json.read_text())
    assert result["config"]["warmup_tokens"] > 0
    modes = next(iter(result["pairs"].values()))["modes"]
    assert set(modes) == {"plain", "dflash 1", "dflash 3", "dflash auto"}
    assert modes["plain"]["speedup"] == 1.0 and len(modes["dflash 3"]["runs_tok_s"]) == 2
    assert modes["dflash 1"]["acceptance_rate"] > 0 and modes["plain"]["acceptance_rate"] == 0


def test_bad_pair_is_a_clear_cli_error(tmp_path: Path) -> None:
    files = pair_files("dense", "dflash2")
    out = run_cli("generate", "--target", str(files.draft), "--prompt", "hi")
    assert out.returncode == 1 and "must be opened together with its target" in out.stderr


def test_tiny_bench_compares_verify_modes_and_reports_checkpoint_costs(tmp_path: Path) -> None:
    out_json = tmp_path / "soft.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\n")
    out = subprocess.run(
        [sys.executable, "-m", "dflash_runtime.testing.bench", "--pairs", "hybrid:soft:128", "--prompts", str(prompts),
         "--max-tokens", "48", "--draft-length", "7", "--temperature", "0.6", "--verify", "sample,match", "--runs", "1",
         "--n-ctx", "512", "--json", str(out_json)],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr
    assert "ckpt ms/req" in out.stdout
    modes = json.loads(out_json.read_text())["pairs"]["hybrid-soft-128"]["modes"]
    assert set(modes) == {"plain", "dflash 7 sample", "dflash 7 match"}
    assert modes["dflash 7 sample"]["acceptance_rate"] > modes["dflash 7 match"]["acceptance_rate"]
    assert modes["plain"]["checkpoint_bytes_per_request"] > 0  # a hybrid target saves one at the prompt's end


def test_the_old_draft_max_flag_still_works_and_says_so() -> None:
    files = pair_files("dense", "dflash2")
    out = run_cli("generate", "--target", str(files.target), "--draft", str(files.draft), "--prompt", "hello world",
                  "--max-tokens", "6", "--draft-max", "3", "--n-ctx", "512", "--json")
    assert out.returncode == 0, out.stderr
    assert "--draft-max is now --draft-length" in out.stderr
    stats = json.loads(out.stdout.partition("[finish: length")[2].split("]", 1)[1])
    assert stats["draft_length"] == 3


def generated_text(*options: str) -> str:
    files = pair_files("dense", "dflash2", head="random")  # a random head: flat enough for draws to differ
    out = run_cli("generate", "--target", str(files.target), "--prompt", "hello world", "--max-tokens", "24",
                  "--n-ctx", "512", "--no-spec", "--seed", "3", *options)
    assert out.returncode == 0, out.stderr
    return out.stdout.partition("[finish:")[0]


def test_generate_takes_top_k_and_min_p() -> None:
    """At temperature 2 the draws wander from the greedy text; --top-k 1, or --min-p 0.99, leave only the top token."""
    greedy = generated_text("--temperature", "0")
    assert generated_text("--temperature", "2", "--top-k", "0", "--top-p", "1") != greedy
    assert generated_text("--temperature", "2", "--top-k", "1") == greedy
    assert generated_text("--temperature", "2", "--top-k", "0", "--min-p", "0.99") == greedy
