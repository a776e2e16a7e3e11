"""`python -m dflash_runtime generate | bench | serve | rpc-server`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import methods as draft_methods
from ..errors import DFlashError


def _add_pair_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--target", required=required, help="target GGUF")
    p.add_argument("--draft", help="draft GGUF: a DFlash / DFlash 2 draft, or a model of the target's vocabulary "
                                   "(draft-simple); omit for target-only decoding")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--gpu-layers", type=int, default=0, help="layers offloaded to the GPU (-1: all)")
    p.add_argument("--threads", type=int, default=None, help="threads of one-row decodes (default: half the cores)")
    p.add_argument("--threads-batch", type=int, default=None,
                   help="threads of decodes of more rows: verifies, prompts (default: --threads)")
    p.add_argument("--draft-capacity", type=int, default=None,
                   help="longest draft the pair is opened for (default: block_size − 1, at most 15; 7 for MTP)")
    p.add_argument("--no-mtp", action="store_true", help="do not open the target's MTP head")
    p.add_argument("--rpc", default=None,
                   help="comma list of RPC servers (host:port) whose devices take part of the layers (--gpu-layers)")
    p.add_argument("--tensor-split", default=None, help="comma list of weights, one per device (remote first)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dflash_runtime", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text, then print the statistics")
    _add_pair_args(g, required=True)
    g.add_argument("--prompt", default="Write a short poem about the sea.")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p × the top probability")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--method", default=None,
                   help=f"draft method ({', '.join(draft_methods.names())}) or a list 'a,b' (default: dflash when a "
                        "draft is given)")
    g.add_argument("--draft-length", default=None, help="'auto' (default) or a fixed draft length, 0 for no draft")
    g.add_argument("--draft-max", default=None, help=argparse.SUPPRESS)  # deprecated spelling of --draft-length
    g.add_argument("--no-spec", action="store_true", help="plain decoding (A/B baseline)")
    g.add_argument("--json", action="store_true", help="print the statistics as JSON")

    b = sub.add_parser("bench", help="speculative vs plain decoding, per draft length (or per concurrency)")
    _add_pair_args(b, required=True)
    add_bench_args(b)

    r = sub.add_parser("rpc-server", help="lend this machine's devices to pairs on other machines (ggml's RPC server)",
                       description=f"Runs the wheel's ggml-rpc-server. {RPC_WARNING}")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    r.add_argument("--port", type=int, default=50052)
    r.add_argument("--threads", type=int, default=None, help="threads of the CPU device")
    r.add_argument("--device", default=None, help="comma list of the devices to lend (default: the GPUs, else the CPU)")
    r.add_argument("--cache", action="store_true", help="keep received weights on disk, so a reload sends none")
    r.add_argument("--print", action="store_true", help="print the command (and its environment) instead of running it")

    from ..openai_api.serve import add_serve_args  # starlette and uvicorn are imported only when serving

    s = sub.add_parser("serve", help="an OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models")
    add_serve_args(s)
    s.add_argument("--n-ctx", type=int, default=4096, help="context of each sequence")
    s.add_argument("--gpu-layers", type=int, default=0, help="layers offloaded to the GPU (-1: all)")
    s.add_argument("--threads", type=int, default=None, help="threads of one-row decodes (default: half the cores)")
    s.add_argument("--threads-batch", type=int, default=None,
                   help="threads of decodes of more rows: verifies, prompts (default: --threads)")
    s.add_argument("--draft-capacity", type=int, default=None,
                   help="longest draft the pair is opened for (default: block_size − 1, at most 15; 7 for MTP)")
    s.add_argument("--no-mtp", action="store_true", help="do not open the target's MTP head")
    return ap


RPC_WARNING = ("An RPC server trusts whoever connects: any client can run graphs on its devices and read or write "
               "their memory. Never expose it to an open network: listen on 127.0.0.1, or on a private network you "
               "trust.")


def _rpc_server(args: argparse.Namespace) -> int:
    import os
    import shlex

    from ..native.rpc import server_command

    argv, env = server_command(args.host, args.port, threads=args.threads, devices=args.device, cache=args.cache)
    if args.print:
        print(f"GGML_BACKEND_PATH={shlex.quote(env['GGML_BACKEND_PATH'])} {shlex.join(argv)}")
        return 0
    print(f"warning: {RPC_WARNING}", file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)  # the server in this process's place: signals and exit status are its own
    return 1  # not reached


def add_bench_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--prompts", type=Path, help="file with one prompt per line")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--draft-length", default=None, help="comma list of lengths and/or 'auto' (default 3,7,auto)")
    b.add_argument("--draft-max", default=None, help=argparse.SUPPRESS)  # deprecated spelling of --draft-length
    # By default the methods with a model (a draft file or the target's MTP head): those the pair runs are compared.
    b.add_argument("--methods", nargs="+", default=[m.name for m in draft_methods.REGISTRY if m.needs],
                   help=f"draft methods to compare with plain ({', '.join(draft_methods.names())}; a method list: "
                        "'a,b')")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--verify", default="sample", help="above temperature 0: comma list of 'sample' and/or 'match'")
    b.add_argument("--runs", type=int, default=None,
                   help="alternating runs per mode, the median reported (default 3; 1 with --concurrency)")
    b.add_argument("--concurrency", type=_counts, default=None,
                   help="comma list of concurrent streams, e.g. 1,2,4,8: each mode runs that many requests at once "
                        "on one engine opened with parallel=max (default draft length: auto)")
    b.add_argument("--json", type=Path, help="write the results here")


def _counts(value: str) -> list[int]:
    counts = [int(x) for x in value.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency takes counts ≥ 1 (got {value!r})")
    return counts


def _draft_arg(value: str) -> int | str:
    return "auto" if value == "auto" else int(value)


def _lengths(args: argparse.Namespace, default: str) -> str:
    if args.draft_max is not None:
        print("warning: --draft-max is now --draft-length", file=sys.stderr)
        return args.draft_max
    return args.draft_length if args.draft_length is not None else default


def _open(args: argparse.Namespace, target: str, draft: str | None, parallel: int = 1, **options: Any):
    from ..engine import load_pair
    from ..files.gguf_meta import read_gguf

    capacity = args.draft_capacity
    if capacity is None and draft is not None:
        block = int(read_gguf(draft).key("block_size", 16))
        capacity = max(1, min(15, block - 1))
    endpoints, split = getattr(args, "rpc", None), getattr(args, "tensor_split", None)
    remote = {"rpc": [e for e in endpoints.split(",") if e.strip()]} if endpoints else {}
    if split:
        remote["tensor_split"] = [float(w) for w in split.split(",") if w.strip()]
    return load_pair(target, draft, n_ctx=args.n_ctx, n_gpu_layers=args.gpu_layers,
                     draft_capacity=capacity if capacity is not None else 7, n_threads=args.threads,
                     n_threads_batch=args.threads_batch, mtp=False if getattr(args, "no_mtp", False) else None,
                     parallel=parallel, **remote, **options)


def _serve(args: argparse.Namespace) -> int:
    from ..openai_api.serve import serve

    return serve(args, lambda: _open(args, args.target, args.draft, args.parallel, busy_timeout_s=args.busy_timeout,
                                     draft_length=_draft_arg(args.draft_length)))


def _generate(args: argparse.Namespace) -> int:
    from ..results.tables import stats_table

    with _open(args, args.target, args.draft) as engine:
        kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                      min_p=args.min_p, seed=args.seed,
                      speculative=not args.no_spec and bool(engine.methods), method=args.method,
                      draft_length=_draft_arg(_lengths(args, "auto")))
        if args.chat:
            events = engine.stream_chat([{"role": "user", "content": args.prompt}], **kwargs)
        else:
            events = engine.stream(args.prompt, **kwargs)
        last = None
        for last in events:
            sys.stdout.write(last.delta)
            sys.stdout.flush()
        assert last is not None
        print(f"\n\n[finish: {last.finish_reason} — {last.finish_detail}]")
        print(json.dumps(last.stats.to_dict(), indent=2) if args.json else stats_table(last.stats))
    return 0


def _bench(args: argparse.Namespace) -> int:
    return run_bench_cli(args, [(Path(args.target).name, args.target, args.draft)])


def run_bench_cli(args: argparse.Namespace, pairs: list[tuple[str, str, str]]) -> int:
    from .bench import BenchConfig, run_bench
    from .bench_concurrency import run_concurrency

    concurrency = getattr(args, "concurrency", None)
    modes = [_draft_arg(x.strip()) for x in _lengths(args, "auto" if concurrency else "3,7,auto").split(",")
             if x.strip()]
    methods = [m.strip() for m in args.methods if m.strip() and m.strip() != "plain"]  # plain always runs
    prompts = None
    if args.prompts:
        prompts = [ln for ln in args.prompts.read_text().splitlines() if ln.strip()]
    verify = [v.strip() for v in args.verify.split(",") if v.strip()]
    runs = args.runs if args.runs is not None else (1 if concurrency else 3)
    cfg = BenchConfig(modes=modes, runs=runs, max_tokens=args.max_tokens, prompts=prompts,
                      temperature=args.temperature, verify=verify, methods=methods)
    if concurrency:
        results = run_concurrency(pairs, cfg, concurrency, lambda t, d: _open(args, t, d, max(concurrency)))
    else:
        results = run_bench(pairs, cfg, lambda t, d: _open(args, t, d))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


STOPPED = 128 + signal.SIGINT  # a shell's status for a command that Ctrl+C ended


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"generate": _generate, "bench": _bench, "serve": _serve, "rpc-server": _rpc_server}[args.cmd](args)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl+C: the engine is closed on the way out (its `with`); no traceback to read
        print("stopped", file=sys.stderr)
        return STOPPED
