"""Hand-made hostile inputs against a real loopback server (uvicorn, `background_server`) over the
fake worker: malformed JSON, wrong types, huge numbers and strings, deep nesting, invalid UTF-8,
lone surrogates, duplicate keys, header abuse and broken HTTP framing (raw sockets). Each case
names the status it must get; every refusal the app makes is an OpenAI error body, no case gets
a 5xx, and no case hangs (every client call has a timeout).

HTTP framing the server's parser refuses (bad chunk sizes, Content-Length with
Transfer-Encoding, NUL in a header) never reaches the app: uvicorn answers 400 with its own
text/plain body and closes the connection. Those cases check the 400 and the close only.

    python -m pytest tests/fuzz/test_hostile_inputs.py -q
"""
from __future__ import annotations

import json
import socket
import zlib

import httpx
import pytest

from gateway.http.server import background_server

from gateway.builders.embedded import build_embedded
from gateway.settings import Settings

MODEL = "smollm2-135m"
TIMEOUT_S = 15.0
MAX_BODY = 2 * 1024 * 1024          # Settings.max_body_bytes' default


@pytest.fixture(scope="module")
def gw():
    emb = build_embedded(Settings(fake_worker=True, fake_context=64), progress=False)
    emb.start()
    with background_server(emb.app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as c:
        yield emb, url, c
    emb.stop()


@pytest.fixture
def client(gw):
    return gw[2]


@pytest.fixture
def auth(gw):
    return {"Authorization": f"Bearer {gw[0].dev_key}"}


@pytest.fixture
def admin(gw):
    return {"Authorization": f"Bearer {gw[0].admin_key}", "Content-Type": "application/json"}


def openai_error(r: httpx.Response, status: int, *, code: str | None = "?",
                 param: str | None = "?") -> dict:
    """Assert `r` is an OpenAI error with this status (and code / param, when given)."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if code != "?":
        assert err["code"] == code, err
    if param != "?":
        assert err["param"] == param, err
    return err


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}).encode()


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2, **fields}).encode()


def body_with(template: bytes, raw_value: bytes) -> bytes:
    """`template` (JSON with the placeholder "@V@") with raw JSON text in its place."""
    return template.replace(b'"@V@"', raw_value)


# ---- malformed JSON ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw, code", [
    (b'{"model": "smollm2-135m", "prompt": "hi"', "invalid_json"),        # cut short
    (b'{"model": "smollm2-135m",, "prompt": "hi"}', "invalid_json"),
    (b"{'model': 'smollm2-135m'}", "invalid_json"),                        # single quotes
    (b'{"model": "smollm2-135m", "prompt": "hi",}', "invalid_json"),       # trailing comma
    (b'{"model": "smollm2-135m"} {"prompt": "x"}', "invalid_json"),        # two documents
    (b'{"a": 01}', "invalid_json"),                                        # leading zero
    (b'{"a": "\\x41"}', "invalid_json"),                                   # bad escape
    (b'{"a": "tab\there"}', "invalid_json"),                               # raw control char
    (b"\xef\xbb\xbf{}", "invalid_json"),                                   # UTF-8 BOM
    (b"", "invalid_body"),
    (b"   \n\t ", "invalid_body"),
    (b"null", "invalid_body"),
    (b"[]", "invalid_body"),
    (b'"a string"', "invalid_body"),
    (b"12", "invalid_body"),
    (b"\x00" * 64, "invalid_json"),
])
def test_malformed_json(client, auth, path, raw, code):
    r = client.post(path, content=raw, headers={**auth, "Content-Type": "application/json"})
    openai_error(r, 400, code=code, param=None)


# ---- wrong types, field by field -----------------------------------------------------------------
WRONG = {"a string": '"5"', "true": "true", "a float": "1.5", "an object": '{"a": 1}',
         "a list": "[1]", "a huge int": str(2**64)}
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed",
                     "stop", "n", "stream", "stream_options", "user", "speculation", "echo",
                     "logprobs", "best_of", "suffix", "frequency_penalty", "presence_penalty",
                     "logit_bias"]
CHAT_FIELDS = ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
               "functions", "response_format"]
ACCEPTED = {   # (field, wrong kind) that are still valid: the neutral value, or a type the field takes
    ("temperature", "a float"), ("top_p", "a float"), ("stop", "a string"), ("user", "a string"),
    ("prompt", "a string"), ("prompt", "a list"), ("model", "a string"), ("suffix", "a string"),
    ("frequency_penalty", "a float"), ("presence_penalty", "a float"), ("response_format", "an object"),
    ("stream", "true"), ("speculation", "an object"), ("stream_options", "an object"),
    ("logprobs", "true"),                     # chat's logprobs is a boolean
}


@pytest.mark.parametrize("kind", list(WRONG))
@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_wrong_type_completions(client, auth, field, kind):
    r = client.post("/v1/completions", headers=auth,
                    content=body_with(completion(**{field: "@V@"}), WRONG[kind].encode()))
    _expect_wrong_type(r, field, kind)


@pytest.mark.parametrize("kind", list(WRONG))
@pytest.mark.parametrize("field", CHAT_FIELDS + ["model", "max_tokens", "stop", "speculation"])
def test_wrong_type_chat(client, auth, field, kind):
    r = client.post("/v1/chat/completions", headers=auth,
                    content=body_with(chat(**{field: "@V@"}), WRONG[kind].encode()))
    _expect_wrong_type(r, field, kind)


def _expect_wrong_type(r: httpx.Response, field: str, kind: str) -> None:
    assert r.status_code < 500, r.text
    if r.status_code == 200:
        assert (field, kind) in ACCEPTED, (field, kind, r.text[:200])
        return
    err = openai_error(r, r.status_code)
    assert r.status_code in (400, 404), (field, kind, r.text)   # 404: a model that is not served
    if r.status_code == 400:
        assert err["param"] is not None and err["param"].split(".")[0] == field, (field, kind, err)


# ---- huge and non-finite numbers -----------------------------------------------------------------
@pytest.mark.parametrize("field, raw, status, param", [
    ("max_tokens", b"1e308", 400, "max_tokens"),
    ("max_tokens", str(2**64).encode(), 400, "max_tokens"),
    ("max_tokens", b"-1", 400, "max_tokens"),
    ("max_tokens", b"0", 400, "max_tokens"),
    ("max_tokens", b"1e400", 400, "max_tokens"),             # overflows to inf when parsed
    ("max_tokens", b"9" * 5000, 400, None),                  # past Python's int-digits limit
    ("max_tokens", b"9" * 4000, 400, "max_tokens"),
    ("max_tokens", b"NaN", 400, None),
    ("max_tokens", b"Infinity", 400, None),
    ("max_tokens", b"-Infinity", 400, None),
    ("max_tokens", str(2**31 - 1).encode(), 400, "max_tokens"),  # past the context: 400
    ("temperature", b"1e308", 400, "temperature"),
    ("temperature", b"-1e308", 400, "temperature"),
    ("temperature", b"1e400", 400, "temperature"),
    ("temperature", b"NaN", 400, None),
    ("temperature", b"1e-320", 200, None),                   # subnormal, in range
    ("top_p", b"1e308", 400, "top_p"),
    ("top_p", b"-0.0", 400, "top_p"),
    ("top_k", str(-(2**63)).encode(), 400, "top_k"),
    ("seed", str(2**64 - 1).encode(), 200, None),
    ("seed", str(-(2**63)).encode(), 200, None),
    ("seed", str(2**64).encode(), 400, "seed"),
    ("seed", str(-(2**63) - 1).encode(), 400, "seed"),
    ("n", str(2**64).encode(), 400, "n"),
    ("speculation", b'{"max_tree_tokens": 18446744073709551616}', 400, "speculation.max_tree_tokens"),
    ("speculation", b'{"max_tree_tokens": -1}', 400, "speculation.max_tree_tokens"),
    ("prompt", b"[2147483647]", 400, "prompt.0"),
    ("prompt", b"[-1]", 400, "prompt"),
    ("prompt", str([2**64]).encode(), 400, "prompt"),
])
def test_huge_numbers(client, auth, field, raw, status, param):
    r = client.post("/v1/completions", headers=auth,
                    content=body_with(completion(**{field: "@V@"}), raw))
    if status == 200:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        openai_error(r, status, param=param)


# ---- huge strings and bodies ---------------------------------------------------------------------
def test_ten_megabyte_body_is_413(client, auth):
    r = client.post("/v1/completions", headers=auth, content=b"x" * (10 * 2**20))
    openai_error(r, 413, code="request_too_large")


def test_ten_megabyte_chunked_body_is_413(client, auth):
    def chunks():
        for _ in range(10):
            yield b"x" * 2**20
    r = client.post("/v1/completions", headers=auth, content=chunks())   # no Content-Length
    openai_error(r, 413, code="request_too_large")


def test_ten_megabyte_prompt_is_413(client, auth):
    r = client.post("/v1/completions", headers=auth, content=completion(prompt="a" * 10 * 2**20))
    openai_error(r, 413, code="request_too_large")


def test_body_just_under_the_limit_is_read(client, auth):
    """A prompt of ~2 MB is read, tokenized and refused for the context (413, param prompt),
    not a slow crawl: the timeout is the client's."""
    prompt = "a " * ((MAX_BODY - 200) // 2)
    r = client.post("/v1/completions", headers=auth, content=completion(prompt=prompt))
    openai_error(r, 413, param="prompt")


def test_admin_ten_megabyte_body_is_413(client, admin):
    r = client.post("/admin/tenants", headers=admin, content=b"[" * (10 * 2**20))
    openai_error(r, 413, code="request_too_large")


@pytest.mark.parametrize("field, size", [("model", 10_000), ("user", 10_000), ("stop", 10_000)])
def test_long_strings_in_short_fields(client, auth, field, size):
    openai_error(client.post("/v1/completions", headers=auth,
                             content=completion(**{field: "x" * size})), 400, param=field)


def test_many_messages_and_stops(client, auth):
    msgs = [{"role": "user", "content": "hi"}] * 5000
    openai_error(client.post("/v1/chat/completions", headers=auth, content=chat(messages=msgs)),
                 400, param="messages")
    openai_error(client.post("/v1/completions", headers=auth, content=completion(stop=["x"] * 1000)),
                 400, param="stop")
    ids = list(range(200_000))                # counted against the context before any is checked
    openai_error(client.post("/v1/completions", headers=auth, content=completion(prompt=ids)), 413,
                 code="context_length_exceeded", param="prompt")


# ---- deep nesting --------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [10_000, 100_000])
@pytest.mark.parametrize("opener, closer", [(b"[", b"]"), (b'{"a":', b"}")])
def test_deep_nesting(client, auth, depth, opener, closer):
    nested = opener * depth + b"1" + closer * depth
    if len(nested) > MAX_BODY:
        nested = nested[:MAX_BODY - 100]              # still deep: cut short, still refused
    for body in (nested, body_with(completion(prompt="@V@"), nested)):
        openai_error(client.post("/v1/completions", headers=auth, content=body), 400)


@pytest.mark.parametrize("field", ["logit_bias", "tools", "response_format", "messages"])
def test_deep_but_parseable_nesting_in_free_form_fields(client, auth, field):
    nested = b'{"a":' * 500 + b"1" + b"}" * 500
    if field in ("tools", "messages"):
        nested = b"[" + nested + b"]"
    elif field == "response_format":
        nested = b'{"type":' + nested + b"}"
    openai_error(client.post("/v1/chat/completions", headers=auth,
                             content=body_with(chat(**{field: "@V@"}), nested)), 400)


def test_admin_deep_nesting(client, admin):
    for depth in (10_000, 100_000):
        r = client.post("/admin/tenants", headers=admin, content=b"[" * depth + b"]" * depth)
        openai_error(r, 400)


# ---- invalid UTF-8 and unpaired surrogates -------------------------------------------------------
@pytest.mark.parametrize("raw", [
    b'{"model": "smollm2-135m", "prompt": "\xff\xfe"}',
    b'{"model": "smollm2-135m", "prompt": "\xc3"}',                  # truncated sequence
    b'{"model": "smollm2-135m", "prompt": "\xed\xa0\x80"}',          # an encoded surrogate
    b'{"model": "smollm2-135m", "prompt": "\xc0\xaf"}',              # overlong
    b"\xfe\xff\x00{\x00}",                                           # UTF-16
])
def test_invalid_utf8(client, auth, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        openai_error(client.post(path, headers=auth, content=raw), 400, code="invalid_body")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion(prompt="\ud800")),
    ("/v1/completions", completion(prompt=["\udfff"])),
    ("/v1/completions", completion(stop="\ud800")),
    ("/v1/completions", completion(user="x\udc00")),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "\ud800"}])),
    ("/v1/chat/completions", chat(messages=[{"role": "user",
                                            "content": [{"type": "text", "text": "\udbff"}]}])),
])
def test_unpaired_surrogates_are_400(client, auth, path, body):
    """JSON allows "\\ud800", but it is no character: a real tokenizer raises TypeError on it
    (a 500 before this was refused), and no response holding it could be encoded."""
    assert b"\\ud" in body or b"\\udc" in body or b"\\udb" in body or b"\\udf" in body
    openai_error(client.post(path, headers=auth, content=body), 400, code="invalid_json")


