"""The attacker: each hostile pattern as a coroutine that runs for its window, within its tenant's
quotas, recording every request's outcome (records.Outcome).

`run_attack(spec)` is what the runner calls in a process of its own (a spawned worker): the
attacker's client work (building megabyte bodies, many sockets) then never holds the GIL of the
process that times the victim and the /health probe. Each pattern stops sending at its window's
end, hangs up what it still holds (such outcomes are `cut`) and cancels the background responses
it made; what the gateway keeps running after that (resumable chat streams cannot be cancelled)
is the runner's to wait out before the next pattern.
"""
from __future__ import annotations

import asyncio
import itertools
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from loadtest.hostile import bodies
from loadtest.hostile.records import Outcome, error_code, event_error, grpc_outcome, sse_data

PATTERNS = ("busy", "tools", "schema", "bytes", "stored", "followers", "grpc", "idle")
REFERENCE = "busy"    # not an attack: an ordinary neighbour filling the batch, the others' yardstick


@dataclass(frozen=True)
class AttackSpec:
    pattern: str
    url: str
    key: str
    model: str
    window_s: float
    concurrency: int = 8              # request loops of the request patterns
    followers: int = 64               # concurrent followers (followers)
    idle_streams: int = 32            # sockets opened and never read (idle)
    long_tokens: int = 2000           # max tokens of the long outputs
    byte_token: int | None = None     # a token id that decodes alone to U+FFFD (bytes)
    grpc_target: str | None = None    # host:port of the gateway's gRPC API (grpc)
    timeout_s: float = 120.0


@dataclass
class AttackResult:
    pattern: str
    started: float
    ended: float                      # the window's end (the cleanup after it excluded)
    outcomes: list[Outcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: bool = False             # the pattern could not run here (no byte token, no gRPC)

    def skip(self, why: str) -> None:
        self.skipped = True
        self.notes.append(f"skipped: {why}")


@dataclass
class _Run:
    spec: AttackSpec
    client: Any                       # httpx.AsyncClient
    deadline: float
    result: AttackResult

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.spec.key}", "Content-Type": "application/json"}

    def record(self, o: Outcome) -> None:
        o.ended = time.monotonic()
        o.server_error = o.server_error or o.status >= 500
        self.result.outcomes.append(o)


def run_attack(spec: AttackSpec) -> AttackResult:
    """Run one pattern for `spec.window_s` seconds from now (in the calling process)."""
    if spec.pattern not in PATTERNS:
        raise ValueError(f"unknown pattern {spec.pattern!r}; patterns: {', '.join(PATTERNS)}")
    return asyncio.run(_attack(spec))


async def _attack(spec: AttackSpec) -> AttackResult:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=spec.url, limits=limits, timeout=spec.timeout_s) as c:
        t0 = time.monotonic()
        run = _Run(spec, c, t0 + spec.window_s, AttackResult(spec.pattern, t0, t0 + spec.window_s))
        try:
            await _PATTERN_FNS[spec.pattern](run)
        except Exception as exc:        # the attacker broke, not the gateway: judge nothing
            run.result.skip(f"the attacker failed: {exc!r}")
    return run.result


