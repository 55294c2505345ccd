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

from pydantic import SecretStr
from ray import serve
from ray.serve.config import RequestRouterConfig

from gateway.ray_serve.config import DeploymentOptions, RayAppConfig
from gateway.ray_serve.deployments import (DRAFT, INGRESS, SCHEDULER, VERIFIER, DraftServer,
                                           SchedulerServer, VerifierServer)
from gateway.ray_serve.ingress import IngressServer
from gateway.settings import Settings


def build_ray_app(config: RayAppConfig):
    """The Serve application: ingress → scheduler → verifier (→ draft workers)."""
    settings = replica_settings(config.gateway_settings())
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
        name=name, max_ongoing_requests=opts.max_ongoing_requests, ray_actor_options=actor,
        health_check_period_s=opts.health_check_period_s,
        graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout_s, **extra)
    if opts.autoscaling_config is not None:
        options["autoscaling_config"] = opts.autoscaling_config
    else:
        options["num_replicas"] = opts.num_replicas
    return serve.deployment(cls, **options)


def replica_settings(settings: Settings) -> dict[str, Any]:
    """The settings every replica is built from, as plain JSON values (Serve passes them to the
    replicas' constructors). The secrets are the keys themselves: `model_dump` writes a SecretStr
    as "**********", which as an admin or metrics key would lock the admins and Prometheus out."""
    out = settings.model_dump(mode="json", exclude_none=True)
    for name, value in settings:
        if isinstance(value, SecretStr):       # admin_key, metrics_key, and any added later
            out[name] = value.get_secret_value()
    return out


# what a verifier replica never needs: it serves no client, checks no key and never touches
# Redis (the scheduler drives it), and it may run on a GPU node the chart keeps secrets off
VERIFIER_WITHHELD = frozenset({"admin_key", "metrics_key", "redis_url", "tenants_file"})


def verifier_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """`replica_settings` less the keys, the Redis URL (with its password) and the tenants
    file (key digests): a verifier replica is built from the model and scheduler fields alone."""
    return {k: v for k, v in settings.items() if k not in VERIFIER_WITHHELD}
