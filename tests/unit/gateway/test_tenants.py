"""Tenants: parsing the tenants file, hashed keys, and the registry in memory and in a real Redis."""
from __future__ import annotations

import copy
import hashlib
import json
import textwrap
import time

import pytest
import redis

from gateway.tenancy.config import TenantsConfigError, load_tenants_file, parse_tenant, parse_tenants
from gateway.tenancy.records import SpeculationPolicy, Tenant, hash_key
from gateway.tenancy.tenants import TenantRegistry

EXAMPLE = {
    "tenants": [
        {"name": "acme", "api_keys": ["sk-acme-0000000000-1-longkey"], "weight": 2, "priority": 0, "rpm": 600,
         "tpm": 200000, "max_concurrent": 16, "max_queued": 64, "max_prompt_tokens": 4000,
         "models": ["*"],
         "speculation": {"enabled": True, "drafters": ["ngram"], "max_tree_tokens": 32}},
        {"name": "beta", "api_keys": ["sha256:" + hashlib.sha256(b"sk-beta-1-longkey").hexdigest()],
         "models": ["smollm2-*"], "speculation": {"enabled": False, "drafters": []}},
    ],
    "admin_keys": ["sk-admin-1-longkey"],
}


def _sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


# ---- keys and parsing -------------------------------------------------------------------------------
def test_hash_key_hashes_plaintext_and_passes_digests_through():
    assert hash_key("sk-acme-0000000000-1-longkey") == _sha("sk-acme-0000000000-1-longkey")
    digest = _sha("x")
    assert hash_key(digest) == digest
    assert hash_key(digest.upper().replace("SHA256:", "sha256:")) == digest
    for bad in ("", "sha256:abc", "sha256:" + "g" * 64):
        with pytest.raises(ValueError):
            hash_key(bad)


def test_parse_example():
    tenants, admins = parse_tenants(EXAMPLE)
    (acme, acme_keys), (beta, beta_keys) = tenants
    assert acme == Tenant("acme", weight=2.0, priority=0, rpm=600, tpm=200000, max_concurrent=16,
                          max_queued=64, max_prompt_tokens=4000, models=("*",),
                          speculation=SpeculationPolicy(True, ("ngram",), 32))
    assert acme_keys == [_sha("sk-acme-0000000000-1-longkey")]
    assert beta == Tenant("beta", models=("smollm2-*",),
                          speculation=SpeculationPolicy(False, (), 32))
    assert beta_keys == [_sha("sk-beta-1-longkey")]
    assert admins == [_sha("sk-admin-1-longkey")]


def _with(path, value):
    doc = copy.deepcopy(EXAMPLE)
    target = doc
    for step in path[:-1]:
        target = target[step]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


