"""Token-level and string-level stop detection, run after each sampled token."""

from __future__ import annotations

from services.common.tokenizer import TailDecoder
from services.scheduler.core.req import FinishInfo, Req

# Enough trailing tokens to contain any stop string that ends in the newest
# token: a token decodes to at least one byte, and a character to at most four.
_TAIL_SLACK_TOKENS = 4


class StopChecker:
    """Decides whether ``req`` is finished after its newest token.

    Owns no state; the tokenizer is only used to decode a short tail when the
    request has stop strings.
    """

    def __init__(
        self, tokenizer: TailDecoder, eos_token_ids: set[int], context_length: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length

    def check(self, req: Req) -> FinishInfo | None:
        params = req.params
        last = req.output_ids[-1]
        grammar = req.grammar
        if grammar is not None and grammar.error is not None:
            return FinishInfo("abort", message=grammar.error)
        if grammar is not None and grammar.is_terminated:
            return FinishInfo("stop", matched=last)  # the grammar is complete
        num_out = len(req.output_ids)
        if num_out >= params.min_new_tokens:
            if last in params.stop_token_ids:
                return FinishInfo("stop", matched=last)
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishInfo("stop", matched=last)
            if params.stop:
                matched = self._match_stop_string(req)
                if matched is not None:
                    return FinishInfo("stop", matched=matched)
        if self.reaches_length(req, num_out):
            return FinishInfo("length")
        return None

    def reaches_length(self, req: Req, num_out: int) -> bool:
        """Whether ``num_out`` output tokens end ``req`` by length: its ``max_new_tokens``,
        or a full context."""
        return (
            num_out >= req.params.max_new_tokens
            or len(req.input_ids) + num_out >= self.context_length
        )

    def _match_stop_string(self, req: Req) -> str | None:
        longest = max(len(s.encode("utf-8")) for s in req.params.stop)
        tail_ids = req.output_ids[-(longest + _TAIL_SLACK_TOKENS) :]
        tail = str(
            self.tokenizer.decode(tail_ids, skip_special_tokens=req.flags.skip_special_tokens)
        )
        # Earlier steps found no stop, so any match now involves the newest token;
        # report the one that ends first, like a streaming reader would see it.
        best: tuple[int, str] | None = None
        for stop in req.params.stop:
            pos = tail.find(stop)
            if pos >= 0 and (best is None or pos + len(stop) < best[0]):
                best = (pos + len(stop), stop)
        return best[1] if best else None
