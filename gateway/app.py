"""The FastAPI app factory: routes, error handlers, middleware and the channel's life."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from fastapi import FastAPI

from gateway.client import FrontendClient, create_channel
from gateway.config import GatewayConfig
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from gateway.openapi import install_openapi
from gateway.routes import embeddings, messages, native, openai, ops, responses_api, sessions
from services.common.auth.api_keys import KeyRing, create_key_ring

ChannelFactory = Callable[[GatewayConfig], grpc.aio.Channel]


def create_app(
    config: GatewayConfig,
    channel_factory: ChannelFactory | None = None,
    keys: KeyRing | None = None,
) -> FastAPI:
    """A gateway app; its one gRPC channel opens at startup and closes at shutdown.

    `channel_factory` lets a caller supply the channel (tests); the default is a
    channel to `config.frontend_addr`, TLS when `config.tls` turns it on. `keys`
    defaults to the ones `config` names.
    """
    make_channel = channel_factory or create_channel
    metrics = GatewayMetrics()
    if keys is None:
        keys = create_key_ring(config.api_key, config.api_key_file)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, Any]]:
        # grpc.aio channels bind to the running loop, so create it here, not at import.
        channel = make_channel(config)
        frontend = FrontendClient(
            channel,
            config.request_timeout_s,
            multiplex=config.multiplex,
            forwards_caller=config.cluster_token.is_enabled,
        )
        try:
            # Lifespan state: handlers read these as request.state.frontend / .metrics.
            yield {"frontend": frontend, "metrics": metrics, "config": config}
        finally:
            if frontend.mux is not None:
                await frontend.mux.close()
            await channel.close()

    app = FastAPI(
        title="tokenline gateway",
        summary="OpenAI-compatible REST/SSE in front of the tokenline gRPC frontend",
        lifespan=lifespan,
    )
    app.include_router(openai.router)
    app.include_router(messages.router)
    app.include_router(responses_api.router)
    app.include_router(embeddings.router)
    app.include_router(native.router)
    app.include_router(ops.router)
    app.include_router(sessions.router)
    install_error_handlers(app)
    install_openapi(app)
    # add_middleware wraps: the last added runs first (request context is outermost).
    if config.max_body_bytes:
        app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if keys.is_enabled:
        app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app
