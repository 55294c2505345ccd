"""`specgate bench refusals`: what one refused request costs the gateway, and the event loop.

A tenant over its limits that sends the next request as soon as the last is refused (a closed
loop) takes as much of the gateway's CPU as its refusals cost: that CPU is the event loop's and
the GIL's, taken from every other tenant's streams and from the step loop. So the figure here is
the gateway process's CPU seconds per refused request, for the limits a flood hits:

    rpm          a tenant with a small requests-per-minute limit, spent first; then a flood
    concurrency  a tenant with `max_concurrent` 1, its one slot held by a long stream; then a flood
    tpm          a tenant whose whole tokens-per-minute window one request took; then a flood
                 (small, so that not even one token fits for the flood's length: only then is a
                 tpm refusal true of every request of the key, and refused early)
    grpc_rpm     the rpm tenant again, its flood over gRPC `Generate` (the client: grpc.aio)

`specgate serve --fake-worker` runs in a child process over Redis (the state store a fleet
uses; its keys under a prefix of their own, deleted afterwards), once per mode:
`early_refusals` on (`fast`) and off (`full`: every refusal takes the whole HTTP path), so one
run gives the before and the after on the same machine. CPU is read from /proc/<pid>/stat
before and after each flood, less what the process used at rest just before (the held stream's
steps); the event loop's lag is the gateway's own histogram (`specgate_event_loop_lag_seconds`)
between the same two moments. The client is the lean raw-socket one of `bench gateway`
(loadtest/http_client.py), in this process.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from loadtest.compare import metrics_text
from loadtest.http_client import _split_response, load
from loadtest.hostile import target as tg
from loadtest.results import write_result

MODES = ("fast", "full")
LIMITS = ("rpm", "concurrency", "tpm", "grpc_rpm")
RPM = 30                       # the rpm tenant's limit: spent by its first RPM requests
TPM = 3                        # the tpm tenant's: one request of "hi" and one token fills it
HOLD_TOKENS = 3000             # the concurrency tenant's held stream: longer than any flood


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--refusals", type=int, default=2000, help="requests in each flood")
    p.add_argument("--concurrency", type=int, default=8, help="the flood's connections")
    p.add_argument("--fake-step-ms", type=float, default=20.0, help="the fake worker's step")
    p.add_argument("--modes", default=",".join(MODES), help="fast, full or both (fast,full)")
    p.add_argument("--json", type=Path, help="write the results here")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: a comma-separated list of {', '.join(MODES)}")
    report = bench_refusals(args.redis_url, modes=modes, refusals=args.refusals,
                            concurrency=args.concurrency, fake_step_ms=args.fake_step_ms)
    print(summary(report), file=sys.stderr)
    if args.json:
        write_result(args.json, report)
    print(json.dumps(report, indent=1))
    return 0


def bench_refusals(redis_url: str, *, modes: list[str], refusals: int = 2000,
                   concurrency: int = 8, fake_step_ms: float = 20.0) -> dict[str, Any]:
    results = {}
    for mode in modes:
        with _served(redis_url, mode == "fast", fake_step_ms) as gw:
            results[mode] = {limit: _flood(gw, limit, refusals, concurrency) for limit in LIMITS}
    return {"benchmark": "refusals", "refusals": refusals, "concurrency": concurrency,
            "fake_step_ms": fake_step_ms, "rpm": RPM, "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(), "modes": results}


def summary(r: dict[str, Any]) -> str:
    lines = [f"bench refusals: {r['refusals']} requests a flood over {r['concurrency']} "
             f"connections (load average {r['load_average'][0]:.1f})"]
    for mode, by_limit in r["modes"].items():
        for limit, m in by_limit.items():
            lines.append(f"  {mode:4} {limit:11} {m['cpu_ms_per_refusal']:.3f} ms CPU a refusal, "
                         f"{m['refusals_per_s']:.0f}/s, loop lag p99 <= {m['loop_lag_p99_le_s']} s "
                         f"max <= {m['loop_lag_max_le_s']} s, statuses {m['statuses']}")
    return "\n".join(lines)


# ---- the gateway ------------------------------------------------------------------------------------
class _Gateway:
    def __init__(self, url: str, pid: int, keys: dict[str, str], admin: str, grpc_port: int) -> None:
        self.url, self.pid, self.keys, self.admin = url, pid, keys, admin
        self.grpc_port = grpc_port
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)


class _served:
    """`specgate serve --fake-worker` over Redis with the bench's tenants, `early_refusals` set."""

    def __init__(self, redis_url: str, early: bool, fake_step_ms: float) -> None:
        self.redis_url, self.early, self.fake_step_ms = redis_url, early, fake_step_ms

    def __enter__(self) -> _Gateway:
        import subprocess

        from gateway.http.server import free_port
        from gateway.tenancy.records import new_api_key

        self.tmp = tempfile.TemporaryDirectory(prefix="specgate-refusals-")
        keys = {"rpm": new_api_key(), "concurrency": new_api_key(), "tpm": new_api_key()}
        admin = new_api_key()
        doc = {"admin_keys": [admin], "tenants": [
            {"name": "rpm", "api_keys": [keys["rpm"]], "rpm": RPM},
            {"name": "concurrency", "api_keys": [keys["concurrency"]], "max_concurrent": 1},
            {"name": "tpm", "api_keys": [keys["tpm"]], "tpm": TPM}]}
        tenants = Path(self.tmp.name) / "tenants.yaml"
        tenants.write_text(json.dumps(doc), encoding="utf-8")
        self.prefix = f"specgate-refusals-{uuid.uuid4().hex[:12]}:"
        port, self.grpc_port = free_port(), free_port()
        cmd = tg.serve_command(port, self.grpc_port, tenants, model=None,
                               redis_url=self.redis_url, fake_step_ms=self.fake_step_ms)
        env = {**os.environ, "SPECGATE_STORE_PREFIX": self.prefix,
               "SPECGATE_EARLY_REFUSALS": "true" if self.early else "false",
               # the cost of a refusal is measured, not how a hold paces a flood
               "SPECGATE_EARLY_REFUSAL_HOLD_S": "0"}
        log_path = Path(self.tmp.name) / "gateway.log"
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=tg.REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            tg.wait_ready(url, self.proc, log_path, 300)
        except BaseException:
            self.__exit__()
            raise
        return _Gateway(url, self.proc.pid, keys, admin, self.grpc_port)

    def __exit__(self, *_: Any) -> None:
        tg.stop(self.proc)
        tg.delete_prefix(self.redis_url, self.prefix)
        self.tmp.cleanup()