def test_surrogate_pairs_are_characters(client, auth):
    r = client.post("/v1/completions", headers=auth, content=completion(prompt="smile \U0001F600"))
    assert r.status_code == 200, r.text
    assert b"\\ud83d\\ude00" in completion(prompt="\U0001F600")      # sent escaped, as a pair


@pytest.mark.parametrize("body", [
    {"name": "bad-models", "models": ["\ud800"]},
    {"name": "bad-drafters", "speculation": {"drafters": ["\udfff"]}},
    {"name": "bad-keys", "api_keys": ["sk-\ud800-key"]},
    {"name": "\ud800"},
])
def test_admin_unpaired_surrogates_are_400(client, admin, body):
    """A tenant stored with a lone surrogate could never be listed again (500 on every
    GET /admin/tenants): refused when put (by the body parser, as on /v1/*, since the body is
    read after authentication by gateway.http.deps.json_value)."""
    openai_error(client.post("/admin/tenants", headers=admin, content=json.dumps(body)), 400,
                 code="invalid_json")
    assert client.get("/admin/tenants", headers=admin).status_code == 200


# ---- admin numbers -------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, status", [
    ("weight", 10**400, 400), ("weight", 1e308, 201), ("weight", 5e-324, 201),
    ("rpm", 10**400, 400), ("rpm", 2**64, 400), ("rpm", 2**53, 201),
    ("tpm", 10**400, 400), ("priority", 10**400, 400), ("max_concurrent", 10**400, 400),
    ("max_queued", 10**400, 400), ("max_queued", 2**53, 201),
    ("max_prompt_tokens", 10**400, 400), ("max_prompt_tokens", 0, 400),
    ("max_prompt_tokens", 2**53, 201),
    ("max_stored_responses", 10**400, 400), ("max_stored_responses", 0, 201),
    ("max_stored_response_bytes", 2**53, 201), ("responses_ttl_s", 0, 400),
    ("responses_ttl_s", 2**53, 400), ("responses_ttl_s", 2**31, 201),
], ids=lambda v: f"{str(v)[:1]}e{len(str(v)) - 1}" if isinstance(v, int) and v > 10**20 else str(v))
def test_admin_huge_numbers(gw, client, admin, field, value, status):
    """Limits past 2**53 (10**400 took every request of the tenant to a 500: OverflowError in the
    limiter) and weights past the largest float (a 500 at once) are refused; what is accepted
    serves requests."""
    name = f"huge-{field}-{status}-{zlib.crc32(repr(value).encode())}"
    key = f"sk-hostile-{name}-0123456789"
    r = client.post("/admin/tenants", headers=admin,
                    content=json.dumps({"name": name, "api_keys": [key], field: value}))
    if status == 400:
        openai_error(r, 400, param=field, code="invalid_tenant")
        return
    assert r.status_code == status, r.text
    for stream in (False, True):
        r = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                        content=completion(stream=stream))
        assert r.status_code == 200, r.text
    assert gw[0].loop_alive()


