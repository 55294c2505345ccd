"""`specgate bench ray`: the Ray Serve deployment against the embedded gateway, one run, same load.

    specgate bench ray --json ray.json [--requests 16 --concurrency 8 --max-tokens 64]

The same requests (round-robin over every workload, greedy chat completions through HTTP, at most
`--concurrency` in flight) go first to the embedded gateway (one process), then to the Ray Serve
application on a local Ray cluster (one ingress, the scheduler, one verifier replica with as many
torch threads as the embedded process, one draft worker unless `--no-draft-workers`), on the
same machine and model. JSON keys:

    ratio_vs_embedded   Ray mode's output tokens/s ÷ the embedded gateway's (target ≥ 0.8)
    overhead_fraction   of the scheduler's step time, the part not spent inside the verifier
                        replica's prefills and steps (forward passes, and drafting, which
                        includes the draft call): planning, RPC, persisting (target ≤ 0.1)
    identical           both modes returned the same text for every request (greedy)

Needs a Redis (`--redis-url`, default redis://127.0.0.1:6379/0); its keys go under a fresh prefix
that is deleted afterwards.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import torch

from loadtest.workload import WORKLOADS, load_workload
from loadtest.results import write_result

KEY = "sk-bench-ray"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--no-draft-workers", action="store_true",
                   help="verifier replicas draft for themselves (no draft deployment)")
    p.add_argument("--json", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    report = bench_ray(model=args.model, requests=args.requests, concurrency=args.concurrency,
                       max_tokens=args.max_tokens, redis_url=args.redis_url,
                       draft_workers=not args.no_draft_workers)
    write_result(args.json, report)
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, (list, dict))}, indent=1))
    return 0


def requests_for(n: int, max_tokens: int, model: str) -> list[dict]:
    sets = [load_workload(w) for w in WORKLOADS]
    out = []
    for i in range(n):
        rec = sets[i % len(sets)][i // len(sets) % len(sets[i % len(sets)])]
        messages = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
        out.append({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    return out


async def drive(url: str, bodies: list[dict], concurrency: int) -> tuple[list[str], int, float]:
    """(texts, output tokens, seconds) for `bodies`, at most `concurrency` in flight."""
    sem = asyncio.Semaphore(concurrency)
    texts: list[str] = [""] * len(bodies)
    tokens = [0]

    async def one(client: httpx.AsyncClient, i: int, body: dict) -> None:
        async with sem:
            r = await client.post(url + "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEY}"})
            r.raise_for_status()
            doc = r.json()
            texts[i] = doc["choices"][0]["message"]["content"]
            tokens[0] += doc["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i, b) for i, b in enumerate(bodies)))
        return texts, tokens[0], time.perf_counter() - t0


def bench_ray(*, model: str, requests: int, concurrency: int, max_tokens: int, redis_url: str,
              draft_workers: bool = True) -> dict[str, Any]:
    from gateway.tenancy.records import Tenant
    from gateway.tenancy.tenants import TenantRegistry

    prefix = f"bench-ray:{uuid.uuid4().hex[:8]}:"
    threads = torch.get_num_threads()
    settings = {"model": model, "redis_url": redis_url, "store_prefix": prefix, "max_batch": concurrency,
                "log_level": "warning"}
    bodies = requests_for(requests, max_tokens, model)
    TenantRegistry(redis_url, prefix).put(Tenant(name="bench"), [KEY])
    try:
        print("bench ray: embedded gateway ...", file=sys.stderr)
        emb_texts, emb_tokens, emb_s, emb_timing = _embedded(settings, bodies, concurrency)
        print("bench ray: Ray Serve application ...", file=sys.stderr)
        ray_texts, ray_tokens, ray_s, timing = _ray(settings, bodies, concurrency, threads, draft_workers)
    finally:
        _delete_prefix(redis_url, prefix)
    emb_rate, ray_rate = emb_tokens / emb_s, ray_tokens / ray_s
    loop_s, compute_s = timing["loop_s"], timing["compute_s"]
    return {
        "model": model, "requests": requests, "concurrency": concurrency, "max_tokens": max_tokens,
        "torch_threads": threads, "draft_workers": draft_workers,
        "embedded_tokens_per_s": round(emb_rate, 2), "ray_tokens_per_s": round(ray_rate, 2),
        "ratio_vs_embedded": round(ray_rate / emb_rate, 3),
        "overhead_fraction": round((loop_s - compute_s) / loop_s, 4) if loop_s else None,
        "embedded_steps": emb_timing["steps"],
        "embedded_step_ms": round(1000 * emb_timing["loop_s"] / max(1, emb_timing["steps"]), 2),
        "ray_steps": timing["steps"],
        "ray_compute_ms_per_step": round(1000 * compute_s / max(1, timing["steps"]), 2),
        "ray_draft_ms_per_step": round(1000 * timing["draft_s"] / max(1, timing["steps"]), 2),
        "ray_step_ms": round(1000 * loop_s / max(1, timing["steps"]), 2),
        "ray_overhead_ms_per_step": round(1000 * (loop_s - compute_s) / max(1, timing["steps"]), 2),
        "identical": emb_texts == ray_texts,
    }


def _embedded(settings: dict, bodies: list[dict], concurrency: int):
    from gateway.http.server import background_server
    from gateway.builders.embedded import build_embedded
    from gateway.settings import Settings

    emb = build_embedded(Settings(**settings), progress=False)
    emb.start()
    try:
        with background_server(emb.app) as url:
            asyncio.run(drive(url, bodies[:1], 1))                      # warm-up
            loop = emb.step_loop
            steps, busy = loop.steps, loop.busy_s
            texts, tokens, seconds = asyncio.run(drive(url, bodies, concurrency))
            return texts, tokens, seconds, {"steps": loop.steps - steps, "loop_s": loop.busy_s - busy}
    finally:
        emb.stop()


def _ray(settings: dict, bodies: list[dict], concurrency: int, threads: int, draft_workers: bool = True):
    import ray
    from ray import serve

    from gateway.builders.ray_app import build_ray_app as build
    from gateway.ray_serve.config import (DeploymentOptions, IngressOptions, RayAppConfig,
                                          StreamingOptions)
    from gateway.ray_serve.replica_secrets import export_secrets
    from gateway.http.server import free_port

    # a Redis URL's password reaches the replicas through the environment, never the config
    cfg = RayAppConfig(settings=export_secrets(settings), ingress=IngressOptions(num_replicas=1, num_cpus=0.1),
                       scheduler=StreamingOptions(num_cpus=0.1),
                       verifier=DeploymentOptions(num_replicas=1, num_cpus=1, torch_threads=threads),
                       draft=DeploymentOptions(num_replicas=1, num_cpus=0.1) if draft_workers else None)
    port = free_port()
    ray.init(include_dashboard=False, logging_level="error", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build(cfg), name="specgate", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        asyncio.run(drive(url, bodies[:1], 1))                          # warm-up
        scheduler = serve.get_deployment_handle("scheduler", app_name="specgate")
        before = scheduler.timing.remote().result()
        texts, tokens, seconds = asyncio.run(drive(url, bodies, concurrency))
        after = scheduler.timing.remote().result()
        timing = {k: after[k] - before[k] for k in after}
        return texts, tokens, seconds, timing
    finally:
        serve.shutdown()
        ray.shutdown()


def _delete_prefix(redis_url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        for key in r.scan_iter(match=prefix + "*", count=1000):
            r.delete(key)
    finally:
        r.close()
