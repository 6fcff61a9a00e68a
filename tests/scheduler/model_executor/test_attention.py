"""Attention backends against a naive per-request reference over the KV pool."""

from __future__ import annotations

import importlib
import itertools
import shutil
from pathlib import Path

import pytest
import torch

from services.scheduler.__main__ import parse_args as scheduler_args
from services.scheduler.mem_cache.kv_pool import KVPool
from services.scheduler.model_executor.attention import create_attention_backend, torch_backend
from services.scheduler.model_executor.attention.base import AttentionBackend
from services.scheduler.model_executor.attention.torch_backend import TorchAttentionBackend
from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.ops.cpu_kernels import find_compiler, is_registered
from services.scheduler.transport.engine_build import build_scheduler
from tests.scheduler.conftest import NO_COMPILER, needs_compiler

HEADS, KV_HEADS, HEAD_DIM, NUM_SLOTS = 4, 2, 16, 256
SCALE = HEAD_DIM**-0.5

# (prefix_len, new tokens) per request: decode-only, prefill-only, chunked, and mixed batches.
CASES = {
    "decode_only": [(5, 1), (17, 1), (1, 1), (40, 1)],
    "prefill_only": [(0, 7), (0, 1), (0, 19)],
    "chunked": [(12, 9), (3, 30)],
    "mixed": [(0, 11), (9, 1), (20, 6), (33, 1), (0, 1), (2, 2)],
}


