"""What an RPC server costs a pair per step: the demo pair with part of its target on an rpc-server over loopback
(the CPU backend on both ends), against the same pair all local.

    python tools/bench_rpc.py [--pair dense|methods] [--gpu-layers 5] [--max-tokens 64] [--runs 3] [--json out.json]

For each mode (plain, DFlash 2, MTP where the pair has it) it runs the prompts `runs` times on each engine, one
request on each in turn, and reports the median speed and time per target decode, and through the relay's counters
the round trips and bytes per decode; it checks that both engines answered the same tokens. Before that, the time of
one small round trip straight to the server and through a relay. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_runtime import load_pair
from dflash_runtime.native.rpc import ask
from dflash_runtime.native.rpc_relay import CONN_CAPS_SIZE, DEVICE_COUNT, HELLO, Relay
from dflash_runtime.space.setup.presets import DEMO_PAIRS
from dflash_runtime.testing.rpc_server import LoopbackServer
from dflash_runtime.testing.tiny_models import tiny_pair

PROMPTS = ("the quick brown fox jumps over the lazy dog.", "one two three four five six", "hello world")


def one_request(engine: Any, prompt: str, mode: dict[str, Any], max_tokens: int, endpoint: str | None) -> dict:
    engine.reset()
    decodes = engine.step_counters()["decodes"]
    before = engine.info()["placement"]["rpc"][endpoint] if endpoint else None
    started = time.perf_counter()
    result = engine.generate(prompt, max_tokens=max_tokens, **mode)
    seconds = time.perf_counter() - started
    out = {"tokens": result.tokens, "seconds": seconds, "decodes": engine.step_counters()["decodes"] - decodes}
    if before is not None:
        after = engine.info()["placement"]["rpc"][endpoint]
        out |= {k: after[k] - before[k] for k in ("round_trips", "bytes_sent", "bytes_received")}
        out["commands"] = {c: n - before["commands"].get(c, 0) for c, n in after["commands"].items()
                           if n > before["commands"].get(c, 0)}
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    decodes = sum(r["decodes"] for r in runs)
    out = {"tok_s": round(statistics.median(len(r["tokens"]) / r["seconds"] for r in runs), 1),
           "ms_per_decode": round(statistics.median(1000 * r["seconds"] / r["decodes"] for r in runs), 3),
           "decodes_per_request": round(decodes / len(runs), 1)}
    if "round_trips" in runs[0]:
        out |= {f"{k}_per_decode": round(sum(r[k] for r in runs) / decodes, 2)
                for k in ("round_trips", "bytes_sent", "bytes_received")}
        names = sorted({c for r in runs for c in r["commands"]})
        out["commands_per_decode"] = {c: round(sum(r["commands"].get(c, 0) for r in runs) / decodes, 2)
                                      for c in names}
    return out


def ping_us(host: str, port: int, n: int) -> float:
    """Median microseconds of one small round trip (DEVICE_COUNT) to host:port."""
    times = []
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ask(sock, HELLO, bytes(CONN_CAPS_SIZE), 4 + CONN_CAPS_SIZE)
        for _ in range(n):
            started = time.perf_counter()
            ask(sock, DEVICE_COUNT, b"", 4)
            times.append(time.perf_counter() - started)
    return round(1e6 * statistics.median(times), 1)


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
    try:
        # One small round trip straight to the server and through a relay of its own (nothing else connected).
        relay = Relay("127.0.0.1", server.port)
        results["ping_us"] = {"direct": ping_us("127.0.0.1", server.port, 500),
                              "through_relay": ping_us("127.0.0.1", int(relay.address.rsplit(":", 1)[1]), 500)}
        print("ping", json.dumps(results["ping_us"]), flush=True)
        remote_options = {"rpc": [server.endpoint], "rpc_cpu": True, "n_gpu_layers": args.gpu_layers,
                          "draft_gpu_layers": 0}
        with load_pair(pair.target, pair.draft, **options) as local, \
                load_pair(pair.target, pair.draft, **options, **remote_options) as remote:
            results["placement"] = {k: v for k, v in remote.info()["placement"].items() if k != "rpc"}
            modes = {"plain": {"speculative": False}}
            # A fixed draft length: "auto" adapts to measured times, which differ between the two engines.
            modes |= {m: {"method": m, "draft_length": 7} for m in ("dflash", "mtp") if m in local.methods}
            for name, mode in modes.items():
                here, there = [], []
                for _ in range(args.runs):  # alternating, so that the machine's load falls on both alike
                    for prompt in PROMPTS:
                        here.append(one_request(local, prompt, mode, args.max_tokens, None))
                        there.append(one_request(remote, prompt, mode, args.max_tokens, server.endpoint))
                same = [r["tokens"] for r in here] == [r["tokens"] for r in there]
                results[name] = {"local": summary(here), "rpc": summary(there), "same_tokens": same}
                results[name]["added_ms_per_decode"] = round(results[name]["rpc"]["ms_per_decode"]
                                                             - results[name]["local"]["ms_per_decode"], 3)
                print(name, json.dumps(results[name]), flush=True)
    finally:
        server.kill()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(v.get("same_tokens", True) for v in results.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
