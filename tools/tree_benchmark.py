"""Draft tree against chain at the same depth: accepted tokens per verify, tokens per target decode, and speed.

    python tools/tree_benchmark.py [--depth 7] [--tree-nodes 16] [--max-tokens 96] [--rounds 4] [--real-layout]

Pairs: generated tiny pairs whose draft distributions are not one-hot (heads "soft", "markov"; "shaped" for
contrast), dense and hybrid targets; with --real-layout also the pair in the real files' layout
(dflash_runtime.testing.real_layout, $DFLASH_REAL_LAYOUT_CACHE). Each answer is checked against plain decoding at
temperature 0. Above it the chain is measured with both verifiers ("sample": rejection sampling with the draft's q;
"match": sample and match, the tree walk's rule on a path). Prints one JSON line per (pair, temperature, method).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dflash_runtime import load_pair
from dflash_runtime.testing.tiny_models import tiny_pair

PROMPTS = ("the quick brown fox jumps over the lazy dog.", "what is the capital of france?",
           "one two three four five")
SEEDS = (1, 2, 3)


def measure(engine, method: str, depth: int, nodes: int | str, temperature: float, verify: str, max_tokens: int,
            plain: dict) -> dict:
    """One round of a mode: every prompt (and seed) once; the stats' totals."""
    totals = dict.fromkeys(("verify_steps", "verify_emitted", "target_steps", "n_generated", "tree_rows", "tree_steps",
                            "tree_off_spine", "decode_ms"), 0)
    for prompt in PROMPTS:
        for seed in SEEDS if temperature > 0 else (0,):
            result = engine.generate(prompt, max_tokens=max_tokens, method=method, draft_length=depth,
                                     tree_nodes=nodes, temperature=temperature, seed=seed, verify=verify)
            if temperature == 0 and result.tokens != plain[prompt]:
                raise AssertionError(f"{method} differs from plain decoding on {prompt!r}")
            for key in totals:
                totals[key] += getattr(result.stats, key)
    return totals


def figures(totals: dict) -> dict:
    return {
        "accepted_per_verify": round(totals["verify_emitted"] / max(1, totals["verify_steps"]), 3),
        "tokens_per_decode": round(totals["n_generated"] / max(1, totals["target_steps"]), 3),
        "tok_s": round(totals["n_generated"] / max(1e-9, totals["decode_ms"] / 1000.0), 1),
        "rows_per_tree": round(totals["tree_rows"] / max(1, totals["tree_steps"]), 2),
        "off_spine": totals["tree_off_spine"],
    }


def bench(name: str, target, draft, args: argparse.Namespace) -> None:
    with load_pair(target, draft, n_ctx=1024, draft_capacity=args.depth, branches=args.branches) as engine:
        plain = {p: engine.generate(p, max_tokens=args.max_tokens, speculative=False).tokens for p in PROMPTS}
        for temperature in (0.0, 1.0):
            rows = {}
            runs = [("chain", "dflash", "match", args.tree_nodes)]
            if temperature > 0:
                runs.append(("chain-sample", "dflash", "sample", args.tree_nodes))
            runs += [("tree", "dflash-tree", "match", args.tree_nodes), ("tree-auto", "dflash-tree", "match", "auto")]
            # Rounds in alternating order, so that a machine's drift weighs on every mode alike.
            totals: dict[str, dict] = {}
            walls = dict.fromkeys((label for label, *_ in runs), 0.0)
            for round_ in range(args.rounds):
                for label, method, verify, nodes in runs if round_ % 2 == 0 else runs[::-1]:
                    t = time.perf_counter()
                    got = measure(engine, method, args.depth, nodes, temperature, verify, args.max_tokens, plain)
                    walls[label] += time.perf_counter() - t
                    totals[label] = {k: totals.get(label, {}).get(k, 0) + v for k, v in got.items()}
            for label in walls:
                rows[label] = {**figures(totals[label]), "wall_s": round(walls[label], 2)}
            ratio = rows["tree"]["accepted_per_verify"] / max(1e-9, rows["chain"]["accepted_per_verify"])
            speed = rows["tree"]["tok_s"] / max(1e-9, rows["chain"]["tok_s"])
            auto = rows["tree-auto"]["tok_s"] / max(1e-9, rows["chain"]["tok_s"])
            print(json.dumps({"pair": name, "temperature": temperature, "depth": args.depth,
                              "tree_nodes": args.tree_nodes, **rows, "tree_over_chain_accepted": round(ratio, 3),
                              "tree_over_chain_speed": round(speed, 3), "auto_over_chain_speed": round(auto, 3)}),
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--tree-nodes", type=int, default=16)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of every mode, in alternating order")
    parser.add_argument("--heads", default="soft,markov,shaped")
    parser.add_argument("--targets", default="dense,hybrid")
    parser.add_argument("--real-layout", action="store_true")
    args = parser.parse_args(argv)
    for head in args.heads.split(","):
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
