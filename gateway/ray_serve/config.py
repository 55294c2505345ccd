"""Ray Serve mode's configuration, typed: what `gateway.builders.ray_app.build_ray_app` assembles.

Plain pydantic models with no Ray import, so a Serve config file's `args` (deploy/serve/specgate.yaml,
the Helm chart's `serveConfigV2`) can be validated anywhere.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from gateway.settings import Settings


class DeploymentOptions(BaseModel):
    """Per-deployment Serve options (a subset, typed)."""
    num_replicas: int | None = Field(1, ge=1)          # None with autoscaling
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(64, ge=1)
    # requests waiting for a replica at each caller (Serve's proxy, a handle); past it, refused
    # at once (HTTP 503, gRPC RESOURCE_EXHAUSTED); -1: no limit (Serve's default)
    max_queued_requests: int = Field(-1, ge=-1)
    # the Retry-After of that refusal (None: none)
    backpressure_retry_after_s: float | None = Field(None, ge=0)
    autoscaling_config: dict[str, Any] | None = None   # Serve's own keys (min/max_replicas, ...)
    health_check_period_s: float = Field(10.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    torch_threads: int | None = Field(None, ge=1)      # verifier only: torch's intra-op threads


class StreamingOptions(DeploymentOptions):
    """For the deployments a client's stream runs through until its last token: the ingress, and
    the scheduler (the ingress follows each request's tokens there). A replica being drained
    (rolling update, scale-down) must wait out the longest generation, not Serve's 30 s: a stream
    cut there is a request lost. While an old scheduler replica drains it keeps its lease and
    steps every request, so requests sent to the new one wait until it is gone."""
    graceful_shutdown_timeout_s: float = Field(900.0, ge=0)


class IngressOptions(StreamingOptions):
    """The ingress: every client's request holds one of its replicas' `max_ongoing_requests`
    slots until its answer (or stream) ends, before the gateway's fairness or admission sees it;
    past them, requests wait in Serve's queue, invisible to both. So the slots are sized for what
    may hold them for long, every tenant's streams, and what is left waits briefly or not at all:

    - a tenant's long-held slots are bounded by the gateway: its generations by `max_concurrent`
      (when set), its followers (resumes, streamed GETs of responses) by
      `max_followers_per_tenant`; one over either is refused (429) by the first thing the
      handler does after authentication, so a refused request holds a slot for milliseconds;
    - `max_ongoing_requests` × replicas should exceed the sum of those bounds over the tenants
      active at once, with room for short requests; one tenant's bounds must stay well below it;
    - `max_queued_requests` keeps Serve's queue short: when every slot is held (streams that may
      run for minutes), a new request gets a 503 with Retry-After at once instead of waiting
      unseen for one of them to end.
    """
    max_ongoing_requests: int = Field(256, ge=1)
    max_queued_requests: int = Field(64, ge=-1)
    backpressure_retry_after_s: float | None = Field(1.0, ge=0)


class RayAppConfig(BaseModel):
    """Everything `build` needs. `settings` are the embedded gateway's settings (`SPECGATE_*`
    environment variables fill what is left out); Ray mode needs `redis_url`, where the scheduler's
    requests, the tenants and the rate limits live for every replica to see."""
    settings: dict[str, Any] = Field(default_factory=dict)
    ingress: IngressOptions = IngressOptions(num_replicas=2, num_cpus=0.1)
    scheduler: StreamingOptions = StreamingOptions(num_cpus=0.2)
    verifier: DeploymentOptions = DeploymentOptions(num_replicas=1, num_cpus=1.0)
    # Draft workers; None: each verifier replica drafts for its own requests.
    draft: DeploymentOptions | None = DeploymentOptions(num_replicas=1, num_cpus=0.2)
    route_prefix: str = "/"

    def gateway_settings(self) -> Settings:
        settings = Settings(**self.settings)
        if not settings.redis_url:
            raise ValueError("Ray mode needs a Redis URL (settings.redis_url or SPECGATE_REDIS_URL): "
                             "every replica reads the tenants, limits and requests from there")
        return settings
