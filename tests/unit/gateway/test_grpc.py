"""The gRPC front through its generated stubs on a loopback port: unary and streaming generation,
health, reflection, auth from metadata, REST's validation and statuses mapped to gRPC codes, and
cancellation; first over `FakeService` (a test double of the *service*, scripted to raise each
error), then over the real embedded gateway on the fake worker (`specgate serve --fake-worker`).

The server runs on an asyncio loop in a background thread (in the gateway it shares uvicorn's);
the tests are ordinary blocking gRPC clients.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import grpc
import redis
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.errors import ApiError
from gateway.grpc_api.server import SERVICE_NAME, start_grpc_server
from gateway.grpc_api.status import INTERNAL_MESSAGE
from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc
from gateway.service import GenerateInput, GenerateOutput, SpecStats, StreamChunk
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import TenantRegistry

KEY = "sk-test-alpha"
AUTH = (("authorization", f"Bearer {KEY}"),)
MODEL = "fake-model"


@contextlib.contextmanager
def serving(service: Any, tenants: Any, replayer: Any = None) -> Iterator[grpc.Channel]:
    """The gRPC server over `service` on a loop thread, and a channel to it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-test-loop", daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(
        start_grpc_server(service, tenants, None, port=0, replayer=replayer), loop).result(10)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield channel
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def call(stub: pb_grpc.GenerationStub, rpc: str, req: pb.GenerateRequest, metadata=AUTH) -> list:
    """Run `Generate` ("unary") or `GenerateStream` ("stream") to the end; the messages received."""
    if rpc == "unary":
        return [stub.Generate(req, metadata=metadata, timeout=10)]
    return list(stub.GenerateStream(req, metadata=metadata, timeout=10))


# ---- over a scripted service ------------------------------------------------------------------------
def output(finish_reason: str = "length") -> GenerateOutput:
    return GenerateOutput(request_id="cmpl-1", text="hello world", token_ids=(5, 6),
                          finish_reason=finish_reason, prompt_tokens=3, completion_tokens=2,
                          speculation=SpecStats(drafted=4, accepted=1, steps=1, tau=2.0))


class FakeService:
    """GenerationService's interface, scripted: `error` is raised at admission (as the real
    `stream()` does, before returning) or, with `error_after_first`, after the first chunk;
    `hang` makes a stream wait after its first chunk. It records each input and how its stream
    was closed (read from the test thread)."""
    models = [MODEL]

    def __init__(self):
        self.is_ready = True
        self.error: BaseException | None = None
        self.error_after_first = False
        self.hang = False
        self.finish_reason = "length"
        self.inputs: list[GenerateInput] = []
        self.arrivals: list[Tenant] = []
        self.stream_closed = threading.Event()
        self.close_reason: str | None = None

    def ready(self) -> bool:
        return self.is_ready

    async def arrive(self, tenant: Tenant) -> None:
        self.arrivals.append(tenant)

    async def generate(self, inp: GenerateInput) -> GenerateOutput:
        self.inputs.append(inp)
        if self.error is not None:
            raise self.error
        return output()

    async def open_stream(self, inp: GenerateInput) -> "FakeStream":
        self.inputs.append(inp)
        if self.error is not None and not self.error_after_first:
            raise self.error
        return FakeStream(self, [StreamChunk("hello", (5,)), StreamChunk(" world", (6,)),
                                 output(self.finish_reason)])


class FakeStream:
    """Like the service's RequestStream: a cancelled wait for the next event cancels nothing;
    only `aclose()` before the end cancels the request."""
    request_id = "cmpl-1"

    def __init__(self, service: FakeService, items: list):
        self.service, self.items, self.sent = service, items, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.sent == 1:
            if self.service.error is not None:
                raise self.service.error
            if self.service.hang:
                await asyncio.Event().wait()    # cancelled here: nothing is cleaned up by that
        if self.sent == len(self.items):
            raise StopAsyncIteration
        self.sent += 1
        return self.items[self.sent - 1]

    async def aclose(self):
        if self.service.close_reason is None:
            self.service.close_reason = "finished" if self.sent == len(self.items) else "cancelled"
        self.service.stream_closed.set()


