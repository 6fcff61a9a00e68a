"""The bf16 prompt-attention kernel (``ops/csrc/prompt_attention.cpp``) against float64
attention, and the torch backend's choice of it for prefill spans."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention import torch_backend
from services.scheduler.model_executor.attention.torch_backend import TorchAttentionBackend
from services.scheduler.model_executor.forward_batch import ForwardBatch
from tests.scheduler.conftest import needs_compiler

BF16_EPS = torch.finfo(torch.bfloat16).eps


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """[L, H, D] in float64: queries at positions S - L .. S - 1 over keys [S, kv_heads, D],
    each up to its own position."""
    length, heads, _ = q.shape
    keys_len, kv_heads, _ = k.shape
    group = heads // kv_heads
    keys = k.double().repeat_interleave(group, dim=1)
    values = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    positions = keys_len - length + torch.arange(length)
    visible = torch.arange(keys_len)[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values)


@pytest.fixture
def prompt_kernel(kernel_model_dir: Path) -> None:
    """The compiled library is loaded; skips where it has no prompt kernel (no AVX512-BF16)."""
    if not torch.ops.tokenline.prompt_attention_fits(64):
        pytest.skip("the prompt kernel is built only at the avx512_bf16 ISA level")


@needs_compiler
@pytest.mark.usefixtures("prompt_kernel")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(14, 2, 64), (4, 4, 128), (4, 1, 256)],
    ids=["group7-d64", "group1-d128", "group4-d256"],
)
@pytest.mark.parametrize(
    ("length", "keys"),
    [(1, 1), (16, 16), (17, 17), (31, 31), (32, 32), (33, 33), (15, 47), (40, 100), (90, 240)],
)
def test_the_prompt_kernel_is_within_a_rounding_at_every_tile_edge(
    heads: int, kv_heads: int, head_dim: int, length: int, keys: int
) -> None:
    """Lengths around the kernel's 16-query blocks and 32-key tiles, with and without a
    prefix before the queries, within two bf16 roundings of the exact attention."""
    gen = torch.Generator().manual_seed(length * 1000 + keys)
    q = torch.randn(length, heads, head_dim, generator=gen).bfloat16()
    k = torch.randn(keys, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(keys, kv_heads, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    got = torch.ops.tokenline.prompt_attention(q, k, v, scale)
    exact = exact_attention(q, k, v, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    error = (got.double() - exact).abs().max().item()
    assert error <= 2 * BF16_EPS * exact.abs().max().item()


@needs_compiler
@pytest.mark.usefixtures("prompt_kernel")
def test_the_prompt_kernel_reads_keys_in_place_with_a_slot_stride() -> None:
    """Keys and values as the pool holds them: a layer's [N, kv_heads, D] with other heads'
    rows between, read as strided views without a copy."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(20, 8, 64, generator=gen).bfloat16()
    wide = torch.randn(50, 4, 64, generator=gen).bfloat16()  # heads 0-1 keys, 2-3 values
    k, v = wide[:, :2], wide[:, 2:]
    assert not k.is_contiguous()
    got = torch.ops.tokenline.prompt_attention(q, k, v, 0.125)
    exact = exact_attention(q, k.contiguous(), v.contiguous(), 0.125)
    assert (got.double() - exact).abs().max() <= 2 * BF16_EPS * exact.abs().max()


@needs_compiler
@pytest.mark.usefixtures("prompt_kernel")
def test_the_prompt_kernel_refuses_what_it_cannot_compute() -> None:
    op = torch.ops.tokenline.prompt_attention
    q = torch.randn(4, 4, 64).bfloat16()
    kv = torch.randn(6, 2, 64).bfloat16()
    cases = [
        (q.float(), kv.float(), "takes bf16"),
        (q, kv[:3], "1 <= L <= S"),
        (torch.randn(4, 3, 64).bfloat16(), kv, "multiple of kv_heads"),
        (torch.randn(4, 4, 48).bfloat16(), torch.randn(6, 2, 48).bfloat16(), "head_dim 64"),
    ]
    for query, keys, message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(query, keys, keys, 0.125)


@needs_compiler
def test_the_override_decides_where_the_kernel_is_chosen(
    monkeypatch: pytest.MonkeyPatch, kernel_model_dir: Path
) -> None:
    """``torch`` keeps torch's flash kernel whatever the CPU; unset, a CPU with AMX keeps it."""
    monkeypatch.setenv("TOKENLINE_PROMPT_ATTENTION", "torch")
    assert not torch_backend.prompt_kernel_pays()
    monkeypatch.delenv("TOKENLINE_PROMPT_ATTENTION")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert not torch_backend.prompt_kernel_pays()
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    fits = bool(torch.ops.tokenline.prompt_attention_fits(64))
    assert torch_backend.prompt_kernel_pays() == fits


@needs_compiler
@pytest.mark.usefixtures("prompt_kernel")
@pytest.mark.parametrize(
    "spec",
    [[(0, 70)], [(30, 90)], [(150, 40)], [(0, 33), (9, 1), (100, 50), (0, 1)]],
    ids=["prompt", "short-prefix", "long-prefix", "mixed"],
)
def test_the_backend_runs_bf16_prefill_spans_on_the_kernel(
    monkeypatch: pytest.MonkeyPatch, spec: list[tuple[int, int]]
) -> None:
    """Chosen by the override (as on a CPU without AMX), every prefill span of a bf16 step
    goes to the kernel, after a cached prefix too, within two bf16 roundings of the exact
    attention over the pool; one-token requests stay on the decode path."""
    monkeypatch.setenv("TOKENLINE_PROMPT_ATTENTION", "kernel")
    backend = TorchAttentionBackend(decode_kernel=True)
    assert backend.prompt_kernel
    heads, kv_heads, head_dim, slots_total = 14, 2, 64, 512
    gen = torch.Generator().manual_seed(len(spec))
    pool = KVPool(slots_total, 1, kv_heads, head_dim, torch.bfloat16)
    pool.k_buffers[0].copy_(torch.randn(slots_total, kv_heads, head_dim, generator=gen))
    pool.v_buffers[0].copy_(torch.randn(slots_total, kv_heads, head_dim, generator=gen))
    free = torch.randperm(slots_total, generator=gen).tolist()
    slots = [[free.pop() for _ in range(prefix + length)] for prefix, length in spec]
    batch = ForwardBatch.build([[0] * n for _, n in spec], [p for p, _ in spec], slots)
    # q as a projection's view: the query heads of a wider row, not contiguous
    qkv = torch.randn(batch.num_tokens, heads + 2 * kv_heads, head_dim, generator=gen)
    q = qkv.bfloat16()[:, :heads]
    k = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(batch.num_tokens, kv_heads, head_dim, generator=gen).bfloat16()
    meta = backend.plan(batch)
    assert len(meta.extends) == sum(1 for _, length in spec if length > 1)
    assert meta.extends and all(
        backend._prompt_kernel_fits(s, q, pool.k_buffers[0]) for s in meta.extends
    )
    out = backend.forward(q, k, v, layer=0, meta=meta, kv_pool=pool, scale=head_dim**-0.5)
    start = 0
    for (prefix, length), request_slots in zip(spec, slots, strict=True):
        keys = pool.k_buffers[0][request_slots]
        values = pool.v_buffers[0][request_slots]
        exact = exact_attention(q[start : start + length], keys, values, head_dim**-0.5)
        error = (out[start : start + length].double() - exact).abs().max()
        assert error <= 2 * BF16_EPS * exact.abs().max(), (prefix, length)
        start += length
