"""Measure the Space's request path on the offline demo's pair: the bytes a reply pickles across the ZeroGPU process
line (every chunk the GPU function yields is pickled there), and the time the web process takes to render one step
of a long answer into the chat's HTML.

    python tools/space_request_path.py [--tokens 1000] [--render-tokens 4000]

Runs against whatever `dflash_runtime` Python imports (PYTHONPATH=<another checkout> measures that one), so two
versions can be compared on one machine. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from typing import Any

from dflash_runtime.space.gpu.host import EngineHost
from dflash_runtime.space.gpu_job import GpuJob
from dflash_runtime.space.page.session import ChatSession
from dflash_runtime.space.requests import Limits, build_request
from dflash_runtime.space.setup.presets import ResolvedPair, configured_preset
from dflash_runtime.testing.tiny_models import pair_paths, tiny_pair

PROMPT = "Explain speculative decoding in three sentences."


def run(n_ctx: int, max_tokens: int) -> list[Any]:
    """The chunks of one answer of exactly `max_tokens` tokens (a request that stops early is retried longer)."""
    from dflash_runtime import load_pair

    pair = tiny_pair(target="dense", draft="dflash2", head="phrase", n_embd=512, dims="scaled")
    preset = configured_preset(True, {"DFLASH_N_CTX": str(n_ctx)}, pair_paths)
    request = build_request(preset=preset.name, presets=[preset.name], limits=Limits(max_new_tokens=max_tokens),
                            message=PROMPT, max_tokens=max_tokens, draft_length="auto")  # fmt: skip
    host = EngineHost(load_pair)
    try:
        return list(host.run(GpuJob(request, preset, ResolvedPair(pair.target, pair.draft))))
    finally:
        host.close()


def texts_and_runs(chunks: list[Any]) -> list[tuple[str, list[tuple[int, str]]]]:
    """Each step's text so far and runs so far, from either chunk format (cumulative `text` or `delta`)."""
    steps, text, runs = [], "", []
    for chunk in chunks:
        text = chunk.text if hasattr(chunk, "text") else text + chunk.delta
        runs = [*runs, *chunk.source_runs]
        steps.append((text, runs))
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000, help="answer length for the pickled bytes")
    parser.add_argument("--render-tokens", type=int, default=4000, help="answer length for the render time")
    args = parser.parse_args()

    chunks = run(2048, args.tokens)
    generated = chunks[-1].stats["n_generated"]
    pickled = [len(pickle.dumps(chunk)) for chunk in chunks]

    long_chunks = run(args.render_tokens + 512, args.render_tokens)
    steps = texts_and_runs(long_chunks)
    session = ChatSession()
    epoch, _ = session.start_turn(PROMPT)
    timings = []
    for text, runs in steps:
        started = time.perf_counter()
        session.show_reply(epoch, text, runs)
        timings.append(time.perf_counter() - started)
    last = timings[-max(10, len(timings) // 20) :]  # the steps at the end of the answer
    print(json.dumps({
        "answer_tokens": generated,
        "chunks": len(chunks),
        "bytes_pickled": sum(pickled),
        "bytes_per_token": round(sum(pickled) / generated, 1),
        "last_chunk_bytes": pickled[-2] if len(pickled) > 1 else pickled[-1],
        "render_answer_tokens": long_chunks[-1].stats["n_generated"],
        "render_steps": len(steps),
        "render_ms_per_step_at_end": round(statistics.median(last) * 1000, 3),
        "render_ms_per_step_at_start": round(statistics.median(timings[: len(last)]) * 1000, 3),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
