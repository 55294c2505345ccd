"""A schema cannot stall anyone (gateway/service/constraint.py): each cap refuses before any
compile, naming itself; a schema that compiles past the time limit is a 400 within the limit
while another tenant's request on the same gateway goes through; a tenant's second compile at
once is a 429; the engine's own words never reach a client. The real engine (xgrammar), over the
default model's tokenizer behind a fake worker."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from gateway.errors import ApiError
from gateway.service.constraint import ConstraintCheck, GrammarLimits
from gateway.text import ToyTokenizer
from workers.speculation.schema_caps import SchemaCaps

TOK = ToyTokenizer()
LIMIT_S = 3.0


def obj(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def constraint(schema: dict) -> str:
    return json.dumps({"type": "json_schema", "schema": schema})


def nest(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):
        schema = obj({"x": schema})
    return schema


CAPS = SchemaCaps(max_bytes=4_000, max_depth=4, max_properties=10, max_enum_values=5, max_enum_chars=40,
                  max_pattern_chars=30, max_repeat=20, max_items=50)
OVER = {
    "schema_max_bytes": obj({"a": {"type": "string", "description": "x" * 5_000}}),
    "schema_max_depth": nest(5),
    "schema_max_properties": obj({f"p{i}": {"type": "integer"} for i in range(11)}),
    "schema_max_enum_values": obj({"a": {"enum": list("abcdef")}}),
    "schema_max_enum_chars": obj({"a": {"enum": ["x" * 25, "y" * 25]}}),
    "schema_max_pattern_chars": obj({"a": {"type": "string", "pattern": "^" + "ab" * 20 + "$"}}),
    "schema_max_repeat": obj({"a": {"type": "string", "pattern": "^[a-z]{1,21}$"}}),
    "schema_max_items": obj({"a": {"type": "array", "items": {"type": "integer"}, "maxItems": 51}}),
}


@pytest.fixture(scope="module")
def toy_check():
    from workers.speculation.grammars import Grammars

    g = Grammars.from_tokenizer(TOK, len(TOK), [TOK.eos_token_id])
    check = ConstraintCheck(TOK, len(TOK), [TOK.eos_token_id], grammars=g,
                            limits=GrammarLimits(caps=CAPS, compile_timeout_s=30.0))
    yield check, g
    g.use_pool(workers=1, timeout_s=1).close()             # the pool the check gave it


@pytest.mark.parametrize("cap", sorted(OVER))
def test_each_cap_refuses_before_any_compile(toy_check, cap):
    check, g = toy_check
    with pytest.raises(ApiError) as e:
        check.check(constraint(OVER[cap]), "t")
    assert (e.value.status, e.value.code, e.value.param) == (400, "schema_too_complex", "response_format")
    assert cap in e.value.message
    assert g.compiles == 0


def test_a_schema_within_the_caps_compiles(toy_check):
    check, g = toy_check
    assert check.check(constraint(nest(4)), "t") is not None
    assert g.compiles == 1


@pytest.mark.parametrize("schema, says", [
    ({"type": "no-such-type"}, 'unsupported type "no-such-type"'),
    (obj({"a": {"type": "string", "pattern": "(("}}), "not a regular expression"),
    (obj({"a": {"$ref": "#/$defs/nowhere"}}), "$ref"),
])
def test_the_engines_words_never_reach_the_client(toy_check, schema, says, caplog):
    check, _ = toy_check
    with caplog.at_level("INFO", logger="gateway.service.constraint"):
        with pytest.raises(ApiError) as e:
            check.check(constraint(schema), "t")
    msg = e.value.message
    assert e.value.status == 400 and e.value.param == "response_format"
    assert says in msg
    for internal in (".cc", "/project", "cpp", "[", "xgrammar", "\n"):
        assert internal not in msg, msg
    assert any(".cc" in r.getMessage() for r in caplog.records), "the engine's words are logged"


# ---- over HTTP: a slow schema is refused in time, and nobody else waits ---------------------------
SLOW = obj({f"p{i}": {"type": "array", "minItems": 50, "maxItems": 400, "items": {
    "type": "string", "pattern": "^[a-z]{10,100}-[0-9]{10,100}$"}} for i in range(24)})


def chat(url: str, key: str, schema: dict, name: str = "x") -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}})


@pytest.fixture(scope="module")
def gateway():
    from gateway.assembly.target import Target
    from gateway.builders.embedded import build_embedded
    from gateway.http.server import background_server
    from gateway.settings import Settings
    from gateway.tenancy.records import Tenant
    from workers.fake_worker import PacedFakeWorker
    from workers.model.loader import load_tokenizer

    tok = load_tokenizer(progress=False)
    settings = Settings(fake_worker=True, served_model_name="m", grammar_compile_timeout_s=LIMIT_S)
    emb = build_embedded(settings, target=Target(tok, PacedFakeWorker(0.0), frozenset({2})))
    emb.tenants.put(Tenant(name="heavy"), ["key-heavy"])
    emb.tenants.put(Tenant(name="light"), ["key-light"])
    emb.start()
    with background_server(emb.app) as url:
        assert chat(url, "key-light", obj({"warm": {"type": "boolean"}})).status_code == 200  # processes up
        yield url
    emb.stop()


def test_a_slow_schema_is_refused_in_time_and_nobody_else_waits(gateway):
    url = gateway
    answers: dict[str, httpx.Response] = {}
    took: dict[str, float] = {}

    def heavy() -> None:
        t0 = time.monotonic()
        answers["heavy"] = chat(url, "key-heavy", SLOW)
        took["heavy"] = time.monotonic() - t0
    t = threading.Thread(target=heavy)
    t.start()
    time.sleep(1.0)                                          # the heavy compile is under way
    second = chat(url, "key-heavy", obj({"other": {"type": "string"}}), "y")   # while its first compiles
    t0 = time.monotonic()
    light = chat(url, "key-light", obj({"city": {"enum": ["Oslo", "Lima"]}, "n": {"type": "integer"}}))
    light_s = time.monotonic() - t0
    t.join()
    assert light.status_code == 200, light.text
    assert light_s < LIMIT_S + 6, "another tenant's request waited on the slow compile"
    assert second.status_code == 429 and second.json()["error"]["code"] == "compile_concurrency_exceeded"
    assert "Retry-After" in second.headers
    err = answers["heavy"].json()["error"]
    assert answers["heavy"].status_code == 400 and err["code"] == "schema_too_complex", err
    assert "grammar_compile_timeout_s" in err["message"]
    assert took["heavy"] < LIMIT_S + 8
