"""What chat, completion and native generate serving have in common.

Every ``prepare`` follows one order so nothing reaches a scheduler unchecked:
range-check the sampling fields, template, tokenize (dynamic batch), fit each
prompt into the context, then fan out one scheduler request per choice.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeAlias

from tokenline.v1 import common_pb2, openai_pb2
from transformers import PreTrainedTokenizerBase

from services.common.errors import InvalidArgumentError, NotFoundError
from services.common.sampling_params import SamplingDefaults
from services.frontend.chat.template import ChatTemplate
from services.frontend.dispatch.batch_tokenizer import DynamicBatchTokenizer
from services.frontend.dispatch.tokenizer_manager import TokenizedRequest, TokenizerManager
from services.frontend.parsers.reasoning import ReasoningParser
from services.frontend.parsers.tool_calls import ToolParser
from services.frontend.serving.output import ChoiceAccumulator, LogprobFormatter
from services.frontend.serving.tool_choice import ToolGrammars
from services.frontend.validation.limits import ModelLimits
from services.frontend.validation.params import (
    FittedPrompt,
    RequestedParams,
    check_sampling,
    fit_prompt,
    params_from_openai,
)
from services.frontend.validation.prompt_logprobs import check_start_len
from services.frontend.validation.structured_output import GrammarChecker

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
OpenAIRequest: TypeAlias = openai_pb2.ChatCompletionRequest | openai_pb2.CompletionRequest


@dataclass(frozen=True, slots=True)
class ServingContext:
    """The frontend's shared pieces, built once in __main__."""

    tokenizer: PreTrainedTokenizerBase
    batcher: DynamicBatchTokenizer
    manager: TokenizerManager
    limits: ModelLimits
    model_name: str
    chat_template: ChatTemplate | None = None
    grammars: GrammarChecker = dataclasses.field(default_factory=GrammarChecker)
    # --tool-call-parser / --reasoning-parser: None reads no calls / no reasoning.
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    tool_grammars: ToolGrammars = dataclasses.field(default_factory=ToolGrammars)
    # The model's generation_config.json defaults (--generation-config).
    sampling_defaults: SamplingDefaults = dataclasses.field(default_factory=SamplingDefaults)

    def current_limits(self) -> ModelLimits:
        """The model's limits with the context length the leased schedulers enforce, so a
        request is refused here exactly when no scheduler could serve it."""
        return self.limits.served_by(self.manager.router.context_length())


@dataclass(slots=True)
class LogprobRequest:
    enabled: bool = False
    top: int = 0
    # Prompt logprobs from this position on (None: none), ``prompt_top`` alternatives each.
    start_len: int | None = None
    prompt_top: int = 0


def new_times() -> common_pb2.StageTimes:
    return common_pb2.StageTimes(received=time.time())


