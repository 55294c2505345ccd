"""A lean HTTP/1.1 client for the gateway benchmark: prebuilt request bytes over raw sockets,
responses read by Content-Length, keep-alive; sequential (`HttpClient`) or many connections at
once on one asyncio loop (`load`), so the client is never what the benchmark measures."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

def completion_request(host: str, key: str, model: str, prompt: str, max_tokens: int) -> bytes:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def parse_head(head: bytes) -> tuple[int, int]:
    """(status, Content-Length) of a response head, without its blank line."""
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return status, int(value)
    raise RuntimeError(f"a response without Content-Length: {head[:200]!r}")


def _split_response(buf: bytes | bytearray) -> tuple[int, int, int] | None:
    """(status, body start, body end) of the first whole response in `buf`, or None."""
    i = buf.find(b"\r\n\r\n")
    if i < 0:
        return None
    status, n = parse_head(bytes(buf[:i]))
    return (status, i + 4, i + 4 + n) if len(buf) >= i + 4 + n else None


class HttpClient:
    """Blocking: one keep-alive connection, one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def post(self, raw: bytes) -> bytes:
        """Send a prebuilt request; returns the response body, raises unless it is a 200."""
        self.sock.sendall(raw)
        while (whole := _split_response(self.buf)) is None:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.buf += data
        status, start, end = whole
        body, self.buf = self.buf[start:end], self.buf[end:]
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
        return body

    def close(self) -> None:
        self.sock.close()


class _Connection(asyncio.Protocol):
    """One keep-alive connection of the load: `await request(raw)` → the status."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        whole = _split_response(self.buf)
        if whole is not None and self.waiter is not None:
            del self.buf[:whole[2]]
            self.waiter.set_result(whole[0])
            self.waiter = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("the server closed the connection"))

    async def request(self, raw: bytes) -> int:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


async def load(host: str, port: int, raw: bytes, total: int,
               concurrency: int) -> tuple[int, int, list[float], float]:
    """`total` requests over `concurrency` connections, each sending its next request as soon as
    its answer is in (after one untimed request each, to connect and warm up).
    → (200s, other statuses, latencies in seconds, elapsed seconds)."""
    aio = asyncio.get_running_loop()
    conns = [(await aio.create_connection(_Connection, host, port))[1]
             for _ in range(concurrency)]
    await asyncio.gather(*(c.request(raw) for c in conns))
    left, statuses, latencies, clock = total, [], [], time.perf_counter

    async def client(conn: _Connection) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = clock()
            statuses.append(await conn.request(raw))
            latencies.append(clock() - t0)

    t0 = clock()
    await asyncio.gather(*(client(c) for c in conns))
    elapsed = clock() - t0
    for c in conns:
        c.transport.close()
    ok = statuses.count(200)
    return ok, len(statuses) - ok, latencies, elapsed