# ---- one flood -----------------------------------------------------------------------------------
def _request(gw: _Gateway, key: str, max_tokens: int, stream: bool = False,
             prompt: str = "Say hello.") -> bytes:
    body = json.dumps({"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens,
                       "stream": stream}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {gw.host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def _lag(gw: _Gateway) -> dict[str, float] | None:
    text = metrics_text(gw.url, gw.admin)
    return tg.loop_lag(tg.metric_samples(text)) if text is not None else None


def _spend_rpm(gw: _Gateway) -> None:
    """Send the rpm tenant's requests until one is refused: its minute is spent."""
    raw = _request(gw, gw.keys["rpm"], 1)
    with socket.create_connection((gw.host, gw.port)) as sock:
        for _ in range(RPM + 5):
            sock.sendall(raw)
            buf = b""
            while (whole := _split_response(buf)) is None:
                if not (data := sock.recv(65536)):
                    raise ConnectionError("the gateway closed the connection")
                buf += data
            if whole[0] == 429:
                return
    raise RuntimeError("the rpm tenant was never refused")


def _hold_slot(gw: _Gateway) -> socket.socket:
    """A long stream of the concurrency tenant, its one slot held until the socket closes."""
    sock = socket.create_connection((gw.host, gw.port))
    sock.sendall(_request(gw, gw.keys["concurrency"], HOLD_TOKENS, stream=True))
    head = sock.recv(4096)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the held stream was refused: {head[:200]!r}")
    return sock


def _fill_tpm(gw: _Gateway) -> None:
    """One request of the tpm tenant charged its whole window (the fake worker's tokenizer
    reads a character a token, and the request uses all it was charged: nothing is refunded)."""
    with socket.create_connection((gw.host, gw.port)) as sock:
        sock.sendall(_request(gw, gw.keys["tpm"], TPM - 2, prompt="hi"))
        buf = b""
        while (whole := _split_response(buf)) is None:
            if not (data := sock.recv(65536)):
                raise ConnectionError("the gateway closed the connection")
            buf += data
    if whole[0] != 200:
        raise RuntimeError(f"the tpm tenant's first request was refused: {whole[0]}")


async def _grpc_load(gw: _Gateway, key: str, total: int,
                     concurrency: int) -> tuple[int, int, None, float]:
    """`load`'s closed loop over gRPC `Generate`, on one channel (HTTP/2 streams)."""
    import grpc

    from gateway.grpc_api.proto import specgate_pb2 as pb
    from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(model="smollm2-135m", prompt="Say hello.", max_tokens=1)
    metadata, left, ok = (("authorization", f"Bearer {key}"),), total, 0
    async with grpc.aio.insecure_channel(f"{gw.host}:{gw.grpc_port}") as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def client() -> None:
            nonlocal left, ok
            while left > 0:
                left -= 1
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.Generate(req, metadata=metadata)
                    ok += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return ok, total - ok, None, time.perf_counter() - t0


def _flood(gw: _Gateway, limit: str, total: int, concurrency: int) -> dict[str, Any]:
    held = (_spend_rpm(gw) if limit in ("rpm", "grpc_rpm") else
            _fill_tpm(gw) if limit == "tpm" else _hold_slot(gw))
    try:
        # the tpm flood's request fits the whole window ("hi"): refused for its fill, not its size
        raw = (b"" if limit == "grpc_rpm" else
               _request(gw, gw.keys[limit], 1, prompt="hi" if limit == "tpm" else "Say hello."))
        rest0, t0 = _cpu_s(gw.pid), time.perf_counter()
        time.sleep(1.0)                              # the process at rest (a held stream steps)
        rest_rate = (_cpu_s(gw.pid) - rest0) / (time.perf_counter() - t0)
        lag0, cpu0 = _lag(gw), _cpu_s(gw.pid)
        ok, other, _, elapsed = asyncio.run(
            _grpc_load(gw, gw.keys["rpm"], total, concurrency) if limit == "grpc_rpm"
            else load(gw.host, gw.port, raw, total, concurrency))
        cpu = _cpu_s(gw.pid) - cpu0 - rest_rate * elapsed
        lag = tg.lag_between(lag0, _lag(gw)) or {}
    finally:
        if isinstance(held, socket.socket):
            held.close()
    sent = total + (concurrency if raw else 0)      # `load` warms each connection up first
    return {"statuses": {"200": ok, "other": other}, "elapsed_s": round(elapsed, 3),
            "refusals_per_s": round(other / elapsed, 1),
            "cpu_s": round(cpu, 3), "rest_cpu_share": round(rest_rate, 3),
            "cpu_ms_per_refusal": round(1000 * cpu / sent, 4),
            "loop_lag_p99_le_s": lag.get("p99_le_s"), "loop_lag_max_le_s": lag.get("max_le_s")}


def docs_table(doc: dict[str, Any]) -> list[str]:
    """The benchmarks page's table of a result (tools/bench_docs.py): one row per mode and limit."""
    from tools.bench_tables import num, table

    rows = [(mode, limit, num(m["cpu_ms_per_refusal"], 3), num(m["refusals_per_s"], 0),
             num(m["loop_lag_p99_le_s"], 4), num(m["loop_lag_max_le_s"], 4))
            for mode, by_limit in doc["modes"].items() for limit, m in by_limit.items()]
    return [f"{num(doc['refusals'])} requests a flood over {num(doc['concurrency'])} connections, "
            f"load average {num(doc['load_average'][0], 1)} on {num(doc['cpu_count'])} CPUs.", "",
            *table(("mode", "limit", "CPU ms a refusal", "refusals/s", "loop lag p99 ≤ s",
                    "loop lag max ≤ s"), rows)]
