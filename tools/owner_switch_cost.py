"""What a newcomer's first request costs after another owner's short or long chat, as the Space runs owners.

The engine opened as the Space opens it (`SessionPolicy(park_on_switch=False)`, the public prefix kept before anyone
comes, every owner parked at the end of its own request). A victim chats for 1 to N turns, with or without the
public system prompt; then a newcomer sends a short chat. The newcomer's whole request (wall time, owner switch
included) and its figures are recorded per victim history, alternating histories over several trials; a timing
oracle would show as a time that grows with the victim's context. With `--parallel N` the engine has N sequences
and N victims fill them all, so the newcomer's sequence is one a victim held. Prints a table and writes JSON.

    python tools/owner_switch_cost.py --pair demo --trials 5 [--parallel 4] --out bench-results/owner-switch.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dflash_runtime import SessionPolicy, load_pair
from dflash_runtime.testing.tiny_models import tiny_pair

SYSTEM = "You are a helpful assistant."
PAIRS = {
    "demo": dict(target="dense", draft="dflash2", head="phrase", n_embd=512, dims="scaled"),
    "methods": dict(target="hybrid", draft="dflash2", head="phrase", n_embd=512, dims="scaled", mtp_layers=1),
}


def chat(engine, text: str) -> list[int]:
    return engine.chat_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                              enable_thinking=False)


def public_len(engine) -> int:
    a, b = chat(engine, "a"), chat(engine, "b")
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def one_trial(pair, victim_turns: int, victim_public: bool, answer_tokens: int, parallel: int = 1) -> dict:
    with load_pair(pair.target, pair.draft, n_ctx=4096, sessions=SessionPolicy(park_on_switch=False),
                   parallel=parallel) as engine:
        public = public_len(engine)
        engine.generate(chat(engine, "x")[:public], max_tokens=1, speculative=False, cache_owner="nobody",
                        public_prefix=public)
        for victim in range(parallel):
            prompt = chat(engine, "tell me a story") if victim_public else engine.tokenize("tell me a story, no system")
            for turn in range(victim_turns):
                answer = engine.generate(prompt, max_tokens=answer_tokens, cache_owner=f"victim-{victim}",
                                         public_prefix=public if victim_public else 0)
                engine.park(f"victim-{victim}")
                prompt = prompt + answer.tokens + engine.tokenize(f" go on, part {turn}", add_special=False)
        victim_context = len(prompt)
        t0 = time.perf_counter()
        mine = engine.generate(chat(engine, "hello, tell me a story"), max_tokens=8, cache_owner="newcomer",
                               public_prefix=public)
        wall_ms = (time.perf_counter() - t0) * 1000.0
        s = mine.stats
        return {"victim_turns": victim_turns, "victim_public": victim_public, "victim_context": victim_context,
                "wall_ms": wall_ms, "outside_decoding_ms": wall_ms - s.prefill_ms - s.decode_ms,
                "n_reused": s.n_reused, "n_prefilled": s.n_prefilled, "prefill_ms": s.prefill_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=sorted(PAIRS), default="demo")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=400)
    parser.add_argument("--parallel", type=int, default=1, help="the engine's sequences (each held by a victim)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pair = tiny_pair(**PAIRS[args.pair])
    histories = [(1, True), (4, True), (4, False)]
    rows: list[dict] = []
    for _ in range(args.trials):
        for turns, public in histories:
            rows.append(one_trial(pair, turns, public, args.answer_tokens, args.parallel))
    print(f"pair {args.pair}, {args.parallel} sequence(s): newcomer's request after the victims' chats "
          f"({args.trials} trials each, median)")
    print("| victim turns | system prompt | victim context | wall ms | outside decoding ms | reused | prefilled |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = []
    for turns, public in histories:
        mine = [r for r in rows if r["victim_turns"] == turns and r["victim_public"] == public]
        med = {k: statistics.median(r[k] for r in mine) for k in ("victim_context", "wall_ms", "outside_decoding_ms",
                                                                    "n_reused", "n_prefilled")}
        summary.append({"victim_turns": turns, "victim_public": public, **med})
        print(f"| {turns} | {'yes' if public else 'no'} | {med['victim_context']:.0f} | {med['wall_ms']:.1f} | "
              f"{med['outside_decoding_ms']:.2f} | {med['n_reused']:.0f} | {med['n_prefilled']:.0f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"pair": args.pair, "parallel": args.parallel, "rows": rows,
                                        "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
