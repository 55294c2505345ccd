"""Schema-driven fuzzing (schemathesis) of every operation in the gateway's own OpenAPI document:
never a 5xx, never a hang, and every 4xx an OpenAI error body
`{"error": {"message", "type", "param", "code"}}`.

Cases are generated from `app.openapi()` (steered only so that a body's `model` is often the
served one, see `_steered`) in both schemathesis modes: positive (bodies and
parameters the schema allows, so they reach the service) and negative (bodies that break the
schema: wrong types, missing fields, out-of-range values). Every call carries a valid key: the
dev tenant's on /v1/*, the admin key on /admin/* and /metrics, so a case gets past
authentication and reaches validation (bad keys are covered in test_hostile_inputs.py).

They go to a real loopback server (uvicorn on a thread, `background_server`) over the fake
worker, not to the ASGI app in process: the bytes cross uvicorn's real HTTP parser and the
BodyLimit middleware as a client sends them, and a hang shows as a client timeout (`TIMEOUT_S`)
instead of blocking the test process.

Size: `SPECGATE_FUZZ_CASES` cases in all (default 150, ~10-20 s: part of the default suite),
spread over the operations. The big run (>= 2,000 cases, a few minutes) is outside the default
suite and run by hand or in CI as

    SPECGATE_FUZZ_CASES=2000 python -m pytest tests/fuzz/test_openapi_fuzz.py -q

`test_case_count` (last in this module) then checks that at least that many cases were sent.
"""
from __future__ import annotations

import copy
import math
import os

import pytest
import requests
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")    # a dev extra
from schemathesis import GenerationMode  # noqa: E402

from gateway.http.server import background_server  # noqa: E402

from gateway.builders.embedded import build_embedded  # noqa: E402
from gateway.settings import Settings  # noqa: E402

CASES = int(os.environ.get("SPECGATE_FUZZ_CASES", "150"))
TIMEOUT_S = 15.0
SETTINGS = dict(fake_worker=True, fake_context=64)

MODEL = "smollm2-135m"


def _steered(doc: dict) -> dict:
    """The app's document, with one change: a generation body's `model` may also be the served
    model (`anyOf` the const and the original string schema), so positive cases get past the
    model check into the service instead of nearly all ending at 404 model_not_found."""
    doc = copy.deepcopy(doc)
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"]["model"] = {"anyOf": [{"const": MODEL}, body["properties"]["model"]]}
    return doc


# The schema is the app's own document (static: no server needed to build it).
_DOC = build_embedded(Settings(**SETTINGS), progress=False).app.openapi()
schema = schemathesis.openapi.from_dict(_steered(_DOC))
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                deterministic=True)
OPERATIONS = sum(len(ops) for ops in _DOC["paths"].values())
# Operations with no inputs (GET /health …) run out of distinct cases early; size the others so
# the total still reaches CASES.
_WITH_INPUTS = sum(1 for ops in _DOC["paths"].values() for op in ops.values()
                   if op.get("parameters") or op.get("requestBody"))
PER_OPERATION = max(1, math.ceil(CASES / max(1, _WITH_INPUTS)))

sent: dict[tuple[str, str], int] = {}      # (operation, schemathesis phase) -> cases sent
statuses: dict[int, int] = {}               # status -> responses


@pytest.fixture(scope="module")
def gateway():
    emb = build_embedded(Settings(**SETTINGS), progress=False)
    dev = emb.tenants.authenticate(emb.dev_key)
    emb.start()
    with background_server(emb.app) as url, requests.Session() as session:
        yield emb, dev, url, session
    emb.stop()


def _restore_dev(emb, dev) -> None:
    """An admin case may delete the dev tenant or rotate its key: put it back as it was."""
    if emb.tenants.authenticate(emb.dev_key) is None:
        emb.tenants.put(dev, [emb.dev_key])


def content_type(r) -> str:
    """The response's content type (schemathesis' Response keeps header values as lists)."""
    for k, v in r.headers.items():
        if k.lower() == "content-type":
            return v[0] if isinstance(v, list) else v
    return ""


def check_response(r) -> None:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        assert content_type(r).startswith("application/json"), r.headers
        body = r.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str) and err["type"]
        assert err["param"] is None or isinstance(err["param"], str)
        assert err["code"] is None or isinstance(err["code"], str)
        return
    ctype = content_type(r)
    if ctype.startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", r.text[-300:]
        assert not any('"error"' in e for e in events), r.text[-300:]
    elif ctype.startswith("application/json"):
        r.json()
    else:
        assert ctype.startswith("text/plain"), ctype           # /metrics: Prometheus text


@schema.parametrize()
@settings(max_examples=PER_OPERATION, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_openapi_operation(case, gateway):
    emb, dev, url, session = gateway
    admin = case.path.startswith("/admin") or case.path == "/metrics"
    key = emb.admin_key if admin else emb.dev_key
    headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
    case.headers = headers
    try:
        r = case.call(base_url=url, session=session, timeout=TIMEOUT_S,
                      headers={"Authorization": f"Bearer {key}"})
    except requests.Timeout:                  # pragma: no cover - the failure being looked for
        pytest.fail(f"no answer within {TIMEOUT_S} s: {case.method} {case.path} "
                    f"{case.body!r:.300}")
    meta = getattr(case, "_meta", None)
    phase = str(getattr(getattr(meta, "phase", None), "name", "fuzzing"))
    label = (case.operation.label, phase)
    sent[label] = sent.get(label, 0) + 1
    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    try:
        check_response(r)
    finally:
        if admin:
            _restore_dev(emb, dev)


def test_case_count():
    """Every operation was fuzzed, and (when all ran) at least SPECGATE_FUZZ_CASES generated
    (fuzzing-phase) cases in all; schemathesis' coverage phase (boundary values, unexpected
    methods) comes on top."""
    if len({op for op, _ in sent}) < OPERATIONS:
        pytest.skip("only part of the module ran")
    by_phase: dict[str, int] = {}
    for (_, phase), n in sent.items():
        by_phase[phase] = by_phase.get(phase, 0) + n
    print(f"\nopenapi fuzz: {sum(by_phase.values())} cases {by_phase}; fuzzing phase per operation: "
          f"{ {op: n for (op, ph), n in sorted(sent.items()) if ph == 'fuzzing'} }; "
          f"statuses {dict(sorted(statuses.items()))}")
    assert by_phase.get("fuzzing", 0) >= CASES, sent
