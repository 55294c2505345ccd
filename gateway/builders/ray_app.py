"""The Ray builder: the embedded gateway's classes as Ray Serve deployments, and the topology.

    ingress (FastAPI gateway, N replicas) --stream--> scheduler (1 replica) --one call per replica
        per step--> verifier (M replicas, one GPU each when `num_gpus` is set) --one call per
        step--> draft (K CPU replicas)

The deployments' classes (`gateway.ray_serve.deployments`, `gateway.ray_serve.ingress`) wrap
embedded-mode classes, assembled from the parts both builders use (`gateway.assembly`); this
module alone decides how many of each, where they run and how requests reach them. Use it from
Python (`serve.run(build_ray_app(RayAppConfig(...)))`), from a Serve config file (`import_path:
gateway.builders.ray_app:app_builder`, see deploy/serve/specgate.yaml), or with
`specgate serve --ray [--config FILE]`.
"""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from gateway.ray_serve.config import DeploymentOptions, RayAppConfig
from gateway.ray_serve.deployments import (DRAFT, INGRESS, SCHEDULER, VERIFIER, DraftServer,
                                           SchedulerServer, VerifierServer)
from gateway.ray_serve.ingress import IngressServer
from gateway.ray_serve.replica_secrets import public_settings, refuse_secrets
from gateway.settings import Settings


def build_ray_app(config: RayAppConfig):
    """The Serve application: ingress → scheduler → verifier (→ draft workers). No secret goes
    into it: a replica reads the ones it needs from its node's environment
    (`gateway.ray_serve.replica_secrets`), so this builder needs none and may run on any node.
    ValueError if the config's settings hold one."""
    refuse_secrets(config.settings)
    settings = public_settings(Settings(**config.settings))
    router = RequestRouterConfig(request_router_class="gateway.ray_serve.routing:KVAffinityRouter")
    drafts = None
    if config.draft is not None:
        drafts = _deployment(DraftServer, DRAFT, config.draft, request_router_config=router).bind()
    verifier = _deployment(VerifierServer, VERIFIER, config.verifier, request_router_config=router).bind(
        verifier_settings(settings), config.verifier.torch_threads, drafts)
    scheduler = _deployment(SchedulerServer, SCHEDULER, config.scheduler).bind(settings, verifier)
    ingress = _deployment(serve.ingress()(IngressServer), INGRESS, config.ingress)
    return ingress.bind(settings, scheduler)


def app_builder(args: dict[str, Any]):
    """For a Serve config file's `import_path`: `args` is a `RayAppConfig` as a mapping."""
    return build_ray_app(RayAppConfig(**(args or {})))


def _deployment(cls: type, name: str, opts: DeploymentOptions, **extra: Any):
    actor: dict[str, Any] = {"num_cpus": opts.num_cpus, "num_gpus": opts.num_gpus}
    if opts.torch_threads:
        # NOTE: torch.set_num_threads alone is not enough: Ray sets OMP_NUM_THREADS from num_cpus,
        # and a Serve replica runs its methods on other threads, whose OpenMP teams take their
        # size from that variable (a 2-thread matmul ran at 1-thread speed there until this was set).
        actor["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(opts.torch_threads)}}
    options: dict[str, Any] = dict(
        name=name, max_ongoing_requests=opts.max_ongoing_requests,
        max_queued_requests=opts.max_queued_requests, ray_actor_options=actor,
        health_check_period_s=opts.health_check_period_s,
        graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout_s, **extra)
    if opts.backpressure_retry_after_s is not None:      # Serve's 503 says when to retry
        options["backpressure_config"] = {"status_code": 503,
                                          "retry_after_s": opts.backpressure_retry_after_s}
    if opts.autoscaling_config is not None:
        options["autoscaling_config"] = opts.autoscaling_config
    else:
        options["num_replicas"] = opts.num_replicas
    return serve.deployment(cls, **options)


# what a verifier replica never needs, beyond the secrets no replica is given: the tenants file
# (key digests) and a password-less Redis URL (it serves no client and never touches Redis: the
# scheduler drives it), and it may run on a GPU node the chart keeps secrets off
VERIFIER_WITHHELD = frozenset({"admin_key", "metrics_key", "key_pepper", "redis_url", "tenants_file"})


def verifier_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """`public_settings` less the tenants file and the Redis URL: a verifier replica is built
    from the model and scheduler fields alone."""
    return {k: v for k, v in settings.items() if k not in VERIFIER_WITHHELD}
