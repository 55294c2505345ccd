"""Ray mode's typed configuration: what the shipped Serve config and a bare one resolve to."""
import os
import typing
from pathlib import Path

import pytest
import yaml

from gateway.ray_serve.config import RayAppConfig
from gateway.settings import Settings

SHIPPED = Path(__file__).resolve().parents[2] / "deploy" / "serve" / "specgate.yaml"


def test_draining_stream_carriers_wait_out_long_streams_while_other_deployments_keep_serves_default():
    """Serve kills a draining replica after graceful_shutdown_timeout_s; for the ingress and the
    scheduler that is every stream they still carry. A rolling update in CI cut 1,200-token
    streams at Serve's 30 s, first at the ingress, then at the scheduler."""
    (app,) = yaml.safe_load(SHIPPED.read_text())["applications"]
    for cfg in (RayAppConfig(), RayAppConfig(**app["args"]),
                RayAppConfig(ingress={"num_replicas": 3}, scheduler={"num_cpus": 0.5})):
        assert cfg.ingress.graceful_shutdown_timeout_s >= 600
        assert cfg.scheduler.graceful_shutdown_timeout_s >= 600
        assert cfg.verifier.graceful_shutdown_timeout_s == 30.0


def test_the_ingress_caps_the_slots_streams_hold_and_serve_is_given_the_caps():
    """A request holds an ingress slot until its answer or stream ends, before fairness or
    admission sees it; past the slots it waits in Serve's queue, unseen. So the ingress's slots
    are sized well above what one tenant may hold for long (its followers here), its queue is
    short, and past it Serve answers 503 with Retry-After at once: in the defaults, in the
    shipped config and in a config that overrides other ingress options."""
    from ray.serve._private.build_app import build_app

    from gateway.builders.ray_app import build_ray_app

    (app,) = yaml.safe_load(SHIPPED.read_text())["applications"]
    followers = Settings().max_followers_per_tenant
    for cfg in (RayAppConfig(), RayAppConfig(**app["args"]), RayAppConfig(ingress={"num_replicas": 3})):
        ingress = cfg.ingress
        assert followers * 4 <= ingress.max_ongoing_requests
        assert 0 < ingress.max_queued_requests < ingress.max_ongoing_requests
        assert ingress.backpressure_retry_after_s == 1.0
    built = {d.name: d._deployment_config for d in
             build_app(build_ray_app(RayAppConfig()), name="specgate").deployments}
    ingress = built["ingress"]
    assert (ingress.max_ongoing_requests, ingress.max_queued_requests) == (256, 64)
    assert (ingress.backpressure_config.status_code, ingress.backpressure_config.retry_after_s) == (503, 1.0)
    assert all(built[name].max_queued_requests == -1 for name in ("scheduler", "verifier", "draft"))


# ---- secrets: never in what Serve keeps -------------------------------------------------------------
ADMIN, METRICS = "adm-secret-key-0123456789", "met-secret-key-0123456789"
PEPPER, REDIS_PASSWORD = "pep-secret-" + "0" * 32, "pw-secret-0123456789"
SECRET_ENV = {"SPECGATE_ADMIN_KEY": ADMIN, "SPECGATE_METRICS_KEY": METRICS, "SPECGATE_KEY_PEPPER": PEPPER,
              "SPECGATE_REDIS_URL": f"redis://:{REDIS_PASSWORD}@redis:6379/0"}


@pytest.fixture
def secret_env(monkeypatch, tmp_path):
    """A node's environment holding every secret, as the chart's gateway pods have it."""
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants: []\n")
    monkeypatch.setenv("SPECGATE_TENANTS_FILE", str(tenants))
    return SECRET_ENV


@pytest.mark.parametrize("args", ["shipped", "bare"])
def test_no_secret_is_in_any_deployments_arguments_or_what_serve_keeps_of_them(secret_env, args):
    """Serve keeps each deployment's constructor arguments, options and user_config in its
    controller's checkpoint, which any Ray process can read (the chart's GPU pods included):
    the app is built where every secret is in the environment, and none of them is in there."""
    from ray.serve._private.build_app import build_app

    from gateway.builders.ray_app import build_ray_app

    cfg = RayAppConfig(**yaml.safe_load(SHIPPED.read_text())["applications"][0]["args"]) \
        if args == "shipped" else RayAppConfig()
    built = build_app(build_ray_app(cfg), name="specgate")
    assert {d.name for d in built.deployments} == {"ingress", "scheduler", "verifier", "draft"}
    secrets = [ADMIN, METRICS, PEPPER, REDIS_PASSWORD]
    for d in built.deployments:
        # what the controller is sent and checkpoints (Serve's own serialization of each)
        kept = d._replica_config.to_proto_bytes() + d._deployment_config.to_proto_bytes()
        assert not [s for s in secrets if s.encode() in kept], d.name
        plain = repr((d.init_args, d.init_kwargs, d._deployment_config.user_config,
                      d.ray_actor_options))
        assert not [s for s in secrets if s in plain], d.name
    settings = next(d for d in built.deployments if d.name == "ingress").init_args[0]
    assert settings["model"] == "smollm2-135m" and "tenants_file" in settings    # the rest is there


