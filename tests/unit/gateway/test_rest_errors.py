"""Every refusal over real HTTP (uvicorn on loopback, fake worker): the OpenAI error shape, the
status, `param`, Retry-After; bodies that are not JSON, not UTF-8, too big or absurd; tenant
isolation; and clients that disconnect (their requests are cancelled and their KV freed)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from gateway.http.server import background_server

from gateway.builders.embedded import build_embedded
from gateway.settings import Settings
from gateway.tenancy.records import Tenant

MODEL = "smollm2-135m"
ADMIN = "sk-admin-test-key"
BODY_LIMIT = 16_384


@pytest.fixture(scope="module")
def server():
    emb = build_embedded(Settings(fake_worker=True, fake_context=4096, fake_step_ms=2,
                                  admin_key=ADMIN, max_body_bytes=BODY_LIMIT))
    for tenant, key in [(Tenant("alpha"), "sk-alpha"),
                        (Tenant("beta", models=("llama-*",)), "sk-beta"),
                        (Tenant("limited", rpm=1), "sk-limited"),
                        (Tenant("refused", rpm=4), "sk-refused"),
                        (Tenant("queued", max_queued=1), "sk-queued")]:
        emb.tenants.put(tenant, [key])
    emb.start()
    with background_server(emb.app) as url:
        yield emb, url
    emb.stop()


@pytest.fixture(scope="module")
def http(server):
    _, url = server
    with httpx.Client(base_url=url, timeout=10, headers={"Authorization": "Bearer sk-alpha"}) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict:
    """The response's OpenAI error object, after checking the status and the shape."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in r.text and 'File "' not in r.text
    return err


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def wait_idle(emb, timeout: float = 5.0) -> None:
    """Until no request is live in the scheduler and no KV is held."""
    deadline = time.monotonic() + timeout
    while emb.step_loop.state.requests or emb.step_loop.worker.worker.resident():
        assert time.monotonic() < deadline, "requests still live"
        time.sleep(0.01)


# ---- auth, models, routes ---------------------------------------------------------------------------
@pytest.mark.parametrize("header", [None, "Bearer sk-nobody", "Basic sk-alpha", "Bearer", "sk-alpha"])
def test_401_without_a_valid_key(server, header):
    _, url = server
    headers = {"Authorization": header} if header is not None else {}
    r = httpx.post(url + "/v1/completions", json=completion(), headers=headers)
    err = error_of(r, 401)
    assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


def test_403_for_a_model_the_tenant_may_not_use(server):
    _, url = server
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sk-beta"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert error_of(r, 403) == {"message": f"this API key may not use model {MODEL!r}",
                                "type": "permission_error", "param": "model",
                                "code": "model_not_allowed"}


def test_404_unknown_model_and_route(http):
    err = error_of(http.post("/v1/completions", json=completion(model="gpt-5")), 404)
    assert (err["param"], err["code"]) == ("model", "model_not_found")
    assert error_of(http.get("/v1/nothing"), 404)["code"] == "unknown_url"
    assert error_of(http.post("/v2/completions", json={}), 404)["code"] == "unknown_url"
    assert error_of(http.delete("/v1/completions"), 405)["code"] == "method_not_allowed"


# ---- bodies and fields --------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    ({"model": MODEL}, "prompt"),
    (completion(max_tokens="5"), "max_tokens"),
    (completion(max_tokens=True), "max_tokens"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens=10**30), "max_tokens"),
    (completion(seed=10**30), "seed"),
    (completion(temperature="hot"), "temperature"),
    (completion(temperature=1e308), "temperature"),
    (completion(top_p=1.5), "top_p"),
    (completion(stop=7), "stop"),
    (completion(stop=["a"] * 17), "stop"),
    (completion(n=9), "n"),                                    # past max_choices (8)
    (completion(n=0), "n"),
    (completion(prompt=["one", "two"]), "prompt"),
    (completion(prompt=[1, -2]), "prompt"),
    (completion(prompt=[1, 99999]), "prompt.1"),
    (completion(prompt=""), "prompt"),
    (completion(speculation={"max_tree_tokens": "many"}), "speculation.max_tree_tokens"),
    (completion(logprobs=6), "logprobs"),                      # the legacy API's bound: 5
    (completion(logprobs=-1), "logprobs"),
    (completion(presence_penalty=2.5), "presence_penalty"),
    (completion(frequency_penalty=-2.01), "frequency_penalty"),
    (completion(frequency_penalty="high"), "frequency_penalty"),
    (completion(logit_bias={"5": 101}), "logit_bias"),
    (completion(logit_bias={"5": "up"}), "logit_bias"),
    (completion(logit_bias={"five": 1}), "logit_bias"),
    (completion(logit_bias={"-5": 1}), "logit_bias"),
    (completion(logit_bias={"1000": 1}), "logit_bias"),        # past the (toy) vocabulary
    (completion(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    (completion(logit_bias=[5, 1]), "logit_bias"),
    (completion(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
])
def test_400_names_the_field(http, body, param):
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools.0.type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "max_completion_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     "top_logprobs"),                                           # without logprobs: true
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": 21}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "presence_penalty": -3}, "presence_penalty"),
])
def test_400_chat_fields(http, body, param):
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param


