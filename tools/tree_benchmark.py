"""Draft tree against linear draft at the same depth: accepted tokens per verify, tokens per target decode, what the
tree's paths moved through host memory, and speed.

    python tools/tree_benchmark.py [--pairs soft,markov,demo] [--targets dense,hybrid] [--depth 7] [--tree-nodes 16]
                                   [--max-tokens 96] [--seeds 6] [--rounds 2] [--real-layout]

Pairs: generated tiny pairs whose draft distributions are not one-hot (heads "soft": the draft's q is the target's p;
"markov": right only part of the time; "shaped" for contrast), on dense and hybrid targets; "demo", the offline demo's
pair (the page's first example as a chat, --demo-tokens tokens); with --real-layout also the pair in the real files'
layout (dflash_runtime.testing.real_layout, $DFLASH_REAL_LAYOUT_CACHE). Each temperature-0 answer is checked against
plain decoding. Modes: at temperature 0 the linear draft, the tree (chosen children, best-first) and tree_nodes="auto";
at temperature 1 the linear draft checked by sample-and-match (`linear`) and by rejection sampling with the draft's q
(`linear-q`), the tree drawn from q under recursive rejection (`tree`), the chosen tree under the walk
(`tree-match`, the rule of a tree that cannot use q) and tree_nodes="auto" with rejection sampling. Rounds of every
mode run in alternating order, so that a machine's drift weighs on every mode alike. Prints one JSON line per
(pair, temperature). Tokens per verify and per decode are counts; tok/s is wall-clock, as loaded as the machine is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from dflash_runtime import load_pair
from dflash_runtime.space.setup.presets import DEMO_PAIR
from dflash_runtime.testing.tiny_models import tiny_pair

PROMPTS = ("the quick brown fox jumps over the lazy dog.", "what is the capital of france?",
           "one two three four five")
DEMO_MESSAGE = "Explain speculative decoding in three sentences."  # the page's first example (app.py EXAMPLES)
TOTALS = ("verify_steps", "verify_emitted", "target_steps", "n_generated", "tree_rows", "tree_steps",
          "tree_off_spine", "tree_host_bytes", "decode_ms")
# (label, method, verify, tree_nodes): None stands for --tree-nodes
MODES = {
    0.0: [("linear", "dflash", "match", None), ("tree", "dflash-tree", "match", None),
          ("tree-auto", "dflash-tree", "match", "auto")],
    1.0: [("linear", "dflash", "match", None), ("linear-q", "dflash", "sample", None),
          ("tree", "dflash-tree", "sample", None), ("tree-match", "dflash-tree", "match", None),
          ("tree-auto", "dflash-tree", "sample", "auto")],
}


def measure(engine: Any, prompts: list[Any], mode: tuple[str, str, str, Any], temperature: float,
            args: argparse.Namespace, plain: dict[int, list[int]]) -> dict[str, int | float]:
    """One round of a mode: every prompt (and seed) once; the stats' totals."""
    label, method, verify, nodes = mode
    totals: dict[str, int | float] = dict.fromkeys(TOTALS, 0)
    for i, prompt in enumerate(prompts):
        for seed in range(1, args.seeds + 1) if temperature > 0 else (0,):
            result = engine.generate(prompt, max_tokens=args.max_tokens, method=method, draft_length=args.depth,
                                     tree_nodes=args.tree_nodes if nodes is None else nodes,
                                     temperature=temperature, seed=seed, verify=verify)
            if temperature == 0 and result.tokens != plain[i]:
                raise AssertionError(f"{label} differs from plain decoding on prompt {i}")
            for key in totals:
                totals[key] += getattr(result.stats, key)
    return totals


def figures(totals: dict[str, int | float], wall_s: float) -> dict[str, float]:
    trees = max(1, int(totals["tree_steps"]))
    return {
        "accepted_per_verify": round(totals["verify_emitted"] / max(1, totals["verify_steps"]), 3),
        "tokens_per_decode": round(totals["n_generated"] / max(1, totals["target_steps"]), 3),
        "rows_per_tree": round(totals["tree_rows"] / trees, 2),
        "tree_steps": int(totals["tree_steps"]),
        "off_spine": int(totals["tree_off_spine"]),
        "host_bytes_per_tree": round(totals["tree_host_bytes"] / trees, 1),
        "tok_s": round(totals["n_generated"] / max(1e-9, totals["decode_ms"] / 1000.0), 1),
        "wall_s": round(wall_s, 2),
    }


def bench(name: str, target: Any, draft: Any, args: argparse.Namespace, *, demo: bool = False) -> None:
    with load_pair(target, draft, n_ctx=4096 if demo else 1024, draft_capacity=args.depth,
                   branches=args.branches) as engine:
        prompts: list[Any] = ([engine.chat_tokens([{"role": "user", "content": DEMO_MESSAGE}])] if demo
                              else list(PROMPTS))
        saved = args.max_tokens
        args.max_tokens = args.demo_tokens if demo else saved
        plain = {i: engine.generate(p, max_tokens=args.max_tokens, speculative=False).tokens
                 for i, p in enumerate(prompts)}
        for temperature, modes in MODES.items():
            totals: dict[str, dict[str, int | float]] = {}
            walls = dict.fromkeys((m[0] for m in modes), 0.0)
            for round_ in range(args.rounds):
                for mode in modes if round_ % 2 == 0 else modes[::-1]:
                    t = time.perf_counter()
                    got = measure(engine, prompts, mode, temperature, args, plain)
                    walls[mode[0]] += time.perf_counter() - t
                    totals[mode[0]] = {k: totals.get(mode[0], {}).get(k, 0) + v for k, v in got.items()}
            rows = {label: figures(totals[label], walls[label]) for label in walls}
            base = rows["linear-q" if temperature > 0 else "linear"]
            print(json.dumps({
                "pair": name, "temperature": temperature, "depth": args.depth, "tree_nodes": args.tree_nodes,
                **rows,
                "tree_over_linear_accepted": round(rows["tree"]["accepted_per_verify"] / base["accepted_per_verify"],
                                                   3),
                "tree_over_linear_per_decode": round(rows["tree"]["tokens_per_decode"] / base["tokens_per_decode"], 3),
                "auto_over_linear_per_decode": round(rows["tree-auto"]["tokens_per_decode"]
                                                     / base["tokens_per_decode"], 3),
                "auto_over_linear_speed": round(rows["tree-auto"]["tok_s"] / max(1e-9, base["tok_s"]), 3),
            }), flush=True)
        args.max_tokens = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--tree-nodes", type=int, default=16)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--demo-tokens", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=6, help="seeds per prompt above temperature 0")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every mode, in alternating order")
    parser.add_argument("--pairs", default="soft,markov,demo", help="heads of the generated pairs, and 'demo'")
    parser.add_argument("--targets", default="dense,hybrid")
    parser.add_argument("--real-layout", action="store_true")
    args = parser.parse_args(argv)
    for head in args.pairs.split(","):
        if head == "demo":
            pair = tiny_pair(**DEMO_PAIR)
            bench("demo", pair.target, pair.draft, args, demo=True)
            continue
        for target in args.targets.split(","):
            pair = tiny_pair(target, "dflash2", head=head)
            bench(f"{target}-{head}", pair.target, pair.draft, args)
    if args.real_layout:
        from dflash_runtime.testing.real_layout import real_layout_pair

        pair = real_layout_pair()
        bench("real-layout", pair.target, pair.draft, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