# ---- duplicate keys ------------------------------------------------------------------------------
def test_duplicate_keys_last_wins(client, auth):
    raw = b'{"model": "nope", "model": "smollm2-135m", "prompt": "hi", "max_tokens": 2}'
    assert client.post("/v1/completions", headers=auth, content=raw).status_code == 200
    raw = b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 2, "max_tokens": "x"}'
    openai_error(client.post("/v1/completions", headers=auth, content=raw), 400, param="max_tokens")


# ---- headers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [
    "Bearer " + "k" * 8_000, "Bearer " + "k" * 60_000, "Bearer", "Basic dXNlcjpwYXNz",
    "bearer", "Bearer a b c", "Token sk-abc", "Bearer " + "é" * 100,
])
def test_bad_authorization(client, value):
    h = {"Authorization": value.encode("utf-8")}
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions")]:
        r = client.request(method, path, headers=h, content=completion())
        openai_error(r, 401, code="invalid_api_key")
    for method, path in [("GET", "/metrics"), ("GET", "/admin/tenants")]:
        openai_error(client.request(method, path, headers=h), 401, code="invalid_api_key")


def test_latin1_authorization(client):
    r = client.get("/v1/models", headers={"Authorization": b"Bearer \xff\xfe\x80"})
    openai_error(r, 401, code="invalid_api_key")


