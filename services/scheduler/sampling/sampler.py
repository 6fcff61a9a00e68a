"""Batched sampling: every parameter per request, a few tensor ops per group of rows.

Per step: raw logprobs (vLLM's default: the model's log-softmax before any
processing), then the history-dependent edits (``LogitsProcessor``), then per row
either argmax (greedy) or a draw from temperature / top-k / top-p / min-p.

Draws are inverse-CDF with one uniform per row, so their cost is a cumulative sum,
not a random number per vocabulary entry. Rows with top-k or top-p work on their
``torch.topk`` candidates instead of sorting the vocabulary; a top-p row whose nucleus
is wider than its candidates finds the nucleus's edge with log-probability bins
(``nucleus_mask``), still without a full sort.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.common.sampling_params import SamplingParams
from services.scheduler.ops.cpu_kernels import SampleKernel
from services.scheduler.sampling.logits_processor import (
    LogitsProcessor,
    PenalizedRequest,
    index_tensor,
)
from services.scheduler.sampling.row_argmax import BLOCK, argmax_rows

CANDIDATE_CAP = 1024
"""Candidates a top-p row without top-k starts from (a peaked nucleus fits easily)."""
_NUM_BINS = 1024  # log-probability bins that locate a wide top-p nucleus's edge
_TINY = torch.finfo(torch.float32).tiny

# (sampled token id, its logprob, [(top token id, logprob), ...])
LogprobEntry = tuple[int, float, list[tuple[int, float]]]


class SampledRequest(PenalizedRequest, Protocol):
    """What the sampler reads of a request (the scheduler's ``Req`` is one), beside what
    the logit edits read."""

    @property
    def generator(self) -> torch.Generator | None: ...

    @property
    def return_logprob(self) -> bool: ...

    @property
    def top_logprobs_num(self) -> int: ...


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[LogprobEntry | None]  # per row; None where the request did not ask


@dataclass(slots=True)
class Candidates:
    """The distribution some sampled rows draw from: unnormalised probabilities after
    temperature, top-k, softmax, then top-p and min-p (0 where a filter removed a token)."""

    rows: list[int]  # positions of these rows in the batch
    weights: torch.Tensor  # [len(rows), K], >= 0
    token_ids: torch.Tensor | None  # [len(rows), K] token of each weight; None: column = token

    def dense(self, vocab: int) -> torch.Tensor:
        """Weights as [len(rows), vocab], indexed by token id."""
        if self.token_ids is None:
            return self.weights
        dense = self.weights.new_zeros(len(self.rows), vocab)
        return dense.scatter_(1, self.token_ids, self.weights)

    def draw(self, uniforms: torch.Tensor, most_likely: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One token per row: the first whose cumulative weight exceeds ``u * total``.

        ``uniforms`` [n] lie in [0, 1); ``most_likely()`` gives each row's argmax logit, which
        every filter keeps. A zero weight never passes the search, except when ``u * total``
        rounds up to the total (or the total is 0): then the row falls back to its top token.
        That is rare, so the argmax over the vocabulary is computed only when it happens.
        """
        index = _inverse_cdf(self.weights, uniforms)
        is_kept = self.weights.gather(1, index) > 0
        if self.token_ids is None:
            if bool(is_kept.all()):
                return index.squeeze(1)
            return torch.where(is_kept, index, most_likely().unsqueeze(1)).squeeze(1)
        # Candidates are sorted descending: column 0 is the top token of the row.
        index = torch.where(is_kept, index, torch.zeros_like(index))
        return self.token_ids.gather(1, index).squeeze(1)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the index [n, 1] of the first weight whose running sum exceeds u * total.

    A wide row (the whole vocabulary) goes in two exact stages: block sums pick the block,
    then a scan of that one block picks the entry. A full-width cumulative sum is a serial
    pass that cost 13x the block sums at batch 32 over 129,280 entries here.
    """
    num_rows, width = weights.shape
    if width <= 4 * BLOCK:
        return _search(weights, uniforms)
    pad = -width % BLOCK
    blocks = (F.pad(weights, (0, pad)) if pad else weights).view(num_rows, -1, BLOCK)
    block, targets = _pick_blocks(blocks.sum(dim=-1), uniforms)
    inside = blocks.gather(1, block.unsqueeze(2).expand(-1, -1, BLOCK)).squeeze(1)
    offset = _search(inside, uniforms, targets)
    return (block * BLOCK + offset).clamp_max_(width - 1)


def _pick_blocks(
    block_sums: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """First stage of the inverse CDF: per row the block [n, 1] where ``u * total`` falls,
    and what is left of that target [n, 1] once the blocks before it are passed."""
    cdf = block_sums.cumsum(dim=-1)
    targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    block = torch.searchsorted(cdf, targets, right=True).clamp_max_(cdf.shape[-1] - 1)
    mass_before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp_min(0)), 0.0)
    return block, targets - mass_before


def _search(
    weights: torch.Tensor, uniforms: torch.Tensor, targets: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse CDF by one cumulative sum; ``targets`` [n, 1] default to u * row total."""
    cdf = torch.cumsum(weights, dim=-1)
    if targets is None:
        targets = uniforms.unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, targets.contiguous(), right=True)
    return index.clamp_max_(cdf.shape[-1] - 1)


