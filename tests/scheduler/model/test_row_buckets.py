"""Row buckets: few distinct shapes, little padding, the same result on the real rows."""

from __future__ import annotations

from pathlib import Path

import torch

from services.scheduler.model.loader import load_model
from services.scheduler.model.row_buckets import BucketedLinear, row_bucket


def test_buckets_are_few_and_waste_at_most_an_eighth() -> None:
    buckets = {row_bucket(n) for n in range(1, 1025)}
    assert len(buckets) <= 64
    for n in range(1, 1025):
        assert n <= row_bucket(n) <= n * 9 / 8
    assert [row_bucket(n) for n in (1, 8, 9, 33, 100, 500, 1024)] == [1, 8, 9, 36, 104, 512, 1024]


def test_a_padded_linear_gives_its_unpadded_rows() -> None:
    torch.manual_seed(0)
    layer = BucketedLinear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(37, 64, dtype=torch.bfloat16)
    expected = layer(x)  # padding off
    layer.pad_rows = True
    got = layer(x)
    assert got.shape == (37, 32)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_loading_in_bf16_on_cpu_turns_padding_on_and_float32_leaves_it_off(
    default_model_dir: Path,
) -> None:
    for dtype, padded in ((torch.bfloat16, True), (torch.float32, False)):
        model, _ = load_model(default_model_dir, dtype)
        layers = [m for m in model.modules() if isinstance(m, BucketedLinear)]
        assert layers and all(m.pad_rows is padded for m in layers)
