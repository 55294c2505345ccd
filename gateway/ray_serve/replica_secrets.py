"""Ray mode's secrets: which settings are secrets, which deployment reads which, and how a
secret reaches a replica without passing through Serve.

Serve keeps what a deployment is built from (the Serve config's `args`, each deployment's
constructor arguments, its `ray_actor_options` with their `runtime_env` env_vars) in its
controller's checkpoint in the GCS, which every process of the cluster can read, the GPU workers'
included. So no secret is ever an argument: a replica that needs one reads it from its own
process environment (`SPECGATE_*`), which it inherits from its node. In the Helm chart that is
the pod's environment, filled from a Kubernetes Secret in the pods whose replicas need it; with
`specgate serve --ray` it is the environment of the process that starts the local cluster
(`export_secrets`).

Who needs what (decided by what each replica does): an ingress replica authenticates every
request and serves the admin API (the admin key, the metrics key, the key pepper, the Redis URL,
the tenants file); the scheduler replica keeps the requests in Redis (the Redis URL alone: it
checks no key, and applies no tenants file); verifier and draft replicas touch neither clients
nor Redis (nothing).
"""
from __future__ import annotations

import os
from typing import Any, Mapping
from urllib.parse import parse_qs, urlsplit

from pydantic import SecretStr

from gateway.settings import Settings

# Every SecretStr setting, and the Redis URL when it carries a password (tests check the list
# against Settings).
SECRET_SETTINGS = ("admin_key", "metrics_key", "key_pepper", "redis_url")
INGRESS_READS = frozenset(SECRET_SETTINGS)
SCHEDULER_READS = frozenset({"redis_url"})
READS_NONE: frozenset[str] = frozenset()


def redis_password(url: str) -> str | None:
    """The password a Redis URL carries (in its user info, or redis-py's `?password=`)."""
    parts = urlsplit(url)
    return parts.password or (parse_qs(parts.query).get("password") or [None])[0]


def is_secret(name: str, value: Any) -> bool:
    """A password-less Redis URL is an address, not a secret: a Serve config may name it."""
    if value is None or name not in SECRET_SETTINGS:
        return False
    if name == "redis_url":
        return redis_password(str(value)) is not None
    return True


def refuse_secrets(settings: Mapping[str, Any], where: str = "settings") -> None:
    """ValueError naming the first secret in `settings` (a Serve config's, or what a builder is
    asked to pass to replicas); the message never repeats its value."""
    for name in SECRET_SETTINGS:
        if is_secret(name, settings.get(name)):
            raise ValueError(
                f"{where}.{name}: a secret never goes in a Serve config or a deployment's arguments "
                "(Serve keeps them where every Ray process can read them); set "
                f"SPECGATE_{name.upper()} in the environment of the nodes that run the ingress and "
                "scheduler replicas instead")


def public_settings(settings: Settings) -> dict[str, Any]:
    """The settings every replica is built from, as plain JSON values (Serve passes them to the
    replicas' constructors and keeps them): every setting but the secrets."""
    out = settings.model_dump(mode="json", exclude_none=True)
    return {name: value for name, value in out.items()
            if not is_secret(name, getattr(settings, name))
            and not isinstance(getattr(settings, name), SecretStr)}


def export_secrets(settings: Mapping[str, Any]) -> dict[str, Any]:
    """For a process that starts a local Ray cluster (`specgate serve --ray`, the benchmarks):
    the secrets among `settings` go to this process's environment, which the cluster's processes
    inherit and Serve does not keep; returns the rest, which may go in a Serve config."""
    public = {}
    for name, value in settings.items():
        if is_secret(name, value):
            os.environ[f"SPECGATE_{name.upper()}"] = str(value)
        else:
            public[name] = value
    return public


def settings_in_replica(args: Mapping[str, Any], reads: frozenset[str]) -> Settings:
    """A replica's settings: its arguments, and from its environment the secrets it `reads`;
    every other secret None, even where its node's environment holds it. ValueError if it reads
    the Redis URL and has none (Ray mode keeps every replica's shared state there)."""
    withheld = {name: None for name in SECRET_SETTINGS if name not in reads}
    settings = Settings(**{**args, **withheld})
    if "redis_url" in reads and not settings.redis_url:
        raise ValueError("Ray mode needs a Redis URL: set SPECGATE_REDIS_URL in the environment of "
                         "the nodes that run the ingress and scheduler replicas (or settings."
                         "redis_url in the Serve config, when it has no password)")
    return settings