def test_two_authorization_headers(gw, client):
    h = [("Authorization", "Bearer nope"), ("Authorization", f"Bearer {gw[0].dev_key}")]
    openai_error(client.get("/v1/models", headers=h), 401)


def test_tenant_key_on_admin_routes(client, auth):
    openai_error(client.get("/metrics", headers=auth), 403, code="admin_only")
    openai_error(client.get("/admin/tenants", headers=auth), 403, code="admin_only")


def test_many_headers(client, auth):
    h = [(f"X-Junk-{i}", "v" * 50) for i in range(2000)] + list(auth.items())
    assert client.get("/v1/models", headers=h).status_code == 200
    r = client.post("/v1/completions", headers=h, content=completion())
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x",
                                   "application/json; charset=latin-1",
                                   "", "garbage"])
def test_content_type_is_not_trusted(client, auth, ctype):
    """The body is JSON whatever the Content-Type says (as OpenAI's own servers read it)."""
    r = client.post("/v1/completions", headers={**auth, "Content-Type": ctype}, content=completion())
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", headers={**auth, "Content-Type": ctype}, content=b"a=b&c=d")
    openai_error(r, 400, code="invalid_json")


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_admin_wrong_content_type(client, admin, ctype):
    r = client.post("/admin/tenants", headers={**admin, "Content-Type": ctype},
                    content=b'{"name": "ctype-tenant"}')
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        openai_error(r, r.status_code)


