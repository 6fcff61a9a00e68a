"""MoE experts as ``prepare_linears`` sets them up: each expert's pair packed for oneDNN
gives the dense experts' result, and in batch-invariant mode a token's output is the same
bits alone and in a batch that spreads over the experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.linear import can_pack, prepare_linears
from services.scheduler.model_executor.models.moe import Experts, Routing, combine, route
from services.scheduler.model_executor.row_kernels import use_row_kernels
from tests.checkpoints import build_hf_model
from tests.scheduler.conftest import needs_compiler

CPU = torch.device("cpu")
TOKENS = 40


def random_experts(dtype: torch.dtype) -> Experts:
    hf_config = build_hf_model("qwen3_moe").config.to_dict()
    config = ModelConfig.from_dict({**hf_config, "architectures": ["Qwen3MoeForCausalLM"]})
    assert config.moe is not None
    torch.manual_seed(3)
    experts = Experts(config, config.moe)
    with torch.no_grad():
        for stack in (experts.gate_up_proj, experts.down_proj):
            stack.normal_(std=stack.shape[-1] ** -0.5)
    return experts.to(dtype)


def router_scores(experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden rows and their router logits."""
    torch.manual_seed(4)
    hidden = experts.gate_up_proj.shape[-1]
    return torch.randn(TOKENS, hidden), torch.randn(TOKENS, experts.num_experts)


def routed_tokens(experts: Experts, dtype: torch.dtype) -> tuple[torch.Tensor, Routing]:
    """Hidden rows and their routing to their top-2 experts (every expert chosen, by
    several tokens)."""
    x, scores = router_scores(experts)
    routing = route(scores, 2, renormalize=False, kernel=False)
    assert set(routing.offsets.diff().nonzero().flatten().tolist()) == set(
        range(experts.num_experts)
    )
    return x.to(dtype), routing


def mixture(experts: Experts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each token's experts' outputs, weighted and summed (eagerly)."""
    return combine(experts(x, routing), routing, x.shape[0], kernel=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_experts_give_the_dense_result(dtype: torch.dtype) -> None:
    if not can_pack(CPU, dtype):
        pytest.skip(f"this CPU or torch build does not pack {dtype} weights for oneDNN")
    experts = random_experts(dtype)
    x, routing = routed_tokens(experts, dtype)
    expected = mixture(experts, x, routing).float()
    assert prepare_linears(experts, CPU, dtype) == "packed"
    assert experts.packed is not None and len(experts.packed) == experts.num_experts
    assert experts.gate_up_proj is None and experts.down_proj is None  # dense stacks freed
    assert experts.pad_rows
    got = mixture(experts, x, routing)
    assert got.shape == x.shape and got.dtype == dtype
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_experts_give_a_token_the_same_bits_in_any_batch(
    dtype: torch.dtype,
) -> None:
    experts = random_experts(dtype)
    x, scores = router_scores(experts)
    x = x.to(dtype)
    prepare_linears(experts, CPU, dtype, batch_invariant=True)
    assert experts.row_tile > 0
    batch = mixture(experts, x, route(scores, 2, renormalize=False, kernel=False))
    for token in (0, 17, TOKENS - 1):
        routing = route(scores[token : token + 1], 2, renormalize=False, kernel=False)
        alone = mixture(experts, x[token : token + 1], routing)
        assert torch.equal(alone[0], batch[token]), f"token {token} depends on its batch"


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_on_the_row_kernel_give_the_eager_result(
    dtype: torch.dtype, kernel_model_dir: Path
) -> None:
    """SiLU-and-multiply through ``torch.ops.tokenline.silu_and_mul`` (the library is
    loaded by ``kernel_model_dir``), on the packed experts as served."""
    experts = random_experts(dtype)
    x, routing = routed_tokens(experts, dtype)
    prepare_linears(experts, CPU, dtype)
    expected = mixture(experts, x, routing).float()
    assert use_row_kernels(experts) == 1 and experts.kernel
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
    got = mixture(experts, x, routing).float()
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
