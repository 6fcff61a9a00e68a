"""What chat, completion and native generate serving have in common."""

from __future__ import annotations

import uuid

from tokenline.v1 import common_pb2, openai_pb2
from transformers import PreTrainedTokenizerBase

from services.common.errors import InvalidArgumentError
from services.common.sampling_params import SamplingParams
from services.frontend.output import ChoiceAccumulator, LogprobFormatter
from services.frontend.params import ModelLimits
from services.frontend.tokenizer_manager import TokenizedRequest, TokenizerManager

MAX_TOP_LOGPROBS = 20


class ServingBase:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        manager: TokenizerManager,
        limits: ModelLimits,
        model_name: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.manager = manager
        self.limits = limits
        self.model_name = model_name
        self.logprobs = LogprobFormatter(tokenizer)

    async def encode(self, text: str) -> list[int]:
        # Special tokens in the text are the template's own; BOS comes from the template.
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def new_rid(request_id: str) -> str:
        return request_id or uuid.uuid4().hex

    @staticmethod
    def check_logprobs(enabled: bool, top: int) -> None:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError(
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}", field="top_logprobs"
            )
        if top and not enabled:
            raise InvalidArgumentError("top_logprobs requires logprobs=true", field="top_logprobs")

    @staticmethod
    def fan_out(
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        logprobs: bool,
        top: int,
        times: common_pb2.StageTimes,
        prefix: str = "",
    ) -> list[TokenizedRequest]:
        """One scheduler request per choice; seeded choices get distinct seeds."""
        n = params.n
        reqs = []
        for i in range(n):
            choice_params = SamplingParams(**{f: getattr(params, f) for f in params.__slots__})
            choice_params.n = 1
            if params.seed is not None:
                choice_params.seed = params.seed + i
            choice_rid = rid if n == 1 and not prefix else f"{rid}{prefix}-{i}"
            reqs.append(
                TokenizedRequest(choice_rid, input_ids, choice_params, logprobs, top, times)
            )
        return reqs

    async def collect(self, reqs: list[TokenizedRequest]) -> list[ChoiceAccumulator]:
        accs = [ChoiceAccumulator() for _ in reqs]
        async for index, row in self.manager.generate(reqs):
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
