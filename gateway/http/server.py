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


# What one connection may hold written and unsent, in the event loop's transport and again in
# the kernel's send buffer. A stream's backpressure (gateway/service/stream.py) starts only once
# these are full: with the kernel's own sizing a client that never reads can leave megabytes
# unread on loopback, hundreds of streamed tokens' worth of steps other tenants wanted. Token
# streams are slow beside what even this much in flight carries. 0: the defaults (64 KiB in the
# transport, the kernel's autotuned send buffer).
SEND_BUFFER_BYTES = 16384


def uvicorn_config(app: Any, *, send_buffer_bytes: int = SEND_BUFFER_BYTES, **options: Any) -> Any:
    """The uvicorn.Config every specgate HTTP server runs with (`options`: host, port, …), its
    connections' write buffering bounded by `send_buffer_bytes` (`SEND_BUFFER_BYTES`)."""
    config = uvicorn.Config(app, lifespan="on", timeout_keep_alive=KEEP_ALIVE_S, **options)
    if send_buffer_bytes:
        base = uvicorn.config.import_from_string(uvicorn.config.HTTP_PROTOCOLS[config.http]) \
            if isinstance(config.http, str) and config.http in uvicorn.config.HTTP_PROTOCOLS else None
        if base is not None:
            config.http = _bounded(base, send_buffer_bytes)
    return config


def _bounded(base: type, limit: int) -> type:
    """uvicorn's HTTP protocol `base`, each connection's write buffers bounded by `limit` bytes."""

    class Bounded(base):                                # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            bound_writes(transport, limit)

    Bounded.__name__ = f"Bounded{base.__name__}"
    return Bounded


def bound_writes(transport: Any, limit: int) -> None:
    """Pause the protocol's writes (uvicorn's `send` waits) past `limit` bytes in the transport,
    and size the socket's send buffer to `limit` (the kernel doubles it for its bookkeeping).
    Best effort: a transport or socket that refuses keeps its defaults."""
    try:
        transport.set_write_buffer_limits(high=limit)
    except (AttributeError, NotImplementedError, ValueError):
        pass
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)
        except (OSError, AttributeError):
            pass


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