class ServingBase:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.tokenizer = ctx.tokenizer
        self.manager = ctx.manager
        self.model_name = ctx.model_name
        self.logprobs = LogprobFormatter(ctx.tokenizer)

    @property
    def limits(self) -> ModelLimits:
        return self.ctx.current_limits()

    @staticmethod
    def new_label(request_id: str) -> str:
        """The client's id for the response (``chatcmpl-<label>``), or a fresh one. Two
        requests may bring the same: it is echoed and logged, never a key."""
        return request_id or uuid.uuid4().hex

    def check_model(self, model: str) -> None:
        """vLLM's rule: no name means the served model; any other name must be it."""
        if model and model != self.model_name:
            raise NotFoundError(f"The model `{model}` does not exist.", field="model")

    def check_generates(self) -> None:
        """INVALID_ARGUMENT when the schedulers run a pooling model (``--runner pooling``):
        they serve embeddings only, and no generation is dispatched to them."""
        if self.manager.router.runs_pooling_only():
            raise InvalidArgumentError(
                "this server runs a pooling model (--runner pooling): it serves "
                "/v1/embeddings only, no generation",
                field="model",
            )

    def openai_params(
        self, request: OpenAIRequest, max_completion_tokens: int | None = None
    ) -> RequestedParams:
        """A chat or completion request's sampling fields and vLLM's prompt extras,
        range-checked before anything else is done; unset fields take the model's
        defaults."""
        self.check_model(request.model)
        self.check_generates()
        requested = params_from_openai(
            request.sampling, max_completion_tokens, self.ctx.sampling_defaults
        )
        if request.HasField("truncate_prompt_tokens"):
            requested.truncate_prompt_tokens = request.truncate_prompt_tokens
        requested.priority = request.priority
        if isinstance(request, openai_pb2.CompletionRequest) and request.echo:
            requested.min_limit = 0  # echo with max_tokens 0: score the prompt (OpenAI, vLLM)
        check_sampling(requested, self.limits)
        return requested

    def eos_ids(self, requested: RequestedParams) -> frozenset[int]:
        """The model's own stop tokens (its EOS): a choice one of them ends has no
        ``stop_reason``, as vLLM reports EOS, even when stop_token_ids lists it too. With
        ``ignore_eos`` only the request's own stop_token_ids end a choice, and they are
        reported."""
        if requested.params.ignore_eos:
            return frozenset()
        return frozenset(self.ctx.limits.stop_token_ids)

    @staticmethod
    def check_logprobs(logprob: LogprobRequest, field: str = "top_logprobs") -> None:
        if logprob.top == -1:
            # vLLM's -1 is the whole vocabulary, which vLLM too refuses unless started
            # with --max-logprobs -1; 129,280 entries a token is not an API answer here.
            raise InvalidArgumentError(
                f"-1 (every vocabulary entry) is not supported; at most {MAX_TOP_LOGPROBS}",
                field=field,
            )
        if not 0 <= logprob.top <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError(
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprob.top}", field=field
            )
        if logprob.top and not logprob.enabled:
            raise InvalidArgumentError(f"{field} requires logprobs", field=field)

    async def encode_prompts(
        self, texts: list[str], field: str, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Plain prompts: the tokenizer adds BOS where the model expects it, unless the
        client said ``add_special_tokens: false``."""
        id_lists = await self.ctx.batcher.encode_many(texts, add_special_tokens)
        for j, ids in enumerate(id_lists):
            if not ids:
                raise InvalidArgumentError(f"prompt {j} is empty", field=field)
        return id_lists

    def check_id_lists(self, id_lists: list[list[int]], field: str) -> None:
        if not id_lists:
            raise InvalidArgumentError("at least one prompt is required", field=field)
        for ids in id_lists:
            if not ids:
                raise InvalidArgumentError("must not be empty", field=field)
            self.check_vocab_range(ids, field)

    def check_vocab_range(self, ids: list[int], field: str) -> None:
        """Every id a token of the model's vocabulary, or INVALID_ARGUMENT naming ``field``."""
        vocab_size = self.ctx.limits.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"token ids outside [0, {vocab_size}): {bad[:5]}", field=field
            )

    def build_requests(
        self,
        label: str,
        requested: RequestedParams,
        id_lists: list[list[int]],
        prompt_field: str,
        logprob: LogprobRequest,
        times: common_pb2.StageTimes,
    ) -> list[TokenizedRequest]:
        """Fit every prompt first (all or nothing), then one request per prompt and choice,
        each with a rid of its own."""
        limits = self.limits  # the schedulers' context as of now, once for every prompt
        fitted = [fit_prompt(requested, ids, limits, prompt_field) for ids in id_lists]
        check_start_len(logprob.start_len, [len(p.input_ids) for p in fitted])
        batched = len(fitted) > 1
        reqs: list[TokenizedRequest] = []
        for j, prompt in enumerate(fitted):
            prompt_label = f"{label}-{j}" if batched else label
            if prompt.num_truncated:
                logger.info("%s: prompt cut by %d tokens", prompt_label, prompt.num_truncated)
            reqs += fan_out(self.manager.new_rid, prompt_label, prompt, logprob, times)
        for req in reqs:
            req.priority = requested.scheduler_priority
        return reqs

    async def collect(self, reqs: list[TokenizedRequest]) -> list[ChoiceAccumulator]:
        """The whole output of each choice. The scheduler is told nobody streams it, so
        it sends each choice's tokens in one final row instead of one per step."""
        reqs = [dataclasses.replace(r, stream=False) for r in reqs]
        accs = [ChoiceAccumulator() for _ in reqs]
        async with aclosing(self.manager.generate(reqs)) as rows:
            async for index, row in rows:
                accs[index].add(row)
        return accs

    @staticmethod
    def running_usage(num_prompt: int, num_out: list[int]) -> openai_pb2.CompletionUsage:
        completion = sum(num_out)
        return openai_pb2.CompletionUsage(
            prompt_tokens=num_prompt,
            completion_tokens=completion,
            total_tokens=num_prompt + completion,
        )


def fan_out(
    new_rid: Callable[[], str],
    label: str,
    prompt: FittedPrompt,
    logprob: LogprobRequest,
    times: common_pb2.StageTimes,
) -> list[TokenizedRequest]:
    """One scheduler request per choice, each with a fresh rid and the label ``label``
    (``<label>-<i>`` when n > 1); a seeded request gives choice i the seed ``seed + i``
    so choices differ."""
    params = prompt.params
    reqs = []
    for i in range(params.n):
        seed = None if params.seed is None else (params.seed + i) % 2**63
        choice = dataclasses.replace(params, n=1, seed=seed)
        reqs.append(
            TokenizedRequest(
                new_rid(),
                prompt.input_ids,
                choice,
                logprob.enabled,
                logprob.top,
                times,
                label=label if params.n == 1 else f"{label}-{i}",
                logprob_start_len=logprob.start_len,
                prompt_top_logprobs_num=logprob.prompt_top,
            )
        )
    return reqs
