"""`python -m services.frontend --model DIR --scheduler-addrs A,B --detokenizer-addr D`"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenline.v1 import detokenizer_pb2, frontend_pb2, frontend_pb2_grpc
from transformers import PreTrainedTokenizerBase

from services.common.auth.api_keys import add_api_key_flags, create_key_ring
from services.common.auth.cluster_token import ClusterToken
from services.common.deadlines import ENGINE_ANSWER_RPC_TIMEOUT_S
from services.common.envs import env_default
from services.common.rpc.drain import work_methods
from services.common.rpc.server import GrpcProcess
from services.common.service_flags import parse_service_args, run_service, service_parser
from services.common.tls import TlsSettings
from services.common.tokenizer import load_tokenizer
from services.frontend.auth import ApiKeyInterceptor, Authenticator
from services.frontend.chat.template import ChatTokenization, create_chat_template
from services.frontend.dispatch.batch_tokenizer import DynamicBatchTokenizer
from services.frontend.dispatch.tokenizer_manager import TokenizerManager
from services.frontend.metrics import FrontendMetrics
from services.frontend.multiplex import StreamBudget
from services.frontend.parsers.reasoning import REASONING_PARSERS
from services.frontend.parsers.tool_calls import TOOL_PARSERS
from services.frontend.request_log import log_finished
from services.frontend.server import FrontendServicer
from services.frontend.serving.base import ServingContext
from services.frontend.serving.chat import ChatServing
from services.frontend.serving.completion import CompletionServing
from services.frontend.serving.embeddings import POOLING_METHODS, EmbeddingServing, PoolingMethod
from services.frontend.serving.generate import GenerateServing
from services.frontend.serving.operations import Operations
from services.frontend.serving.response_store import DEFAULT_CAPACITY, DEFAULT_TTL_S, ResponseStore
from services.frontend.serving.responses import ResponsesServing
from services.frontend.validation.generation_config import (
    GENERATION_CONFIG_AUTO,
    GenerationDefaults,
    load_generation_defaults,
    log_generation_defaults,
)
from services.frontend.validation.limits import ModelLimits, load_model_limits

logger = logging.getLogger(__name__)
SERVICE = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"]
# Refused while draining, and waited for: each starts a generation (or holds streams that
# do). Aborts, lookups of stored responses and the info calls are still answered.
WORK_METHODS = (
    "ChatCompletion",
    "ChatCompletionStream",
    "Completion",
    "CompletionStream",
    "ResponsesCreate",
    "ResponsesCreateStream",
    "Embed",
    "Generate",
    "GenerateStream",
    "OpenSession",
    "Multiplex",
)


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    model: str
    served_model_name: str
    host: str
    port: int
    metrics_port: int
    scheduler_addrs: tuple[str, ...]
    detokenizer_addr: str
    context_length: int
    default_max_tokens: int
    generation_config: str
    allow_auto_truncate: bool
    tokenizer_batch_window_ms: float
    tokenizer_max_batch_size: int
    chat_tokenization: ChatTokenization
    chat_template: str  # a Jinja file used instead of the tokenizer's ("" = the tokenizer's)
    tool_call_parser: str
    reasoning_parser: str
    pooling: PoolingMethod
    max_concurrent_rpcs: int
    add_calls_in_flight: int
    add_requests_timeout: float
    drain_timeout: float
    response_store_size: int
    response_store_ttl: float
    log_level: str
    log_json: bool
    api_key: str | None
    api_key_file: str | None
    cluster_token: ClusterToken
    tls: TlsSettings


def _addr_list(value: str) -> tuple[str, ...]:
    addrs = tuple(a.strip() for a in value.split(",") if a.strip())
    if not addrs:
        raise ValueError("at least one address is required")
    return addrs


def _choice(names: Mapping[str, object]) -> Callable[[str], str]:
    """An environment value that must be one of ``names`` (or empty: none)."""

    def parse(value: str) -> str:
        if value and value not in names:
            raise ValueError(f"one of {sorted(names)}")
        return value

    return parse


def create_parser() -> argparse.ArgumentParser:
    """The frontend's flags, built without parsing (the flags reference reads it too)."""
    p = service_parser("tokenline-frontend", __doc__, default_port=50051)
    _add_routing_flags(p)
    _add_request_flags(p)
    _add_output_flags(p)
    add_api_key_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> FrontendConfig:
    p = create_parser()
    args, tls = parse_service_args(p, argv)
    if isinstance(args["scheduler_addrs"], str):
        args["scheduler_addrs"] = _addr_list(args["scheduler_addrs"])
    if args["tokenizer_batch_window_ms"] < 0 or args["tokenizer_max_batch_size"] < 1:
        p.error("--tokenizer-batch-window-ms must be >= 0 and --tokenizer-max-batch-size >= 1")
    if args["add_calls_in_flight"] < 1 or args["add_requests_timeout"] <= 0:
        p.error("--add-calls-in-flight must be >= 1 and --add-requests-timeout > 0")
    if args["response_store_size"] < 1 or args["response_store_ttl"] <= 0:
        p.error("--response-store-size must be >= 1 and --response-store-ttl > 0")
    return FrontendConfig(**args, tls=tls)


