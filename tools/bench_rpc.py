"""What an RPC server costs a pair per step: the demo pair with part of its target on an rpc-server over loopback
(the CPU backend on both ends), against the same pair all local.

    python tools/bench_rpc.py [--pair dense|methods] [--gpu-layers 5] [--max-tokens 64] [--runs 3] [--json out.json]

For each mode (plain, DFlash 2, MTP where the pair has it) it runs the prompts `runs` times on each engine and
reports the median speed, the target decodes, and through the relay's counters the round trips and bytes per decode;
it checks that both engines answered the same tokens. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_runtime import load_pair
from dflash_runtime.space.presets import DEMO_PAIRS
from dflash_runtime.testing.rpc_server import LoopbackServer
from dflash_runtime.testing.tiny_models import tiny_pair

PROMPTS = ("the quick brown fox jumps over the lazy dog.", "one two three four five six", "hello world")


def run_mode(engine: Any, mode: dict[str, Any], max_tokens: int, runs: int, endpoint: str | None) -> dict[str, Any]:
    speeds, answers = [], []
    decodes = trips = sent = received = 0
    seconds = 0.0
    for _ in range(runs):
        for prompt in PROMPTS:
            engine.reset()
            before_steps = engine.step_counters()["decodes"]
            before = engine.info()["placement"].get("rpc", {}).get(endpoint) if endpoint else None
            started = time.perf_counter()
            result = engine.generate(prompt, max_tokens=max_tokens, **mode)
            elapsed = time.perf_counter() - started
            seconds += elapsed
            speeds.append(len(result.tokens) / elapsed)
            answers.append(result.tokens)
            decodes += engine.step_counters()["decodes"] - before_steps
            if before is not None:
                after = engine.info()["placement"]["rpc"][endpoint]
                trips += after["round_trips"] - before["round_trips"]
                sent += after["bytes_sent"] - before["bytes_sent"]
                received += after["bytes_received"] - before["bytes_received"]
    out = {"tok_s": round(statistics.median(speeds), 1), "decodes_per_request": decodes / (runs * len(PROMPTS)),
           "ms_per_decode": round(1000 * seconds / decodes, 3), "answers": answers}
    if endpoint:
        out |= {"round_trips_per_decode": round(trips / decodes, 2), "bytes_sent_per_decode": round(sent / decodes),
                "bytes_received_per_decode": round(received / decodes)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=sorted(DEMO_PAIRS), default="dense")
    ap.add_argument("--gpu-layers", type=int, default=5, help="layers (the output head counts as one) on the server")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads of each end's CPU device")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    pair = tiny_pair(**DEMO_PAIRS[args.pair][0])
    options = {"n_ctx": 1024, "draft_capacity": 7, "n_threads": args.threads}
    results: dict[str, Any] = {"pair": args.pair, "gpu_layers": args.gpu_layers, "runs": args.runs,
                               "max_tokens": args.max_tokens}  # fmt: skip
    server = LoopbackServer(threads=args.threads).start()
    remote_options = {"rpc": [server.endpoint], "rpc_cpu": True, "n_gpu_layers": args.gpu_layers,
                      "draft_gpu_layers": 0}
    try:
        with load_pair(pair.target, pair.draft, **options) as local, \
                load_pair(pair.target, pair.draft, **options, **remote_options) as remote:
            results["placement"] = {k: v for k, v in remote.info()["placement"].items() if k != "rpc"}
            modes = {"plain": {"speculative": False}}
            modes |= {m: {"method": m} for m in ("dflash", "mtp") if m in local.methods}
            for name, mode in modes.items():
                here = run_mode(local, mode, args.max_tokens, args.runs, None)
                there = run_mode(remote, mode, args.max_tokens, args.runs, server.endpoint)
                same = here.pop("answers") == there.pop("answers")
                results[name] = {"local": here, "rpc": there, "same_tokens": same,
                                 "added_ms_per_decode": round(there["ms_per_decode"] - here["ms_per_decode"], 3)}
                print(name, json.dumps(results[name]), flush=True)
    finally:
        server.kill()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(v.get("same_tokens", True) for v in results.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
