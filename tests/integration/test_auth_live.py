"""Both front doors under API keys, on a live stack whose services share a cluster token.

The gateway (HTTP) and the frontend's gRPC port check the same key file; roles keep
the operator's calls for admin keys; a user's abort reaches only their own requests;
per-key limits answer 429 / RESOURCE_EXHAUSTED with a retry delay; a rotated key
works without a restart; the scheduler and detokenizer refuse callers without the
cluster token.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from tokenline.v1 import (
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    openai_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

from gateway.config import GatewayConfig
from services.common.errors import retry_after_of
from services.launch import LocalStack
from tests.gateway.gateway_harness import GatewayServer
from tests.live_stack import running_stack
from tests.waiting import wait_until

pytestmark = pytest.mark.live

KEYS = {
    "alice": "alice-secret-1",
    "bob": "bob-secret-1",
    "root": "root-secret-1",
    "carol": "carol-secret-1",  # one token a minute: its second request is over
    "dave": "dave-secret-1",  # one request at a time
    "erin": "erin-secret-1",  # rotated by a test
}
KEY_FILE = """
[[key]]
name = "alice"
secret = "alice-secret-1"
[[key]]
name = "bob"
secret = "bob-secret-1"
[[key]]
name = "root"
secret = "root-secret-1"
role = "admin"
[[key]]
name = "carol"
secret = "carol-secret-1"
tokens_per_minute = 1
[[key]]
name = "dave"
secret = "dave-secret-1"
max_concurrent = 1
[[key]]
name = "erin"
secret = "{erin}"
"""
CLUSTER_TOKEN = "cluster-token-for-tests"
ENDLESS = {"max_tokens": 4000, "ignore_eos": True}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "keys.toml"
    path.write_text(KEY_FILE.format(erin=KEYS["erin"]))
    return path


@pytest.fixture(scope="module")
def stack(
    default_model_dir: Path,
    key_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LocalStack]:
    token_file = key_file.parent / "cluster-token"
    token_file.write_text(CLUSTER_TOKEN + "\n")
    keys = ["--api-key-file", str(key_file)]
    with running_stack(
        default_model_dir,
        tmp_path_factory.mktemp("auth-stack-logs"),
        request,
        cluster_token_file=token_file,
        scheduler_args=["--kv-cache-tokens", "8192", "--num-threads", "1"],
        frontend_args=keys,
        gateway_args=keys,
    ) as live:
        yield live


@pytest.fixture(scope="module")
def root(stack: LocalStack) -> str:
    return stack.base_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def model_id(stack: LocalStack) -> str:
    return Path(stack.model).resolve().name


def _bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def _metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),) if secret else ()


@pytest.fixture(scope="module")
def frontend(stack: LocalStack) -> Iterator[frontend_pb2_grpc.FrontendServiceStub]:
    with grpc.insecure_channel(stack.addr("frontend")) as channel:
        yield frontend_pb2_grpc.FrontendServiceStub(channel)


def _chat(model_id: str) -> openai_pb2.ChatCompletionRequest:
    request = openai_pb2.ChatCompletionRequest(model=model_id, max_completion_tokens=2)
    request.messages.add(role="user", content="Hi")
    return request


def _code(call: object) -> grpc.StatusCode:
    assert isinstance(call, grpc.RpcError)
    return call.code()


# ---- the gRPC door ------------------------------------------------------------------


@pytest.mark.parametrize("header", [None, "Bearer wrong-secret", "Basic alice-secret-1"])
def test_grpc_without_a_valid_key_is_unauthenticated(
    frontend: frontend_pb2_grpc.FrontendServiceStub, model_id: str, header: str | None
) -> None:
    metadata = (("authorization", header),) if header else ()
    with pytest.raises(grpc.RpcError) as info:
        frontend.ChatCompletion(_chat(model_id), metadata=metadata, timeout=30)
    assert _code(info.value) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        frontend.Abort(frontend_pb2.AbortRequest(abort_all=True), metadata=metadata, timeout=30)
    assert _code(info.value) == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_with_a_user_key_is_served_and_health_stays_open(
    stack: LocalStack, frontend: frontend_pb2_grpc.FrontendServiceStub, model_id: str
) -> None:
    reply = frontend.ChatCompletion(_chat(model_id), metadata=_metadata(KEYS["alice"]), timeout=60)
    assert reply.choices[0].finish_reason in {"length", "stop"}
    with grpc.insecure_channel(stack.addr("frontend")) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_user_cannot_speak_for_another_on_a_multiplex_call(
    frontend: frontend_pb2_grpc.FrontendServiceStub, model_id: str
) -> None:
    request = frontend_pb2.MuxRequest(stream_id=1, caller="bob")
    request.chat.CopyFrom(_chat(model_id))
    batches = frontend.Multiplex(iter([request]), metadata=_metadata(KEYS["alice"]), timeout=60)
    frames = [frame for batch in batches for frame in batch.frames]
    assert [f.WhichOneof("kind") for f in frames] == ["end"]
    assert frames[0].end.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert "caller" in frames[0].end.message


# ---- roles ----------------------------------------------------------------------------


def test_operator_calls_need_an_admin_key_on_both_doors(
    frontend: frontend_pb2_grpc.FrontendServiceStub, root: str
) -> None:
    user, admin = _metadata(KEYS["alice"]), _metadata(KEYS["root"])
    for call in (
        lambda md: frontend.Abort(frontend_pb2.AbortRequest(abort_all=True), metadata=md),
        lambda md: frontend.FlushCache(scheduler_pb2.FlushCacheRequest(), metadata=md),
        lambda md: frontend.GetServerInfo(frontend_pb2.GetServerInfoRequest(), metadata=md),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(user)
        assert _code(info.value) == grpc.StatusCode.PERMISSION_DENIED
        call(admin)  # served: no error
    for method, path, body in (
        ("POST", "/abort_request", {"abort_all": True}),
        ("POST", "/flush_cache", None),
        ("GET", "/get_server_info", None),
    ):
        refused = httpx.request(method, root + path, json=body, headers=_bearer("alice"))
        assert refused.status_code == 403, path
        assert refused.json()["error"]["type"] == "permission_error"
        served = httpx.request(method, root + path, json=body, headers=_bearer("root"))
        assert served.status_code == 200, (path, served.text)


def _sse_frames(resp: httpx.Response) -> Iterator[str]:
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def test_a_user_aborts_only_their_own_requests(
    frontend: frontend_pb2_grpc.FrontendServiceStub, root: str, model_id: str
) -> None:
    """Bob's stream goes over the gateway's one Multiplex call, for Bob by name."""
    body = {"model": model_id, "prompt": "Once", "stream": True} | ENDLESS
    headers = _bearer("bob") | {"X-Request-Id": "bobs-request"}
    with httpx.stream("POST", f"{root}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200
        frames = _sse_frames(resp)
        next(frames)
        by_alice = httpx.post(
            f"{root}/abort_request", json={"rid": "bobs-request"}, headers=_bearer("alice")
        )
        assert by_alice.json() == {"num_aborted": 0}
        over_grpc = frontend.Abort(
            frontend_pb2.AbortRequest(rid="bobs-request"), metadata=_metadata(KEYS["alice"])
        )
        assert over_grpc.num_aborted == 0
        by_bob = httpx.post(
            f"{root}/abort_request", json={"rid": "bobs-request"}, headers=_bearer("bob")
        )
        assert by_bob.json() == {"num_aborted": 1}
        rest = list(frames)
    assert rest[-1] == "[DONE]"  # Bob's own abort ended it


def test_usage_metrics_name_the_key_and_never_show_a_secret(
    stack: LocalStack, frontend: frontend_pb2_grpc.FrontendServiceStub, model_id: str
) -> None:
    frontend.ChatCompletion(_chat(model_id), metadata=_metadata(KEYS["alice"]), timeout=60)
    text = httpx.get(stack.ports.metrics_url("frontend"), timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    completion = (("key", "alice"), ("kind", "completion"))
    assert samples[("tokenline_frontend_key_tokens_total", completion)] >= 1
    gateway = httpx.get(stack.ports.metrics_url("gateway"), timeout=10).text
    for secret in (*KEYS.values(), CLUSTER_TOKEN):
        assert secret not in text and secret not in gateway


# ---- per-key limits -------------------------------------------------------------------


def test_tokens_per_minute_answers_429_with_retry_after(
    frontend: frontend_pb2_grpc.FrontendServiceStub, root: str, model_id: str
) -> None:
    body = {"model": model_id, "prompt": "Hi", "max_tokens": 2}
    first = httpx.post(f"{root}/v1/completions", json=body, headers=_bearer("carol"), timeout=60)
    assert first.status_code == 200
    second = httpx.post(f"{root}/v1/completions", json=body, headers=_bearer("carol"), timeout=60)
    assert second.status_code == 429
    assert second.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(second.headers["Retry-After"]) <= 60
    with pytest.raises(grpc.RpcError) as info:
        frontend.ChatCompletion(_chat(model_id), metadata=_metadata(KEYS["carol"]))
    assert _code(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    delay = retry_after_of(info.value)  # type: ignore[arg-type]
    assert delay is not None and 0 < delay <= 60
    # Another key's budget is its own.
    assert httpx.post(f"{root}/v1/completions", json=body, headers=_bearer("alice")).is_success


def test_concurrent_requests_over_the_limit_get_429(root: str, model_id: str) -> None:
    body = {"model": model_id, "prompt": "Once", "stream": True} | ENDLESS
    with httpx.stream("POST", f"{root}/v1/completions", json=body, headers=_bearer("dave")) as r:
        frames = _sse_frames(r)  # held: a dropped reader would close the stream
        next(frames)
        again = httpx.post(f"{root}/v1/completions", json=body, headers=_bearer("dave"))
        assert again.status_code == 429, again.text[:300]
        assert "Retry-After" in again.headers
    # The stream closed: its slot is free again (the frontend releases it as it aborts).
    short = {"model": model_id, "prompt": "Hi", "max_tokens": 2}

    def served() -> bool:
        url = f"{root}/v1/completions"
        return httpx.post(url, json=short, headers=_bearer("dave"), timeout=60).is_success

    wait_until(served, 30, "dave's slot freed")


def test_a_gateway_without_the_cluster_token_forwards_each_callers_own_key(
    stack: LocalStack, key_file: Path, model_id: str
) -> None:
    """No token to vouch for it: each call carries its caller's key, and keyed streams go
    as their own RPCs (one Multiplex call could carry only one key)."""
    config = GatewayConfig(frontend_addr=stack.addr("frontend"), api_key_file=str(key_file))
    server = GatewayServer(config).start()
    try:
        alice = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["alice"], max_retries=0)
        messages: Any = [{"role": "user", "content": "Hi"}]
        stream = alice.chat.completions.create(
            model=model_id, messages=messages, max_tokens=2, stream=True
        )
        assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
        body = {"abort_all": True}
        denied = httpx.post(f"{server.url}/abort_request", json=body, headers=_bearer("alice"))
        assert denied.status_code == 403
        served = httpx.post(f"{server.url}/abort_request", json=body, headers=_bearer("root"))
        assert served.status_code == 200
    finally:
        server.stop()


# ---- rotation -------------------------------------------------------------------------


def test_a_rotated_key_works_without_a_restart(
    stack: LocalStack,
    key_file: Path,
    frontend: frontend_pb2_grpc.FrontendServiceStub,
    root: str,
    model_id: str,
) -> None:
    old, new = KEYS["erin"], "erin-secret-2"
    client = openai.OpenAI(base_url=stack.base_url, api_key=old, max_retries=0)
    assert [m.id for m in client.models.list().data] == [model_id]
    staged = key_file.with_suffix(".new")
    staged.write_text(KEY_FILE.format(erin=new))
    os.replace(staged, key_file)  # atomic, as an operator's tooling would write it
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(grpc.RpcError) as info:
        frontend.ChatCompletion(_chat(model_id), metadata=_metadata(old))
    assert _code(info.value) == grpc.StatusCode.UNAUTHENTICATED
    rotated = openai.OpenAI(base_url=stack.base_url, api_key=new, max_retries=0)
    assert [m.id for m in rotated.models.list().data] == [model_id]
    assert frontend.ChatCompletion(_chat(model_id), metadata=_metadata(new)).choices
    # SIGHUP rereads the file; it neither ends the process nor drops the keys.
    for name in ("frontend", "gateway"):
        stack.procs[name].send_signal(signal.SIGHUP)
    assert rotated.models.list().data
    assert frontend.ChatCompletion(_chat(model_id), metadata=_metadata(new)).choices
    assert all(stack.procs[n].poll() is None for n in ("frontend", "gateway"))


# ---- the internal doors ---------------------------------------------------------------


def test_internal_rpcs_need_the_cluster_token(stack: LocalStack) -> None:
    with grpc.insecure_channel(stack.addr("scheduler")) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            scheduler.AddRequests(scheduler_pb2.AddReqBatch(), timeout=10)
        assert _code(info.value) == grpc.StatusCode.UNAUTHENTICATED
        attach = scheduler.Attach(iter([scheduler_pb2.AttachRequest()]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(attach)
        assert _code(info.value) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            scheduler.Abort(scheduler_pb2.AbortReq(rid="x"), metadata=_metadata("guess"))
        assert _code(info.value) == grpc.StatusCode.UNAUTHENTICATED
        # An API key, even an admin's, is no cluster token.
        with pytest.raises(grpc.RpcError) as info:
            scheduler.FlushCache(
                scheduler_pb2.FlushCacheRequest(), metadata=_metadata(KEYS["root"])
            )
        assert _code(info.value) == grpc.StatusCode.UNAUTHENTICATED
        info_reply = scheduler.GetInfo(
            scheduler_pb2.ServerInfoRequest(), metadata=_metadata(CLUSTER_TOKEN), timeout=10
        )
        assert info_reply.num_total_kv_tokens > 0
    with grpc.insecure_channel(stack.addr("detokenizer")) as channel:
        detokenizer = detokenizer_pb2_grpc.DetokenizerServiceStub(channel)
        subscription = detokenizer.Subscribe(detokenizer_pb2.SubscribeRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(subscription)
        assert _code(info.value) == grpc.StatusCode.UNAUTHENTICATED