def _add_routing_flags(p: argparse.ArgumentParser) -> None:
    """Where requests go, and how many RPCs this frontend takes at once."""
    p.add_argument(
        "--served-model-name",
        default="",
        help="name reported by /v1/models (default: the model folder's name)",
    )
    p.add_argument(
        "--scheduler-addrs",
        type=_addr_list,
        default=env_default("TOKENLINE_SCHEDULER_ADDRS", ("127.0.0.1:50052",), _addr_list),
        metavar="A,B",
        help="scheduler gRPC addresses; each request goes to the least-loaded leased one",
    )
    p.add_argument(
        "--detokenizer-addr",
        default=env_default("TOKENLINE_DETOKENIZER_ADDR", "127.0.0.1:50053"),
        help="detokenizer gRPC address host:port, whose text this frontend subscribes to",
    )
    p.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=4096,
        help="RPCs past this get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--add-calls-in-flight",
        type=int,
        default=1,
        help="AddRequests calls out at once per scheduler; what is dispatched meanwhile "
        "goes as one call when one is answered",
    )
    p.add_argument(
        "--add-requests-timeout",
        type=float,
        default=ENGINE_ANSWER_RPC_TIMEOUT_S,
        help="seconds an AddRequests call may take; its requests then fail with "
        "DEADLINE_EXCEEDED and are aborted on the scheduler",
    )
    p.add_argument(
        "--response-store-size",
        type=int,
        default=DEFAULT_CAPACITY,
        help="/v1/responses kept for GET and previous_response_id (store: true, the "
        "default); past it the oldest goes",
    )
    p.add_argument(
        "--response-store-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        help="seconds a stored response is kept",
    )


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    """How a request is fitted and tokenized."""
    p.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="cap the context the schedulers report (0: theirs)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        help="max_tokens when a request sets none (capped by the context; the model's "
        "generation_config.json max_new_tokens wins, see --generation-config)",
    )
    p.add_argument(
        "--generation-config",
        default=GENERATION_CONFIG_AUTO,
        metavar="auto|vllm|DIR",
        help="sampling defaults for fields a request leaves unset: auto reads the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens); vllm ignores it (vLLM's name); DIR reads that folder's file",
    )
    p.add_argument(
        "--allow-auto-truncate",
        action="store_true",
        help="cut a prompt's left side to fit prompt + max_tokens into the context "
        "(default: refuse with INVALID_ARGUMENT)",
    )
    p.add_argument(
        "--tokenizer-batch-window-ms",
        type=float,
        default=2.0,
        help="how long concurrent encodes may gather into one tokenizer call",
    )
    p.add_argument(
        "--tokenizer-max-batch-size",
        type=int,
        default=64,
        help="most texts per tokenizer call",
    )
    p.add_argument(
        "--chat-tokenization",
        choices=["auto", "text", "template"],
        default="auto",
        help="encode the rendered chat text, or tokenize inside apply_chat_template "
        "(auto: the latter only when the text round trip would lose control tokens)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=env_default("TOKENLINE_CHAT_TEMPLATE", ""),
        help="a Jinja chat template used instead of the tokenizer's, e.g. for a model "
        "whose tokenizer has none (without one, chat is refused: use completions)",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """How the model's output is read: tool calls and reasoning."""
    p.add_argument(
        "--tool-call-parser",
        choices=["", *TOOL_PARSERS],
        metavar="{" + ",".join(TOOL_PARSERS) + "}",
        default=env_default("TOKENLINE_TOOL_CALL_PARSER", "", _choice(TOOL_PARSERS)),
        help="read the model's tool calls in this syntax (deepseek_v31: the default model); "
        "needed for tool_choice 'auto'. Without one, 'required' and a named function force "
        "plain JSON the server reads back itself (default: none)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["", *REASONING_PARSERS],
        metavar="{" + ",".join(REASONING_PARSERS) + "}",
        default=env_default("TOKENLINE_REASONING_PARSER", "", _choice(REASONING_PARSERS)),
        help="split <think> reasoning off the answer as reasoning_content (default: none)",
    )
    p.add_argument(
        "--pooling",
        choices=list(POOLING_METHODS),
        default="last",
        help="how /v1/embeddings pools a prompt's final hidden states (after the final "
        "norm): the last token's (vLLM's default for decoder models), the mean over every "
        "token, or the first token's (cls); the vector is L2-normalised unless a request "
        "says normalize: false",
    )


def _model_limits(
    config: FrontendConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[ModelLimits, GenerationDefaults]:
    """The model's limits, with generation_config.json's max_new_tokens (when it has one
    and --generation-config reads it) as the default max_tokens; and its sampling defaults."""
    limits = load_model_limits(
        config.model,
        tokenizer,
        context_length=config.context_length,
        default_max_tokens=config.default_max_tokens,
        allow_auto_truncate=config.allow_auto_truncate,
    )
    mode = config.generation_config
    generation = load_generation_defaults(config.model, mode, limits.vocab_size)
    log_generation_defaults(generation, mode)
    if generation.max_new_tokens is not None:
        limits = dataclasses.replace(limits, default_max_tokens=generation.max_new_tokens)
    return limits, generation


def create_serving_context(config: FrontendConfig, metrics: FrontendMetrics) -> ServingContext:
    """Everything the servicer shares, built once from the frozen config."""
    tokenizer = load_tokenizer(config.model)
    limits, generation = _model_limits(config, tokenizer)
    frontend_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def on_finished(row: detokenizer_pb2.StrRow, label: str, owner: str) -> None:
        metrics.observe_finished(row, owner)
        log_finished(row, label)

    manager = TokenizerManager(
        frontend_id,
        list(config.scheduler_addrs),
        config.detokenizer_addr,
        on_finished=on_finished,
        tls=config.tls,
        cluster_token=config.cluster_token,
        add_calls_in_flight=config.add_calls_in_flight,
        add_timeout_s=config.add_requests_timeout,
    )
    batcher = DynamicBatchTokenizer(
        tokenizer,
        window_s=config.tokenizer_batch_window_ms / 1000.0,
        max_batch_size=config.tokenizer_max_batch_size,
        on_batch=metrics.observe_batch,
    )
    metrics.track(lambda: len(manager.table), lambda: manager.num_aborts_sent)
    template = create_chat_template(tokenizer, config.chat_template, config.chat_tokenization)
    return ServingContext(
        tokenizer=tokenizer,
        batcher=batcher,
        manager=manager,
        limits=limits,
        model_name=config.served_model_name or Path(config.model).resolve().name,
        chat_template=template,
        tool_parser=TOOL_PARSERS.get(config.tool_call_parser),
        reasoning_parser=REASONING_PARSERS.get(config.reasoning_parser),
        sampling_defaults=generation.sampling,
    )


READINESS_INTERVAL_S = 0.05


async def track_readiness(process: GrpcProcess, manager: TokenizerManager, name: str) -> None:
    """Readiness says SERVING exactly while a request could complete: the detokenizer
    stream is up and a scheduler answers. Checked every 50 ms (a few microseconds each), so
    a stack is ready as soon as its last lease is up; a lost service shows when its stream
    breaks, or a scheduler's beats stop for the router's BEAT_TIMEOUT_S."""
    ready = False
    while True:
        if manager.can_serve != ready:
            ready = manager.can_serve
            await process.set_ready(ready)
            logger.log(
                logging.INFO if ready else logging.WARNING,
                "frontend %s %s",
                name,
                "ready" if ready else "not ready: lost the detokenizer or every scheduler",
            )
        await asyncio.sleep(READINESS_INTERVAL_S)


async def serve(config: FrontendConfig) -> None:
    metrics = FrontendMetrics()
    ctx = create_serving_context(config, metrics)
    manager = ctx.manager
    frontend_id = manager.frontend_id
    ops = Operations(ctx, model_path=config.model, metrics_port=config.metrics_port)
    streams = StreamBudget(config.max_concurrent_rpcs, metrics)
    keys = create_key_ring(config.api_key, config.api_key_file)
    auth = Authenticator(keys, config.cluster_token)
    chat = ChatServing(ctx)
    store = ResponseStore(config.response_store_size, config.response_store_ttl)
    metrics.track_response_store(store)
    servicer = FrontendServicer(
        chat,
        CompletionServing(ctx),
        GenerateServing(ctx),
        ops,
        streams,
        auth,
        responses=ResponsesServing(chat, store),
        embeddings=EmbeddingServing(ctx, config.pooling),
    )
    process = GrpcProcess(
        host=config.host,
        port=config.port,
        service_names=[SERVICE.full_name],
        metrics_port=config.metrics_port,
        max_concurrent_rpcs=config.max_concurrent_rpcs,
        tls=config.tls,
        interceptors=[ApiKeyInterceptor(auth)],
        work_methods=work_methods(SERVICE, WORK_METHODS),
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.reload)
    frontend_pb2_grpc.add_FrontendServiceServicer_to_server(servicer, process.server)
    await process.start()
    manager.start()

    ready_task = asyncio.create_task(track_readiness(process, manager, frontend_id))
    await process.serve_until_signal(config.drain_timeout, on_drain=streams.begin_drain)
    ready_task.cancel()
    await manager.close()
    await ctx.batcher.close()


def main() -> None:
    run_service(parse_args, serve)


if __name__ == "__main__":
    main()