@pytest.mark.parametrize("raw,code", [
    (b"\xff\xfe\x00garbage", "invalid_body"),
    (b'{"model": "smollm2-135m", "prompt": "caf\xe9"}', "invalid_body"),     # latin-1, not UTF-8
    (b"", "invalid_body"),
    (b"{not json", "invalid_json"),
    (b'{"model": "smollm2-135m", "prompt": "x"', "invalid_json"),
    (b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}', "invalid_json"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),               # > 4300 digits
    (b"[" * 5000 + b"]" * 5000, "invalid_json"),                              # nested too deep
    (b"[1, 2]", "invalid_body"),
    (b'"a string"', "invalid_body"),
])
def test_400_for_bodies_that_are_not_a_json_object(http, raw, code):
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert error_of(r, 400)["code"] == code


def test_413_body_too_large_declared_or_chunked(http):
    big = json.dumps(completion(prompt="x" * BODY_LIMIT)).encode()
    err = error_of(http.post("/v1/completions", content=big,
                             headers={"Content-Type": "application/json"}), 413)
    assert err["code"] == "request_too_large"

    def chunks():                                    # no Content-Length: refused while arriving
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    err = error_of(http.post("/v1/completions", content=chunks(),
                             headers={"Content-Type": "application/json"}), 413)
    assert err["code"] == "request_too_large"


def test_413_prompt_longer_than_the_context(http):
    err = error_of(http.post("/v1/completions", json=completion(prompt="x" * 5000)), 413)
    assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")


# ---- limits and queues -------------------------------------------------------------------------------
def retry_after(r: httpx.Response) -> int:
    value = int(r.headers["retry-after"])
    assert value >= 1
    return value


def test_429_rate_limited_with_retry_after(server):
    _, url = server
    h = {"Authorization": "Bearer sk-limited"}
    assert httpx.post(url + "/v1/completions", json=completion(), headers=h).status_code == 200
    r = httpx.post(url + "/v1/completions", json=completion(), headers=h)
    err = error_of(r, 429)
    assert (err["type"], err["code"]) == ("rate_limit_error", "rpm_exceeded")
    assert 30 <= retry_after(r) <= 60                  # rpm = 1: the next slot is ~a minute away


def test_refusals_count_against_the_tenants_rpm(server):
    """Every request of a tenant counts against its requests per minute as it arrives, refused
    or not: a body that does not parse, a field out of range, a tools payload too large for the
    context, a model it may not see. With rpm = 4, four refusals leave nothing for a fifth,
    valid, request: 429 before its body is even read."""
    _, url = server
    h = {"Authorization": "Bearer sk-refused"}
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 8000}}]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    refusals = [(b"{not json", 400), (json.dumps(completion(temperature=9)).encode(), 400),
                (json.dumps(chat).encode(), 413), (json.dumps(completion(model="gpt-x")).encode(), 404)]
    for body, status in refusals:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        error_of(httpx.post(url + path, content=body, headers=h), status)
    r = httpx.post(url + "/v1/completions", json=completion(), headers=h)
    assert error_of(r, 429)["code"] == "rpm_exceeded" and retry_after(r) >= 1
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers=h)
    assert error_of(r, 429)["code"] == "rpm_exceeded"         # the body was not read


def test_429_tenant_queue_full_with_retry_after(server):
    emb, url = server
    h = {"Authorization": "Bearer sk-queued"}
    with httpx.Client(base_url=url, headers=h, timeout=10) as c:
        with c.stream("POST", "/v1/completions", json=completion(max_tokens=3000, stream=True)) as s:
            lines = s.iter_lines()                     # (kept: dropping it closes the stream)
            next(lines)                                # admitted and running
            r = c.post("/v1/completions", json=completion())
            err = error_of(r, 429)
            assert err["code"] == "tenant_queue_full"
            retry_after(r)
    wait_idle(emb)