class Sampler:
    """Turns last-token logits [B, V] into one token per request.

    Each seeded request draws its uniform from its own generator and its candidates
    from its own row only (one ``topk`` per candidate count), so the same seed gives
    the same tokens whatever else shares the batch.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        candidate_cap: int = CANDIDATE_CAP,
        kernel: SampleKernel | None = None,
    ) -> None:
        if candidate_cap < 1:
            raise ValueError(f"candidate_cap must be >= 1, got {candidate_cap}")
        self.processor = LogitsProcessor(eos_token_ids)
        self.candidate_cap = candidate_cap
        self.kernel = kernel  # the compiled plain-row kernel, where one was built
        self._default_generator = torch.Generator(device=device)
        self._default_generator.seed()

    def prepare(
        self, reqs: Sequence[SampledRequest], vocab_size: int, device: torch.device
    ) -> None:
        """Start what the next ``sample(logits, reqs)`` needs and the logits do not (the
        grammar masks), so it runs beside the forward pass. Nothing when no row has one."""
        self.processor.grammar_mask.prefetch(reqs, vocab_size, device)

    def sample(self, logits: torch.Tensor, reqs: Sequence[SampledRequest]) -> SampleOutput:
        """One token per row of ``logits`` (consumed: edited in place when float32).

        A batch of plain rows (greedy or temperature-only, no logprobs, nothing to edit)
        stays in the model's dtype: a float32 copy of [32, 129,280] logits costs as much as
        the argmax, and the compiled kernel reads bf16 itself. Any other batch is converted.
        """
        if all(_is_plain(req, logits.shape[-1]) for req in reqs):
            plain = self._choose_plain(logits, reqs)
            if plain is not None:
                token_ids = plain.tolist()
                self.processor.record(reqs, token_ids)
                return SampleOutput(token_ids, [None] * len(reqs))
        logits = logits.float()
        logprob_rows = [i for i, r in enumerate(reqs) if r.return_logprob]
        raw_logprobs = (
            torch.log_softmax(logits[index_tensor(logprob_rows, logits.device)], dim=-1)
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

    def _choose_plain(
        self, logits: torch.Tensor, reqs: Sequence[SampledRequest]
    ) -> torch.Tensor | None:
        """Plain rows in the model's dtype, all in one call of the compiled kernel; without
        it an all-greedy batch takes ``argmax_rows`` and any other returns None, for the
        float32 path.

        In the kernel greedy rows take their argmax, seeded rows the inverse CDF at their
        own generator's uniform (the same draw as on the float32 path, so a seeded request's
        tokens do not depend on which path its batch took), and the rest an exact draw by
        proposals from a per-step seed of the sampler's generator (no exp per entry).
        """
        kernel = self.kernel
        if kernel is None or not kernel.fits(logits):
            if all(r.params.is_greedy for r in reqs):
                return argmax_rows(logits)
            return None
        inverse = [0.0 if r.params.is_greedy else 1.0 / r.params.temperature for r in reqs]
        own = [-1.0] * len(reqs)  # negative: no uniform of its own
        for i, req in enumerate(reqs):
            if req.generator is not None and not req.params.is_greedy:
                own[i] = float(_own_uniform(req))
        seed = int(torch.randint(2**62, (1,), generator=self._default_generator))
        return kernel(
            logits,
            torch.tensor(inverse, dtype=torch.float32),
            torch.tensor(own, dtype=torch.float32),
            seed,
        )

    def candidates(self, logits: torch.Tensor, reqs: Sequence[SampledRequest]) -> list[Candidates]:
        """What every sampled (non-greedy) row draws from, in groups with disjoint rows:
        rows without top-k / top-p over the whole vocabulary, the others by candidate count."""
        vocab = logits.shape[-1]
        by_count: dict[int | None, list[int]] = {}
        for i, req in enumerate(reqs):
            if not req.params.is_greedy:
                count = _candidate_count(req.params, vocab, self.candidate_cap)
                by_count.setdefault(count, []).append(i)
        dense_rows = by_count.pop(None, [])
        groups = [_dense_candidates(logits, reqs, dense_rows)] if dense_rows else []
        for count in sorted(c for c in by_count if c is not None):
            groups += _top_candidates(logits, reqs, by_count[count], count)
        return groups

    def _choose(self, logits: torch.Tensor, reqs: Sequence[SampledRequest]) -> torch.Tensor:
        device = logits.device
        tokens = torch.zeros(len(reqs), dtype=torch.int64, device=device)
        greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
        if greedy:
            tokens[index_tensor(greedy, device)] = argmax_rows(_rows(logits, greedy))
        groups = self.candidates(logits, reqs)
        if groups:
            uniforms = self._uniforms(reqs, device)
            for group in groups:
                index = index_tensor(group.rows, device)
                top = lambda index=index: argmax_rows(logits[index])  # noqa: E731
                tokens[index] = group.draw(uniforms[index], top)
        return tokens

    def _uniforms(self, reqs: Sequence[SampledRequest], device: torch.device) -> torch.Tensor:
        """U[0, 1) per sampled row (0 for greedy rows): seeded rows from their own
        generator, the rest together from the sampler's."""
        uniforms = torch.zeros(len(reqs), device=device)
        shared = [i for i, r in enumerate(reqs) if r.generator is None and not r.params.is_greedy]
        if shared:
            draws = torch.rand(len(shared), generator=self._default_generator, device=device)
            uniforms[index_tensor(shared, device)] = draws
        for i, req in enumerate(reqs):
            if req.generator is not None and not req.params.is_greedy:
                uniforms[i] = _own_uniform(req).to(device)[0]
        return uniforms