@pytest.mark.parametrize("raw", [b"NaN", b'{"name": "x", "rpm": ' + b"9" * 5000 + b"}",
                                 b'{"name": "x\xff"}', b"", b"{", b"[]", b'"x"'])
def test_admin_malformed_bodies(client, admin, raw):
    openai_error(client.post("/admin/tenants", headers=admin, content=raw), 400)


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE", "GET"])
def test_wrong_methods(client, auth, method):
    openai_error(client.request(method, "/v1/completions", headers=auth), 405,
                 code="method_not_allowed")


@pytest.mark.parametrize("path", ["/v1/models/%FF", "/v1/models/%ED%A0%80", "/v1/models/" + "x" * 8000,
                                  "/v1/../v1/models/x", "/v1/models/a%00b"])
def test_odd_model_paths(client, auth, path):
    openai_error(client.get(path, headers=auth), 404)


@pytest.mark.parametrize("path", ["/admin/tenants/%FF", "/admin/tenants/" + "x" * 8000])
def test_odd_admin_paths(client, admin, path):
    openai_error(client.delete(path, headers=admin), 404, code="tenant_not_found")
    openai_error(client.post(path + "/rotate-key", headers=admin), 404, code="tenant_not_found")


# ---- HTTP framing, over a raw socket -------------------------------------------------------------
def _raw(url: str, data: bytes, *, shut_write: bool = False) -> bytes:
    host, port = url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                pytest.fail(f"no answer (or no close) within {TIMEOUT_S} s: {out[:200]!r}")
            if not chunk:
                return out
            out += chunk


