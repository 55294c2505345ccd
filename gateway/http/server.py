"""Running the HTTP app: the one uvicorn configuration every specgate server uses, the event
loop it runs on, and a background server for tests and benchmarks."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator

import uvicorn


# How long an idle keep-alive connection stays open. uvicorn's default, 5 s, is also httpx's
# keepalive_expiry: a client may then send its next request on a pooled connection at the instant
# the server closes it, and see a ReadError for a request the server never read (it happened in a
# `loadtest compare` run on a busy 2-core machine: README.md, "Serving path and start-up times").
# Longer than clients keep idle connections, the client always closes first; 90 s is what Ray
# Serve's proxy keeps (Ray mode).
KEEP_ALIVE_S = 90


def uvicorn_config(app: Any, **options: Any) -> Any:
    """The uvicorn.Config every specgate HTTP server runs with (`options`: host, port, …)."""
    return uvicorn.Config(app, lifespan="on", timeout_keep_alive=KEEP_ALIVE_S, **options)


def run_on(loop_factory: Callable[[], asyncio.AbstractEventLoop] | None, main: Any) -> None:
    """`asyncio.run(main)` on uvicorn's choice of event loop ("auto": uvloop when installed), the
    one `uvicorn.run` and `background_server` use; gRPC shares it. Python 3.10 has no
    `asyncio.Runner`: the default loop there."""
    if loop_factory is None or sys.version_info < (3, 11):
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for servers that take a port number, not a socket:
    Ray Serve's proxy, Prometheus)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def background_server(app: Any, host: str = "127.0.0.1", port: int = 0,
                      log_level: str = "warning") -> Iterator[str]:
    """Serve `app` with uvicorn on a daemon thread (tests, gateway benchmarks); yields the base
    URL ("http://127.0.0.1:PORT"); stops the server on exit. Port 0: a free port."""
    # IPPROTO_TCP given explicitly: asyncio sets TCP_NODELAY only on sockets that say so (with
    # proto 0 every response would wait ~40 ms for a delayed ACK: Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn_config(app, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="specgate-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