def _own_uniform(req: SampledRequest) -> torch.Tensor:
    """A seeded request's U[0, 1) for this step, [1] from its own generator: the one draw
    both the kernel and the float32 path take, so its tokens do not depend on the path."""
    assert req.generator is not None
    return torch.rand(1, generator=req.generator, device=req.generator.device)


def _is_plain(req: SampledRequest, vocab: int) -> bool:
    """Nothing but an argmax or a temperature draw over the whole row: no logprobs, no
    edits, no top-k / top-p / min-p."""
    params = req.params
    if req.return_logprob or LogitsProcessor.edits(req):
        return False
    return params.is_greedy or (
        params.min_p == 0.0 and _candidate_count(params, vocab, CANDIDATE_CAP) is None
    )


def _candidate_count(params: SamplingParams, vocab: int, cap: int) -> int | None:
    """Candidates a row needs: its top_k, else ``cap`` if it uses top-p; None: the whole row."""
    if 0 < params.top_k < vocab:
        return params.top_k
    return min(cap, vocab) if params.top_p < 1.0 else None


def _rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Those rows of ``tensor``; the tensor itself (no copy) when they are all of it."""
    if rows == list(range(tensor.shape[0])):
        return tensor
    return tensor[index_tensor(rows, tensor.device)]


def _over_temperature(
    values: torch.Tensor, temperatures: list[float], *, in_place: bool = False
) -> torch.Tensor:
    """Each row of ``values`` divided by its temperature; no pass when all of them are 1.
    ``in_place`` edits ``values`` (a tensor the caller owns) instead of allocating."""
    if all(t == 1.0 for t in temperatures):
        return values
    column = torch.tensor(temperatures, device=values.device).unsqueeze(1)
    return values.div_(column) if in_place else values / column


def _row_values(
    reqs: Sequence[SampledRequest], rows: list[int], name: str, device: torch.device
) -> torch.Tensor:
    """One float parameter per row, shaped [len(rows), 1] to broadcast over candidates."""
    values = [getattr(reqs[i].params, name) for i in rows]
    return torch.tensor(values, device=device).unsqueeze(1)


def _dense_candidates(
    logits: torch.Tensor, reqs: Sequence[SampledRequest], rows: list[int]
) -> Candidates:
    """Rows with neither top-k nor top-p: the whole row, as ``softmax(x / T)``.

    Torch's softmax, written over ``logits`` (consumed), so no [B, V] buffer is allocated.
    It replaced separate max, subtract, clamp and ``exp_`` passes: its fused, vectorised
    exp takes 1.1-1.4 ms for [32, 129280] on the AMD EPYC here, where ``exp_`` alone took
    1.8 ms, and needs no clamp to stay fast on peaked rows or on -inf (a grammar or
    min_tokens mask), which gets exactly 0. Min-p keeps ``p >= min_p * p_max``.
    """
    temperatures = [reqs[i].params.temperature for i in rows]
    values = _over_temperature(_rows(logits, rows), temperatures, in_place=True)
    probs = torch.softmax(values, dim=-1, out=values)
    if any(reqs[i].params.min_p > 0.0 for i in rows):
        min_p = _row_values(reqs, rows, "min_p", probs.device)
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return Candidates(rows, probs, None)


def _top_candidates(
    logits: torch.Tensor, reqs: Sequence[SampledRequest], rows: list[int], count: int
) -> list[Candidates]:
    """Rows sharing a candidate count: their ``count`` largest logits, sorted descending.

    One ``topk`` per count keeps a row's candidates (and their order among ties) a function
    of that row alone. A top-p-only row whose candidates hold less mass than its top_p has
    a nucleus wider than them, so it is redone over its whole row (``_wide_nucleus``).
    """
    device, vocab = logits.device, logits.shape[-1]
    is_p_only = [not 0 < reqs[i].params.top_k < vocab for i in rows]
    probs, token_ids = _candidate_probs(_rows(logits, rows), reqs, rows, count, is_p_only)
    top_p = _row_values(reqs, rows, "top_p", device)
    weights, mass = _nucleus(probs, top_p, _row_values(reqs, rows, "min_p", device))
    is_wide = [False] * len(rows)
    if any(is_p_only) and count < vocab:  # a host sync, only when a row may need a full sort
        is_short = (mass < top_p.squeeze(1)).tolist()
        is_wide = [short and p_only for short, p_only in zip(is_short, is_p_only, strict=True)]
    if not any(is_wide):
        return [Candidates(rows, weights, token_ids)]
    groups = [_wide_nucleus(logits, reqs, [rows[j] for j, w in enumerate(is_wide) if w])]
    narrow = [j for j, w in enumerate(is_wide) if not w]
    if narrow:
        index = index_tensor(narrow, device)
        groups.append(Candidates([rows[j] for j in narrow], weights[index], token_ids[index]))
    return groups


def _wide_nucleus(
    logits: torch.Tensor, reqs: Sequence[SampledRequest], rows: list[int]
) -> Candidates:
    """Top-p rows whose nucleus is wider than their candidates (near-flat distributions),
    over the whole row and without sorting it: see ``nucleus_mask``."""
    temperatures = [reqs[i].params.temperature for i in rows]
    probs = torch.softmax(_over_temperature(_rows(logits, rows), temperatures), dim=-1)
    keep = nucleus_mask(probs, _row_values(reqs, rows, "top_p", probs.device))
    min_p = _row_values(reqs, rows, "min_p", probs.device)
    keep &= probs >= min_p * probs.amax(dim=-1, keepdim=True)
    return Candidates(rows, probs * keep, None)


def nucleus_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens of each row [n, V] are in its top-p nucleus: in descending order, those
    whose preceding mass is below ``top_p`` [n, 1] (the first always stays).

    A full sort of 129,280 entries per row costs ~7 ms; instead the row's log-probabilities
    are cut into ``_NUM_BINS`` equal bins, bin masses (one scatter-add) locate the bin where
    the nucleus ends, bins above it are kept whole and only that bin's tokens are ordered.
    Exact: bins never reorder tokens, and the cut-off bin is ordered like a sort would.
    """
    num_bins = _NUM_BINS
    log_p = probs.clamp_min(_TINY).log()
    top = log_p.amax(dim=-1, keepdim=True)
    width = ((top - log_p.amin(dim=-1, keepdim=True)) / num_bins).clamp_min(_TINY)
    bins = ((top - log_p) / width).long().clamp_(0, num_bins - 1)  # bin 0: the largest
    mass = probs.new_zeros(probs.shape[0], num_bins).scatter_add_(1, bins, probs)
    through = mass.cumsum(dim=-1)
    cut = (through < top_p).sum(dim=-1, keepdim=True).clamp_max_(num_bins - 1)
    before_cut = through.gather(1, cut) - mass.gather(1, cut)
    in_cut = bins == cut
    width_cut = int(in_cut.sum(dim=-1).max())
    values, order = torch.where(in_cut, probs, -1.0).topk(width_cut, dim=-1)
    keep_sorted = (values >= 0) & (values.cumsum(dim=-1) - values + before_cut < top_p)
    keep = torch.zeros_like(in_cut).scatter_(1, order, keep_sorted)
    return keep | (bins < cut)


