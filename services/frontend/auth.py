"""The frontend's front door: one interceptor checking API keys on FrontendService.

A caller presents ``authorization: Bearer <key>``. A key from the key ring is the
caller itself. The cluster token marks a peer of the deployment (the gateway), which
may name the caller it speaks for: ``x-tokenline-caller`` on a call, or each
``MuxRequest.caller`` on a Multiplex call; with no name it acts as an admin. Anything
else is UNAUTHENTICATED; health and reflection stay open. The operator's calls need an
admin key (PERMISSION_DENIED otherwise); ``abort_all`` is checked where it is served.
"""

from __future__ import annotations

from typing import Any

import grpc
from tokenline.v1 import frontend_pb2

from services.common.auth.api_keys import ApiKey, KeyRing, bearer_token
from services.common.auth.caller import current_caller, set_caller
from services.common.auth.cluster_token import FORWARDED_CALLER, ClusterToken
from services.common.errors import PermissionDeniedError, UnauthenticatedError
from services.common.rpc.handlers import is_open_method, metadata_value, refusal, wrap_behavior

# What a cluster peer is when it names no caller: a service of the deployment.
CLUSTER_PEER = ApiKey(name="cluster", role="admin", secret=b"")
_SERVICE = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"].full_name
ADMIN_METHODS = frozenset(f"/{_SERVICE}/{name}" for name in ("FlushCache", "GetServerInfo"))


class Authenticator:
    """Who a credential is: a key's owner, or whom a cluster peer speaks for."""

    def __init__(self, keys: KeyRing, cluster_token: ClusterToken) -> None:
        self.keys = keys
        self.cluster_token = cluster_token

    @property
    def is_enabled(self) -> bool:
        return self.keys.is_enabled

    def identify(self, authorization: str, forwarded: str) -> ApiKey:
        """The caller, or UnauthenticatedError. Only a cluster peer may forward a name."""
        if self.cluster_token.matches(authorization):
            return self.forwarded(forwarded) if forwarded else CLUSTER_PEER
        key = self.keys.authenticate(bearer_token(authorization))
        if key is None:
            raise UnauthenticatedError("invalid or missing API key")
        return key

    def stream_caller(self, name: str) -> ApiKey:
        """Whom a multiplexed stream naming ``name`` is for; only a cluster peer may name one."""
        if current_caller() is not CLUSTER_PEER:
            raise PermissionDeniedError("only the gateway may name a caller", field="caller")
        return self.forwarded(name)

    def forwarded(self, name: str) -> ApiKey:
        key = self.keys.by_name(name)
        if key is None:
            raise UnauthenticatedError("the forwarded caller holds no current key")
        return key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses unauthenticated calls and runs the rest as their caller."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or is_open_method(details.method) or not self.auth.is_enabled:
            return handler
        try:
            caller = self.auth.identify(
                metadata_value(details, "authorization"),
                metadata_value(details, FORWARDED_CALLER),
            )
        except UnauthenticatedError as exc:
            return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, exc.message)
        if details.method in ADMIN_METHODS and not caller.is_admin:
            name = details.method.rsplit("/", 1)[-1]
            return refusal(handler, grpc.StatusCode.PERMISSION_DENIED, f"{name} needs an admin key")
        return as_caller(handler, caller)


def as_caller(handler: grpc.RpcMethodHandler, key: ApiKey) -> Any:
    """``handler`` running with ``key`` as the current caller (services/common/auth/caller.py)."""

    def unary(behavior: Any) -> Any:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            set_caller(key)
            return await behavior(request, context)

        return run

    def streaming(behavior: Any) -> Any:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            set_caller(key)
            async for item in behavior(request, context):
                yield item

        return run

    return wrap_behavior(handler, unary, streaming)