def test_503_scheduler_full_and_not_ready():
    emb = build_embedded(Settings(fake_worker=True, fake_step_ms=2, max_live=1))
    emb.start()
    try:
        with background_server(emb.app) as url, httpx.Client(
                base_url=url, timeout=10, headers={"Authorization": f"Bearer {emb.dev_key}"}) as c:
            assert c.get("/ready").json() == {"status": "ready"}
            with c.stream("POST", "/v1/completions", json=completion(max_tokens=3000, stream=True)) as s:
                lines = s.iter_lines()
                next(lines)
                r = c.post("/v1/completions", json=completion())
                err = error_of(r, 503)
                assert (err["type"], err["code"]) == ("server_error", "queue_full")
                retry_after(r)
            wait_idle(emb)
            emb.step_loop.stop()                       # the loop is gone: not ready
            emb.thread = None
            r = c.get("/ready")
            assert error_of(r, 503)["code"] == "not_ready"
            retry_after(r)
            assert c.get("/health").json() == {"status": "ok"}
    finally:
        emb.stop()


def test_an_unexpected_error_is_a_generic_500(server, http, monkeypatch):
    emb, _ = server

    async def broken(inp):
        raise RuntimeError("secret internals at /srv/specgate/model.py")

    monkeypatch.setattr(emb.service, "generate", broken)
    r = http.post("/v1/completions", json=completion())
    err = error_of(r, 500)
    assert err == {"message": "internal server error", "type": "server_error", "param": None,
                   "code": "internal_error"}
    assert "secret" not in r.text


# ---- isolation ------------------------------------------------------------------------------------------
def test_metrics_need_the_admin_key(server):
    _, url = server
    assert error_of(httpx.get(url + "/metrics"), 401)["code"] == "invalid_api_key"
    r = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sk-alpha"})
    assert error_of(r, 403)["code"] == "admin_only"
    assert "specgate_" not in r.text
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and "specgate_requests_total" in r.text


def test_a_tenant_sees_only_its_own_models_and_no_admin_api(server):
    _, url = server
    beta = {"Authorization": "Bearer sk-beta"}
    assert httpx.get(url + "/v1/models", headers=beta).json() == {"object": "list", "data": []}
    assert error_of(httpx.get(url + f"/v1/models/{MODEL}", headers=beta), 404)["param"] == "model"
    error_of(httpx.get(url + "/admin/tenants", headers=beta), 403)   # a tenant key: 403


def test_a_response_names_only_the_caller(server, http):
    _, url = server
    r = http.post("/v1/completions", json=completion())
    assert r.status_code == 200
    for other in ("beta", "limited", "queued", "dev"):
        assert other not in r.text
    r = httpx.post(url + "/v1/completions", json=completion(),
                   headers={"Authorization": "Bearer sk-limited"})
    assert r.status_code == 429 and "alpha" not in r.text


# ---- disconnects ------------------------------------------------------------------------------------------
def test_a_client_that_leaves_mid_stream_cancels_its_request_and_frees_its_kv(server):
    emb, url = server
    worker = emb.step_loop.worker.worker                # the fake worker, under the metrics'
    with httpx.Client(base_url=url, timeout=10, headers={"Authorization": "Bearer sk-alpha"}) as c:
        with c.stream("POST", "/v1/chat/completions",
                      json={"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
                            "max_tokens": 3000, "stream": True}) as s:
            lines = (line for line in s.iter_lines() if line.startswith("data: "))   # not id: lines
            first = json.loads(next(lines).removeprefix("data: "))
            rid = first["id"]
            while rid not in worker.resident():
                time.sleep(0.005)
        # leaving the `with` closes the connection mid-stream
    wait_idle(emb)
    assert emb.step_loop.store.get(rid).stats.status.value == "cancelled"


def test_a_non_streaming_client_that_leaves_cancels_its_request(server):
    emb, url = server
    before = emb.metrics.requests.labels("alpha", "cancelled")._value.get()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=completion(max_tokens=3000), timeout=0.3,
                   headers={"Authorization": "Bearer sk-alpha"})
    wait_idle(emb)                                     # ~4 s of work, gone within a step or two
    assert emb.metrics.requests.labels("alpha", "cancelled")._value.get() == before + 1
