"""The fake frontend (tests/gateway/fake_frontend.py) answers every RPC of FrontendService:
a method it inherits from the generated servicer answers UNIMPLEMENTED, which the gateway
renders as a 500, and the gateway's fuzzing over the fake would then fail on the new route
rather than on a real fault (as it did when ResponsesGetStream was added)."""

from __future__ import annotations

from tokenline.v1 import frontend_pb2, frontend_pb2_grpc

from tests.gateway.fake_frontend import FakeFrontendServicer


def test_the_fake_overrides_every_frontend_rpc() -> None:
    service = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"]
    generated = frontend_pb2_grpc.FrontendServiceServicer
    missing = [
        m.name
        for m in service.methods
        if getattr(FakeFrontendServicer, m.name) is getattr(generated, m.name)
    ]
    assert missing == []