def _candidate_probs(
    logits: torch.Tensor,
    reqs: Sequence[SampledRequest],
    rows: list[int],
    count: int,
    is_p_only: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and token ids of each row's ``count`` largest logits (temperature keeps
    their order). A top-k row's softmax is over its k kept logits, a top-p-only row's over
    the whole vocabulary."""
    temperatures = [reqs[i].params.temperature for i in rows]
    values, token_ids = torch.topk(logits, count, dim=-1)
    probs = torch.softmax(_over_temperature(values, temperatures), dim=-1)
    p_only = [j for j, flag in enumerate(is_p_only) if flag]
    if p_only:
        index = index_tensor(p_only, logits.device)
        scaled = _over_temperature(_rows(logits, p_only), [temperatures[j] for j in p_only])
        probs[index] = torch.softmax(scaled, dim=-1).gather(1, token_ids[index])
    return probs, token_ids


def _nucleus(
    probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero sorted probabilities outside the top-p nucleus or below ``min_p`` times the
    first (largest); also each row's candidate mass. Rows with top_p >= 1 keep every
    candidate, whatever rounding does to their cumulative sum."""
    cumulative = torch.cumsum(probs, dim=-1)
    # Keep a token when the mass strictly before it is below top_p (the first always stays).
    keep = cumulative - probs < torch.where(top_p < 1.0, top_p, torch.inf)
    keep &= probs >= min_p * probs[:, :1]
    return probs * keep, cumulative[:, -1]


def _logprob_entries(
    logprobs: torch.Tensor, tokens: torch.Tensor, rows: list[int], reqs: Sequence[SampledRequest]
) -> list[LogprobEntry]:
    """(token, logprob, top list) per row, with one device->host copy for the batch."""
    chosen = tokens[index_tensor(rows, tokens.device)]
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