_DELETE = object()
BAD = [
    # (where, new value, the field the error must name, words it must contain)
    (("tenants", 0, "name"), _DELETE, "tenants[0].name", "required"),
    (("tenants", 1, "name"), "acme", "tenants[1].name", "duplicate"),
    (("tenants", 0, "name"), "a:b", "tenants[0].name", "letters"),
    (("tenants", 0, "rpm"), -5, "tenants[0].rpm", ">= 1"),
    (("tenants", 0, "tpm"), 0, "tenants[0].tpm", ">= 1"),
    (("tenants", 0, "max_concurrent"), 1.5, "tenants[0].max_concurrent", "integer"),
    (("tenants", 0, "priority"), -1, "tenants[0].priority", ">= 0"),
    (("tenants", 0, "max_prompt_tokens"), 0, "tenants[0].max_prompt_tokens", ">= 1"),
    (("tenants", 0, "weight"), 0, "tenants[0].weight", "> 0"),
    (("tenants", 0, "weight"), True, "tenants[0].weight", "number"),
    (("tenants", 0, "colour"), "red", "tenants[0].colour", "unknown field"),
    (("tenants", 0, "models"), "*", "tenants[0].models", "list"),
    (("tenants", 0, "models"), ["ok", ""], "tenants[0].models[1]", "non-empty"),
    (("tenants", 0, "speculation"), {"max_tree_tokens": 0}, "tenants[0].speculation.max_tree_tokens", ">= 1"),
    (("tenants", 0, "speculation"), {"drafterz": ["ngram"]}, "tenants[0].speculation.drafterz", "unknown field"),
    (("tenants", 0, "speculation"), {"drafters": "ngram"}, "tenants[0].speculation.drafters", "list"),
    (("tenants", 0, "speculation"), {"enabled": "yes please"}, "tenants[0].speculation.enabled", "true or false"),
    (("tenants", 0, "speculation"), {"enabled": True, "drafters": []}, "tenants[0].speculation.drafters", "drafter"),
    (("tenants", 0, "speculation"), [1], "tenants[0].speculation", "mapping"),
    (("tenants", 1, "api_keys"), ["sk-other-longkey", "sk-acme-0000000000-1-longkey"], "tenants[1].api_keys[1]", "tenants[0]"),
    (("tenants", 0, "api_keys"), ["sha256:1234"], "tenants[0].api_keys[0]", "64 hex"),
    (("admin_keys",), ["sk-acme-0000000000-1-longkey"], "admin_keys[0]", "tenants[0]"),
    (("tenants", 0, "api_keys"), ["sk-short"], "tenants[0].api_keys[0]", "at least 16 characters"),
    (("admin_keys",), ["a"], "admin_keys[0]", "at least 16 characters"),
    (("tenants",), {"acme": {}}, "tenants", "list"),
    (("tenants", 0), "acme", "tenants[0]", "mapping"),
    (("admins",), [], "admins", "unknown field"),
]