@dataclass
class Env:
    service: FakeService
    stub: pb_grpc.GenerationStub
    channel: grpc.Channel
    tenant: Tenant


@pytest.fixture
def env() -> Iterator[Env]:
    tenants = TenantRegistry()                      # in memory: the real registry
    tenant = Tenant("alpha")
    tenants.put(tenant, [KEY])
    service = FakeService()
    with serving(service, tenants) as channel:
        yield Env(service, pb_grpc.GenerationStub(channel), channel, tenant)


def test_generate_unary_maps_request_and_response(env):
    req = pb.GenerateRequest(model=MODEL, prompt="Say hi", max_tokens=2, temperature=0.5, top_k=4,
                             seed=7, stop=["\n", "END"], speculation=False, max_tree_tokens=3, user="u-1")
    (resp,) = call(env.stub, "unary", req)

    assert (resp.id, resp.text, list(resp.token_ids), resp.finish_reason) == \
        ("cmpl-1", "hello world", [5, 6], "length")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (3, 2, 5)
    assert (resp.speculation.drafted, resp.speculation.accepted, resp.speculation.steps,
            resp.speculation.tau) == (4, 1, 1, 2.0)
    assert env.service.inputs == [GenerateInput(
        tenant=env.tenant, model=MODEL, prompt="Say hi", max_tokens=2, temperature=0.5, top_k=4,
        seed=7, stop=("\n", "END"), speculation=False, max_tree_tokens=3, user="u-1",
        service_tier="default")]                 # no tier asked: the tenant's default
    assert resp.service_tier == "default"


def test_unset_fields_take_rests_defaults(env):
    call(env.stub, "unary", pb.GenerateRequest(model=MODEL, prompt="p"))
    assert env.service.inputs == [GenerateInput(tenant=env.tenant, model=MODEL, prompt="p",
                                                service_tier="default")]


def test_chat_messages_and_token_ids(env):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="developer", content="Be brief."),
                                     pb.ChatMessage(role="user", content="Hi")])
    call(env.stub, "unary", pb.GenerateRequest(model=MODEL, messages=chat), metadata=(("x-api-key", KEY),))
    call(env.stub, "stream", pb.GenerateRequest(model=MODEL, prompt_ids=pb.TokenIds(ids=[7, 8, 9])))

    chat_inp, ids_inp = env.service.inputs
    # "developer" is OpenAI's newer "system", as in REST.
    assert chat_inp == GenerateInput(tenant=env.tenant, model=MODEL, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        service_tier="default")
    assert ids_inp == GenerateInput(tenant=env.tenant, model=MODEL, prompt_ids=(7, 8, 9),
                                    service_tier="default")


@pytest.mark.parametrize("req,param", [
    (pb.GenerateRequest(model=MODEL), "prompt"),
    (pb.GenerateRequest(model=MODEL, prompt="p", stop=["x"] * 17), "stop"),
    (pb.GenerateRequest(model=MODEL, prompt="p", user="u" * 257), "user"),
    (pb.GenerateRequest(model=MODEL, messages=pb.ChatMessages()), "messages"),
    (pb.GenerateRequest(model=MODEL, messages=pb.ChatMessages(messages=[pb.ChatMessage(role="robot")])),
     "messages.0.role"),
])
def test_rest_validation_applies(env, req, param):
    for rpc in ("unary", "stream"):
        with pytest.raises(grpc.RpcError) as err:
            call(env.stub, rpc, req)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert dict(err.value.trailing_metadata())["error-param"] == param
    assert env.service.inputs == []


def test_tool_messages_are_refused_by_name(env):
    """The proto has no tools nor tool_call_id: a tool message is refused as unsupported, not
    as a malformed message."""
    req = pb.GenerateRequest(model=MODEL, messages=pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="Hi"), pb.ChatMessage(role="tool", content="3C")]))
    for rpc in ("unary", "stream"):
        with pytest.raises(grpc.RpcError) as err:
            call(env.stub, rpc, req)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not available over gRPC" in err.value.details()
        meta = dict(err.value.trailing_metadata())
        assert (meta["error-param"], meta.get("error-code")) == ("messages", "unsupported_parameter")
    assert env.service.inputs == []


