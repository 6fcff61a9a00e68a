"""The compiled row kernels (csrc/fused_rows.cpp): RMSNorm, RoPE and SiLU-and-multiply give
the eager layers' results (rounded where the eager ops round), each row the same bits alone
or among many, and a native model switched to them gives the eager model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.scheduler.model_executor.forward_batch import ForwardBatch
from services.scheduler.model_executor.models.layers import (
    MLP,
    Attention,
    RMSNorm,
    apply_rotary,
)
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.row_kernels import use_row_kernels
from services.scheduler.ops.cpu_kernels import is_registered
from tests.scheduler.conftest import needs_compiler
from tests.scheduler.parity import new_pool

pytestmark = needs_compiler
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# One rounding step of each dtype, relative: the kernel and eager may land a value either
# side of a rounding boundary (their float32 sums and exponentials differ in the last bits).
ULP = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.fixture(scope="module", autouse=True)
def loaded(kernel_model_dir: Path) -> None:
    assert is_registered("rms_norm") and is_registered("silu_and_mul")


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps).to(x.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


def rows(num: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``num`` rows of ``width``, each contiguous but not the whole tensor (a view into
    wider rows, as a split of a fused projection's output is), with a ragged tail."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num, width + 40, generator=gen) * 2)[:, :width].to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [896, 100])
def test_rms_norm_gives_the_eager_result(dtype: torch.dtype, width: int) -> None:
    x = rows(70, width, dtype)
    weight = (1 + 0.1 * torch.randn(width)).to(dtype)
    got = torch.ops.tokenline.rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    want = eager_rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_per_head_norm_takes_the_kernel_on_its_heads_rows(dtype: torch.dtype) -> None:
    """Qwen3's q/k norms see [tokens, heads, head_dim] views of the fused projection, whose
    heads are no one tensor of rows: with the kernel on, each head is normalised as the
    kernel normalises that row alone, within an ulp of the eager norm."""
    tokens, heads, head_dim = 9, 4, 128
    x = rows(tokens, 2 * heads * head_dim, dtype, seed=4)[:, : heads * head_dim]
    heads_view = x.view(tokens, heads, head_dim)
    norm = RMSNorm(head_dim, 1e-6).to(dtype)
    gen = torch.Generator().manual_seed(5)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(head_dim, generator=gen))
    eager = norm(heads_view)
    norm.kernel = True
    got = norm(heads_view)
    assert got.shape == heads_view.shape
    for token, head in ((0, 0), (4, 3), (8, 1)):
        row = heads_view[token, head].contiguous().view(1, head_dim)
        alone = torch.ops.tokenline.rms_norm(row, norm.weight, 1e-6)[0]
        assert torch.equal(got[token, head], alone)
    torch.testing.assert_close(got.float(), eager.float(), rtol=ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("half", [4864, 37])
def test_silu_and_mul_gives_the_eager_result(dtype: torch.dtype, half: int) -> None:
    x = rows(33, 2 * half, dtype, seed=1)
    got = torch.ops.tokenline.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (33, half)
    want = F.silu(x[:, :half]) * x[:, half:]
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (128, 64), (16, 8)])
def test_rotary_gives_the_eager_result(dtype: torch.dtype, head_dim: int, rotary_dim: int) -> None:
    """Full and partial rotary (Phi-3's), on a head view of a fused projection's output."""
    tokens, heads = 21, 3
    qkv = rows(tokens, 2 * heads * head_dim, dtype, seed=3)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    angles = torch.randn(tokens, rotary_dim // 2) * 4
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = torch.ops.tokenline.rotary(x, cos, sin)
    assert got.shape == x.shape and got.is_contiguous()
    want = apply_rotary(x, cos, sin)
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP[dtype], atol=ULP[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    x = rows(300, 2 * 896, dtype, seed=2)
    weight = (1 + 0.1 * torch.randn(2 * 896)).to(dtype)
    for op in (
        lambda t: torch.ops.tokenline.rms_norm(t, weight, 1e-6),
        torch.ops.tokenline.silu_and_mul,
    ):
        batch = op(x)
        for row in (0, 151, 299):
            assert torch.equal(op(x[row : row + 1])[0], batch[row])


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(RuntimeError, match="rms_norm: weight must be a contiguous"):
        torch.ops.tokenline.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul: the width holds gate and up"):
        torch.ops.tokenline.silu_and_mul(torch.ones(2, 7))
    with pytest.raises(RuntimeError, match=r"rows dense"):
        torch.ops.tokenline.silu_and_mul(torch.ones(8, 2).t())
    with pytest.raises(RuntimeError, match="rotary: R must be even and at most D"):
        torch.ops.tokenline.rotary(torch.ones(2, 1, 4), torch.ones(2, 6), torch.ones(2, 6))


def test_a_model_on_the_row_kernels_gives_the_eager_logits(kernel_model_dir: Path) -> None:
    model, config = load_model(kernel_model_dir, torch.float32, "cpu")
    switched = [m for m in model.modules() if isinstance(m, (RMSNorm, MLP, Attention))]
    assert use_row_kernels(model) == len(switched) > 0
    assert all(m.kernel for m in switched)
    prompt = list(range(10, 60))

    def logits() -> torch.Tensor:
        pool = new_pool(config, len(prompt))
        batch = ForwardBatch.build([prompt], [0], [pool.allocate(len(prompt))])
        return model(batch, pool, all_logits=True)

    fused = logits()
    assert use_row_kernels(model, enabled=False) == len(switched)
    # Logits here span about +-40: a norm's float32 sum taken in another order moves some by
    # up to ~5e-4 after the layers (seen: 1,499 of 6.5M entries past 3e-4).
    torch.testing.assert_close(fused, logits(), rtol=0.0, atol=1e-3)