@pytest.mark.parametrize("where,value,field,words", BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_parse_errors_name_the_field(where, value, field, words):
    with pytest.raises(TenantsConfigError) as err:
        parse_tenants(_with(where, value))
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")
    assert words in str(err.value)


def test_parse_error_never_echoes_a_key():
    with pytest.raises(TenantsConfigError) as err:
        parse_tenants(_with(("tenants", 1, "api_keys"), ["sk-acme-0000000000-1-longkey"]))
    assert "sk-acme-0000000000-1-longkey" not in str(err.value)


def test_file_error_names_file_and_line(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(textwrap.dedent("""\
        tenants:
          - name: acme
            api_keys: ["sk-acme-0000000000-1-longkey"]
          - name: beta
            rpm: -3
        """))
    with pytest.raises(TenantsConfigError) as err:
        TenantRegistry.from_file(path)
    assert str(err.value).startswith(f"{path}:5: tenants[1].rpm:")


def test_empty_file_is_no_tenants(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("")
    assert TenantRegistry.from_file(path).list() == []


def test_allows_model_patterns():
    t = Tenant("t", models=("smollm2-*", "gpt-x"))
    assert t.allows_model("smollm2-135m") and t.allows_model("gpt-x")
    assert not t.allows_model("gpt-x2") and not t.allows_model("SMOLLM2-135m")
    assert Tenant("u").allows_model("anything")


# ---- the registry (memory and Redis) ------------------------------------------------------------------
def _registry(store) -> TenantRegistry:
    url, prefix = store
    registry = TenantRegistry(url, prefix)
    registry.load_config(*parse_tenants(EXAMPLE))
    return registry


def test_authenticate(store):
    registry = _registry(store)
    assert registry.authenticate("sk-acme-0000000000-1-longkey").name == "acme"
    assert registry.authenticate("sk-beta-1-longkey").name == "beta"      # configured as a digest
    assert registry.authenticate("sk-acme-0000000000-2-longkey") is None
    assert registry.authenticate("") is None and registry.authenticate(None) is None
    # A digest is not a key: sending what the store (or the file) holds gets nobody in.
    assert registry.authenticate(_sha("sk-acme-0000000000-1-longkey")) is None
    assert registry.is_admin("sk-admin-1-longkey")
    assert not registry.is_admin("sk-acme-0000000000-1-longkey") and not registry.is_admin(None)
    assert not registry.is_admin(_sha("sk-admin-1-longkey"))


def test_get_list_put_remove(store):
    registry = _registry(store)
    assert [t.name for t in registry.list()] == ["acme", "beta"]
    assert registry.get("acme").rpm == 600 and registry.get("nobody") is None
    registry.put(Tenant("acme", rpm=10))                 # replace, keeping its keys
    assert registry.authenticate("sk-acme-0000000000-1-longkey").rpm == 10
    registry.put(Tenant("acme", rpm=11), ["sk-acme-new-longkey"])  # replace keys too
    assert registry.authenticate("sk-acme-0000000000-1-longkey") is None
    assert registry.authenticate("sk-acme-new-longkey").rpm == 11
    assert registry.remove("acme") and not registry.remove("acme")
    assert registry.authenticate("sk-acme-new-longkey") is None and registry.get("acme") is None


def test_put_with_another_tenants_key_changes_nothing(store):
    registry = _registry(store)
    with pytest.raises(ValueError, match="another tenant"):
        registry.put(Tenant("gamma"), ["sk-new-longkey", "sk-acme-0000000000-1-longkey"])
    assert registry.get("gamma") is None
    assert registry.authenticate("sk-new-longkey") is None
    assert registry.authenticate("sk-acme-0000000000-1-longkey").name == "acme"


def test_put_rejects_an_invalid_tenant(store):
    registry = _registry(store)
    with pytest.raises(ValueError, match="rpm"):
        registry.put(Tenant("acme", rpm=-1))
    assert registry.get("acme").rpm == 600


def test_rotate_key(store):
    registry = _registry(store)
    new = registry.rotate_key("acme")
    assert new.startswith("sk-") and len(new) > 40
    assert registry.authenticate(new).name == "acme"
    assert registry.authenticate("sk-acme-0000000000-1-longkey") is None
    assert registry.authenticate("sk-beta-1-longkey").name == "beta"     # other tenants untouched
    assert registry.rotate_key("acme") != new
    with pytest.raises(KeyError):
        registry.rotate_key("nobody")


def test_dev_tenant_created_once(store):
    url, prefix = store
    registry = TenantRegistry(url, prefix)
    key = registry.ensure_dev_tenant()
    assert key and len(key) > 40
    assert registry.authenticate(key).name == "dev"
    assert registry.ensure_dev_tenant() is None
    assert [t.name for t in registry.list()] == ["dev"]
    assert TenantRegistry(None).ensure_dev_tenant() != key          # random, not a default


def test_no_dev_tenant_when_tenants_exist(store):
    assert _registry(store).ensure_dev_tenant() is None


def test_reloading_the_same_file_keeps_admin_changes(store, tmp_path):
    url, prefix = store
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-0000000000-1-longkey], rpm: 5}\n"
                    "admin_keys: [sk-admin-1-longkey]\n")
    first = TenantRegistry(url, prefix)

    def start_replica() -> TenantRegistry:
        # A replica starting with the file: a new registry over the same store (in memory, the
        # same registry is the only one that sees the store).
        registry = first if url is None else TenantRegistry(url, prefix)
        registry.load_config(*load_tenants_file(path))
        return registry

    new = start_replica().rotate_key("acme")
    second = start_replica()
    assert second.authenticate("sk-acme-0000000000-1-longkey") is None        # the rotation stands
    assert second.authenticate(new).name == "acme"
    assert second.remove("acme")
    assert start_replica().get("acme") is None              # and so does a removal
    # An edited entry is applied again: the file is the operator's word.
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-0000000000-1-longkey], rpm: 6}\n"
                    "admin_keys: [sk-admin-2-longkey]\n")
    third = start_replica()
    assert third.authenticate("sk-acme-0000000000-1-longkey").rpm == 6
    assert third.authenticate(new) is None
    assert third.is_admin("sk-admin-2-longkey") and not third.is_admin("sk-admin-1-longkey")


