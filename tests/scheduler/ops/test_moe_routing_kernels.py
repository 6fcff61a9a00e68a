"""The compiled MoE routing and weighted sum (csrc/moe_routing.cpp): the eager path's pairs
in its order, its weights to the last bits of a float32 exp, its sums bit for bit in the
16-bit dtypes; a token's the same alone and in a batch; and a MoE model switched to them
gives the eager model's logits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.models.moe import SparseMoeBlock, combine, route
from services.scheduler.model_executor.row_kernels import use_row_kernels
from services.scheduler.ops.cpu_kernels import is_registered
from tests.checkpoints import build_hf_model
from tests.scheduler.conftest import needs_compiler
from tests.scheduler.model_executor.models.test_decode_copy import save_checkpoint
from tests.scheduler.parity import all_logits

pytestmark = needs_compiler
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# tokens, experts, top_k: a decode step of one request, a prefill, Qwen3-MoE's real 128 / 8.
SHAPES = [(1, 32, 4), (70, 8, 2), (300, 128, 8), (5, 60, 1)]


@pytest.fixture(scope="module", autouse=True)
def loaded(kernel_model_dir: Path) -> None:
    assert is_registered("moe_route") and is_registered("moe_combine")


def untied_logits(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Router logits with no two equal in a row, so the top-k has one answer."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]) * 0.01


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), SHAPES)
def test_route_gives_the_eager_pairs_and_weights(
    tokens: int, experts: int, top_k: int, renormalize: bool
) -> None:
    logits = untied_logits(tokens, experts)
    got = route(logits, top_k, renormalize, kernel=True)
    want = route(logits, top_k, renormalize, kernel=False)
    assert torch.equal(got.token_of, want.token_of)
    assert torch.equal(got.offsets, want.offsets)
    assert got.weights.dtype == torch.float32
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-7)
    if renormalize:
        sums = torch.zeros(tokens).index_add_(0, got.token_of, got.weights)
        torch.testing.assert_close(sums, torch.ones(tokens))


def test_route_breaks_a_tie_at_the_last_place_toward_the_lower_expert() -> None:
    # bf16 router logits tie often; experts 2, 5 and 6 tie for the second place.
    logits = torch.tensor([[0.5, 0.0, 1.0, 0.25, 0.0, 0.5, 0.5, -1.0]], dtype=torch.bfloat16)
    routing = route(logits, 2, renormalize=True, kernel=True)
    chosen = routing.offsets.diff().nonzero().flatten().tolist()
    assert chosen == [0, 2]
    # Expert 0 (logit 0.5) and expert 2 (1.0), in expert order: e^-0.5 : 1, summing to one.
    first, second = routing.weights.tolist()
    assert second / first == pytest.approx(math.exp(0.5))
    assert first + second == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "experts", "top_k"), SHAPES)
def test_combine_gives_the_eager_sums(
    dtype: torch.dtype, tokens: int, experts: int, top_k: int
) -> None:
    routing = route(untied_logits(tokens, experts, seed=1), top_k, True, kernel=False)
    outputs = torch.randn(tokens * top_k, 200, generator=torch.Generator().manual_seed(2))
    outputs = outputs.to(dtype)
    got = combine(outputs, routing, tokens, kernel=True)
    want = combine(outputs, routing, tokens, kernel=False)
    assert got.dtype == dtype and got.shape == (tokens, 200)
    if dtype == torch.float32:  # a product fused into the sum: last bits
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


def test_combine_gives_zero_to_a_token_with_no_rows() -> None:
    outputs = torch.ones(2, 40, dtype=torch.bfloat16)
    token_of = torch.tensor([0, 2])
    got = torch.ops.tokenline.moe_combine(outputs, torch.tensor([0.5, 2.0]), token_of, 3)
    assert got[0].eq(0.5).all() and got[1].eq(0).all() and got[2].eq(2).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_token_is_routed_and_summed_the_same_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    tokens, experts, top_k = 50, 32, 4
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(3)).to(dtype)
    # What expert e gives token t: outputs[t, e].
    outputs = torch.randn(tokens, experts, 96, generator=torch.Generator().manual_seed(4))
    outputs = outputs.to(dtype)

    def mix(first: int, last: int) -> torch.Tensor:
        routing = route(logits[first:last], top_k, True, kernel=True)
        expert_of = torch.repeat_interleave(torch.arange(experts), routing.offsets.diff())
        rows = outputs[first:last][routing.token_of, expert_of]
        return combine(rows, routing, last - first, kernel=True)

    batch = mix(0, tokens)
    for token in (0, 23, tokens - 1):
        assert torch.equal(mix(token, token + 1)[0], batch[token]), f"token {token}"


def test_bad_input_is_refused_with_the_reason() -> None:
    with pytest.raises(RuntimeError, match="top_k must be in 1..experts"):
        torch.ops.tokenline.moe_route(torch.ones(2, 4), 5, True)
    with pytest.raises(RuntimeError, match="logits must be"):
        torch.ops.tokenline.moe_route(torch.ones(8), 2, True)
    rows, token_of = torch.ones(3, 8), torch.tensor([0, 0, 1])
    with pytest.raises(RuntimeError, match="weights must be float32"):
        torch.ops.tokenline.moe_combine(rows, torch.ones(3, dtype=torch.bfloat16), token_of, 2)
    with pytest.raises(RuntimeError, match="token out of range"):
        torch.ops.tokenline.moe_combine(rows, torch.ones(3), token_of, 1)


def test_a_moe_model_on_the_kernels_gives_the_eager_logits(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """A prompt's prefill (its tokens spread over the experts) and two decode steps (one
    token each), with the kernels and eagerly."""
    checkpoint = save_checkpoint(build_hf_model("qwen3_moe"), tmp_path, default_model_dir)
    model, _ = load_model(checkpoint, torch.float32, "cpu")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and not any(block.kernel for block in blocks)
    prompt = list(range(10, 40))
    eager = all_logits(model, prompt, decode=2)
    use_row_kernels(model)
    assert all(block.kernel for block in blocks)
    torch.testing.assert_close(all_logits(model, prompt, decode=2), eager, rtol=0.0, atol=1e-3)
