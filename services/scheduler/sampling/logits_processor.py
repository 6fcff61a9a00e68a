"""Logit edits that depend on a request's history: penalties, logit_bias, min_tokens.

Applied in place to the last-token logits of a batch, in this order (vLLM's):
repetition penalty, frequency and presence penalties, logit_bias, the min_tokens
mask, then each grammar's allowed-token mask (last, so nothing can re-allow a token
the grammar forbids). Each touches only the rows of requests that asked for it, so a
batch of plain requests pays nothing.

``index_tensor`` (ids as an index tensor) is defined here and shared with the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.sampling_params import SamplingParams
from services.scheduler.sampling.grammar import GrammarMasker, HasGrammar


class TokenHistory(Protocol):
    """A request's tokens so far, as ``PenaltyState.create`` reads them."""

    @property
    def input_ids(self) -> list[int]: ...

    @property
    def output_ids(self) -> list[int]: ...


@dataclass(slots=True)
class PenaltyState:
    """Per-request token statistics, kept across steps (and retraction) on the logits' device."""

    output_counts: torch.Tensor  # [V] float32: times each token was generated
    prompt_mask: torch.Tensor  # [V] bool: tokens in the prompt (the repetition penalty sees them)

    @classmethod
    def create(cls, req: TokenHistory, vocab_size: int, device: torch.device) -> PenaltyState:
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if req.output_ids:  # created late, e.g. in a unit test: catch up
            ids = index_tensor(req.output_ids, device)
            counts.index_add_(0, ids, torch.ones(len(ids), device=device))
        prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        prompt_mask[index_tensor(req.input_ids, device)] = True
        return cls(counts, prompt_mask)


class PenalizedRequest(TokenHistory, HasGrammar, Protocol):
    """What the logit edits read of a request (the scheduler's ``Req`` is one); they keep
    its ``PenaltyState`` on it."""

    penalties: PenaltyState | None

    @property
    def params(self) -> SamplingParams: ...


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


class LogitsProcessor:
    """Edits logits in place; owns the per-request ``PenaltyState`` it creates on ``req``."""

    def __init__(self, eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.grammar_mask = GrammarMasker()

    def __call__(self, logits: torch.Tensor, reqs: Sequence[PenalizedRequest]) -> None:
        self._apply_penalties(logits, reqs)
        self._apply_logit_bias(logits, reqs)
        self._mask_stops_before_min_tokens(logits, reqs)
        self.grammar_mask(logits, reqs)

    @staticmethod
    def edits(req: PenalizedRequest) -> bool:
        """Whether this step's ``__call__`` may change the request's row."""
        params = req.params
        return (
            has_penalties(params)
            or bool(params.logit_bias)
            or len(req.output_ids) < params.min_new_tokens
            or req.grammar is not None
        )

    def record(self, reqs: Sequence[PenalizedRequest], token_ids: Sequence[int]) -> None:
        """Count each request's newly sampled token for its later penalties, and advance
        its grammar by it."""
        for req, token in zip(reqs, token_ids, strict=True):
            if req.penalties is not None:
                req.penalties.output_counts[token] += 1
            if req.grammar is not None:
                req.grammar.accept(token)

    def _apply_penalties(self, logits: torch.Tensor, reqs: Sequence[PenalizedRequest]) -> None:
        rows = [i for i, r in enumerate(reqs) if has_penalties(r.params)]
        if not rows:
            return
        vocab, device = logits.shape[-1], logits.device
        states = []
        for i in rows:
            req = reqs[i]
            if req.penalties is None:
                req.penalties = PenaltyState.create(req, vocab, device)
            states.append(req.penalties)
        params = [reqs[i].params for i in rows]
        index = index_tensor(rows, device)
        sub = logits[index]
        counts = torch.stack([s.output_counts for s in states])
        generated = counts > 0
        # Repetition penalty (CTRL paper, as HF and vLLM): tokens seen in the prompt or
        # output get positive logits divided and negative ones multiplied.
        rep = _column([p.repetition_penalty for p in params], device)
        seen = generated | torch.stack([s.prompt_mask for s in states])
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        # Frequency and presence penalties (OpenAI): over generated tokens only.
        freq = _column([p.frequency_penalty for p in params], device)
        pres = _column([p.presence_penalty for p in params], device)
        sub = sub - freq * counts - pres * generated.float()
        logits[index] = sub

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, reqs: Sequence[PenalizedRequest]) -> None:
        rows, tokens, biases = [], [], []
        for i, req in enumerate(reqs):
            for token, bias in req.params.logit_bias.items():
                rows.append(i)
                tokens.append(token)
                biases.append(bias)
        if rows:
            device = logits.device
            values = torch.tensor(biases, dtype=logits.dtype, device=device)
            logits.index_put_(
                (index_tensor(rows, device), index_tensor(tokens, device)), values, accumulate=True
            )

    def _mask_stops_before_min_tokens(
        self, logits: torch.Tensor, reqs: Sequence[PenalizedRequest]
    ) -> None:
        """Until a request has ``min_new_tokens`` outputs, nothing may end it: its stop token
        ids and (unless ``ignore_eos``) EOS get probability zero."""
        rows, tokens = [], []
        for i, req in enumerate(reqs):
            params = req.params
            if len(req.output_ids) >= params.min_new_tokens:
                continue
            stops = list(params.stop_token_ids)
            if not params.ignore_eos:
                stops.extend(self.eos_token_ids)
            rows.extend([i] * len(stops))
            tokens.extend(stops)
        if rows:
            device = logits.device
            logits[index_tensor(rows, device), index_tensor(tokens, device)] = float("-inf")


def index_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row or token ids as an int64 index tensor on ``device``."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
