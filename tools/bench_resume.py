"""`specgate bench resume`: kill -9 the gateway in the middle of a streamed background response,
start it again, resume the stream with `starting_after`, and check what the client put together.

    specgate bench resume --redis-url redis://127.0.0.1:6379 --tries 20 --json results/bench_resume_embedded.json

Per sampling mode (greedy; seeded sampling), one uninterrupted run first gives the reference
events. Then each try: start `specgate serve` (a real process over Redis), POST a background
response with `stream: true`, read its events up to a random number of text deltas, SIGKILL the
gateway, start a new one (same replica id: it recovers the request from Redis and finishes it),
GET `/v1/responses/{id}?stream=true&starting_after=<last sequence number seen>`, and compare:

    identical   the text of the deltas before the kill plus those after equals the reference's
    numbered    the sequence numbers seen, before and after, are 0, 1, 2, … with none missing
                or repeated, and the stream ends with the reference's terminal event

A try passes when both hold. The report is JSON: per mode, the tries, each try's kill point and
verdicts, and the pass count. `--ray`: the same against the Ray Serve app on a local Ray cluster,
where each kill is of the scheduler replica and every ingress replica (Serve starts new ones; the
new scheduler recovers the response from Redis, a new ingress answers the resume).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from workers.model.loader import DEFAULT_MODEL
from loadtest.results import write_result

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-resume-bench-0000"
LEASE_S = 2.0           # the replica lease: a killed gateway's id is free again this soon
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MODES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1234}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--redis-url", required=True, help="a Redis the gateways share (the state store)")
    p.add_argument("--tries", type=int, default=20, help="kill points per sampling mode")
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--modes", default="greedy,seeded")
    p.add_argument("--seed", type=int, default=0, help="of the kill points")
    p.add_argument("--ray", action="store_true",
                   help="the Ray Serve app on a local Ray cluster: each kill is of the scheduler "
                        "replica and every ingress replica (Serve starts new ones)")
    p.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    report = bench_resume(model=args.model, redis_url=args.redis_url, tries=args.tries,
                          max_tokens=args.max_tokens, modes=args.modes.split(","), seed=args.seed,
                          progress=lambda line: print(line, file=sys.stderr, flush=True),
                          ray=args.ray)
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
    print(text)
    return 0 if all(m["passed"] == m["tries"] for m in report["modes"].values()) else 1


# ---- one gateway process ------------------------------------------------------------------------
@dataclass
class Gateway:
    model: str
    redis_url: str
    prefix: str
    port: int
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 900.0) -> None:
        import httpx

        env = {**os.environ, "SPECGATE_STORE_PREFIX": self.prefix, "SPECGATE_REPLICA_ID": "resume",
               "SPECGATE_REPLICA_LEASE_S": str(LEASE_S), "SPECGATE_LOG_LEVEL": "warning",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        deadline = time.monotonic() + timeout_s
        while True:            # a killed holder's replica lease may still run: start again
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specgate.cli", "serve", "--model", self.model,
                 "--served-model-name", "m", "--redis-url", self.redis_url, "--port", str(self.port)],
                cwd=ROOT, env=env, stdout=log, stderr=log)
            while self.proc.poll() is None:
                try:
                    if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError("the gateway did not become ready")
                time.sleep(0.1)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway exited ({self.proc.returncode}) and kept exiting")
            time.sleep(0.5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """SIGKILL, then a new process (once the dead one's replica lease has run out)."""
        self.kill()
        time.sleep(LEASE_S)
        self.start()

    def resume(self, url: str) -> list[dict]:
        return read_events("GET", url)


@dataclass
class RayGateway:
    """The Ray Serve app (deploy/serve/specgate.yaml's shape) on a local Ray cluster; a restart
    kills the scheduler replica and every ingress replica (ray.kill: the process is terminated
    at once, nothing runs on the way out) and Serve's controller starts new ones."""
    model: str
    redis_url: str
    prefix: str
    port: int
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import ray
        from ray import serve

        from gateway.builders.ray_app import build_ray_app
        from gateway.cli.serve_ray import load_config
        from gateway.ray_serve.replica_secrets import export_secrets

        # a Redis URL's password reaches the replicas through the environment, never the config
        cfg, _ = load_config(ROOT / "deploy" / "serve" / "specgate.yaml",
                             export_secrets({"model": self.model, "served_model_name": "m",
                                             "redis_url": self.redis_url, "store_prefix": self.prefix}))
        cfg.ingress.autoscaling_config, cfg.ingress.num_replicas = None, 2
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="error",
                 log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        serve.run(build_ray_app(cfg), name="specgate", route_prefix="/")

    def kill(self) -> None:
        import ray
        if ray.is_initialized():
            ray.shutdown()

    def restart(self) -> None:
        import ray

        for name in [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if "#scheduler#" in a["name"] or "#ingress#" in a["name"]]:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def resume(self, url: str, timeout_s: float = 180.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:                          # until Serve has started an ingress replica again
            try:
                return read_events("GET", url)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


# ---- a client reading events ----------------------------------------------------------------------
def read_events(method: str, url: str, *, body: dict | None = None,
                stop: Callable[[list[dict]], bool] | None = None, timeout_s: float = 300.0) -> list[dict]:
    """The server-sent events of one call, until the stream ends or `stop(events so far)`."""
    import httpx

    events: list[dict] = []
    with httpx.stream(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=timeout_s) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{method} {url}: {resp.status_code} {resp.read()!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if stop is not None and stop(events):
                break
    return events


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")


def deltas(events: list[dict]) -> int:
    return sum(e.get("type") == "response.output_text.delta" for e in events)


def request_body(max_tokens: int, sampling: dict) -> dict:
    return {"model": "m", "input": PROMPT, "max_output_tokens": max_tokens, "background": True,
            "stream": True, **sampling}


# ---- the measurement ---------------------------------------------------------------------------------
def bench_resume(*, model: str, redis_url: str, tries: int, max_tokens: int, modes: list[str],
                 seed: int = 0, progress: Callable[[str], None] = lambda _: None,
                 log_path: Path | None = None, ray: bool = False) -> dict[str, Any]:
    from gateway.http.server import free_port
    from gateway.tenancy.records import Tenant
    from gateway.tenancy.tenants import TenantRegistry

    prefix = f"resume:{uuid.uuid4().hex[:8]}:"
    TenantRegistry(redis_url, prefix).put(Tenant("bench"), [KEY])
    gw = (RayGateway if ray else Gateway)(model, redis_url, prefix, free_port(), log_path=log_path)
    rng = random.Random(seed)
    report: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "mode": "ray" if ray else "embedded",
                              "modes": {}}
    try:
        gw.start()
        for mode in modes:
            sampling = MODES[mode]
            ref = read_events("POST", gw.url + "/v1/responses", body=request_body(max_tokens, sampling))
            n = deltas(ref)
            if n < 2:
                raise RuntimeError(f"the reference run gave {n} text deltas: too few to cut")
            rows = []
            for i in range(tries):
                k = rng.randint(1, n - 1)
                row = one_try(gw, request_body(max_tokens, sampling), ref, k)
                rows.append(row)
                progress(f"{mode} try {i + 1}/{tries}: killed after {k} of {n} deltas: "
                         f"{'pass' if row['passed'] else 'FAIL'}")
            report["modes"][mode] = {"reference_deltas": n, "reference_events": len(ref),
                                     "tries": tries, "passed": sum(r["passed"] for r in rows),
                                     "rows": rows}
    finally:
        gw.kill()
        _drop_prefix(redis_url, prefix)
    return report


def one_try(gw: Gateway | RayGateway, body: dict, ref: list[dict], k: int) -> dict[str, Any]:
    """One kill point: `k` text deltas read, then the kill and restart, then the resume."""
    before = read_events("POST", gw.url + "/v1/responses", body=body,
                         stop=lambda evs: deltas(evs) >= k)
    response_id = before[0]["response"]["id"]
    t0 = time.monotonic()
    gw.restart()
    restart_s = time.monotonic() - t0
    last = before[-1]["sequence_number"]
    after = gw.resume(f"{gw.url}/v1/responses/{response_id}?stream=true&starting_after={last}")
    seen = [e["sequence_number"] for e in before + after]
    identical = text_of(before) + text_of(after) == text_of(ref)
    numbered = seen == list(range(len(ref))) and bool(after) and after[-1]["type"] == ref[-1]["type"]
    return {"kill_after_deltas": k, "events_before": len(before), "events_after": len(after),
            "restart_s": round(restart_s, 2), "identical": identical, "numbered": numbered,
            "passed": identical and numbered}


def _drop_prefix(redis_url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        keys = list(r.scan_iter(match=prefix + "*", count=1000))
        for i in range(0, len(keys), 500):
            r.delete(*keys[i:i + 500])
    finally:
        r.close()
