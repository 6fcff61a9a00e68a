"""RotaryEmbedding's cos/sin rows: gathered from tables that grow past any length, equal to
computing them per token (HF's formula), and the same row for a position whatever batch it
is in."""

from __future__ import annotations

import torch

from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.layers import RotaryEmbedding
from services.scheduler.model_executor.models.rope import RopeScaling, inv_freq

ROTARY_DIM = 64
LONGROPE = RopeScaling(
    "longrope",
    factor=4.0,
    original_max_position_embeddings=512,
    short_factor=tuple(1.0 + 0.01 * i for i in range(ROTARY_DIM // 2)),
    long_factor=tuple(1.0 + 0.5 * i for i in range(ROTARY_DIM // 2)),
    attention_factor=1.19,
)


def decode_batch(seq_lens: list[int]) -> ForwardBatch:
    """One decode token per request, at position seq_len - 1."""
    slots = [list(range(n)) for n in seq_lens]
    return ForwardBatch.build([[7]] * len(seq_lens), [n - 1 for n in seq_lens], slots)


def reference(
    positions: torch.Tensor, factors: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin rows computed for these positions alone, in HF's order of operations."""
    freqs = positions.float()[:, None] * factors[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def test_rows_match_per_token_computation_as_the_tables_grow() -> None:
    rotary = RotaryEmbedding(10000.0, ROTARY_DIM, RopeScaling())
    factors = inv_freq(10000.0, ROTARY_DIM, RopeScaling())
    for seq_lens in ([5, 9], [3000, 17], [70_000]):  # the last two reach past the tables
        batch = decode_batch(seq_lens)
        cos, sin = rotary(batch, torch.bfloat16)
        want_cos, want_sin = reference(batch.positions, factors, 1.0, torch.bfloat16)
        assert cos.shape == (len(seq_lens), ROTARY_DIM) and cos.is_contiguous()
        torch.testing.assert_close(cos, want_cos)
        torch.testing.assert_close(sin, want_sin)
    assert rotary._tables[(torch.device("cpu"), torch.bfloat16)][0].shape[0] >= 70_000


def test_a_position_gets_the_same_row_in_any_batch() -> None:
    rotary = RotaryEmbedding(10000.0, ROTARY_DIM, RopeScaling())
    alone, _ = rotary(decode_batch([40]), torch.float32)
    beside_longer, _ = rotary(decode_batch([5000, 40, 3]), torch.float32)
    assert torch.equal(alone[0], beside_longer[1])


def test_longrope_switches_to_long_factors_past_the_original_context() -> None:
    rotary = RotaryEmbedding(10000.0, ROTARY_DIM, LONGROPE)
    batch = decode_batch([100, 600])  # below and past the original 512
    cos, sin = rotary(batch, torch.float32)
    short_factors = inv_freq(10000.0, ROTARY_DIM, LONGROPE)
    long_factors = inv_freq(10000.0, ROTARY_DIM, LONGROPE, long=True)
    below, past = batch.positions[:1], batch.positions[1:]
    scale = LONGROPE.attention_factor
    for got, want in zip(
        (cos, sin), reference(below, short_factors, scale, torch.float32), strict=True
    ):
        torch.testing.assert_close(got[:1], want)
    for got, want in zip(
        (cos, sin), reference(past, long_factors, scale, torch.float32), strict=True
    ):
        torch.testing.assert_close(got[1:], want)
    short_past, _ = reference(past, short_factors, scale, torch.float32)
    assert not torch.allclose(cos[1:], short_past)  # the factors do differ there
