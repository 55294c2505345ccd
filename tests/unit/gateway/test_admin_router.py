"""The admin API on a tiny FastAPI app, over an in-memory registry and a real Redis one."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.errors import install_handlers
from gateway.http.routers.admin import router
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import TenantRegistry

ADMIN = "sk-admin-test"


def _app(registry: TenantRegistry) -> TestClient:
    app = FastAPI()
    install_handlers(app)
    app.state.tenants = registry
    app.include_router(router)
    return TestClient(app)


def _auth(key: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def registry(store) -> TenantRegistry:
    url, prefix = store
    registry = TenantRegistry(url, prefix)
    registry.add_admin_key(ADMIN)
    registry.put(Tenant("acme", rpm=600), ["sk-acme-1"])
    return registry


@pytest.fixture
def client(registry) -> TestClient:
    return _app(registry)


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {ADMIN}"}, _auth("sk-wrong"),
    _auth("sk-acme-1"),                                   # a tenant's key is not an admin key
])
@pytest.mark.parametrize("method,path", [
    ("GET", "/admin/tenants"), ("POST", "/admin/tenants"), ("DELETE", "/admin/tenants/acme"),
    ("POST", "/admin/tenants/acme/rotate-key"),
])
def test_every_route_needs_an_admin_key(client, registry, headers, method, path):
    resp = client.request(method, path, headers=headers, json={"name": "evil"})
    err = _error(resp, 401)
    assert err["code"] == "invalid_api_key"
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert registry.get("acme") is not None and registry.get("evil") is None
    assert registry.authenticate("sk-acme-1") is not None


def test_list_shows_no_keys(client, registry):
    registry.put(Tenant("beta"), ["sha256:" + "ab" * 32])
    resp = client.get("/admin/tenants", headers=_auth())
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    assert [t["name"] for t in body["data"]] == ["acme", "beta"]
    assert body["data"][0]["rpm"] == 600 and body["data"][0]["speculation"]["enabled"] is True
    assert "sk-acme-1" not in resp.text and "sha256" not in resp.text and "api_keys" not in resp.text


def test_post_without_keys_generates_one(client, registry):
    resp = client.post("/admin/tenants", headers=_auth(),
                       json={"name": "beta", "rpm": 5, "models": ["smollm2-*"]})
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["tenant"]["name"] == "beta" and body["tenant"]["rpm"] == 5
    key = body["api_key"]
    assert key.startswith("sk-") and registry.authenticate(key).models == ("smollm2-*",)


def test_post_with_keys_returns_none_and_replaces(client, registry):
    resp = client.post("/admin/tenants", headers=_auth(), json={"name": "beta", "api_keys": ["sk-b"]})
    assert resp.status_code == 201 and "api_key" not in resp.json()
    assert registry.authenticate("sk-b").name == "beta"
    resp = client.post("/admin/tenants", headers=_auth(), json={"name": "beta", "rpm": 9})
    assert resp.status_code == 200 and "api_key" not in resp.json()      # replaced, keys kept
    assert registry.authenticate("sk-b").rpm == 9


@pytest.mark.parametrize("body,param", [
    ({"name": "beta", "rpm": -1}, "rpm"),
    ({"name": "beta", "colour": "red"}, "colour"),
    ({"rpm": 5}, "name"),
    ({"name": "beta", "speculation": {"max_tree_tokens": 0}}, "speculation.max_tree_tokens"),
    ({"name": "beta", "api_keys": ["sk-acme-1"]}, "api_keys"),      # another tenant's key
    (["not", "an", "object"], None),
])
def test_post_invalid_body_is_400_naming_the_field(client, registry, body, param):
    err = _error(client.post("/admin/tenants", headers=_auth(), json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param:
        assert param in err["message"]
    assert registry.get("beta") is None
    assert "sk-acme-1" not in err["message"]


def test_post_malformed_json_is_400(client):
    resp = client.post("/admin/tenants", headers={**_auth(), "Content-Type": "application/json"},
                       content=b"{not json")
    _error(resp, 400)


def test_delete(client, registry):
    resp = client.delete("/admin/tenants/acme", headers=_auth())
    assert resp.status_code == 200 and resp.json() == {"id": "acme", "object": "tenant", "deleted": True}
    assert registry.authenticate("sk-acme-1") is None
    err = _error(client.delete("/admin/tenants/acme", headers=_auth()), 404)
    assert err["code"] == "tenant_not_found"


def test_rotate_key(client, registry):
    resp = client.post("/admin/tenants/acme/rotate-key", headers=_auth())
    assert resp.status_code == 200
    new = resp.json()["api_key"]
    assert registry.authenticate(new).name == "acme" and registry.authenticate("sk-acme-1") is None
    _error(client.post("/admin/tenants/nobody/rotate-key", headers=_auth()), 404)


def test_a_change_on_one_replica_is_seen_by_another(redis_url, redis_prefix):
    first = TenantRegistry(redis_url, redis_prefix)
    first.add_admin_key(ADMIN)
    one, two = _app(first), _app(TenantRegistry(redis_url, redis_prefix))
    key = one.post("/admin/tenants", headers=_auth(), json={"name": "beta"}).json()["api_key"]
    assert [t["name"] for t in two.get("/admin/tenants", headers=_auth()).json()["data"]] == ["beta"]
    new = two.post("/admin/tenants/beta/rotate-key", headers=_auth()).json()["api_key"]
    assert first.authenticate(key) is None and first.authenticate(new).name == "beta"
    assert two.delete("/admin/tenants/beta", headers=_auth()).status_code == 200
    assert first.authenticate(new) is None