def test_generate_stream_deltas_then_final(env):
    stream = env.stub.GenerateStream(pb.GenerateRequest(model=MODEL, prompt="Say hi"), metadata=AUTH,
                                     timeout=10)
    events = list(stream)

    assert dict(stream.initial_metadata())["request-id"] == "cmpl-1"
    assert [e.WhichOneof("event") for e in events] == ["delta", "delta", "final"]
    assert [(e.delta.text, list(e.delta.token_ids)) for e in events[:2]] == [("hello", [5]), (" world", [6])]
    assert (events[-1].final.text, events[-1].final.usage.total_tokens) == ("hello world", 5)
    assert env.service.close_reason == "finished"


def test_cancelling_a_stream_closes_the_service_stream(env):
    env.service.hang = True
    stream = env.stub.GenerateStream(pb.GenerateRequest(model=MODEL, prompt="p"), metadata=AUTH, timeout=10)
    assert next(stream).delta.text == "hello"
    stream.cancel()

    assert env.service.stream_closed.wait(5)
    assert env.service.close_reason == "cancelled"


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer sk-wrong"),), (("x-api-key", "nope"),),
                                      (("authorization", KEY),)])   # without "Bearer": no key
@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_missing_or_invalid_key_is_unauthenticated(env, metadata, rpc):
    with pytest.raises(grpc.RpcError) as err:
        call(env.stub, rpc, pb.GenerateRequest(model=MODEL, prompt="p"), metadata=metadata)
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert env.service.inputs == []


