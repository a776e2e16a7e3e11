"""`python -m dflash_runtime serve TARGET [DRAFT]`: the /v1 routes over one engine, on a port of their own (uvicorn),
with `GET /health` for readiness. `DFLASH_API_KEY` (or `--api-key`) makes every /v1 route ask for that key."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from pathlib import Path
from typing import Any

STOP_GRACE_S = 10  # seconds open answers get to end once the server is told to stop


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", help="target GGUF")
    p.add_argument("draft", nargs="?", default=None, help="DFlash / DFlash 2 draft GGUF (omit: the target alone, "
                   "with its MTP head when it has one)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--model", default=None, help="the model id the API serves (default: the target's file name)")
    p.add_argument("--parallel", type=int, default=1, help="answers the engine runs at once (its sequences)")
    p.add_argument("--max-waiting", type=int, default=16, help="answers that may wait for a sequence (more: 429)")
    p.add_argument("--busy-timeout", type=float, default=120.0, help="seconds an answer waits for a sequence (503)")
    p.add_argument("--draft-length", default="auto", help="'auto' (adaptive) or a fixed draft length, 0 for none")
    p.add_argument("--api-key", default=None, help="the key clients must send (default: $DFLASH_API_KEY; none: open)")


def build_app(engine: Any, model: str, api_key: str | None, max_waiting: int = 16) -> Any:
    """The ASGI application (imported here: the command line is parsed without starlette)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from .engine_backend import EngineBackend
    from .server import V1Api

    backend = EngineBackend(engine, model, max_waiting=max_waiting)
    api = V1Api(backend, api_key=api_key)

    async def health(request: Request) -> JSONResponse:
        """Ready, and how many answers run (counts, nothing of what they are). `?idle_within=S`: answered once no
        answer's stream is open, or after S seconds (at most 60; `idle` says which)."""
        wait = request.query_params.get("idle_within")
        idle = None
        if wait is not None:
            try:
                seconds = min(max(float(wait), 0.0), 60.0)
            except ValueError:
                return JSONResponse({"error": {"message": "idle_within must be a number of seconds",
                                               "type": "invalid_request_error", "param": "idle_within",
                                               "code": "invalid_value"}}, status_code=400)  # fmt: skip
            idle = await asyncio.to_thread(backend.streams.wait_idle, seconds)
        return JSONResponse({"status": "ok", "running": engine.info()["running"], "streams": backend.streams.count(),
                             "parallel": engine.parallel, **({"idle": idle} if idle is not None else {})})

    app = api.app()
    app.router.routes.append(Route("/health", health, methods=["GET"]))
    return app


def server_config(app: Any) -> Any:
    """Uvicorn's configuration for `app`: no proxy headers (uvicorn would otherwise rewrite a request's peer from
    `X-Forwarded-For` sent from 127.0.0.1, so that a local client could name any address it likes)."""
    import uvicorn

    # timeout_graceful_shutdown: a backstop, what has not ended this long after Ctrl+C (or SIGTERM) is cancelled.
    return uvicorn.Config(app, log_level="warning", proxy_headers=False, forwarded_allow_ips="",
                          timeout_graceful_shutdown=STOP_GRACE_S)


def serve(args: argparse.Namespace, open_engine: Any) -> int:
    import uvicorn

    api_key = args.api_key or os.environ.get("DFLASH_API_KEY") or None
    with open_engine() as engine:
        model = args.model or Path(args.target).name
        app = build_app(engine, model, api_key, args.max_waiting)
        # Bound before the line is printed: a client that reads it may connect at once (uvicorn accepts from the
        # listening socket's backlog once it runs).
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(128)
        line = f"serving {model} on http://{args.host}:{args.port}/v1 ({'API key required' if api_key else 'open'})"

        class Server(uvicorn.Server):
            """Says that it serves once it does: by then Ctrl+C is uvicorn's to handle (it stops the server, then
            raises KeyboardInterrupt, which the command line turns into its "stopped" line)."""

            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets)
                print(line, flush=True)

            async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
                # Open answers end as when their clients hang up (their engine requests stop); uvicorn would wait
                # for them to finish, then cancel them with a traceback.
                for connection in list(self.server_state.connections):
                    transport = getattr(connection, "transport", None)
                    if transport is not None:
                        transport.close()
                await super().shutdown(sockets)

        Server(server_config(app)).run(sockets=[sock])
    return 0
