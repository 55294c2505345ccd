"""Ray mode's typed configuration: what the shipped Serve config and a bare one resolve to."""
from pathlib import Path

import yaml

from gateway.ray_serve.config import RayAppConfig

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