STATUS_CODES = [
    (400, grpc.StatusCode.INVALID_ARGUMENT),
    (401, grpc.StatusCode.UNAUTHENTICATED),
    (403, grpc.StatusCode.PERMISSION_DENIED),
    (404, grpc.StatusCode.NOT_FOUND),
    (413, grpc.StatusCode.INVALID_ARGUMENT),
    (422, grpc.StatusCode.INVALID_ARGUMENT),
    (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (500, grpc.StatusCode.INTERNAL),
    (503, grpc.StatusCode.UNAVAILABLE),
    (418, grpc.StatusCode.INTERNAL),     # no gRPC counterpart
]


@pytest.mark.parametrize("status,code", STATUS_CODES)
@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_api_errors_map_to_status_codes(env, status, code, rpc):
    env.service.error = ApiError(status, f"problem {status}", param="model", code="some_code")
    with pytest.raises(grpc.RpcError) as err:
        call(env.stub, rpc, pb.GenerateRequest(model=MODEL, prompt="p"))
    assert (err.value.code(), err.value.details()) == (code, f"problem {status}")
    trailers = dict(err.value.trailing_metadata())
    assert (trailers["error-type"], trailers["error-param"], trailers["error-code"]) == \
        (env.service.error.type, "model", "some_code")
    assert "retry-after" not in trailers


@pytest.mark.parametrize("status,code", [(429, grpc.StatusCode.RESOURCE_EXHAUSTED),
                                         (503, grpc.StatusCode.UNAVAILABLE)])
@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_retry_after_travels_in_trailing_metadata(env, status, code, rpc):
    env.service.error = ApiError(status, "slow down", retry_after_s=2.2)
    with pytest.raises(grpc.RpcError) as err:
        call(env.stub, rpc, pb.GenerateRequest(model=MODEL, prompt="p"))
    assert err.value.code() is code
    assert dict(err.value.trailing_metadata())["retry-after"] == "3"   # whole seconds, up, as REST


@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_a_state_store_outage_is_unavailable_with_retry_after_as_in_rest(env, rpc):
    env.service.error = redis.ConnectionError("Error 111 connecting to 10.0.0.7:6379")
    with pytest.raises(grpc.RpcError) as err:
        call(env.stub, rpc, pb.GenerateRequest(model=MODEL, prompt="p"))
    trailers = dict(err.value.trailing_metadata())
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert (trailers["error-code"], trailers["retry-after"]) == ("store_unavailable", "1")
    assert "10.0.0.7" not in err.value.details()


@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_unexpected_exception_is_internal_with_a_generic_message(env, rpc):
    env.service.error = RuntimeError("secret at /srv/specgate/x.py line 3")
    with pytest.raises(grpc.RpcError) as err:
        call(env.stub, rpc, pb.GenerateRequest(model=MODEL, prompt="p"))
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    everything = err.value.debug_error_string() + repr(err.value.trailing_metadata())
    assert not any(s in everything for s in ("Traceback", "secret", "RuntimeError", ".py"))


def test_an_error_mid_stream_ends_the_stream_with_its_status(env):
    env.service.error, env.service.error_after_first = RuntimeError("boom"), True
    stream = env.stub.GenerateStream(pb.GenerateRequest(model=MODEL, prompt="p"), metadata=AUTH, timeout=10)
    assert next(stream).delta.text == "hello"
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def test_a_failed_generation_sends_its_final_then_internal(env):
    env.service.finish_reason = "error"
    stream = env.stub.GenerateStream(pb.GenerateRequest(model=MODEL, prompt="p"), metadata=AUTH, timeout=10)
    received = []
    with pytest.raises(grpc.RpcError) as err:
        for event in stream:
            received.append(event)
    assert received[-1].final.finish_reason == "error"
    assert err.value.code() is grpc.StatusCode.INTERNAL
    assert dict(err.value.trailing_metadata())["error-code"] == "generation_failed"


def test_health_follows_service_ready(env):
    health = health_pb2_grpc.HealthStub(env.channel)
    for name in ("", SERVICE_NAME):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    env.service.is_ready = False
    resp = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_reflection_lists_and_describes_the_service(env):
    stub = reflection_pb2_grpc.ServerReflectionStub(env.channel)
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)]
    listed, described = stub.ServerReflectionInfo(iter(requests), timeout=10)

    names = {s.name for s in listed.list_services_response.service}
    assert {"specgate.v1.Generation", "grpc.health.v1.Health"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    methods = {m.name for f in files for s in f.service for m in s.method}
    assert methods == {"Generate", "GenerateStream", "Resume"}


def test_committed_generated_code_matches_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    from gateway.grpc_api.proto.generate import generate

    assert generate(tmp_path, f"--descriptor_set_out={tmp_path / 'specgate.pb'}") == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "specgate.pb").read_bytes()).file[0]
    for message in fresh.message_type:          # protoc adds JSON names to descriptor sets only
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "specgate.proto changed: run `python -m gateway.grpc_api.proto.generate`"


# ---- over the real embedded gateway, on the fake worker -----------------------------------------------
@pytest.fixture
def gateway_env():
    """What `specgate serve --fake-worker` builds (service, step loop, tenants, limiter), served
    over gRPC; the dev tenant's key, and a tenant limited to one request a minute."""
    from gateway.builders.embedded import build_embedded
    from gateway.settings import Settings

    emb = build_embedded(Settings(fake_worker=True, fake_step_ms=2, fake_context=100_000, policy="fcfs"),
                         progress=False)
    emb.tenants.put(Tenant("slow", rpm=1), ["sk-slow"])
    emb.start()
    try:
        with serving(emb.service, emb.tenants, emb.replayer) as channel:
            yield emb, pb_grpc.GenerationStub(channel)
    finally:
        emb.stop()


