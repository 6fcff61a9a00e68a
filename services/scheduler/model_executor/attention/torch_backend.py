"""Attention with torch's scaled_dot_product_attention: runs anywhere torch runs.

Decode tokens (one new token per request) are the common case in continuous
batching, so they are padded into a single SDPA call with a key-padding mask.
Requests that add several tokens (prefill chunks) run one SDPA call each: padding
them together would waste work quadratic in the longest chunk. A chunk after a short cached
prefix (at most half its length, such as a chat template's shared opening) runs one causal
call with its queries zero-padded over the prefix (``_padded_causal``); on CPU a chunk after
a longer prefix runs as two flash calls, over the prefix and over its own keys, merged by
their log-sum-exps (``_prefix_then_causal``), so no mask makes the kernel score masked keys.

On CPU, when the engine's compiled kernels are loaded (``ops/cpu_kernels.py``), decode
tokens go to ``torch.ops.tokenline.decode_attention`` instead, which reads each request's
keys and values in place in the pool, without the padded gather and its float32 copy
(docs/benchmarks.md, "Decode attention on CPU", has what it measured). On a CPU with
AVX512-BF16 but no AMX, bf16 prefill spans without a window go to
``torch.ops.tokenline.prompt_attention``, a causal kernel over the span's keys, prefix
included: there torch's flash kernel reaches a fraction of what the linear layers do
(docs/scheduler.md, "Prompt attention without AMX").

The padded SDPA call is not batch-invariant: how CPU SDPA blocks the keys depends on the
longest request, so a row can round differently beside longer ones. With
``batch_invariant`` the backend gives each decode request a call of its own (the compiled
kernel already computes each request on its own).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention.base import AttentionBackend, AttentionMetadata
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.ops.isa_levels import has_amx

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(slots=True)
class ExtendSpan:
    """One request adding ``length`` tokens at flat rows ``start:start+length``."""

    start: int
    length: int
    prefix_len: int  # tokens already in KV before this step
    slots: torch.Tensor  # pool slots of the keys the span's queries see (a window trims)
    # [length, len(slots)] bool, or None for causality alone: plain causal without a
    # prefix, ``_padded_causal`` after a short one, ``_prefix_then_causal`` after a long one
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """All one-token requests of a step, padded into one SDPA call."""

    rows: torch.Tensor  # [B] flat row of each decode token
    slots: list[torch.Tensor]  # per request: its [seq_len] pool slots, unpadded
    table: torch.Tensor  # [B, max_seq] slot table, padded with slot 0
    seq_lens: torch.Tensor  # [B] int64: the keys of request b are table[b, :seq_lens[b]]
    # Every row of the step is a decode token, in order (rows is 0..B-1): the forward
    # reads q and writes the output whole, with no gather or scatter by rows, whichever
    # way it computes them.
    whole_step: bool = False
    _mask: torch.Tensor | None = field(default=None, repr=False)  # built by the first layer

    @property
    def max_seq(self) -> int:
        return self.table.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        """[B, 1, 1, max_seq] True where a key is real: built when the padded SDPA call
        first reads it, then shared by every layer; the kernel's steps never build it."""
        if self._mask is None:
            key_pos = torch.arange(self.max_seq, device=self.table.device)
            self._mask = (key_pos[None, :] < self.seq_lens[:, None])[:, None, None, :]
        return self._mask

    def gather(self, buf: torch.Tensor) -> torch.Tensor:
        """[B, max_seq, kv_heads, D] keys or values of every decode request, padded.
        ``index_select`` on the flat table: several times faster than 2-D fancy indexing."""
        num_reqs = self.rows.shape[0]
        flat = buf.index_select(0, self.table.view(-1))
        return flat.view(num_reqs, self.max_seq, *buf.shape[1:])


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    decode: DecodeGroup | None = None
    extends: list[ExtendSpan] = field(default_factory=list)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, batch_invariant: bool = False, decode_kernel: bool = False) -> None:
        # Whether ``torch.ops.tokenline.decode_attention`` is loaded: the engine loads its
        # compiled kernels before it builds the model (transport/engine_build.py).
        self.decode_kernel = decode_kernel
        self.prompt_kernel = decode_kernel and prompt_kernel_pays()
        self.batch_invariant = batch_invariant

    def plan(self, batch: ForwardBatch, window: int | None = None) -> TorchAttentionMetadata:
        meta = TorchAttentionMetadata(batch=batch)
        decode_rows: list[int] = []
        decode_slots: list[torch.Tensor] = []
        start = 0
        for seq_len, length, slots in zip(
            batch.seq_lens, batch.extend_lens, batch.kv_slots, strict=True
        ):
            if length == 1:
                decode_rows.append(start)
                # A windowed decode token sees its last ``window`` keys: the kernel and
                # the padded SDPA call both read a table holding just those.
                decode_slots.append(slots if window is None else slots[-window:])
            elif length > 1:
                meta.extends.append(_extend_span(start, length, seq_len, slots, window))
            start += length
        if decode_rows:
            meta.decode = _decode_group(decode_rows, decode_slots, whole_step=not meta.extends)
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer: int,
        meta: AttentionMetadata,
        kv_pool: KVPool,
        scale: float,
    ) -> torch.Tensor:
        if not isinstance(meta, TorchAttentionMetadata):
            raise TypeError("TorchAttentionBackend needs metadata from its own plan()")
        kv_pool.write(layer, meta.batch.out_cache_loc, k, v)
        k_buf, v_buf = kv_pool.k_buffers[layer], kv_pool.v_buffers[layer]
        dec = meta.decode
        if dec is not None and dec.whole_step:
            return self._decode(q, k_buf, v_buf, dec, scale)
        out = torch.empty_like(q)
        for span in meta.extends:
            rows = slice(span.start, span.start + span.length)
            if span.prefix_len == 0:  # nothing cached: the new K/V are the whole context
                span_k, span_v = k[rows], v[rows]
            else:
                span_k = k_buf.index_select(0, span.slots)
                span_v = v_buf.index_select(0, span.slots)
            if self._prompt_kernel_fits(span, q, k_buf):
                out[rows] = torch.ops.tokenline.prompt_attention(
                    q[rows].contiguous(), span_k, span_v, scale
                )
                continue
            span_q = q[rows].unsqueeze(0)
            if span.mask is None and span.prefix_len:
                pads = pads_prefix(span.prefix_len, span.length)
                attend = _padded_causal if pads else _prefix_then_causal
                out[rows] = attend(span_q, span_k, span_v, span.prefix_len, scale)[0]
                continue
            out[rows] = _sdpa(span_q, span_k.unsqueeze(0), span_v.unsqueeze(0), span.mask, scale)[0]
        if dec is not None:
            out[dec.rows] = self._decode(q[dec.rows], k_buf, v_buf, dec, scale)
        return out

    def _decode(
        self,
        dec_q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        dec: DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        """[B, H, D]: the decode queries ``dec_q`` over their requests' keys, by the
        compiled kernel where it fits, else one SDPA call per request (batch-invariant)
        or one padded call."""
        if self._kernel_fits(dec_q, k_buf):
            return torch.ops.tokenline.decode_attention(  # type: ignore[no-any-return]
                dec_q.contiguous(), k_buf, v_buf, dec.table, dec.seq_lens, scale
            )
        if self.batch_invariant:
            return _decode_one_by_one(dec_q, k_buf, v_buf, dec.slots, scale)
        dec_k, dec_v = dec.gather(k_buf), dec.gather(v_buf)  # [B, S, kvH, D]
        return _sdpa(dec_q.unsqueeze(1), dec_k, dec_v, dec.mask, scale)[:, 0]

    def _prompt_kernel_fits(self, span: ExtendSpan, q: torch.Tensor, k_buf: torch.Tensor) -> bool:
        return (
            self.prompt_kernel
            and span.mask is None
            and q.device.type == "cpu"
            and q.dtype == torch.bfloat16
            and k_buf.dtype == torch.bfloat16
            and prompt_kernel_takes(q.shape[-1])
        )

    def _kernel_fits(self, q: torch.Tensor, k_buf: torch.Tensor) -> bool:
        return (
            self.decode_kernel
            and q.device.type == "cpu"
            and q.dtype == k_buf.dtype
            and q.dtype in _KERNEL_DTYPES
            and k_buf.stride(-1) == 1
        )


def prompt_kernel_pays() -> bool:
    """Whether bf16 prefill spans go to ``tokenline::prompt_attention``: the loaded library
    has it (AVX512-BF16), and the CPU has no AMX, on whose tiles torch's flash kernel is the
    faster (``TOKENLINE_PROMPT_ATTENTION`` = ``torch`` or ``kernel`` overrides, to compare)."""
    if not prompt_kernel_takes(64):
        return False
    override = os.environ.get("TOKENLINE_PROMPT_ATTENTION", "")
    if override in ("torch", "kernel"):
        return override == "kernel"
    return not has_amx()


@functools.cache
def prompt_kernel_takes(head_dim: int) -> bool:
    """Whether the loaded library's prompt kernel runs this head size (asked once per size,
    not per span and layer)."""
    return bool(torch.ops.tokenline.prompt_attention_fits(head_dim))


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA on [B, L, heads, D] layouts (the pool's); ``mask=None`` means causal, L == S.

    Decode calls (one query per request) on CPU run in float32 whatever the model dtype:
    torch's bf16 SDPA is several times slower there for that shape (1.3 vs 0.3 ms a layer at
    batch 32 on an AVX512_BF16 EPYC), and float32 is the more exact of the two. Prefill keeps
    the model dtype, where both are as fast and HF's bf16 numerics are the reference.
    """
    dtype = q.dtype  # the pool may store K/V in another dtype than the model computes in
    is_cpu_decode = q.device.type == "cpu" and q.shape[1] == 1
    compute = torch.float32 if is_cpu_decode else dtype
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(compute),
        k.transpose(1, 2).to(compute),
        v.transpose(1, 2).to(compute),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).to(dtype)


def pads_prefix(prefix_len: int, length: int) -> bool:
    """Whether a chunk after cached tokens is cheaper as one causal call over queries
    zero-padded to the prefix's length: the padding's wasted half-square of scores (P²/2)
    costs less than the split's second call and merge while the prefix P is at most half
    the chunk. 2-core Xeon with AMX, bf16, the 0.5B shape's heads: a 450-token chunk after
    1 / 128 / 225 cached tokens 3.2 / 3.2 / 3.2 ms split against 1.9 / 2.0 / 2.7 padded,
    while 256 after 256 is 1.2 against 1.6 and 64 after 512 0.5 against 2.7."""
    return 0 < 2 * prefix_len <= length


def _padded_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """[1, L, heads, D]: queries at positions ``prefix_len..`` over their prefix and their
    own keys (``k``, ``v`` [prefix_len + L, kv_heads, D]) as one causal call, with zero
    queries standing in for the prefix's rows: with as many queries as keys, causal is
    exact, and the padded rows' outputs are dropped."""
    padded = q.new_zeros(1, prefix_len + q.shape[1], *q.shape[2:])
    padded[:, prefix_len:] = q
    return _sdpa(padded, k.unsqueeze(0), v.unsqueeze(0), None, scale)[:, prefix_len:]


def _prefix_then_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """[1, L, heads, D]: queries at positions ``prefix_len..`` (``q`` [1, L, heads, D]) over
    their cached prefix and their own causal keys (``k``, ``v`` [prefix_len + L, kv_heads,
    D]), as two calls of torch's CPU flash kernel merged by their log-sum-exps.

    The one masked call this replaces cannot skip a block: it scores every query against
    every key, the causal triangle's upper half included, and converts the boolean mask
    first; the prefix call has no mask and the causal call skips the upper half's blocks.
    A 1,024-token chunk after 1,024 cached tokens of the 0.5B shape: 22.9 ms a layer with
    the mask, 16.5 ms split (2-core Xeon with AMX, bf16). The merge runs in float32.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    dtype = q.dtype
    query = q.transpose(1, 2)  # [1, heads, L, D]
    keys, values = (
        k.to(dtype).unsqueeze(0).transpose(1, 2),
        v.to(dtype).unsqueeze(0).transpose(1, 2),
    )
    old, old_lse = flash(query, keys[:, :, :prefix_len], values[:, :, :prefix_len], scale=scale)
    new, new_lse = flash(
        query, keys[:, :, prefix_len:], values[:, :, prefix_len:], is_causal=True, scale=scale
    )
    top = torch.maximum(old_lse, new_lse)
    old_weight, new_weight = (old_lse - top).exp(), (new_lse - top).exp()
    total = old_weight + new_weight
    merged = old.float() * (old_weight / total).unsqueeze(-1)
    merged += new.float() * (new_weight / total).unsqueeze(-1)
    return merged.to(dtype).transpose(1, 2)


def _decode_one_by_one(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """[B, heads, D]: each decode query ([B, heads, D]) over its own keys only, one SDPA
    call per request, so no row depends on the others' lengths."""
    outs = []
    for b, request_slots in enumerate(slots):
        keys = k_buf.index_select(0, request_slots).unsqueeze(0)
        values = v_buf.index_select(0, request_slots).unsqueeze(0)
        visible = torch.ones(1, 1, 1, len(request_slots), dtype=torch.bool, device=q.device)
        outs.append(_sdpa(q[b : b + 1].unsqueeze(1), keys, values, visible, scale)[:, 0])
    return torch.cat(outs)


def _extend_span(
    start: int, length: int, seq_len: int, slots: torch.Tensor, window: int | None
) -> ExtendSpan:
    """Queries at positions ``prefix_len..seq_len-1`` over the keys any of them sees: all
    of the context, or under a ``window`` only from the first query's window on. A mask is
    built only where the forward's SDPA call reads one: a window that trims keys, or a
    long prefix off CPU (a short one is padded over anywhere, a long one on CPU split by
    ``_prefix_then_causal``)."""
    prefix_len = seq_len - length
    unwindowed = window is None or (prefix_len == 0 and window >= length)
    no_mask = prefix_len == 0 or pads_prefix(prefix_len, length) or slots.device.type == "cpu"
    if unwindowed and no_mask:
        return ExtendSpan(start, length, prefix_len, slots, None)  # causality alone
    first_key = 0 if window is None else max(0, prefix_len - window + 1)
    mask = extend_mask(first_key, prefix_len, seq_len, window, slots.device)
    return ExtendSpan(start, length, prefix_len, slots[first_key:], mask)


def extend_mask(
    first_key: int, prefix_len: int, seq_len: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[seq_len - prefix_len, seq_len - first_key] bool: which keys from ``first_key`` on
    each query at ``prefix_len..seq_len-1`` sees, causally and within ``window``."""
    keys = torch.arange(first_key, seq_len, device=device)
    queries = torch.arange(prefix_len, seq_len, device=device)
    mask = keys[None, :] <= queries[:, None]  # causal with an offset
    if window is not None:
        mask &= keys[None, :] > queries[:, None] - window
    return mask


def _decode_group(rows: list[int], slots: list[torch.Tensor], whole_step: bool) -> DecodeGroup:
    device = slots[0].device
    seq_lens = torch.tensor([len(s) for s in slots], device=device)
    table = pad_sequence(slots, batch_first=True, padding_value=0)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    return DecodeGroup(rows_t, slots, table.to(torch.int64).contiguous(), seq_lens, whole_step)
