"""`python -m dflash_runtime bench` on generated pairs, no downloads:

    python -m dflash_runtime.testing.bench --pairs demo --runs 3 --max-tokens 512 --draft-length auto
    python -m dflash_runtime.testing.bench --pairs matrix --runs 3 --max-tokens 128 --draft-max 3,7,auto
    python -m dflash_runtime.testing.bench --pairs hybrid:soft:512 --temperature 0.6 --verify sample,match
    python -m dflash_runtime.testing.bench --pairs real --runs 1 --max-tokens 32
    python -m dflash_runtime.testing.bench --pairs methods --draft-length 3,auto --methods dflash mtp ngram-mod,dflash
    python -m dflash_runtime.testing.bench --pairs hybrid:shaped:128:mtp --methods dflash mtp --concurrency 1,2,4,8
    python -m dflash_runtime.testing.bench --pairs dense:words:512:dflash1,dense:words:512:dspark --methods dspark

`--pairs`: a comma list of 'demo' (the offline demo's pair: dense width-512 target whose head writes words of a small
Markov chain, one-layer DFlash 2 draft), 'matrix' (widths 512 and 1024 × random/const heads × dense/hybrid targets),
'methods' (hybrid targets with an MTP head and a DFlash 2 draft, width 512, random/phrase/const heads: both methods
on one target), target:head:width[:mtp][:draft] (a DFlash 2 draft, or the generator's draft kind named: dflash1,
dspark, eagle3; ':mtp' gives the hybrid target an MTP head) and 'real'
(the pair in the real files' layout: NVFP4 + Q8_0 hybrid target with an MTP layer, Q4_K_M draft, the full Qwen3.5
vocabulary; see real_layout.py, built on first use). Every other option is the bench's (see
`python -m dflash_runtime bench -h`; `--concurrency` opens each pair with parallel sequences); the table reports
each pair's open time.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..cli.main import add_bench_args, run_bench_cli
from ..errors import DFlashError
from ..space.setup.presets import DEMO_PAIR
from .real_layout import real_layout_pair
from .tiny_models import tiny_pair

REAL = "real"
DEMO = "demo"
DRAFT = "dflash2"  # the generated pairs' draft where a spec names none


def tiny_targets(spec: str) -> list[tuple[str, str, str]]:
    items: list[tuple[str, str, int, int, str]] = []
    for part in (p.strip() for p in spec.split(",")):
        if part == "matrix":
            items += [(k, h, w, 0, DRAFT) for w in (512, 1024) for h in ("random", "const")
                      for k in ("dense", "hybrid")]
        elif part == "methods":
            items += [("hybrid", h, 512, 1, DRAFT) for h in ("random", "phrase", "const")]
        elif part in (REAL, DEMO):
            items.append((part, "", 0, 0, DRAFT))
        else:
            kind, head, width, *rest = part.split(":")
            drafts = [r for r in rest if r != "mtp"]
            items.append((kind, head, int(width), int("mtp" in rest), drafts[0] if drafts else DRAFT))
    out = []
    for kind, head, width, mtp_layers, draft in items:
        if kind == REAL:
            real = real_layout_pair()
            out.append(("real-layout", str(real.target), str(real.draft)))
            continue
        if kind == DEMO:
            demo = tiny_pair(**DEMO_PAIR)
            out.append(("demo", str(demo.target), str(demo.draft)))
            continue
        p = tiny_pair(kind, draft, head=head, n_embd=width, dims="scaled" if width >= 256 else "tiny",
                      mtp_layers=mtp_layers)
        name = f"{kind}-{head}-{width}" + ("-mtp" if mtp_layers else "") + ("" if draft == DRAFT else f"-{draft}")
        out.append((name, str(p.target), str(p.draft)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_runtime.testing.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="matrix",
                        help="demo, matrix, methods, target:head:width[:mtp][:draft], real (comma list)")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--threads-batch", type=int, default=None)
    parser.add_argument("--draft-capacity", type=int, default=7)
    add_bench_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_bench_cli(args, tiny_targets(args.pairs))
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
