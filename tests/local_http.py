"""A quiet HTTP/1.1 server on 127.0.0.1 for the tests' fakes (Hub, Hub uploads, ZeroGPU device API): every request,
whatever its method, goes to one function."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def serve(answer: Callable[[BaseHTTPRequestHandler], None]) -> ThreadingHTTPServer:
    """A started server on a free port that hands each request to `answer`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def _answer(self) -> None:
            answer(self)

        do_GET = do_HEAD = do_POST = do_PUT = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def origin(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def shut(server: ThreadingHTTPServer | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()