def test_real_service_generate_stream_cancel_and_limits(gateway_env):
    emb, stub = gateway_env
    auth = (("authorization", f"Bearer {emb.dev_key}"),)
    model = emb.settings.model_id

    (unary,) = call(stub, "unary", pb.GenerateRequest(model=model, prompt="Hello", max_tokens=12), auth)
    assert (unary.finish_reason, unary.usage.completion_tokens, len(unary.token_ids)) == ("length", 12, 12)
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + 12 and unary.speculation.steps >= 1

    events = call(stub, "stream", pb.GenerateRequest(model=model, prompt="Hello", max_tokens=20), auth)
    final = events[-1].final
    assert "".join(e.delta.text for e in events[:-1]) == final.text
    assert [t for e in events[:-1] for t in e.delta.token_ids] == list(final.token_ids)
    assert final.usage.completion_tokens == 20

    # A stream the client cancels is cancelled in the scheduler too.
    stream = stub.GenerateStream(pb.GenerateRequest(model=model, prompt="Hello", max_tokens=90_000),
                                 metadata=auth, timeout=30)
    next(stream)
    rid = dict(stream.initial_metadata())["request-id"]
    stream.cancel()
    deadline = time.monotonic() + 5
    while rid in emb.step_loop.state.requests:
        assert time.monotonic() < deadline, "the cancelled request is still live"
        time.sleep(0.01)
    assert emb.step_loop.store.get(rid).stats.status.value == "cancelled"

    # The service's own checks and the tenant's limits, as gRPC codes.
    with pytest.raises(grpc.RpcError) as err:
        call(stub, "unary", pb.GenerateRequest(model="no-such-model", prompt="x"), auth)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    slow = (("x-api-key", "sk-slow"),)
    call(stub, "unary", pb.GenerateRequest(model=model, prompt="x", max_tokens=2), slow)
    with pytest.raises(grpc.RpcError) as err:
        call(stub, "stream", pb.GenerateRequest(model=model, prompt="x", max_tokens=2), slow)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(err.value.trailing_metadata())["retry-after"]) >= 1


def test_real_service_resume_after_any_delta_follows_a_running_one_and_is_tenant_scoped(gateway_env):
    emb, stub = gateway_env
    auth = (("authorization", f"Bearer {emb.dev_key}"),)
    model = emb.settings.model_id
    emb.tenants.put(Tenant("other"), ["sk-other"])

    def resumed(rid: str, after: int, metadata=auth) -> list:
        return list(stub.Resume(pb.ResumeRequest(request_id=rid, after=after), metadata=metadata,
                                timeout=20))

    stream = stub.GenerateStream(pb.GenerateRequest(model=model, prompt="Hello", max_tokens=30),
                                 metadata=auth, timeout=10)
    events = list(stream)
    rid = dict(stream.initial_metadata())["request-id"]
    deltas, final = events[:-1], events[-1].final
    received = 0
    for k in range(len(deltas) + 1):              # after each delta (and none): the rest, the same
        received += len(deltas[k - 1].delta.token_ids) if k else 0
        got = resumed(rid, received)
        assert got[-1].final == final
        assert "".join(e.delta.text for e in got[:-1]) == "".join(e.delta.text for e in deltas[k:])
        assert [t for e in got[:-1] for t in e.delta.token_ids] == \
            [t for e in deltas[k:] for t in e.delta.token_ids]

    # a running request is followed to its end; resuming it cancels nothing
    live = stub.GenerateStream(pb.GenerateRequest(model=model, prompt="Hello", max_tokens=300),
                               metadata=auth, timeout=20)
    first = [next(live), next(live)]
    running = dict(live.initial_metadata())["request-id"]
    follower = stub.Resume(pb.ResumeRequest(request_id=running, after=sum(
        len(e.delta.token_ids) for e in first)), metadata=auth, timeout=20)
    rest = list(live)
    followed = list(follower)
    assert followed[-1].final == rest[-1].final and rest[-1].final.finish_reason == "length"
    assert "".join(e.delta.text for e in followed[:-1]) == "".join(e.delta.text for e in rest[:-1])

    # another tenant's request is NOT_FOUND, as an unknown one; no key is UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as theirs:
        resumed(rid, 0, (("x-api-key", "sk-other"),))
    with pytest.raises(grpc.RpcError) as unknown:
        resumed(rid + "x", 0)
    assert theirs.value.code() is unknown.value.code() is grpc.StatusCode.NOT_FOUND
    assert theirs.value.details() == unknown.value.details().replace(rid + "x", rid)
    with pytest.raises(grpc.RpcError) as err:
        resumed(rid, 0, ())
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