# ---- the building blocks -----------------------------------------------------------------------
async def _until_deadline(run: _Run, coros: list[Awaitable[Any]]) -> None:
    """Run `coros` until they end or the window does; those still running are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, run.deadline - time.monotonic()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _loops(run: _Run, n: int, one: Callable[[int], Awaitable[Any]]) -> None:
    """`n` loops, each sending its next request once its last is answered, until the window
    ends; `one(k)` gets a number no other request of the pattern got."""
    counter = itertools.count()

    async def loop() -> None:
        while time.monotonic() < run.deadline:
            await one(next(counter))

    await _until_deadline(run, [loop() for _ in range(n)])


async def _call(run: _Run, kind: str, method: str, path: str, content: bytes | None = None) -> Any:
    """One request, its whole answer read; the response (None when none came)."""
    o = Outcome(kind, time.monotonic())
    try:
        resp = await run.client.request(method, path, content=content, headers=run.headers)
        o.status = resp.status_code
        if resp.status_code >= 400:
            o.code = error_code(resp.content)
        return resp
    except asyncio.CancelledError:
        o.cut = True
        raise
    except Exception as exc:                 # no answer: a timeout, a dropped connection
        o.detail = type(exc).__name__
        return None
    finally:
        run.record(o)


async def _stream(run: _Run, kind: str, method: str, path: str, content: bytes | None = None,
                  *, first_id: bool = False) -> str | None:
    """One streamed request read to its end (or, with `first_id`, to its first chunk carrying an
    `id`, which is returned: the attacker then hangs up)."""
    o = Outcome(kind, time.monotonic())
    try:
        async with run.client.stream(method, path, content=content, headers=run.headers) as resp:
            o.status = resp.status_code
            if resp.status_code >= 400:
                o.code = error_code(await resp.aread())
                return None
            async for line in resp.aiter_lines():
                event = sse_data(line)
                if (err := event_error(event)) is not None:
                    o.code, o.server_error = err
                elif first_id and isinstance(event, dict) and event.get("id"):
                    o.cut = True
                    return str(event["id"])
        return None
    except asyncio.CancelledError:
        o.cut = True
        raise
    except Exception as exc:
        o.detail = type(exc).__name__
        return None
    finally:
        run.record(o)


# ---- the patterns ------------------------------------------------------------------------------
async def _busy(run: _Run) -> None:
    body = bodies.busy_stream(run.spec.model)
    await _loops(run, run.spec.concurrency, lambda k: _stream(
        run, "busy", "POST", "/v1/chat/completions", body.with_nonce(k)))


async def _tools(run: _Run) -> None:
    body = bodies.tools_bomb(run.spec.model)
    run.result.notes.append(f"body {len(body) / bodies.MIB:.2f} MiB")
    await _loops(run, run.spec.concurrency, lambda k: _call(
        run, "tools", "POST", "/v1/chat/completions", body.with_nonce(k)))


async def _schema(run: _Run) -> None:
    body = bodies.schema_bomb(run.spec.model)
    await _loops(run, run.spec.concurrency, lambda k: _call(
        run, "schema", "POST", "/v1/chat/completions", body.with_nonce(k)))


async def _bytes(run: _Run) -> None:
    """A few resumable streams forced to byte tokens, each left after its first chunk, then
    replays of them (each a whole stream again) from every loop until the window ends."""
    if run.spec.byte_token is None:
        run.result.skip("the tokenizer has no token that decodes alone to U+FFFD")
        return
    body = bodies.byte_stream(run.spec.model, run.spec.byte_token, run.spec.long_tokens)
    streams = max(1, run.spec.concurrency // 2)
    ids = [i for i in await asyncio.gather(*(_stream(
        run, "bytes", "POST", "/v1/chat/completions", body.with_nonce(k), first_id=True)
        for k in range(streams))) if i]
    run.result.notes.append(f"{len(ids)} byte-token streams of {run.spec.long_tokens} tokens, "
                            f"token id {run.spec.byte_token}")
    if ids:
        await _loops(run, run.spec.concurrency, lambda k: _stream(
            run, "replay", "GET", f"/v1/chat/completions/{ids[k % len(ids)]}/stream"))


async def _stored(run: _Run) -> None:
    body = bodies.stored_response(run.spec.model)
    await _loops(run, run.spec.concurrency * 2, lambda k: _call(
        run, "stored", "POST", "/v1/responses", body.with_nonce(k)))
    stored = sum(o.status == 200 for o in run.result.outcomes)
    run.result.notes.append(f"{stored} responses stored")


async def _followers(run: _Run) -> None:
    """One long background response and one long resumable chat stream, then many concurrent
    followers of each, re-following whatever has ended until the window does."""
    import json

    spec = run.spec
    made = await _call(run, "long_response", "POST", "/v1/responses",
                       json.dumps(bodies.long_response(spec.model, spec.long_tokens)).encode())
    response_id = made.json().get("id") if made is not None and made.status_code == 200 else None
    chat_id = await _stream(run, "long_chat", "POST", "/v1/chat/completions", json.dumps(
        bodies.long_chat_stream(spec.model, spec.long_tokens)).encode(), first_id=True)
    paths = ([f"/v1/responses/{response_id}?stream=true"] if response_id else []) + \
            ([f"/v1/chat/completions/{chat_id}/stream"] if chat_id else [])
    run.result.notes.append(f"{spec.followers} followers of {len(paths)} long outputs")
    if paths:
        async def follow(k: int) -> None:
            while time.monotonic() < run.deadline:
                await _stream(run, "follow", "GET", paths[k % len(paths)])

        await _until_deadline(run, [follow(k) for k in range(spec.followers)])
    if response_id:
        await _call(run, "cancel", "POST", f"/v1/responses/{response_id}/cancel")


async def _grpc(run: _Run) -> None:
    """Unary Generate calls whose prompts are near and over the HTTP body cap and gRPC's own
    receive limit, from every loop, the sizes in turn."""
    if not run.spec.grpc_target:
        run.result.skip("no gRPC target (--grpc-target)")
        return
    import grpc

    from gateway.grpc_api.proto import specgate_pb2 as pb
    from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc

    msgs = [pb.GenerateRequest(model=run.spec.model, prompt=bodies.grpc_prompt(size, i), max_tokens=1)
            for i, size in enumerate(bodies.GRPC_PROMPT_BYTES)]
    run.result.notes.append("prompts of " + ", ".join(
        f"{m.ByteSize() / bodies.MIB:.2f}" for m in msgs) + " MiB")
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    metadata = (("authorization", f"Bearer {run.spec.key}"),)
    async with grpc.aio.insecure_channel(run.spec.grpc_target, options=options) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(k: int) -> None:
            o = Outcome(f"grpc_{k % len(msgs)}", time.monotonic())
            call = stub.Generate(msgs[k % len(msgs)], metadata=metadata, timeout=run.spec.timeout_s)
            try:
                await call
            except asyncio.CancelledError:
                o.cut = True
                call.cancel()
                raise
            except grpc.RpcError:
                pass
            finally:
                if not o.cut:
                    code = await call.code()
                    trailing = {k: v for k, v in (await call.trailing_metadata() or ())
                                if isinstance(v, str)}
                    grpc_outcome(o, code.name, trailing, await call.details())
                run.record(o)

        await _loops(run, run.spec.concurrency, one)


async def _idle(run: _Run) -> None:
    """Streaming requests sent on sockets with a small receive buffer that are never read until
    the window ends; then whatever status line came is read and the socket closed."""
    parts = urlsplit(run.spec.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    held: list[tuple[socket.socket, Outcome]] = []
    try:
        for n in range(run.spec.idle_streams):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setblocking(False)
            o = Outcome("idle", time.monotonic(), cut=True)
            held.append((s, o))
            try:
                await loop.sock_connect(s, (host, port))
                await loop.sock_sendall(s, bodies.idle_stream(
                    run.spec.model, f"{host}:{port}", run.spec.key, run.spec.long_tokens, n))
            except OSError as exc:                      # refused or reset: no answer
                o.cut, o.detail = False, type(exc).__name__
        run.result.notes.append(f"{len(held)} streams opened, never read")
        await asyncio.sleep(max(0.0, run.deadline - time.monotonic()))
    finally:
        for s, o in held:
            o.status = await _status_line(loop, s)
            s.close()
            if o.status >= 400:
                o.cut = False
            run.record(o)


async def _status_line(loop: asyncio.AbstractEventLoop, s: socket.socket) -> int:
    """The status of whatever answer has come on `s` (0 when none has)."""
    try:
        head = await asyncio.wait_for(loop.sock_recv(s, 4096), timeout=1.0)
        return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        return 0


_PATTERN_FNS: dict[str, Callable[[_Run], Awaitable[None]]] = {
    "busy": _busy, "tools": _tools, "schema": _schema, "bytes": _bytes, "stored": _stored,
    "followers": _followers, "grpc": _grpc, "idle": _idle}
