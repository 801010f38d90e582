"""API-key authentication, the standard health service and server reflection."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inference_engine.generated import runtime_pb2 as pb
from inference_engine.generated import runtime_pb2_grpc


def test_calls_need_the_bearer_api_key(serve):
    server = serve("qwen3", api_key="s3cret")
    with pytest.raises(grpc.RpcError) as missing:
        server.stub.CreateSession(pb.CreateSessionRequest())
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as wrong:
        server.stub.CreateSession(pb.CreateSessionRequest(), metadata=[("authorization", "Bearer nope")])
    assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as streaming:
        list(server.stub.Generate(pb.GenerateRequest(session_id="x", max_tokens=1)))
    assert streaming.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as bidi:
        list(server.stub.Converse(iter([pb.ConverseRequest()])))
    assert bidi.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = [("authorization", "Bearer s3cret")]
    sid = server.stub.CreateSession(pb.CreateSessionRequest(initial_token_ids=[1, 2]), metadata=good).session_id
    replies = list(server.stub.Generate(pb.GenerateRequest(session_id=sid, max_tokens=3), metadata=good))
    assert replies[-1].done.generated_token_count == 3


def test_health_reports_serving_without_credentials(serve):
    server = serve("qwen3", api_key="s3cret")
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "kakeya.v1.RuntimeService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_runtime_service(serve):
    server = serve("qwen3")
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="kakeya.v1.RuntimeService"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests)))
    names = {s.name for s in listed.list_services_response.service}
    assert {"kakeya.v1.RuntimeService", "grpc.health.v1.Health"} <= names
    assert described.file_descriptor_response.file_descriptor_proto


def test_request_ids_are_echoed_in_trailing_metadata(serve):
    server = serve("qwen3")
    stub = runtime_pb2_grpc.RuntimeServiceStub(server.channel)
    _, call = stub.CreateSession.with_call(pb.CreateSessionRequest(), metadata=[("x-request-id", "req-42")])
    assert ("x-request-id", "req-42") in tuple(call.trailing_metadata())


def test_health_answers_without_the_key_while_reflection_still_needs_it(serve):
    server = serve("qwen3", api_key="s3cret")
    health = health_pb2_grpc.HealthStub(server.channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    reflection_stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with pytest.raises(grpc.RpcError) as denied:
        list(reflection_stub.ServerReflectionInfo(iter([request])))
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    good = [("authorization", "Bearer s3cret")]
    (listed,) = list(reflection_stub.ServerReflectionInfo(iter([request]), metadata=good))
    assert "kakeya.v1.RuntimeService" in {s.name for s in listed.list_services_response.service}
