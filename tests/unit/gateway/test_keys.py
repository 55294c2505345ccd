"""Keys and admin over real HTTP (uvicorn on loopback, fake worker): the configured admin keys
replace the stored ones at start, the metrics key reads /metrics only, the API docs are off by
default, configured keys have a minimum length, and a request that can never fit its tenant's
TPM is a 400, not a 429 to retry."""
from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from gateway.builders.embedded import build_embedded
from gateway.builders.ray_app import verifier_settings
from gateway.http.server import background_server
from gateway.ray_serve.replica_secrets import public_settings
from gateway.settings import Settings
from gateway.tenancy.records import MIN_KEY_CHARS, Tenant, hash_key

MODEL = "smollm2-135m"
ADMIN_A, ADMIN_B = "sk-admin-key-a-0001", "sk-admin-key-b-0002"
FILE_ADMIN = "sk-file-admin-key-0003"
METRICS = "sk-metrics-key-0004"
TENANT = "sk-acme-tenant-key-0005"


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _status(url: str, key: str | None, path: str = "/admin/tenants") -> int:
    return httpx.get(url + path, headers=_auth(key), timeout=10).status_code


def _settings(redis_url: str, prefix: str, **kw) -> Settings:
    return Settings(fake_worker=True, redis_url=redis_url, store_prefix=prefix, **kw)


def test_the_configured_admin_keys_replace_the_stored_ones(redis_url, redis_prefix, tmp_path):
    """Start with admin key A, restart with B over the same Redis: A is revoked. A revocation
    through the API outlives a restart with the same configuration."""
    first = build_embedded(_settings(redis_url, redis_prefix, admin_key=ADMIN_A))
    with background_server(first.app) as url:
        assert _status(url, ADMIN_A) == 200
    first.stop()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(f"admin_keys: [{FILE_ADMIN}]\n")
    config = _settings(redis_url, redis_prefix, admin_key=ADMIN_B, tenants_file=tenants_file)
    second = build_embedded(config)
    with background_server(second.app) as url:
        assert _status(url, ADMIN_A) == 401                 # no longer configured: revoked
        assert _status(url, ADMIN_B) == 200 and _status(url, FILE_ADMIN) == 200
        r = httpx.post(url + "/admin/admin-keys/revoke", headers=_auth(ADMIN_B),
                       json={"key": FILE_ADMIN}, timeout=10)
        assert r.status_code == 200, r.text
        assert _status(url, FILE_ADMIN) == 401
    second.stop()
    third = build_embedded(config)                          # same configuration: stays revoked
    with background_server(third.app) as url:
        assert _status(url, FILE_ADMIN) == 401 and _status(url, ADMIN_B) == 200
        assert _status(url, ADMIN_A) == 401
    third.stop()


def test_a_configured_admin_key_that_is_a_tenants_key_stops_the_start(redis_url, redis_prefix):
    first = build_embedded(_settings(redis_url, redis_prefix, admin_key=ADMIN_A))
    first.tenants.put(Tenant("acme"), [TENANT])
    first.stop()
    with pytest.raises(ValueError, match="also a tenant's API key") as e:
        build_embedded(_settings(redis_url, redis_prefix, admin_key=TENANT))
    assert TENANT not in str(e.value)
    assert first.tenants.is_admin(ADMIN_A) and not first.tenants.is_admin(TENANT)
    with pytest.raises(ValueError, match="metrics_key is a tenant's API key"):
        build_embedded(_settings(redis_url, redis_prefix, admin_key=ADMIN_A, metrics_key=TENANT))


@pytest.fixture(scope="module")
def gateway():
    emb = build_embedded(Settings(fake_worker=True, fake_context=1024, admin_key=ADMIN_A,
                                  metrics_key=METRICS))
    emb.tenants.put(Tenant("acme", tpm=100), [TENANT])
    emb.start()
    with background_server(emb.app) as url:
        yield emb, url
    emb.stop()


