"""Batched sampling: every parameter per request, in one pass over the batch.

Per step: raw logprobs (vLLM's default: the model's log-softmax before any
processing), then the history-dependent edits (``LogitsProcessor``), then per row
either argmax (greedy) or a draw from temperature / top-k / top-p / min-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.scheduler.logits_processor import LogitsProcessor
from services.scheduler.req import LogprobEntry, Req

_TINY = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[LogprobEntry | None]  # per row; None where the request did not ask


class Sampler:
    """Turns last-token logits [B, V] into one token per request.

    Draws use the exponential race (argmax of p / E with E ~ Exp(1) is an exact
    sample from p): no cumulative sums, and each seeded request draws its noise
    from its own generator, so the same seed gives the same tokens whatever else
    shares the batch.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.processor = LogitsProcessor(eos_token_ids)
        self._default_generator = torch.Generator(device=device)
        self._default_generator.seed()

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> SampleOutput:
        """One token per row of ``logits`` (consumed: edited in place when float32)."""
        logits = logits.float()
        logprob_rows = [i for i, r in enumerate(reqs) if r.return_logprob]
        raw_logprobs = (
            torch.log_softmax(logits[_ids(logprob_rows, logits.device)], dim=-1)
            if logprob_rows
            else None
        )
        self.processor(logits, reqs)
        tokens = self._choose(logits, reqs)
        token_ids = tokens.tolist()
        self.processor.record(reqs, token_ids)
        logprobs: list[LogprobEntry | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            entries = _logprob_entries(raw_logprobs, tokens, logprob_rows, reqs)
            for i, entry in zip(logprob_rows, entries, strict=True):
                logprobs[i] = entry
        return SampleOutput(token_ids, logprobs)

    def sampling_weights(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """Unnormalised probabilities [B, V] that sampled rows draw from (after temperature,
        top-k, softmax, then top-p and min-p on that softmax)."""
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in reqs], device=device)
        scaled = logits / temps.unsqueeze(1)
        _apply_top_k(scaled, [r.params.top_k for r in reqs])
        probs = torch.softmax(scaled, dim=-1)
        _apply_top_p_min_p(probs, [r.params.top_p for r in reqs], [r.params.min_p for r in reqs])
        return probs

    def _choose(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        tokens = torch.argmax(logits, dim=-1)
        rows = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if rows:
            index = _ids(rows, logits.device)
            sampled_reqs = [reqs[i] for i in rows]
            weights = self.sampling_weights(logits[index], sampled_reqs)
            noise = self._exponential_noise(weights, sampled_reqs)
            tokens[index] = torch.argmax(weights / noise, dim=-1)
        return tokens

    def _exponential_noise(self, like: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        noise = torch.empty_like(like)
        seeded = [j for j, r in enumerate(reqs) if r.generator is not None]
        if len(seeded) < len(reqs):  # one draw for every unseeded row together
            noise.exponential_(generator=self._default_generator)
        for j in seeded:
            noise[j].exponential_(generator=reqs[j].generator)
        # Exp(1) can return 0.0; a masked token (p = 0) must never win by 0 / 0.
        return noise.clamp_min_(_TINY)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> None:
    """Keep tokens whose logit is at least the row's k-th largest (k <= 0: all)."""
    vocab = logits.shape[-1]
    rows = [i for i, k in enumerate(top_ks) if 0 < k < vocab]
    if not rows:
        return
    device = logits.device
    index = _ids(rows, device)
    row_ks = [top_ks[i] for i in rows]
    ks = _ids(row_ks, device)
    sub = logits[index]
    kth = torch.topk(sub, max(row_ks), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
    logits[index] = sub.masked_fill(sub < kth, float("-inf"))


def _apply_top_p_min_p(probs: torch.Tensor, top_ps: list[float], min_ps: list[float]) -> None:
    """Zero tokens outside the top-p nucleus or below ``min_p`` times the top probability."""
    rows = [i for i, (p, m) in enumerate(zip(top_ps, min_ps, strict=True)) if p < 1.0 or m > 0.0]
    if not rows:
        return
    device = probs.device
    index = _ids(rows, device)
    top_p = torch.tensor([top_ps[i] for i in rows], device=device).unsqueeze(1)
    min_p = torch.tensor([min_ps[i] for i in rows], device=device).unsqueeze(1)
    sub = probs[index]
    sorted_probs, order = torch.sort(sub, dim=-1, descending=True)
    # Keep a token when the mass strictly before it is below top_p (the first always stays).
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    probs[index] = sub * keep


def _logprob_entries(
    logprobs: torch.Tensor, tokens: torch.Tensor, rows: list[int], reqs: Sequence[Req]
) -> list[LogprobEntry]:
    """(token, logprob, top list) per row, with one device->host copy for the batch."""
    chosen = tokens[_ids(rows, tokens.device)]
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    chosen_ids = chosen.tolist()
    num_top = max(reqs[i].top_logprobs_num for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if num_top > 0:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    entries = []
    for j, i in enumerate(rows):
        k = reqs[i].top_logprobs_num
        top = list(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        entries.append((chosen_ids[j], chosen_lp[j], top))
    return entries


def _ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