# ---- Redis only: shared by replicas, no plaintext stored ---------------------------------------------------
def test_two_registries_over_one_redis_see_changes_at_once(redis_url, redis_prefix):
    a = TenantRegistry(redis_url, redis_prefix)
    b = TenantRegistry(redis_url, redis_prefix)
    a.put(Tenant("acme", rpm=7), ["sk-acme-0000000000-1-longkey"])
    assert b.authenticate("sk-acme-0000000000-1-longkey") == Tenant("acme", rpm=7)
    new = b.rotate_key("acme")
    assert a.authenticate("sk-acme-0000000000-1-longkey") is None and a.authenticate(new).name == "acme"
    a.put(Tenant("acme", rpm=8))
    assert b.get("acme").rpm == 8
    assert b.remove("acme")
    assert a.authenticate(new) is None and a.list() == []
    b.add_admin_key("sk-admin-9-longkey")
    assert a.is_admin("sk-admin-9-longkey")


def test_two_replicas_create_one_dev_tenant(redis_url, redis_prefix):
    keys = [TenantRegistry(redis_url, redis_prefix).ensure_dev_tenant() for _ in range(2)]
    assert keys[0] is not None and keys[1] is None


def test_redis_holds_no_plaintext_key(redis_url, redis_prefix, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-plain-1-longkey]}\n"
                    "admin_keys: [sk-admin-plain-1]\n")
    registry = TenantRegistry.from_file(path, redis_url, redis_prefix)
    rotated = registry.rotate_key("acme")
    registry.put(Tenant("beta"), ["sk-beta-plain-1-longkey"])
    dev = TenantRegistry(redis_url, redis_prefix + "dev:").ensure_dev_tenant()
    secrets_ = ["sk-acme-plain-1-longkey", "sk-admin-plain-1", rotated, "sk-beta-plain-1-longkey", dev]
    dump = _dump(redis_url, redis_prefix)
    assert _sha("sk-beta-plain-1-longkey") in dump          # the dump does see the stored data
    for secret in secrets_:
        assert secret not in dump


def _dump(url: str, prefix: str) -> str:
    """Every key under `prefix` and every value it holds, as one string."""
    parts = []
    with redis.Redis.from_url(url, decode_responses=True) as r:
        for key in r.scan_iter(match=prefix + "*"):
            parts.append(key)
            kind = r.type(key)
            if kind == "hash":
                parts += [f"{k}={v}" for k, v in r.hgetall(key).items()]
            elif kind == "set":
                parts += list(r.smembers(key))
            elif kind == "zset":
                parts += list(r.zrange(key, 0, -1))
            elif kind == "string":
                parts.append(r.get(key))
    assert parts, "nothing stored under the prefix"
    return "\n".join(parts)


def test_parse_tenant_is_the_admin_body_parser():
    tenant, digests = parse_tenant({"name": "solo", "rpm": 3})
    assert tenant == Tenant("solo", rpm=3) and digests == []
    with pytest.raises(TenantsConfigError) as err:
        parse_tenant({"name": "solo", "rpm": "3"})
    assert err.value.field == "rpm"


# ---- tenant ids: what the engine's caches are keyed by --------------------------------------------------
def test_a_tenant_keeps_its_id_until_removed_and_comes_back_with_a_new_one(store, tmp_path):
    url, prefix = store
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-0000000000-1], rpm: 5}\n")
    registry = TenantRegistry.from_file(path, url, prefix)
    first = registry.get("acme").id
    assert first and registry.authenticate("sk-acme-0000000000-1").id == first
    # replaced, keys rotated, the file applied again: the same tenant, the same id
    registry.put(Tenant("acme", rpm=9, id="t-chosen-by-a-caller"))    # a caller cannot set it
    registry.rotate_key("acme")
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-0000000000-2], rpm: 6}\n")
    registry.load_config(*load_tenants_file(path))
    assert registry.get("acme").id == first and registry.authenticate("sk-acme-0000000000-2").id == first
    assert [t.id for t in registry.list()] == [first]
    # removed (the record says which id went) and created again under the same name: a new id
    removed = registry.remove("acme")
    assert removed.name == "acme" and removed.id == first
    registry.put(Tenant("acme"), ["sk-acme-0000000000-3"])
    again = registry.authenticate("sk-acme-0000000000-3").id
    assert again not in (first, "t-chosen-by-a-caller")
    assert registry.remove("acme").id == again and registry.remove("acme") is None
    registry.put(Tenant("acme"))
    assert registry.get("acme").id not in (first, again)
    dev = TenantRegistry(url, prefix + "dev:")
    assert dev.authenticate(dev.ensure_dev_tenant()).id.startswith("t-")