@pytest.mark.parametrize("key,metrics,admin", [
    (METRICS, 200, 403), (ADMIN_A, 200, 200), (TENANT, 403, 403), (None, 401, 401),
    ("sk-unknown-key-0006", 401, 401),
])
def test_the_metrics_key_reads_metrics_only(gateway, key, metrics, admin):
    _, url = gateway
    assert _status(url, key, "/metrics") == metrics
    assert _status(url, key, "/admin/tenants") == admin
    r = httpx.post(url + "/admin/tenants", headers=_auth(key), json={"name": "evil"}, timeout=10)
    assert r.status_code == (201 if admin == 200 else admin)
    if admin == 200:
        r = httpx.delete(url + "/admin/tenants/evil", headers=_auth(key), timeout=10)
        assert r.status_code == 200


def test_the_metrics_key_may_be_configured_as_its_digest():
    emb = build_embedded(Settings(fake_worker=True, metrics_key=hash_key(METRICS)))
    with background_server(emb.app) as url:
        assert _status(url, METRICS, "/metrics") == 200
        assert _status(url, hash_key(METRICS), "/metrics") == 401      # a digest is not a key


def test_the_metrics_key_cannot_become_a_tenants_key(gateway):
    _, url = gateway
    r = httpx.post(url + "/admin/tenants", headers=_auth(ADMIN_A),
                   json={"name": "sneaky", "api_keys": [METRICS]}, timeout=10)
    assert r.status_code == 409 and r.json()["error"]["code"] == "metrics_key_conflict"


def test_verifier_replicas_get_no_secret():
    """Verifier replicas (GPU pods in the chart) serve no client and never reach Redis: their
    arguments hold neither key, nor the Redis URL and its password, nor the tenants file, and
    they are built from what they do get. (No replica's arguments hold a secret:
    tests/unit/test_ray_config.py.)"""
    full = public_settings(Settings(admin_key=ADMIN_A, metrics_key=METRICS,
                                    redis_url="redis://:pw-secret@redis:6379/0",
                                    tenants_file="/etc/specgate/tenants.yaml"))
    out = verifier_settings(full)
    assert not {"admin_key", "metrics_key", "key_pepper", "redis_url", "tenants_file"} & set(out)
    assert ADMIN_A not in str(full) and "pw-secret" not in str(full)
    s = Settings(**out)
    assert (s.model, s.max_batch, s.max_tree_tokens) == (Settings().model, full["max_batch"],
                                                        full["max_tree_tokens"])


@pytest.mark.parametrize("docs", [False, True])
def test_the_api_docs_are_off_unless_enabled(docs):
    emb = build_embedded(Settings(fake_worker=True, openapi_docs=docs))
    with background_server(emb.app) as url:
        for path in ("/docs", "/redoc", "/openapi.json"):
            r = httpx.get(url + path, timeout=10)
            assert r.status_code == (200 if docs else 404), path
            if not docs:
                assert r.json()["error"]["type"] == "not_found_error"
    assert "/admin/tenants" in emb.app.openapi()["paths"]     # the schema, for tools, either way


@pytest.mark.parametrize("name", ["admin_key", "metrics_key"])
def test_configured_keys_have_a_minimum_length(name):
    short = "k" * (MIN_KEY_CHARS - 1)
    with pytest.raises(ValidationError, match=f"at least {MIN_KEY_CHARS} characters") as e:
        Settings(**{name: short})
    assert short not in str(e.value)
    Settings(**{name: "k" * MIN_KEY_CHARS})


def test_a_request_that_can_never_fit_the_tpm_is_400_not_429(gateway):
    """acme may use 100 tokens a minute: asking for 200 can never pass, however long it waits."""
    _, url = gateway
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 200}
    r = httpx.post(url + "/v1/completions", headers=_auth(TENANT), json=body, timeout=10)
    assert r.status_code == 400 and "Retry-After" not in r.headers, r.text
    err = r.json()["error"]
    assert err["code"] == "request_exceeds_tpm" and err["param"] == "max_tokens"
    assert "100 tokens per minute" in err["message"]
    # without max_tokens a request may use the whole context (1024): never fits either
    r = httpx.post(url + "/v1/completions", headers=_auth(TENANT), json={**body, "max_tokens": None},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_exceeds_tpm"
    ok = httpx.post(url + "/v1/completions", headers=_auth(TENANT), json={**body, "max_tokens": 40},
                    timeout=10)
    assert ok.status_code == 200, ok.text
    r = httpx.post(url + "/v1/completions", headers=_auth(TENANT), json={**body, "max_tokens": 90},
                   timeout=10)
    assert r.status_code == 429 and "Retry-After" in r.headers     # fits, just not now
