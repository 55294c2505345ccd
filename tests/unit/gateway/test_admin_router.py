"""The admin API on a tiny FastAPI app, over an in-memory registry and a real Redis one."""
from __future__ import annotations

import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.errors import install_handlers
from gateway.http.routers.admin import DEFAULT_GRACE_S, router
from gateway.settings import Settings
from gateway.tenancy.records import MIN_KEY_CHARS, Tenant, hash_key
from gateway.tenancy.tenant_store import LAST_ADMIN, REVOKED
from gateway.tenancy.tenants import MAX_GRACE_S, TenantRegistry

ADMIN = "sk-admin-test-key"
METRICS = "sk-metrics-test-key"


def _app(registry: TenantRegistry) -> TestClient:
    app = FastAPI()
    install_handlers(app)
    app.state.tenants = registry
    app.state.settings = Settings(metrics_key=METRICS)
    app.state.service = app.state.store_probe = None     # the registry alone: no engine, no probe
    app.state.responses = None                           # nor stored responses
    app.include_router(router)
    return TestClient(app)


def _auth(key: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def registry(store) -> TenantRegistry:
    url, prefix = store
    registry = TenantRegistry(url, prefix, reserved=[hash_key(METRICS)])
    registry.add_admin_key(ADMIN)
    registry.put(Tenant("acme", rpm=600), ["sk-acme-key-00001"])
    return registry


@pytest.fixture
def client(registry) -> TestClient:
    return _app(registry)


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


ROUTES = [("GET", "/admin/tenants"), ("POST", "/admin/tenants"), ("DELETE", "/admin/tenants/acme"),
          ("POST", "/admin/tenants/acme/rotate-key"), ("POST", "/admin/admin-keys/revoke")]


@pytest.mark.parametrize("headers,status", [
    ({}, 401), ({"Authorization": "Bearer"}, 401), ({"Authorization": f"Basic {ADMIN}"}, 401),
    (_auth("sk-wrong"), 401),
    (_auth("sk-acme-key-00001"), 403),                            # a tenant's key is not an admin key
    (_auth(METRICS), 403),                                # nor is the metrics key
])
@pytest.mark.parametrize("method,path", ROUTES)
def test_every_route_needs_an_admin_key(client, registry, headers, status, method, path):
    resp = client.request(method, path, headers=headers, json={"name": "evil", "key": ADMIN})
    err = _error(resp, status)
    if status == 401:
        assert err["code"] == "invalid_api_key"
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    else:
        assert err["code"] == "admin_only" and err["type"] == "permission_error"
    assert registry.get("acme") is not None and registry.get("evil") is None
    assert registry.authenticate("sk-acme-key-00001") is not None and registry.is_admin(ADMIN)


@pytest.mark.parametrize("headers,status", [({}, 401), (_auth("sk-wrong"), 401),
                                            (_auth("sk-acme-key-00001"), 403), (_auth(METRICS), 403)])
@pytest.mark.parametrize("method,path", ROUTES)
def test_auth_answers_before_the_body_is_read(client, headers, status, method, path):
    """Malformed JSON from a caller without an admin key is a 401/403, not a 400: the body of an
    unauthenticated request is never parsed."""
    resp = client.request(method, path, content=b"{not json",
                          headers={**headers, "Content-Type": "application/json"})
    _error(resp, status)


def test_list_shows_no_keys(client, registry):
    registry.put(Tenant("beta"), ["sha256:" + "ab" * 32])
    resp = client.get("/admin/tenants", headers=_auth())
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    assert [t["name"] for t in body["data"]] == ["acme", "beta"]
    assert body["data"][0]["rpm"] == 600 and body["data"][0]["speculation"]["enabled"] is True
    assert "sk-acme-key-00001" not in resp.text and "sha256" not in resp.text and "api_keys" not in resp.text


def test_post_without_keys_generates_one(client, registry):
    resp = client.post("/admin/tenants", headers=_auth(),
                       json={"name": "beta", "rpm": 5, "models": ["smollm2-*"]})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["tenant"]["name"] == "beta" and body["tenant"]["rpm"] == 5
    key = body["api_key"]
    assert key.startswith("sk-") and registry.authenticate(key).models == ("smollm2-*",)


def test_post_with_keys_returns_none_and_replaces(client, registry):
    resp = client.post("/admin/tenants", headers=_auth(),
                       json={"name": "beta", "api_keys": ["sk-beta-key-00001"]})
    assert resp.status_code == 201 and "api_key" not in resp.json()
    assert registry.authenticate("sk-beta-key-00001").name == "beta"
    resp = client.post("/admin/tenants", headers=_auth(), json={"name": "beta", "rpm": 9})
    assert resp.status_code == 200 and "api_key" not in resp.json()      # replaced, keys kept
    assert registry.authenticate("sk-beta-key-00001").rpm == 9


@pytest.mark.parametrize("body,param", [
    ({"name": "beta", "rpm": -1}, "rpm"),
    ({"name": "beta", "colour": "red"}, "colour"),
    ({"rpm": 5}, "name"),
    ({"name": "beta", "speculation": {"max_tree_tokens": 0}}, "speculation.max_tree_tokens"),
    ({"name": "beta", "api_keys": ["sk-acme-key-00001"]}, "api_keys"),      # another tenant's key
    ({"name": "beta", "api_keys": ["x" * (MIN_KEY_CHARS - 1)]}, "api_keys[0]"),   # too short
    (["not", "an", "object"], None),
])
def test_post_invalid_body_is_400_naming_the_field(client, registry, body, param):
    err = _error(client.post("/admin/tenants", headers=_auth(), json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param:
        assert param in err["message"]
    assert registry.get("beta") is None
    assert "sk-acme-key-00001" not in err["message"]


def test_post_malformed_json_is_400(client):
    resp = client.post("/admin/tenants", headers={**_auth(), "Content-Type": "application/json"},
                       content=b"{not json")
    _error(resp, 400)


def test_delete(client, registry):
    resp = client.delete("/admin/tenants/acme", headers=_auth())
    assert resp.status_code == 200 and resp.json() == {"id": "acme", "object": "tenant", "deleted": True}
    assert registry.authenticate("sk-acme-key-00001") is None
    err = _error(client.delete("/admin/tenants/acme", headers=_auth()), 404)
    assert err["code"] == "tenant_not_found"


def test_rotate_key(client, registry):
    resp = client.post("/admin/tenants/acme/rotate-key?grace_s=0", headers=_auth())
    assert resp.status_code == 200 and resp.json()["grace_s"] == 0
    new = resp.json()["api_key"]
    assert registry.authenticate(new).name == "acme" and registry.authenticate("sk-acme-key-00001") is None
    _error(client.post("/admin/tenants/nobody/rotate-key", headers=_auth()), 404)


def test_rotate_key_keeps_the_old_key_for_a_grace_period(client, registry):
    resp = client.post("/admin/tenants/acme/rotate-key", headers=_auth())      # default grace
    assert resp.status_code == 200 and resp.json()["grace_s"] == DEFAULT_GRACE_S > 0
    new = resp.json()["api_key"]
    assert registry.authenticate(new).name == "acme"
    assert registry.authenticate("sk-acme-key-00001").name == "acme"          # clients have time to move
    for bad in ("-1", str(MAX_GRACE_S + 1), "soon"):
        err = _error(client.post(f"/admin/tenants/acme/rotate-key?grace_s={bad}", headers=_auth()),
                     400)
        assert err["param"] == "grace_s"


def test_the_grace_ends_on_every_replica(redis_url, redis_prefix):
    """The deadline lives in Redis: a replica that did not rotate the key ends it too."""
    first, second = TenantRegistry(redis_url, redis_prefix), TenantRegistry(redis_url, redis_prefix)
    first.add_admin_key(ADMIN)
    first.put(Tenant("acme"), ["sk-acme-key-00001"])
    new = _app(first).post("/admin/tenants/acme/rotate-key?grace_s=0.5",
                           headers=_auth()).json()["api_key"]
    assert second.authenticate("sk-acme-key-00001").name == "acme"
    newer = second.rotate_key("acme", grace_s=60)      # a second rotation: the first grace holds
    time.sleep(0.6)
    for replica in (first, second):
        assert replica.authenticate("sk-acme-key-00001") is None
    assert second.authenticate(new).name == "acme" and second.authenticate(newer).name == "acme"
    assert second.remove("acme") and first.authenticate(new) is None


def test_a_key_is_never_both_a_tenants_and_an_admins(client, registry):
    for key, code in ((ADMIN, "admin_key_conflict"), (METRICS, "metrics_key_conflict")):
        err = _error(client.post("/admin/tenants", headers=_auth(),
                                 json={"name": "beta", "api_keys": [key]}), 409)
        assert err["code"] == code and err["param"] == "api_keys" and key not in err["message"]
        assert registry.get("beta") is None and registry.authenticate(key) is None
        _error(client.post("/admin/tenants", headers=_auth(),    # nor one replacing a key
                           json={"name": "acme", "api_keys": [key]}), 409)
        assert registry.authenticate("sk-acme-key-00001").name == "acme"


def test_revoke_an_admin_key(client, registry):
    second, third = "sk-admin-second-key", "sk-admin-third-key"
    registry.add_admin_key(second)
    registry.add_admin_key(third)

    def revoke(key: str, by: str = ADMIN):
        return client.post("/admin/admin-keys/revoke", headers=_auth(by), json={"key": key})

    assert revoke(second).json() == {"object": "admin_key", "revoked": True}
    assert not registry.is_admin(second)
    _error(revoke(second, by=second), 401)                      # revoked: it stops at once
    assert revoke(hash_key(third)).status_code == 200           # by digest
    assert not registry.is_admin(third)
    assert _error(revoke(ADMIN), 409)["code"] == "own_admin_key"   # the last one, too
    assert _error(revoke("sk-not-an-admin-key"), 404)["code"] == "admin_key_not_found"
    assert _error(revoke("sk-acme-key-00001"), 404)["code"] == "admin_key_not_found"
    for body in ({}, {"key": ""}, {"key": 5}, {"key": ADMIN, "more": 1}, [ADMIN],
                 {"key": "sha256:zz"}):
        assert _error(client.post("/admin/admin-keys/revoke", headers=_auth(), json=body),
                      400)["param"] == "key"
    assert registry.is_admin(ADMIN)


def test_the_last_admin_key_is_never_revoked(store):
    """Two admins revoking each other at once: the second revocation finds its target the last
    admin key (its own was revoked a moment before) and is refused, so one admin remains."""
    registry = TenantRegistry(*store)
    registry.add_admin_key(ADMIN)
    registry.add_admin_key("sk-admin-second-key")
    assert registry.revoke_admin_key("sk-admin-second-key", ADMIN) == REVOKED
    assert registry.revoke_admin_key(ADMIN, "sk-admin-second-key") == LAST_ADMIN
    assert registry.is_admin(ADMIN)


def test_a_change_on_one_replica_is_seen_by_another(redis_url, redis_prefix):
    first = TenantRegistry(redis_url, redis_prefix)
    first.add_admin_key(ADMIN)
    one, two = _app(first), _app(TenantRegistry(redis_url, redis_prefix))
    key = one.post("/admin/tenants", headers=_auth(), json={"name": "beta"}).json()["api_key"]
    assert [t["name"] for t in two.get("/admin/tenants", headers=_auth()).json()["data"]] == ["beta"]
    new = two.post("/admin/tenants/beta/rotate-key?grace_s=0", headers=_auth()).json()["api_key"]
    assert first.authenticate(key) is None and first.authenticate(new).name == "beta"
    assert two.delete("/admin/tenants/beta", headers=_auth()).status_code == 200
    assert first.authenticate(new) is None
