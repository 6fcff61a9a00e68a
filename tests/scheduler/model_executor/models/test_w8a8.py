"""``--quantization w8a8``: the engine's int8 x int8 kernel is the exact integer product of
rows quantized per row, a row's bits the same alone as in any batch; with two-part rows
(int8 weight-only on this kernel) it is the weight-only product within bf16 rounding, and
an int8 model on it as accurate as on the weight-only kernels; the packed weight is the
only copy and gives its int8 rows back; a w8a8 checkpoint (fused projections, experts,
tied head) stays within a few times bf16 serving's distance of its dequantised reference,
and keeps each request's tokens its own through the scheduler; the flag is refused in one
line below the kernel level that has AVX512-VNNI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.int8.int8_weight import Int8Weight
from services.scheduler.model_executor.models.int8.w8a8_weight import W8A8Weight
from services.scheduler.model_executor.models.linear import prepare_linears
from services.scheduler.model_executor.models.loader import load_model, load_native
from services.scheduler.model_executor.models.quantization import (
    QuantizationError,
    QuantizedEmbedding,
    check_quantization,
    int8_takes_vnni_kernel,
    int8_weights,
    quantize_model,
)
from services.scheduler.ops.cpu_kernels import find_compiler
from services.scheduler.ops.isa_levels import level_named
from tests.scheduler.conftest import NO_COMPILER
from tests.scheduler.factories import make_req, make_scheduler, run_to_completion
from tests.scheduler.model_executor.models.quantized_reference import dequantized_reference
from tests.scheduler.parity import all_logits

BF16_U = torch.finfo(torch.bfloat16).eps / 2
FP32_U = torch.finfo(torch.float32).eps / 2


@pytest.fixture
def w8a8_kernels(request: pytest.FixtureRequest) -> None:
    """The engine's kernels loaded; skipped without a compiler to build them, or where the
    build has no int8 x int8 kernel."""
    if find_compiler() is None:
        pytest.skip(NO_COMPILER)
    request.getfixturevalue("kernel_model_dir")
    if not torch.ops.tokenline.w8a8_built():
        pytest.skip("the kernel build here has no AVX512-VNNI (level below avx512_bf16)")


def packed_weight(outputs: int, width: int, seed: int, stack: int = 0) -> W8A8Weight:
    gen = torch.Generator().manual_seed(seed)
    shape = (stack, outputs, width) if stack else (outputs, width)
    return W8A8Weight.pack(Int8Weight.quantize(torch.randn(shape, generator=gen) * 0.05))


def quantized_rows_product(x: torch.Tensor, weight: W8A8Weight) -> torch.Tensor:
    """What w8a8 computes for bf16 rows ``x``, in float64: each row quantized to int8 with
    the scale max |row| / 127 (in float32, by its reciprocal, ties to even, as the kernel
    does), the exact integer product with the int8 weight, times both scales."""
    rows = x.float()
    scale = rows.abs().amax(dim=-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.round(rows * (1 / scale)[:, None]).clamp(-127, 127)
    exact = quantized.double() @ weight.plain().double().T
    return exact * scale.double()[:, None] * weight.scales.double()


@pytest.mark.parametrize(
    ("rows", "outputs", "width"),
    [(1, 64, 64), (6, 70, 36), (7, 130, 896), (13, 9, 80), (20, 200, 4864)],
    ids=["1x64x64", "6x70x36", "7x130x896", "13x9x80", "20x200x4864"],
)
@pytest.mark.usefixtures("w8a8_kernels")
def test_the_kernel_is_the_exact_integer_product_of_rows_quantized_per_row(
    rows: int, outputs: int, width: int
) -> None:
    """Partial blocks of 64 output channels, widths past the last 64-value chunk (36, 80:
    the packing's scalar tail), row groups of 6 with a ragged last one; a row of zeros stays
    zero. The int32 sums are exact, so the only rounding left is the float32 scaling and
    the bf16 output."""
    weight = packed_weight(outputs, width, seed=rows * width + outputs)
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 4).to(torch.bfloat16)
    x[0] = 0
    got = weight.matmul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    want = quantized_rows_product(x, weight)
    assert ((got.double() - want).abs() <= (BF16_U + 4 * FP32_U) * want.abs()).all()
    assert not got[0].any()
    bias = torch.randn(outputs, generator=gen)
    assert torch.equal(weight.matmul(x.float(), bias), got.float() + bias)  # float32 rows in


@pytest.mark.usefixtures("w8a8_kernels")
def test_the_packed_weight_gives_back_its_int8_rows_and_each_expert_of_a_stack() -> None:
    """The packed blocks are the weight's only copy: ``plain`` and ``rows`` (the tied
    embedding's lookup) read the int8 values back exactly, partial last block included, and
    a stack's ``select`` is that expert's weight."""
    gen = torch.Generator().manual_seed(3)
    int8 = Int8Weight.quantize(torch.randn(3, 100, 48, generator=gen))
    stack = W8A8Weight.pack(int8)
    assert stack.packed.dtype == torch.uint8 and stack.packed.shape == (3, 2, 12, 64, 4)
    assert torch.equal(stack.plain(), int8.qweight)
    expert = stack.select(2)
    ids = torch.tensor([[0, 99], [64, 63]])
    assert torch.equal(expert.rows(ids), int8.qweight[2][ids])
    x = torch.randn(5, 48, generator=gen).to(torch.bfloat16)
    assert torch.equal(expert.matmul(x), W8A8Weight.pack(int8.select(2)).matmul(x))
    assert torch.equal(expert.dequantize(), int8.select(2).dequantize())


@pytest.mark.parametrize(
    ("rows", "outputs", "width"),
    [(1, 64, 64), (3, 70, 36), (7, 130, 896), (20, 200, 4864)],
    ids=["1x64x64", "3x70x36", "7x130x896", "20x200x4864"],
)
@pytest.mark.usefixtures("w8a8_kernels")
def test_two_part_rows_give_the_weight_only_product_within_bf16_rounding(
    rows: int, outputs: int, width: int
) -> None:
    """``activation_parts`` 2 (int8 weight-only on this kernel): each row goes in as
    itself quantized and its residual quantized 254 times finer, so a value is off by at
    most max |row| / 64,516 before the exact sums. The result is bf16 rows times the int8
    weight up to that, the float32 scaling and the bf16 output; one-part rows (w8a8) are
    off by up to 127 times as much and fail the same bound. A large outlier sets the
    row's scale, as in trained models."""
    weight = packed_weight(outputs, width, seed=rows * width + outputs)
    two_part = W8A8Weight(weight.packed, weight.scales, activation_parts=2)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
    x[0, width // 2] = 60.0
    want = x.double() @ weight.dequantize(torch.float64).T
    per_value = x.double().abs().amax(dim=-1, keepdim=True) / 64_516
    residual = per_value * weight.dequantize(torch.float64).abs().sum(dim=-1)
    allowed = (BF16_U + 4 * FP32_U) * want.abs() + residual
    got = two_part.matmul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    assert ((got.double() - want).abs() <= allowed).all()
    assert not ((weight.matmul(x).double() - want).abs() <= allowed).all()


@pytest.mark.parametrize("parts", [1, 2], ids=["one-part", "two-part"])
@pytest.mark.usefixtures("w8a8_kernels")
def test_a_row_is_the_same_bits_alone_and_in_any_batch(parts: int) -> None:
    """Each row's scale and exact sums depend on it alone, whatever the batch's size or
    the rows beside it (row groups of 6 quantized rows, the first of which prefetches; a
    two-part row's parts share a group)."""
    packed = packed_weight(130, 96, seed=5)
    weight = W8A8Weight(packed.packed, packed.scales, activation_parts=parts)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(17, 96, generator=gen).to(torch.bfloat16)
    batch = weight.matmul(x)
    for i in range(len(x)):
        assert torch.equal(weight.matmul(x[i : i + 1]), batch[i : i + 1])
    assert torch.equal(weight.matmul(x[3:11]), batch[3:11])


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
@pytest.mark.usefixtures("w8a8_kernels")
def test_a_w8a8_checkpoint_stays_within_a_few_times_bf16_of_its_reference(
    qwen3_checkpoints: dict[str, Path], name: str
) -> None:
    """A w8a8 model in bf16 (the dtype it serves in) against the same int8 weights dense in
    float32: an activation quantized to 8 bits per row has a step of max |row| / 127,
    against bf16's relative 2^-8 per value, so its logits may move a few times as far as
    serving the reference in bf16 moves them (2-3x on these checkpoints; a wrong scale or
    row moves them by the logits' own size). Every int8 weight is packed, the experts' and
    the tied head's included, and the embedding reads the head's table."""
    checkpoint = qwen3_checkpoints[name]
    model, _ = load_model(checkpoint, torch.bfloat16, "cpu", quantization="w8a8")
    assert isinstance(model, NativeCausalLM)
    weights = int8_weights(model)
    assert weights and all(isinstance(w, W8A8Weight) for w in weights)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    assert embedding.table is model.lm_head.quantized
    ids = [0, *range(1000, 1024)]  # 21 prefill rows, then 4 decode steps
    want = all_logits(dequantized_reference(checkpoint, torch.float32), ids, decode=4)
    w8a8_error = (all_logits(model, ids, decode=4).float() - want).abs().mean(dim=-1)
    in_bf16 = all_logits(dequantized_reference(checkpoint, torch.bfloat16), ids, decode=4)
    bf16_error = (in_bf16.float() - want).abs().mean(dim=-1)
    assert (w8a8_error < 6 * bf16_error).all(), (w8a8_error, bf16_error)


@pytest.mark.usefixtures("w8a8_kernels")
def test_int8_in_bf16_runs_on_this_kernel_with_two_part_rows_as_close_as_weight_only(
    qwen3_checkpoints: dict[str, Path],
) -> None:
    """Where AVX512-BF16 runs without AMX, ``--quantization int8`` packs a bf16 model's
    int8 weights for this kernel with two-part rows (the tied head's table shared with the
    embedding), and its logits stay as close to the dequantised float32 reference as the
    same int8 weights on the weight-only kernels (the pair path) do: within 5 % on the mean
    |logit error| (w8a8 is 25-45 % further here). A float32 model keeps the weight-only
    kernels."""
    if not int8_takes_vnni_kernel(torch.bfloat16):
        pytest.skip("AMX runs int8 batches on oneDNN's tiles here (int8_weight.py)")
    checkpoint = qwen3_checkpoints["qwen3_moe"]
    model, _ = load_model(checkpoint, torch.bfloat16, "cpu", quantization="int8")
    assert isinstance(model, NativeCausalLM)
    weights = int8_weights(model)
    assert weights and all(isinstance(w, W8A8Weight) and w.activation_parts == 2 for w in weights)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    assert embedding.table is model.lm_head.quantized
    weight_only, _ = load_native(checkpoint, torch.bfloat16, torch.device("cpu"))
    quantize_model(weight_only)
    prepare_linears(weight_only, torch.device("cpu"), torch.bfloat16)
    assert all(isinstance(w, Int8Weight) for w in int8_weights(weight_only))
    ids = [0, *range(1000, 1024)]  # 21 prefill rows, then 4 decode steps
    want = all_logits(dequantized_reference(checkpoint, torch.float32), ids, decode=4)

    def error(served: NativeCausalLM) -> float:
        return float((all_logits(served, ids, decode=4).float() - want).abs().mean())

    assert error(model) < 1.05 * error(weight_only.eval())
    in_float32, _ = load_model(checkpoint, torch.float32, "cpu", quantization="int8")
    assert all(isinstance(w, Int8Weight) for w in int8_weights(in_float32))


@pytest.mark.usefixtures("w8a8_kernels")
def test_greedy_through_the_scheduler_is_the_same_alone_and_batched(
    qwen3_checkpoints: dict[str, Path],
) -> None:
    """--batch-invariant with w8a8, on the MoE checkpoint (each expert's row count moves
    with the batch): each request's tokens are those it gets alone."""
    checkpoint = qwen3_checkpoints["qwen3_moe"]
    prompts = {"a": [0, *range(500, 503)], "b": [0, *range(900, 920)], "c": [0, 77, 78]}

    def run(rids: list[str]) -> dict[str, list[int]]:
        load: dict[str, str | bool] = {"quantization": "w8a8", "batch_invariant": True}
        scheduler = make_scheduler(checkpoint, kv_tokens=512, dtype=torch.bfloat16, load=load)
        reqs = [make_req(r, prompts[r], temperature=0.0, max_new_tokens=5) for r in rids]
        return run_to_completion(scheduler, {0: reqs})

    together = run(sorted(prompts))
    for rid in prompts:
        assert run([rid]) == {rid: together[rid]}


def test_w8a8_is_refused_in_one_line_below_the_avx512_bf16_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU without AVX512-VNNI (AVX2 only) has no int8 x int8 kernel: refused before any
    weight is read, naming int8 as what runs there."""
    monkeypatch.setattr(
        "services.scheduler.model_executor.models.quantization.machine_level",
        lambda: level_named("avx2"),
    )
    with pytest.raises(QuantizationError) as info:
        check_quantization("w8a8", torch.device("cpu"), "native")
    message = str(info.value)
    assert message.startswith("--quantization w8a8 needs AVX512-VNNI") and "\n" not in message
    assert "avx2" in message and "use int8" in message
    check_quantization("int8", torch.device("cpu"), "native")  # int8 needs no such level
