"""Serving linears: few row buckets, little padding, and packed oneDNN weights that give
the dense layer's result on the real rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scheduler.model_executor.models.linear import (
    SLOW_BAND,
    Linear,
    can_pack,
    prepare_linears,
    row_bucket,
)
from services.scheduler.model_executor.models.loader import load_model

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(
    not can_pack(CPU, torch.float32), reason="this torch build has no oneDNN linear packing"
)


def test_buckets_are_few_and_waste_at_most_a_sixteenth() -> None:
    buckets = {row_bucket(n) for n in range(1, 1025)}
    assert len(buckets) <= 112
    for n in range(1, 1025):
        assert n <= row_bucket(n) <= n * 17 / 16
        assert row_bucket(row_bucket(n)) == row_bucket(n)
    assert [row_bucket(n) for n in (1, 16, 17, 33, 100, 129, 500, 1024)] == [
        1,
        16,
        17,
        34,
        100,
        136,
        512,
        1024,
    ]


def test_bf16_packing_follows_what_the_cpu_supports() -> None:
    """An AVX2-only CPU cannot pack bf16 weights (oneDNN refuses), so it is not asked to."""
    assert can_pack(CPU, torch.bfloat16) == (
        can_pack(CPU, torch.float32) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_tiles_give_each_row_the_same_bits_at_any_row_count(dtype: torch.dtype) -> None:
    """In batch-invariant mode every matmul sees the same shape, so a row's result is the
    same bits whether it comes alone, first or last among many."""
    torch.manual_seed(2)
    layer = Linear(96, 200, dtype=dtype)
    rows = torch.randn(70, 96, dtype=dtype)
    expected = layer(rows).float()
    prepare_linears(layer, CPU, dtype, batch_invariant=True)
    alone = layer(rows[:1])
    assert torch.equal(layer(rows)[:1], alone)
    assert torch.equal(layer(torch.cat([rows[1:40], rows[:1]]))[-1:], alone)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(layer(rows).float(), expected, rtol=tolerance, atol=tolerance)


def test_a_padded_linear_gives_its_unpadded_rows() -> None:
    torch.manual_seed(0)
    layer = Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    expected = layer(x)  # padding off
    layer.pad_rows = True
    got = layer(x)
    assert got.shape == (37, 32)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_gives_the_dense_result(dtype: torch.dtype, bias: bool) -> None:
    if not can_pack(CPU, dtype):
        pytest.skip(f"this CPU or torch build does not pack {dtype} weights for oneDNN")
    torch.manual_seed(1)
    layer = Linear(96, 200, bias=bias, dtype=dtype)
    x = torch.randn(64, 96, dtype=dtype)[::2]  # 32 rows, not contiguous
    expected = layer(x)
    layer.pack(keep_dense=False)
    layer.pad_rows = True
    assert layer.weight is None  # the dense copy is freed
    got = layer(x)
    assert got.shape == (32, 200) and got.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=2e-2)
    else:  # only the order of summation differs
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_packing
def test_loading_on_cpu_packs_every_linear_and_keeps_the_tied_embedding(
    default_model_dir: Path,
) -> None:
    for dtype in [d for d in (torch.bfloat16, torch.float32) if can_pack(CPU, d)]:
        model, config = load_model(default_model_dir, dtype)
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        assert layers and all(m.packed_weight is not None and m.pad_rows for m in layers)
        assert config.tie_word_embeddings
        assert model.lm_head.weight is model.model.embed_tokens.weight  # shared: kept dense
        projections = [m for m in layers if m is not model.lm_head]
        assert projections and all(m.weight is None for m in projections)
        # The packed LM head scores a hidden row as the dense embedding matrix does.
        hidden = torch.randn(3, config.hidden_size, dtype=dtype)
        dense = torch.nn.functional.linear(hidden, model.model.embed_tokens.weight).float()
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(
            model.compute_logits(hidden).float(), dense, rtol=tolerance, atol=tolerance
        )


def test_fp16_on_cpu_is_padded_and_cuda_is_left_plain() -> None:
    model = torch.nn.Sequential(
        Linear(8, 8, dtype=torch.float16), Linear(8, 4, dtype=torch.float16)
    )
    assert prepare_linears(model, torch.device("cuda"), torch.float16) == "plain"
    assert not any(m.pad_rows or m.packed_weight is not None for m in model)
    assert prepare_linears(model, CPU, torch.float16) == "padded"
    assert all(m.pad_rows and m.packed_weight is None and m.weight is not None for m in model)


@pytest.mark.parametrize(("in_width", "out_width"), [(192, 64), (64, 512)])
def test_a_packed_linear_in_the_slow_band_gives_the_dense_result(
    in_width: int, out_width: int
) -> None:
    """A chunk of 513-1,280 rows through a narrow projection runs in 512-row slices
    (``SLOW_BAND``); a wide one whole. Either way the rows get the dense layer's result."""
    if not can_pack(CPU, torch.bfloat16):
        pytest.skip("this CPU or torch build does not pack bf16 weights for oneDNN")
    torch.manual_seed(3)
    layer = Linear(in_width, out_width, bias=True, dtype=torch.bfloat16)
    x = torch.randn(1000, in_width, dtype=torch.bfloat16)
    expected = layer(x).float()
    prepare_linears(layer, CPU, torch.bfloat16)
    assert row_bucket(1000) in range(SLOW_BAND[0], SLOW_BAND[1] + 1)
    got = layer(x)
    assert got.shape == (1000, out_width)
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=2e-2)