def _head(key: str, extra: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
            + b"\r\nConnection: close\r\n" + extra + b"\r\n")


@pytest.mark.parametrize("name, extra, body", [
    ("chunk size not hex", b"Transfer-Encoding: chunked\r\n",
     b"zz\r\n" + completion() + b"\r\n0\r\n\r\n"),
    ("chunk shorter than said", b"Transfer-Encoding: chunked\r\n",
     b"5\r\n" + completion() + b"\r\n0\r\n\r\n"),
    ("chunk size overflows", b"Transfer-Encoding: chunked\r\n",
     b"ffffffffffffffffffff\r\n" + completion() + b"\r\n0\r\n\r\n"),
    ("both CL and TE", b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n", b"0\r\n\r\n"),
    ("CL not a number", b"Content-Length: abc\r\n", completion()),
    ("CL negative", b"Content-Length: -1\r\n", completion()),
    ("CL astronomically large", b"Content-Length: " + b"9" * 30 + b"\r\n", completion()),
    ("NUL in a header", b"X-Junk: a\x00b\r\n", b""),
])
def test_broken_framing_is_400_from_the_server(gw, name, extra, body):
    out = _raw(gw[1], _head(gw[0].dev_key, extra) + body)
    assert out.startswith(b"HTTP/1.1 400 "), (name, out[:300])


def test_declared_length_over_limit_is_413_before_the_body(gw):
    out = _raw(gw[1], _head(gw[0].dev_key, b"Content-Length: 104857600\r\n") + b"{")
    assert out.startswith(b"HTTP/1.1 413 "), out[:300]
    err = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "request_too_large"


def test_valid_chunked_body_is_served(gw):
    body = completion()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:10], body[10:])) + b"0\r\n\r\n"
    out = _raw(gw[1], _head(gw[0].dev_key, b"Transfer-Encoding: chunked\r\n") + chunked)
    assert out.startswith(b"HTTP/1.1 200 "), out[:300]


@pytest.mark.parametrize("extra", [b"Content-Length: 500\r\n", b"Transfer-Encoding: chunked\r\n"])
def test_client_gone_mid_body_does_not_hang(gw, client, auth, extra):
    """A client that stops half-way through its body and closes its side: the server answers or
    closes, it does not wait forever; the gateway keeps serving."""
    partial = completion()[:20] if b"Content-Length" in extra else b"ff\r\n" + completion()[:20]
    out = _raw(gw[1], _head(gw[0].dev_key, extra) + partial, shut_write=True)
    assert not out or not out.startswith(b"HTTP/1.1 5"), out[:300]
    assert client.post("/v1/completions", headers=auth, content=completion()).status_code == 200


def test_garbage_request_line(gw):
    out = _raw(gw[1], b"\x00\xff\xfe garbage\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 "), out[:300]


def test_still_healthy_afterwards(gw, client, auth):
    assert gw[0].loop_alive()
    assert client.get("/ready").status_code == 200
    assert client.post("/v1/completions", headers=auth, content=completion()).status_code == 200