def naive_attention(q: torch.Tensor, batch: ForwardBatch, pool: KVPool, layer: int) -> torch.Tensor:
    """Reference in float64: explicit scores, offset-causal mask, softmax, per request."""
    out, start = [], 0
    per_request = zip(batch.seq_lens, batch.extend_lens, batch.kv_slots, strict=True)
    for seq_len, length, slots in per_request:
        prefix = seq_len - length
        keys = pool.k_buffers[layer][slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        values = pool.v_buffers[layer][slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        queries = q[start : start + length].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * SCALE
        visible = torch.arange(seq_len)[None, :] <= (prefix + torch.arange(length))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += length
    return torch.cat(out).float()


def random_step(
    spec: list[tuple[int, int]], seed: int = 0
) -> tuple[ForwardBatch, KVPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool with random cached K/V and a batch over shuffled, non-contiguous slots."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(NUM_SLOTS, 2, KV_HEADS, HEAD_DIM, torch.float32)
    for layer in range(2):
        pool.k_buffers[layer].normal_(generator=gen)
        pool.v_buffers[layer].normal_(generator=gen)
    free = torch.randperm(NUM_SLOTS, generator=gen).tolist()
    slots, new_ids = [], []
    for prefix, length in spec:
        slots.append([free.pop() for _ in range(prefix + length)])
        new_ids.append([0] * length)
    batch = ForwardBatch.build(new_ids, [p for p, _ in spec], slots)
    num_tokens = batch.num_tokens
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=gen)
    return batch, pool, q, k, v


def run_backend(
    backend: AttentionBackend,
    batch: ForwardBatch,
    pool: KVPool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int = 1,
) -> torch.Tensor:
    meta = backend.plan(batch)
    return backend.forward(q, k, v, layer=layer, meta=meta, kv_pool=pool, scale=SCALE)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["padded", "invariant"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_backend_matches_naive(case: str, batch_invariant: bool) -> None:
    batch, pool, q, k, v = random_step(CASES[case])
    untouched_before = pool.k_buffers[0].clone()
    backend = create_attention_backend("torch", "cpu", batch_invariant)
    out = run_backend(backend, batch, pool, q, k, v)
    # The backend stored the new K/V exactly where the batch said, in the right layer only.
    assert torch.equal(pool.k_buffers[1][batch.out_cache_loc], k)
    assert torch.equal(pool.v_buffers[1][batch.out_cache_loc], v)
    assert torch.equal(pool.k_buffers[0], untouched_before)
    torch.testing.assert_close(out, naive_attention(q, batch, pool, 1), atol=1e-5, rtol=1e-5)


def test_torch_backend_bf16_pool_close_to_naive() -> None:
    batch, pool, q, k, v = random_step(CASES["mixed"], seed=1)
    pool.k_buffers = [b.bfloat16() for b in pool.k_buffers]
    pool.v_buffers = [b.bfloat16() for b in pool.v_buffers]
    out = run_backend(create_attention_backend("torch", "cpu"), batch, pool, q, k, v)
    torch.testing.assert_close(out, naive_attention(q, batch, pool, 1), atol=2e-2, rtol=2e-2)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("sdpa2", "cpu")


def test_flash_attn_refuses_batch_invariance_by_name() -> None:
    with pytest.raises(ValueError, match="--batch-invariant needs --attention-backend torch"):
        create_attention_backend("flash_attn", "cpu", batch_invariant=True)


def test_flash_attn_backend_importable_and_refuses_cpu() -> None:
    module = importlib.import_module(
        "services.scheduler.model_executor.attention.flash_attn_backend"
    )
    assert module.FlashAttnBackend.name == "flash_attn"
    with pytest.raises(RuntimeError, match="flash_attn"):
        create_attention_backend("flash_attn", "cpu")


def _flash_kernel_installed() -> bool:
    from services.scheduler.model_executor.attention.flash_attn_backend import load_varlen_kernel

    try:
        load_varlen_kernel()
    except RuntimeError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", sorted(CASES))
def test_flash_attn_backend_matches_naive(case: str) -> None:
    if not _flash_kernel_installed():
        pytest.skip("neither vllm-flash-attn nor flash-attn is installed")
    batch, pool, q, k, v = random_step(CASES[case])
    batch_cuda = ForwardBatch.build(
        [[0] * n for n in batch.extend_lens],
        [s - n for s, n in zip(batch.seq_lens, batch.extend_lens, strict=True)],
        [s.tolist() for s in batch.kv_slots],
        device="cuda",
    )
    pool.k_buffers = [b.cuda().bfloat16() for b in pool.k_buffers]
    pool.v_buffers = [b.cuda().bfloat16() for b in pool.v_buffers]
    backend = create_attention_backend("flash_attn", "cuda")
    out = run_backend(backend, batch_cuda, pool, *(t.cuda().bfloat16() for t in (q, k, v)))
    pool.k_buffers = [b.float().cpu() for b in pool.k_buffers]
    pool.v_buffers = [b.float().cpu() for b in pool.v_buffers]
    expected = naive_attention(q, batch, pool, 1)  # over the bf16-rounded K/V the kernel saw
    torch.testing.assert_close(out.float().cpu(), expected, atol=3e-2, rtol=3e-2)


@pytest.fixture(params=["sdpa", "kernel"])
def decode_backend(request: pytest.FixtureRequest) -> AttentionBackend:
    """The torch backend on each batch-invariant decode path: SDPA one request at a time
    (``--batch-invariant``), or the compiled kernel (always per request)."""
    if request.param == "sdpa":
        return create_attention_backend("torch", "cpu", batch_invariant=True)
    if find_compiler() is None:
        pytest.skip(NO_COMPILER)
    return request.getfixturevalue("kernel_backend")


@pytest.mark.parametrize("seed", range(6))
def test_a_bf16_decode_row_is_the_same_alone_and_padded_in_a_batch(
    seed: int, decode_backend: AttentionBackend
) -> None:
    """Greedy tokens must not depend on what else is decoding: a request's decode output
    is bit-identical alone and beside longer requests, on both invariant decode paths.
    The padded SDPA call of the default mode is not (on an AMX Xeon its float32 result
    moved with the padding), which is why ``--batch-invariant`` decodes one by one."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = 64  # the default model's: the kernel's blocking depends on it
    lengths = [40, 300, 90]  # keys of each request after this step
    pool = KVPool(sum(lengths), 2, KV_HEADS, head_dim, torch.bfloat16)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=gen))
    starts = [0, *itertools.accumulate(lengths)]
    slots = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    q = torch.randn(len(lengths), HEADS, head_dim, generator=gen).bfloat16()
    k = torch.randn(len(lengths), KV_HEADS, head_dim, generator=gen).bfloat16()
    v = torch.randn(len(lengths), KV_HEADS, head_dim, generator=gen).bfloat16()
    backend = decode_backend

    def decode(rows: list[int], scale: float) -> torch.Tensor:
        batch = ForwardBatch.build(
            [[0] for _ in rows], [lengths[i] - 1 for i in rows], [slots[i] for i in rows]
        )
        meta = backend.plan(batch)
        return backend.forward(
            q[rows], k[rows], v[rows], layer=1, meta=meta, kv_pool=pool, scale=scale
        )

    for scale in (head_dim**-0.5, 0.25):
        alone = decode([0], scale)[0]
        assert torch.equal(decode([0, 1, 2], scale)[0], alone)
        assert torch.equal(decode([2, 0, 1], scale)[1], alone)


# ---- the compiled decode kernel (csrc/decode_attention.cpp) ---------------------------


@pytest.fixture
def kernel_backend(kernel_model_dir: Path) -> TorchAttentionBackend:
    """A torch backend with the compiled decode kernel, as the engine sets it up."""
    assert is_registered("decode_attention")
    backend = TorchAttentionBackend()
    backend.decode_kernel = True
    return backend


@needs_compiler
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_decode_kernel_matches_naive(case: str, kernel_backend: TorchAttentionBackend) -> None:
    batch, pool, q, k, v = random_step(CASES[case], seed=3)
    out = run_backend(kernel_backend, batch, pool, q, k, v)
    torch.testing.assert_close(out, naive_attention(q, batch, pool, 1), atol=1e-5, rtol=1e-5)


@needs_compiler
def test_a_decode_only_step_reads_and_writes_whole_with_the_rows_a_mixed_step_gives(
    kernel_backend: TorchAttentionBackend,
) -> None:
    """A step of decode tokens alone skips the gather and scatter by rows; its rows are
    what the same requests get beside a prompt chunk (the kernel computes each alone)."""
    mixed, pool, q, k, v = random_step([(9, 1), (0, 11), (33, 1)], seed=5)
    assert not kernel_backend.plan(mixed).decode.whole_step  # type: ignore[union-attr]
    mixed_out = run_backend(kernel_backend, mixed, pool, q, k, v)
    decode_rows = [0, 12]
    slots = [mixed.kv_slots[0].tolist(), mixed.kv_slots[2].tolist()]
    alone = ForwardBatch.build([[0], [0]], [9, 33], slots)
    assert kernel_backend.plan(alone).decode.whole_step  # type: ignore[union-attr]
    alone_out = run_backend(
        kernel_backend, alone, pool, q[decode_rows], k[decode_rows], v[decode_rows]
    )
    assert torch.equal(alone_out, mixed_out[decode_rows])


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_decode_kernel_in_half_precision_is_as_close_as_sdpa(
    dtype: torch.dtype, kernel_backend: TorchAttentionBackend
) -> None:
    """In the pool's dtype the kernel accumulates in float32, as the SDPA path computes
    decode in float32: both land within one rounding of the output dtype of the exact."""
    batch, pool, q, k, v = random_step(CASES["decode_only"] * 3, seed=4)
    pool.k_buffers = [b.to(dtype) for b in pool.k_buffers]
    pool.v_buffers = [b.to(dtype) for b in pool.v_buffers]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with_kernel = run_backend(kernel_backend, batch, pool, q, k, v).float()
    with_sdpa = run_backend(create_attention_backend("torch", "cpu"), batch, pool, q, k, v)
    pool.k_buffers = [b.float() for b in pool.k_buffers]
    pool.v_buffers = [b.float() for b in pool.v_buffers]
    exact = naive_attention(q.float(), batch, pool, 1)
    tolerance = 2 * torch.finfo(dtype).eps
    assert (with_kernel - exact).abs().max() <= tolerance * exact.abs().max()
    torch.testing.assert_close(with_kernel, with_sdpa.float(), atol=tolerance, rtol=tolerance)


@needs_compiler
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(14, 2, 64), (4, 4, 128), (16, 8, 128), (8, 2, 32), (10, 2, 96), (6, 3, 48)],
    ids=["group7-d64", "group1-d128", "group2-d128", "group4-d32", "group5-d96", "d48-float-path"],
)
def test_the_bf16_decode_kernel_is_within_a_rounding_at_every_tile_edge(
    kernel_model_dir: Path, heads: int, kv_heads: int, head_dim: int
) -> None:
    """bf16 pools take the pair-dot-product path where head_dim is a multiple of 32 and the
    build has AVX512-BF16 (16 keys a tile, two keys a weighted-sum step, the group's rows in
    register-sized chunks: 4 + 3 of 7 at head_dim 64, 2 + 2 + 1 of 5 at 96): lengths around
    a tile and odd lengths, against the exact float64 attention, within two bf16 roundings;
    head_dim 48 takes the float path, held to the same bound."""
    gen = torch.Generator().manual_seed(head_dim)
    lengths = [1, 2, 15, 16, 17, 31, 33, 190]
    num_slots = sum(lengths) + 5
    k_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16()
    v_buf = torch.randn(num_slots, kv_heads, head_dim, generator=gen).bfloat16()
    order = torch.randperm(num_slots, generator=gen)
    table = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    start = 0
    for row, length in enumerate(lengths):
        table[row, :length] = order[start : start + length]
        start += length
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).bfloat16()
    scale = head_dim**-0.5
    got = torch.ops.tokenline.decode_attention(q, k_buf, v_buf, table, torch.tensor(lengths), scale)
    group = heads // kv_heads
    for row, length in enumerate(lengths):
        keys = k_buf[table[row, :length]].double().repeat_interleave(group, dim=1)
        values = v_buf[table[row, :length]].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[row].double(), keys) * scale
        exact = torch.einsum("hs,shd->hd", scores.softmax(dim=-1), values)
        error = (got[row].double() - exact).abs().max()
        assert error <= 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max(), (row, length)


@needs_compiler
def test_the_decode_kernel_refuses_what_would_read_outside_the_pool(
    kernel_model_dir: Path,
) -> None:
    op = torch.ops.tokenline.decode_attention
    q = torch.randn(2, HEADS, HEAD_DIM)
    buf = torch.randn(8, KV_HEADS, HEAD_DIM)
    table = torch.tensor([[0, 1, 2], [3, 4, 0]])
    assert op(q, buf, buf, table, torch.tensor([3, 2]), SCALE).shape == q.shape
    cases = [
        (torch.tensor([[0, 1, 8], [3, 4, 0]]), torch.tensor([3, 2]), "slot out of range"),
        (torch.tensor([[0, 1, -1], [3, 4, 0]]), torch.tensor([3, 2]), "slot out of range"),
        (table, torch.tensor([4, 2]), "seq_lens out of range"),
        (table, torch.tensor([0, 2]), "seq_lens out of range"),
        (table.int(), torch.tensor([3, 2]), "int64"),
    ]
    for slots, lens, message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(q, buf, buf, slots, lens, SCALE)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        op(torch.randn(2, 3, HEAD_DIM), buf, buf, table, torch.tensor([3, 2]), SCALE)


@needs_compiler
def test_the_engine_attaches_the_decode_kernel_when_its_library_is_built(
    kernel_model_dir: Path, default_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(default_model_dir, model_dir, ignore=shutil.ignore_patterns("kernels"))
    shutil.copytree(kernel_model_dir / "kernels", model_dir / "kernels")
    scheduler, _ = build_scheduler(scheduler_args(["--model", str(model_dir)]))
    assert scheduler.runner.model.attn_backend.decode_kernel
    assert scheduler.sampler.kernel is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("prefix", "length", "padded"), [(150, 90, False), (45, 90, True), (7, 90, True)]
)
def test_a_chunk_after_its_prefix_is_as_close_as_the_masked_call(
    dtype: torch.dtype, prefix: int, length: int, padded: bool
) -> None:
    """A prefill chunk after cached tokens runs, with no mask, as one causal call over
    zero-padded queries (a prefix of at most half the chunk) or as two flash calls (prefix,
    then causal) merged by their log-sum-exps; against float64 either is as close as one
    masked call is."""
    batch, pool, q, k, v = random_step([(prefix, length)], seed=3)
    pool.k_buffers = [b.to(dtype) for b in pool.k_buffers]
    pool.v_buffers = [b.to(dtype) for b in pool.v_buffers]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    backend = TorchAttentionBackend()
    meta = backend.plan(batch)
    (span,) = meta.extends
    assert span.prefix_len == prefix and span.mask is None  # the forward pads or splits it
    assert torch_backend.pads_prefix(span.prefix_len, span.length) is padded
    out = run_backend(backend, batch, pool, q, k, v).float()
    reference = naive_attention(q.float(), batch, pool, 1)
    span_k = pool.k_buffers[1].index_select(0, span.slots).unsqueeze(0)
    span_v = pool.v_buffers[1].index_select(0, span.slots).unsqueeze(0)
    mask = torch_backend.extend_mask(0, prefix, prefix + length, None, q.device)
    masked = torch_backend._sdpa(q.unsqueeze(0), span_k, span_v, mask, SCALE)[0].float()
    masked_error = (masked - reference).abs().max().item()
    error = (out - reference).abs().max().item()
    assert error <= 2 * masked_error + (1e-6 if dtype == torch.float32 else 4e-3)


def test_a_windowed_chunk_keeps_its_masked_call() -> None:
    batch, *_ = random_step([(40, 10)])
    (span,) = TorchAttentionBackend().plan(batch, window=16).extends
    assert span.mask is not None and span.mask.shape == (10, 25)  # keys 25..49 of 50