def test_each_replica_reads_from_its_environment_only_the_secrets_it_needs(secret_env):
    from gateway.ray_serve.replica_secrets import (INGRESS_READS, READS_NONE, SCHEDULER_READS,
                                                   settings_in_replica)

    ingress = settings_in_replica({"model": "m"}, INGRESS_READS)
    assert ingress.admin_key.get_secret_value() == ADMIN and ingress.key_pepper.get_secret_value() == PEPPER
    assert ingress.metrics_key.get_secret_value() == METRICS and REDIS_PASSWORD in ingress.redis_url
    scheduler = settings_in_replica({"model": "m"}, SCHEDULER_READS)      # keeps requests in Redis
    assert REDIS_PASSWORD in scheduler.redis_url
    assert (scheduler.admin_key, scheduler.metrics_key, scheduler.key_pepper) == (None, None, None)
    verifier = settings_in_replica({"model": "m"}, READS_NONE)
    assert (verifier.admin_key, verifier.metrics_key, verifier.key_pepper, verifier.redis_url) == (None,) * 4


def test_a_replica_without_a_redis_url_says_where_to_put_one(monkeypatch):
    from gateway.ray_serve.replica_secrets import SCHEDULER_READS, settings_in_replica

    monkeypatch.delenv("SPECGATE_REDIS_URL", raising=False)
    with pytest.raises(ValueError, match="SPECGATE_REDIS_URL"):
        settings_in_replica({"model": "m"}, SCHEDULER_READS)


@pytest.mark.parametrize("name,value", [
    ("admin_key", ADMIN), ("metrics_key", METRICS), ("key_pepper", PEPPER),
    ("redis_url", f"redis://:{REDIS_PASSWORD}@redis:6379/0"),
    ("redis_url", f"redis://redis:6379/0?password={REDIS_PASSWORD}")])
def test_a_serve_config_that_holds_a_secret_is_refused_without_repeating_it(tmp_path, name, value):
    from gateway.builders.ray_app import app_builder
    from gateway.cli.serve_ray import load_config

    with pytest.raises(ValueError, match=f"settings.{name}: a secret never goes") as err:
        app_builder({"settings": {name: value}})
    assert value not in str(err.value) and f"SPECGATE_{name.upper()}" in str(err.value)
    doc = yaml.safe_load(SHIPPED.read_text())
    doc["applications"][0]["args"]["settings"][name] = value
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=name):
        load_config(path, {})
    with pytest.raises(ValueError, match=name):                    # nor from the flags
        load_config(SHIPPED, {name: value})


def test_a_redis_url_without_a_password_is_an_address_a_config_may_name():
    from gateway.ray_serve.replica_secrets import is_secret, public_settings

    assert not is_secret("redis_url", "redis://127.0.0.1:6379/0")
    local = "redis://127.0.0.1:6379/0"
    assert public_settings(Settings(redis_url=local))["redis_url"] == local
    assert "redis_url" not in public_settings(Settings(redis_url=f"redis://:{REDIS_PASSWORD}@r:6379/0"))


def test_every_secret_setting_is_known_as_one():
    """A SecretStr setting added later is withheld too (else it would be sent as '**********',
    or not withheld at all)."""
    from pydantic import SecretStr

    from gateway.ray_serve.replica_secrets import SECRET_SETTINGS

    secret_fields = {name for name, f in Settings.model_fields.items()
                     if SecretStr in typing.get_args(f.annotation)}
    assert secret_fields and secret_fields <= set(SECRET_SETTINGS)


def test_a_process_starting_a_local_cluster_hands_its_secrets_over_through_its_environment(monkeypatch):
    """`specgate serve --ray --redis-url redis://:pw@…`: the password goes to the environment the
    local cluster's processes inherit, the rest to the Serve config."""
    from gateway.ray_serve.replica_secrets import export_secrets

    monkeypatch.setenv("SPECGATE_REDIS_URL", "redis://before")     # restored after the test
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0"
    public = export_secrets({"redis_url": url, "model": "m", "port": 9000})
    assert public == {"model": "m", "port": 9000}
    assert os.environ["SPECGATE_REDIS_URL"] == url
    assert export_secrets({"redis_url": "redis://127.0.0.1:6379/0"}) == {"redis_url": "redis://127.0.0.1:6379/0"}
