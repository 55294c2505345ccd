"""The gRPC front's bounds, over the real embedded gateway on the fake worker as `specgate serve`
starts its gRPC front (`gateway.cli.serve.start_grpc`): a message is capped at `max_body_bytes`
as a REST body is, and every request counts against its tenant's requests per minute as it
arrives, so refusals are not free."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Iterator

import grpc
import pytest

from gateway.cli.serve import start_grpc
from gateway.errors import ApiError
from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc
from gateway.grpc_api.messages import arrived_input
from gateway.settings import Settings
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import TenantRegistry
from tests.unit.gateway.test_grpc import call

CAP = 64 * 1024


@contextlib.contextmanager
def grpc_gateway(settings: Settings) -> Iterator[tuple[object, pb_grpc.GenerationStub, grpc.Channel]]:
    """The embedded gateway with its gRPC front as the CLI starts it, on a loop thread."""
    from gateway.builders.embedded import build_embedded

    emb = build_embedded(settings, progress=False)
    emb.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-bounds-loop", daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start_grpc(emb), loop).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield emb, pb_grpc.GenerationStub(channel), channel
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
        emb.stop()


@pytest.fixture(scope="module")
def gateway():
    # prefilled whole: the message under the cap is a prompt of some 60 000 tokens
    settings = Settings(fake_worker=True, fake_step_ms=1, fake_context=100_000, grpc_port=0,
                        max_body_bytes=CAP, prefill_chunk_tokens=0)
    with grpc_gateway(settings) as (emb, stub, channel):
        emb.tenants.put(Tenant("metered", rpm=3), ["sk-metered"])
        yield emb, stub, channel


@pytest.mark.parametrize("rpc", ["unary", "stream"])
def test_a_message_over_max_body_bytes_is_refused_and_one_under_it_served(gateway, rpc):
    emb, stub, _ = gateway
    auth = (("authorization", f"Bearer {emb.dev_key}"),)
    model = emb.settings.model_id
    with pytest.raises(grpc.RpcError) as err:
        call(stub, rpc, pb.GenerateRequest(model=model, prompt="x" * (CAP + 1), max_tokens=2), auth)
    assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
    under = pb.GenerateRequest(model=model, prompt="x" * (CAP - 1024), max_tokens=2)
    assert under.ByteSize() < CAP
    final = call(stub, rpc, under, auth)[-1]
    final = final if rpc == "unary" else final.final
    assert final.usage.completion_tokens == 2


def test_grpc_refusals_count_against_the_tenants_rpm(gateway):
    emb, stub, _ = gateway
    auth = (("x-api-key", "sk-metered"),)
    model = emb.settings.model_id
    for req, code in ((pb.GenerateRequest(model=model, prompt="x", temperature=9), "INVALID_ARGUMENT"),
                      (pb.GenerateRequest(model="gpt-x", prompt="x"), "NOT_FOUND"),
                      (pb.GenerateRequest(model=model, prompt="x", max_tokens=200_000), "INVALID_ARGUMENT")):
        with pytest.raises(grpc.RpcError) as err:
            call(stub, "unary", req, auth)
        assert err.value.code().name == code
    with pytest.raises(grpc.RpcError) as err:
        call(stub, "unary", pb.GenerateRequest(model=model, prompt="hi", max_tokens=2), auth)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(err.value.trailing_metadata())
    assert trailers["error-code"] == "rpm_exceeded" and int(trailers["retry-after"]) >= 1


def test_a_message_over_the_cap_is_refused_before_its_key_is_read():
    """The servicer's own cap (what bounds Ray mode, where Serve's proxy takes larger messages):
    413 `request_too_large`, before authentication or any work on the message."""
    class Unreached:
        async def arrive(self, tenant):
            raise AssertionError("arrived")

    big = pb.GenerateRequest(model="m", prompt="x" * 2048)
    with pytest.raises(ApiError) as err:
        asyncio.run(arrived_input(Unreached(), TenantRegistry(), big, (), 1024))
    assert (err.value.status, err.value.code) == (413, "request_too_large")
    with pytest.raises(ApiError) as err:                      # under the cap: the key is read
        asyncio.run(arrived_input(Unreached(), TenantRegistry(), big, (), 4096))
    assert err.value.status == 401


@pytest.mark.parametrize("method,streams", [("Generate", False), ("GenerateStream", True),
                                            ("Resume", True)])
def test_a_message_that_does_not_parse_gets_invalid_argument_in_the_apis_words(gateway, method,
                                                                                 streams):
    """Bytes no request type reads (a truncated field) get INVALID_ARGUMENT naming the method
    and `invalid_message`, not UNKNOWN with the parser's exception text; the front serves on."""
    emb, stub, channel = gateway
    auth = (("authorization", f"Bearer {emb.dev_key}"),)
    rpc = (channel.unary_stream if streams else channel.unary_unary)(
        f"/specgate.v1.Generation/{method}")
    with pytest.raises(grpc.RpcError) as err:
        result = rpc(b"\x0a\xff\xff", metadata=auth, timeout=30)    # field 1, length past the end
        if streams:
            list(result)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert method in err.value.details() and "Error" not in err.value.details()
    assert dict(err.value.trailing_metadata())["error-code"] == "invalid_message"
    ok = call(stub, "unary", pb.GenerateRequest(model=emb.settings.model_id, prompt="hi",
                                                max_tokens=2), auth)[-1]
    assert ok.usage.completion_tokens == 2