def test_every_replica_sees_one_id_per_tenant(redis_url, redis_prefix):
    a = TenantRegistry(redis_url, redis_prefix)
    b = TenantRegistry(redis_url, redis_prefix)
    a.put(Tenant("acme"), ["sk-acme-0000000000-1"])
    assert b.authenticate("sk-acme-0000000000-1").id == a.get("acme").id
    b.put(Tenant("acme", rpm=3))
    assert a.get("acme").id == b.get("acme").id


# ---- keys at rest: an HMAC under the server's pepper -----------------------------------------------------
PEPPER = "pepper-" + "0123456789abcdef" * 2
KEYS_FILE = ("tenants:\n  - {name: acme, api_keys: [sk-acme-plain-1-longkey], rpm: 5}\n"
             "admin_keys: [sk-admin-plain-1-longkey]\n")


def test_keys_rest_as_hmacs_under_the_pepper_not_as_their_sha256(redis_url, redis_prefix, tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(KEYS_FILE)
    registry = TenantRegistry.from_file(path, redis_url, redis_prefix, pepper=PEPPER)
    rotated = registry.rotate_key("acme", grace_s=60)
    registry.put(Tenant("beta"), ["sk-beta-plain-1-longkey"])
    registry.add_admin_key("sk-admin-plain-2-longkey")
    dev_registry = TenantRegistry(redis_url, redis_prefix + "dev:", pepper=PEPPER)
    dev = dev_registry.ensure_dev_tenant()
    keys = ["sk-acme-plain-1-longkey", rotated, "sk-beta-plain-1-longkey", "sk-admin-plain-1-longkey",
            "sk-admin-plain-2-longkey", dev]
    dump = _dump(redis_url, redis_prefix)
    assert dump.count("hmac-sha256:") >= 6                  # every key, and none as its SHA-256
    for key in keys:
        assert key not in dump and _sha(key)[7:] not in dump
    # and it is the pepper that finds them: the same store under another pepper finds none
    assert registry.authenticate(rotated).name == "acme" and registry.is_admin("sk-admin-plain-2-longkey")
    assert dev_registry.authenticate(dev).name == "dev"
    stranger = TenantRegistry(redis_url, redis_prefix, pepper=PEPPER.upper())
    assert all(stranger.authenticate(k) is None and not stranger.is_admin(k) for k in keys)


def test_a_store_written_without_a_pepper_keeps_every_key_once_peppered(redis_url, redis_prefix, tmp_path):
    """An older release's store (plain SHA-256 digests, bare fingerprints of the applied file):
    a key still works before the migration (and is peppered at its first use); starting with
    the file peppers the rest, keeps a rotated-out key's grace, re-applies nothing, and leaves
    no SHA-256 digest of a key behind."""
    path = tmp_path / "tenants.yaml"
    path.write_text(KEYS_FILE)
    old = TenantRegistry.from_file(path, redis_url, redis_prefix)           # no pepper
    rotated = old.rotate_key("acme", grace_s=300)                           # the file's key in grace
    old.put(Tenant("beta"), ["sk-beta-plain-1-longkey"])
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:       # as older releases wrote it
        applied = r.hgetall(redis_prefix + "tenants:applied")
        r.hset(redis_prefix + "tenants:applied", mapping={k: json.loads(v)["fp"] for k, v in applied.items()})
        expiry = r.hgetall(redis_prefix + "tenants:expiry")
    assert _sha("sk-beta-plain-1-longkey") in _dump(redis_url, redis_prefix)

    new = TenantRegistry(redis_url, redis_prefix, pepper=PEPPER)
    assert new.authenticate("sk-beta-plain-1-longkey").name == "beta"       # first use: peppered
    assert _sha("sk-beta-plain-1-longkey") not in _dump(redis_url, redis_prefix)
    new.load_config(*load_tenants_file(path))                               # a start: all of them
    dump = _dump(redis_url, redis_prefix)
    assert "sha256:" not in dump.replace("hmac-sha256:", "")
    assert new.authenticate("sk-acme-plain-1-longkey").name == "acme"      # still in its grace
    assert new.authenticate(rotated).name == "acme" and new.is_admin("sk-admin-plain-1-longkey")
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        assert sorted(r.hgetall(redis_prefix + "tenants:expiry").values()) == sorted(expiry.values())
        records = [json.loads(v) for v in r.hgetall(redis_prefix + "tenants:applied").values()]
    assert all(rec["fp"].startswith("hmac:") for rec in records)           # no unkeyed fingerprint


def test_a_start_with_another_pepper_or_none_is_refused_not_a_401_for_every_key(redis_url, redis_prefix,
                                                                                tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(KEYS_FILE)
    TenantRegistry.from_file(path, redis_url, redis_prefix, pepper=PEPPER)
    for other, words in ((PEPPER.upper(), "another key pepper"), (None, "set SPECGATE_KEY_PEPPER")):
        with pytest.raises(ValueError, match=words) as err:
            TenantRegistry.from_file(path, redis_url, redis_prefix, pepper=other)
        assert PEPPER not in str(err.value)
    again = TenantRegistry.from_file(path, redis_url, redis_prefix, pepper=PEPPER)
    assert again.authenticate("sk-acme-plain-1-longkey").name == "acme"
    assert PEPPER not in _dump(redis_url, redis_prefix)


def test_a_presented_key_costs_the_same_few_redis_commands_however_many_tenants(tmp_path):
    """O(1): authenticating is one script call whose commands do not grow with the tenants, for
    a peppered key and for one still in its older form. Counted by the server's own command
    statistics, on a server of this test's own."""
    from redis_server import private_redis_server

    def cost(r: redis.Redis, call) -> dict[str, int]:
        before = r.info("commandstats")
        call()
        after = r.info("commandstats")
        calls = {k: v["calls"] - before.get(k, {"calls": 0})["calls"] for k, v in after.items()}
        return {k: n for k, n in calls.items() if n and k != "cmdstat_info"}

    with private_redis_server() as url, redis.Redis.from_url(url) as r:
        costs = []
        for n in (5, 200):
            prefix = f"n{n}:"
            TenantRegistry(url, prefix).put(Tenant("legacy"), ["sk-legacy-key-000001"])   # unpeppered
            registry = TenantRegistry(url, prefix, pepper=PEPPER)
            for i in range(n):
                registry.put(Tenant(f"t{i}"), [f"sk-tenant-key-{i:06d}"])
            registry.authenticate("sk-tenant-key-000000")              # scripts loaded
            costs.append((cost(r, lambda: registry.authenticate(f"sk-tenant-key-{n - 1:06d}")),
                          cost(r, lambda: registry.authenticate("sk-legacy-key-000001"))))
    assert costs[0] == costs[1]
    peppered, legacy = costs[0]
    assert peppered.get("cmdstat_evalsha") == 1 and sum(peppered.values()) <= 6, peppered
    assert legacy.get("cmdstat_evalsha") == 1 and sum(legacy.values()) <= 16, legacy


# ---- the tenants file applied again keeps what the admin API did ------------------------------------------
def test_an_edited_tenants_file_keeps_a_rotation_and_its_grace(store, tmp_path):
    """Rotate a key through the admin API with a grace period, edit another field of the
    tenant's entry, start again with the file: the edit applies, and the rotated key and the
    old key's grace stand: both keys work until the grace ends, then only the new one."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from gateway.errors import install_handlers
    from gateway.http.routers.admin import router
    from gateway.settings import Settings

    url, prefix = store
    path = tmp_path / "tenants.yaml"
    path.write_text(KEYS_FILE)
    settings = Settings(redis_url=url, store_prefix=prefix, tenants_file=path, key_pepper=PEPPER)
    first = TenantRegistry.from_settings(settings)

    def start_replica() -> TenantRegistry:
        # in memory the registry is the store: the same one applies the file again
        if url is None:
            first.load_config(*load_tenants_file(path))
            return first
        return TenantRegistry.from_settings(settings)

    app = FastAPI()
    install_handlers(app)
    app.state.tenants, app.state.settings = first, settings
    app.state.service = app.state.store_probe = None
    app.include_router(router)
    grace_s, t0 = 10.0, time.monotonic()        # the deadline: between t0 + grace_s and t1 + grace_s
    resp = TestClient(app).post(f"/admin/tenants/acme/rotate-key?grace_s={grace_s}",
                                headers={"Authorization": "Bearer sk-admin-plain-1-longkey"})
    assert resp.status_code == 200, resp.text
    rotated, t1 = resp.json()["api_key"], time.monotonic()
    path.write_text(KEYS_FILE.replace("rpm: 5", "rpm: 7"))
    replica = start_replica()
    old = replica.authenticate("sk-acme-plain-1-longkey")
    assert replica.authenticate(rotated).rpm == 7                # the edit applied
    if time.monotonic() < t0 + grace_s - 0.5:    # (a machine too loaded to get here in time proves nothing)
        assert old is not None and old.rpm == 7
    while replica.authenticate("sk-acme-plain-1-longkey") is not None:
        assert time.monotonic() < t1 + grace_s + 30, "the old key outlived its grace"
        time.sleep(0.2)
    assert time.monotonic() >= t0 + grace_s - 0.5                # not cut short
    assert replica.authenticate(rotated).name == "acme"
    assert start_replica().authenticate("sk-acme-plain-1-longkey") is None    # and stays gone


def test_the_file_gives_and_takes_only_the_keys_its_edit_adds_and_removes(store, tmp_path):
    url, prefix = store
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-a-0000000001, sk-acme-b-0000000001]}\n")
    registry = TenantRegistry.from_file(path, url, prefix, pepper=PEPPER)
    api_key = registry.rotate_key("acme", grace_s=600)          # a and b in their grace
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-a-0000000001, sk-acme-c-0000000001]}\n")
    registry.load_config(*load_tenants_file(path))
    assert registry.authenticate("sk-acme-c-0000000001").name == "acme"       # added: given
    assert registry.authenticate(api_key).name == "acme"                     # the API's: kept
    assert registry.authenticate("sk-acme-a-0000000001").name == "acme"      # kept, in its grace
    assert registry.authenticate("sk-acme-b-0000000001").name == "acme"      # removed, but in its grace
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-a-0000000001]}\n")
    registry.load_config(*load_tenants_file(path))
    assert registry.authenticate("sk-acme-c-0000000001") is None             # removed, no grace: gone
    assert registry.authenticate(api_key).name == "acme"
    registry.put(Tenant("gamma"), ["sk-beta-0000000001"])
    path.write_text("tenants:\n  - {name: acme, api_keys: [sk-acme-a-0000000001]}\n"
                    "  - {name: beta, api_keys: [sk-beta-0000000001]}\n")
    with pytest.raises(ValueError, match="another tenant"):                   # conflicts still refused
        registry.load_config(*load_tenants_file(path))
    assert registry.get("beta") is None and registry.authenticate("sk-beta-0000000001").name == "gamma"
