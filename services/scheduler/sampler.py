"""Batched sampling: every parameter per request, in one pass over the batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.sampling_params import SamplingParams


class Sampler:
    """Turns last-token logits [B, V] into one token per row.

    Seeded rows draw their noise from a per-request generator, so the same seed
    gives the same tokens whatever else shares the batch.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = device
        self._default_generator = torch.Generator(device=device)
        self._default_generator.seed()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (token ids [B], log-softmax of the processed logits [B, V])."""
        logits = logits.float()
        greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        temps = torch.tensor(
            [1.0 if p.is_greedy else p.temperature for p in params], device=logits.device
        )
        scaled = logits / temps.unsqueeze(1)
        scaled = _apply_top_k(scaled, [p.top_k for p in params])
        probs = torch.softmax(scaled, dim=-1)
        probs = _apply_top_p_min_p(probs, [p.top_p for p in params], [p.min_p for p in params])
        noise = torch.empty_like(probs)
        for row, gen in enumerate(generators):
            noise[row].exponential_(generator=gen or self._default_generator)
        # Exponential race: argmax(p / E) is an exact draw from p, and needs no
        # cumulative sums, so one generator per row gives batch-independent draws.
        sampled = torch.argmax(probs / noise, dim=-1)
        tokens = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
        return tokens, torch.log_softmax(logits, dim=-1)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    if all(k <= 0 for k in top_ks):
        return logits
    vocab = logits.shape[-1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
    ks = ks.clamp(max=vocab)
    sorted_logits = torch.sort(logits, dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p_min_p(
    probs: torch.Tensor, top_ps: list[float], min_ps: list[float]
) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps) and all(m <= 0.0 for m in min_ps):
        return probs
    top_p = torch.tensor(top_ps, device=probs.device).unsqueeze(1)
    min_p = torch.tensor(min_ps, device=probs.device).unsqueeze(1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    # Keep a token when the mass strictly before it is below top_p (the first always stays).
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return probs * keep
