"""The gateway under attack: one this test starts (`specgate serve` in a child process, its two
tenants in a tenants file) or one it is pointed at (`--url` and the tenants' keys), and what is
read from it besides answers: /ready, /metrics (live requests, a loop-lag series where the
gateway has one), its RSS, and Redis `used_memory`.

`specgate serve` as a subprocess, not an embedded app in a child: the load tester sits above
the gateway and starts one only through `gateway.builders` or as a process, and `serve` is what
an operator runs (HTTP and gRPC on one event loop, the tenants file, the flags).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from loadtest.compare import metrics_text
from loadtest.results import REPO


@dataclass(frozen=True)
class Quotas:
    """Each tenant's limits: generous, so that the attacker stays within its own."""
    rpm: int | None = 1000
    tpm: int | None = 5_000_000
    max_concurrent: int | None = 64


@dataclass(frozen=True)
class Target:
    url: str
    victim_key: str
    attacker_key: str
    admin_key: str | None = None         # reads /metrics
    grpc_target: str | None = None       # host:port
    pid: int | None = None               # the gateway's process, when this test started it
    redis_url: str | None = None
    store_prefix: str | None = None


def tenants_file(path: Path, keys: dict[str, str], admin_key: str, quotas: Quotas) -> Path:
    """The tenants file of the two tenants (`keys`: name → API key), JSON (which is YAML)."""
    limits = {k: v for k, v in (("rpm", quotas.rpm), ("tpm", quotas.tpm),
                                ("max_concurrent", quotas.max_concurrent)) if v is not None}
    doc = {"admin_keys": [admin_key],
           "tenants": [{"name": name, "api_keys": [key], **limits} for name, key in keys.items()]}
    path.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return path


def serve_command(port: int, grpc_port: int, tenants: Path, *, model: str | None,
                  redis_url: str | None, fake_step_ms: float | None) -> list[str]:
    """`specgate serve` with this run's ports and tenants (`fake_step_ms`: the fake worker)."""
    cmd = [sys.executable, "-m", "specgate.cli", "serve", "--port", str(port),
           "--grpc-port", str(grpc_port), "--tenants", str(tenants), "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    if fake_step_ms is not None:
        cmd += ["--fake-worker", "--fake-step-ms", str(fake_step_ms)]
    return cmd


@contextlib.contextmanager
def served(*, model: str | None = None, redis_url: str | None = None, quotas: Quotas = Quotas(),
           fake_step_ms: float | None = None, start_timeout_s: float = 900.0) -> Iterator[Target]:
    """A gateway of this checkout serving the victim and the attacker until the block ends; over
    Redis its keys live under a prefix of their own, deleted afterwards."""
    from gateway.http.server import free_port
    from gateway.tenancy.records import new_api_key

    keys = {"victim": new_api_key(), "attacker": new_api_key()}
    admin = new_api_key()
    prefix = f"specgate-hostile-{uuid.uuid4().hex[:12]}:"
    port, grpc_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="specgate-hostile-") as tmp:
        cmd = serve_command(port, grpc_port, tenants_file(Path(tmp) / "tenants.yaml", keys, admin,
                                                          quotas),
                            model=model, redis_url=redis_url, fake_step_ms=fake_step_ms)
        env = {**os.environ, "SPECGATE_STORE_PREFIX": prefix,
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        log_path = Path(tmp) / "gateway.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc, log_path, start_timeout_s)
            yield Target(url, keys["victim"], keys["attacker"], admin, f"127.0.0.1:{grpc_port}",
                         proc.pid, redis_url, prefix if redis_url else None)
        finally:
            stop(proc)
            if redis_url:
                delete_prefix(redis_url, prefix)


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Until GET /ready is a 200; the gateway's log in the error when it exits or never is."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:]
            why = f"exited ({proc.returncode})" if proc.poll() is not None else "never became ready"
            raise RuntimeError(f"the gateway {why}; its log ends:\n{tail}")
        time.sleep(0.25)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (serve shuts down cleanly), then SIGKILL if it is still there 20 s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every Redis key under this run's prefix (a stored response lives for 30 days)."""
    import redis

    deleted = 0
    with redis.Redis.from_url(url) as client:
        batch: list[Any] = []
        for key in client.scan_iter(match=prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += client.delete(*batch)
                batch.clear()
        if batch:
            deleted += client.delete(*batch)
    return deleted


# ---- what is read besides answers --------------------------------------------------------------
def redis_used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024          # "VmRSS:   123456 kB"
    raise RuntimeError(f"no VmRSS for process {pid}")


def metric_samples(text: str) -> list[tuple[str, float]]:
    """(name, value) of every sample on a /metrics page; a histogram's bucket is named with its
    bound ('x_bucket{le="0.1"}')."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(f'{s.name}{{le="{s.labels["le"]}"}}' if "le" in s.labels else s.name, s.value)
            for f in text_string_to_metric_families(text) for s in f.samples]


def live_requests(samples: list[tuple[str, float]]) -> float | None:
    """Queued, running and preempted requests (`specgate_queue_depth` over its labels)."""
    depth = [v for name, v in samples if name == "specgate_queue_depth"]
    return sum(depth) if depth else None


LOOP_LAG = "specgate_event_loop_lag_seconds"     # the gateway's histogram (gateway/looplag.py)


def loop_lag(samples: list[tuple[str, float]]) -> dict[str, float] | None:
    """The gateway's event-loop lag histogram as it stands (its cumulative samples by name);
    None where the gateway has none (then /health's latency is the proxy)."""
    out = {name: v for name, v in samples if name.startswith(LOOP_LAG)}
    return out or None


def lag_between(before: dict[str, float] | None,
                after: dict[str, float] | None) -> dict[str, float | int | None] | None:
    """The lag the gateway measured between two readings of its histogram (`loop_lag`): how
    many wake-ups, their mean, and the bucket bounds under which 99% and all of them fell
    (None: no reading, or the histogram was reset between them)."""
    if not before or not after:
        return None
    n = after.get(LOOP_LAG + "_count", 0.0) - before.get(LOOP_LAG + "_count", 0.0)
    if n <= 0:
        return None
    total = after.get(LOOP_LAG + "_sum", 0.0) - before.get(LOOP_LAG + "_sum", 0.0)
    head = LOOP_LAG + '_bucket{le="'
    bounds = sorted((float(name[len(head):-2]), after[name] - before.get(name, 0.0))
                    for name in after if name.startswith(head))

    def under(share: float) -> float | None:      # None: beyond the largest finite bound
        le = next((le for le, c in bounds if c >= share * n - 1e-9), math.inf)
        return None if math.isinf(le) else le

    return {"wakeups": int(n), "mean_s": total / n, "p99_le_s": under(0.99),
            "max_le_s": under(1.0)}


def read_metrics(target: Target) -> list[tuple[str, float]] | None:
    if target.admin_key is None:
        return None
    text = metrics_text(target.url, target.admin_key)
    return metric_samples(text) if text is not None else None
