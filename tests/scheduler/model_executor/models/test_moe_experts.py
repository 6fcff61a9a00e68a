"""MoE experts as ``prepare_linears`` sets them up: each expert's pair packed for oneDNN
gives the dense experts' result, and in batch-invariant mode a token's output is the same
bits alone and in a batch that spreads over the experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.model_executor.models.linear import can_pack, prepare_linears
from services.scheduler.model_executor.models.moe import Experts
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


def routed_tokens(experts: Experts, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Hidden rows, their top-2 experts (every expert chosen, by several tokens) and their
    router weights."""
    torch.manual_seed(4)
    hidden = experts.gate_up_proj.shape[-1]
    x = torch.randn(TOKENS, hidden, dtype=dtype)
    scores = torch.randn(TOKENS, experts.num_experts)
    weights, expert_ids = scores.softmax(dim=-1).topk(2, dim=-1)
    assert set(expert_ids.flatten().tolist()) == set(range(experts.num_experts))
    return x, expert_ids, weights.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_experts_give_the_dense_result(dtype: torch.dtype) -> None:
    if not can_pack(CPU, dtype):
        pytest.skip(f"this CPU or torch build does not pack {dtype} weights for oneDNN")
    experts = random_experts(dtype)
    x, expert_ids, weights = routed_tokens(experts, dtype)
    expected = experts(x, expert_ids, weights).float()
    assert prepare_linears(experts, CPU, dtype) == "packed"
    assert experts.packed is not None and len(experts.packed) == experts.num_experts
    assert experts.gate_up_proj is None and experts.down_proj is None  # dense stacks freed
    assert experts.pad_rows
    got = experts(x, expert_ids, weights)
    assert got.shape == x.shape and got.dtype == dtype
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_experts_give_a_token_the_same_bits_in_any_batch(
    dtype: torch.dtype,
) -> None:
    experts = random_experts(dtype)
    x, expert_ids, weights = routed_tokens(experts, dtype)
    prepare_linears(experts, CPU, dtype, batch_invariant=True)
    assert experts.row_tile > 0
    batch = experts(x, expert_ids, weights)
    for token in (0, 17, TOKENS - 1):
        alone = experts(
            x[token : token + 1], expert_ids[token : token + 1], weights[token : token + 1]
        )
        assert torch.equal(alone[0], batch[token]), f"token {token} depends on its batch"


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_on_the_row_kernel_give_the_eager_result(
    dtype: torch.dtype, kernel_model_dir: Path
) -> None:
    """SiLU-and-multiply through ``torch.ops.tokenline.silu_and_mul`` (the library is
    loaded by ``kernel_model_dir``), on the packed experts as served."""
    experts = random_experts(dtype)
    x, expert_ids, weights = routed_tokens(experts, dtype)
    prepare_linears(experts, CPU, dtype)
    expected = experts(x, expert_ids, weights).float()
    assert use_row_kernels(experts) == 1 and experts.kernel
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
    got = experts(x, expert_ids, weights).float()
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
