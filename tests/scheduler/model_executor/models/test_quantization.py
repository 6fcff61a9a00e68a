"""``--quantization int8``: an int8 linear computes its dequantised weight's product within
the rounding its kernel allows (torch's bf16 one or the engine's compiled one),
bit-identically for a row alone and in any batch when batch-invariant; a quantized
checkpoint (fused projections, experts, tied head) stays closer to its dequantised reference
than serving that reference in bf16 does; the flag is refused in one line where it cannot
run. (``--quantization w8a8``: ``test_w8a8.py``.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from services.scheduler.__main__ import parse_args, resolve_or_exit
from services.scheduler.model_executor.models.causal_lm import NativeCausalLM
from services.scheduler.model_executor.models.int8.int8_weight import (
    KERNEL_MAX_ROWS,
    OWN_KERNEL_MAX_ROWS,
    TILES_ANY_ROWS_FROM,
    TILES_MAX_ROWS,
    Int8Weight,
)
from services.scheduler.model_executor.models.linear import Linear
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.models.quantization import (
    QuantizedEmbedding,
    int8_weights,
    use_int8_kernel,
)
from tests.scheduler.conftest import needs_compiler
from tests.scheduler.factories import make_req, make_scheduler, run_to_completion
from tests.scheduler.model_executor.models.quantized_reference import dequantized_reference
from tests.scheduler.parity import all_logits

# Unit roundoffs: the kernel rounds rows and its output to bf16 and sums in float32.
BF16_U = torch.finfo(torch.bfloat16).eps / 2
FP32_U = torch.finfo(torch.float32).eps / 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def error_bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A rigorous first-order bound on |int8 linear - exact product| per output: rounding
    the rows to bf16 (u), the float32 sum of K terms (K u32), the bf16 output (u) and the
    cast to the layer's dtype (at most u again), each relative to sum_k |x_k w_k| (+ |b|)."""
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        magnitude += bias.double().abs()
    return (3 * BF16_U + x.shape[1] * FP32_U) * magnitude


# The engine's compiled kernel (csrc/int8_rows.cpp) or torch's _weight_int8pack_mm.
KERNELS = ["torch", pytest.param("own", marks=needs_compiler)]


@pytest.fixture(params=KERNELS)
def own_kernel(request: pytest.FixtureRequest) -> bool:
    """Whether the int8 weights a test builds take the engine's kernel (loaded for it)."""
    if request.param == "own":
        request.getfixturevalue("kernel_model_dir")  # builds and loads the library
    return bool(request.param == "own")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5, KERNEL_MAX_ROWS, 40], ids=lambda n: f"{n}rows")
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_int8_linear_is_its_dequantised_weights_product(
    dtype: torch.dtype, rows: int, bias: bool, own_kernel: bool
) -> None:
    """Up to KERNEL_MAX_ROWS rows take the int8 kernel, more the dense GEMM on the
    dequantised weight."""
    torch.manual_seed(rows)
    layer = Linear(96, 80, bias=bias, dtype=dtype)
    x = torch.randn(2 * rows, 96, dtype=dtype)[::2]  # not contiguous
    table = layer.quantize(row_independent=False)
    table.kernel = own_kernel
    assert layer.weight is None and table.qweight.dtype == torch.int8
    dense = table.dequantize(torch.float64)
    expected = x.double() @ dense.T + (layer.bias.double() if bias else 0)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 80)
    error = (got.double() - expected).abs()
    assert (error <= error_bound(x, dense, layer.bias)).all(), float(error.max())


def test_quantizing_rounds_each_weight_to_the_nearest_step_of_its_row() -> None:
    torch.manual_seed(0)
    weight = torch.randn(3, 8, 32) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    weight[0, 0] = 0.0  # an all-zero row
    table = Int8Weight.quantize(weight)
    assert table.qweight.shape == weight.shape and table.scales.shape == (3, 8)
    assert int(table.qweight.abs().max()) == 127
    step = table.scales[..., None]
    assert ((table.dequantize() - weight).abs() <= step / 2 * (1 + 1e-6)).all()
    assert not table.dequantize()[0, 0].any()
    torch.testing.assert_close(table.select(2).dequantize(), table.dequantize()[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_is_the_same_bits_alone_and_in_any_batch_when_batch_invariant(
    dtype: torch.dtype, own_kernel: bool
) -> None:
    torch.manual_seed(3)
    layer = Linear(64, 48, dtype=dtype)
    layer.quantize(row_independent=True).kernel = own_kernel
    rows = torch.randn(70, 64, dtype=dtype)
    alone = layer(rows[:1])
    for size in (3, 17, 70):
        assert torch.equal(layer(rows[:size])[:1], alone)
        assert torch.equal(layer(torch.cat([rows[1:size], rows[:1]]))[-1:], alone)


@needs_compiler
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rows", "outputs", "width"),
    [(1, 83, 100), (3, 130, 16), (6, 7, 4864), (11, 64, 33)],
    ids=["1x83x100", "3x130x16", "6x7x4864", "11x64x33"],
)
def test_the_own_kernel_takes_any_shape_and_is_row_independent(
    kernel_model_dir: Path, dtype: torch.dtype, rows: int, outputs: int, width: int
) -> None:
    """Widths with a remainder past the vector loop, output channels that fill no 4-channel
    block or thread share, row counts past its 4-row blocks: within the float32 sum's
    rounding (rows are not rounded to bf16 on the way in) and the output's, and each row the
    same bits as when computed alone."""
    gen = torch.Generator().manual_seed(rows * width)
    weight = torch.randn(outputs, width, generator=gen)
    table = Int8Weight.quantize(weight, row_independent=True, kernel=True)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    got = torch.ops.tokenline.int8_rows_mm(x, table.qweight, table.scales, True)
    assert got.dtype == dtype and got.shape == (rows, outputs)
    assert within_one_sum_of_exact(got, x, table)
    for i in range(rows):
        alone = torch.ops.tokenline.int8_rows_mm(x[i : i + 1], table.qweight, table.scales, True)
        assert torch.equal(alone, got[i : i + 1])


def within_one_sum_of_exact(got: torch.Tensor, x: torch.Tensor, table: Int8Weight) -> bool:
    """Whether ``got`` is ``x`` times the dequantised weight within a float32 sum over K of
    exact products, rounded once to ``got``'s dtype."""
    dense = table.dequantize(torch.float64)
    expected = x.double() @ dense.T
    output_u = torch.finfo(got.dtype).eps / 2 if got.dtype != torch.float32 else FP32_U
    bound = (output_u + 2 * x.shape[1] * FP32_U) * (x.double().abs() @ dense.abs().T)
    return bool(((got.double() - expected).abs() <= bound).all())


MANY_ROW_SHAPES = [(9, 83, 96), (16, 130, 4864), (70, 7, 32), (200, 300, 896), (33, 65, 34)]
MANY_ROW_IDS = ["9x83x96", "16x130x4864", "70x7x32", "200x300x896", "33x65x34"]


@needs_compiler
@pytest.mark.parametrize(("rows", "outputs", "width"), MANY_ROW_SHAPES, ids=MANY_ROW_IDS)
def test_many_bf16_rows_take_the_tiles_where_the_cpu_has_them(
    kernel_model_dir: Path, rows: int, outputs: int, width: int
) -> None:
    """Past 8 bf16 rows, on a CPU with oneDNN's tile kernels (AMX), the kernel widens each
    block of 64 output channels to bf16 once and multiplies it on the tiles: partial channel
    blocks, row tiles of 64 with a ragged last one, and K of 32 to 4,864, within a float32
    sum of exact products of the exact result. The weight's routing follows: every row count
    takes the kernel there for a large weight, up to 32 for a small one, past 16 rows the
    dense path elsewhere."""
    if not torch.ops.tokenline.int8_tiles():
        pytest.skip("no oneDNN tile kernels (AMX) on this CPU")
    table, x = many_bf16_rows(rows, outputs, width)
    assert table.kernel_max_rows(x) == TILES_MAX_ROWS  # a small weight
    assert table.kernel_max_rows(x.float()) == OWN_KERNEL_MAX_ROWS
    large = Int8Weight(
        torch.zeros(TILES_ANY_ROWS_FROM // 64, 64, dtype=torch.int8),
        torch.ones(TILES_ANY_ROWS_FROM // 64),
        kernel=True,
    )
    assert large.kernel_max_rows(x[:, :64]) == sys.maxsize


@needs_compiler
@pytest.mark.parametrize(("rows", "outputs", "width"), MANY_ROW_SHAPES, ids=MANY_ROW_IDS)
def test_without_tiles_the_float_loop_takes_up_to_16_rows_of_any_width(
    kernel_model_dir: Path, rows: int, outputs: int, width: int
) -> None:
    """Where the CPU has no tiles, ``Int8Weight`` sends bf16 and float32 rows alike to the
    kernel's float loop up to 16 rows and dequantises past them (a bf16 model's int8 runs
    on the w8a8 kernel there instead: ``test_w8a8.py``). The loop itself takes any row
    count and any width, odd ones included, within a float32 sum of exact products."""
    if torch.ops.tokenline.int8_tiles():
        pytest.skip("oneDNN's tiles take these rows here (AMX)")
    table, x = many_bf16_rows(rows, outputs, width)
    assert table.kernel_max_rows(x) == OWN_KERNEL_MAX_ROWS
    assert table.kernel_max_rows(x.float()) == OWN_KERNEL_MAX_ROWS
    # An odd width takes the float loop: the kernel takes any K (``can_quantize`` asks more).
    gen = torch.Generator().manual_seed(width + 1)
    odd = Int8Weight.quantize(torch.randn(outputs, width + 1, generator=gen), kernel=True)
    wide = torch.randn(rows, width + 1, generator=gen).to(torch.bfloat16)
    got = torch.ops.tokenline.int8_rows_mm(wide, odd.qweight, odd.scales)
    assert within_one_sum_of_exact(got, wide, odd)


def many_bf16_rows(rows: int, outputs: int, width: int) -> tuple[Int8Weight, torch.Tensor]:
    """A random int8 weight and bf16 rows whose product, by the kernel directly and through
    ``Int8Weight.matmul``'s routing, is checked against the exact one."""
    gen = torch.Generator().manual_seed(rows * width)
    table = Int8Weight.quantize(torch.randn(outputs, width, generator=gen), kernel=True)
    x = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
    got = torch.ops.tokenline.int8_rows_mm(x, table.qweight, table.scales)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    assert within_one_sum_of_exact(got, x, table)
    assert within_one_sum_of_exact(table.matmul(x), x, table)
    return table, x


@needs_compiler
def test_quantized_weights_take_the_own_kernel_once_it_is_loaded_and_switch_back(
    kernel_model_dir: Path, qwen3_checkpoints: dict[str, Path]
) -> None:
    """Every int8 weight of a loaded model (projections, experts, the tied head) takes the
    compiled kernel when the library is loaded, and ``use_int8_kernel`` switches them to
    torch's and back. In float32 the compiled kernel's decode rows are closer to the
    dequantised reference than torch's kernel's, which rounds every row to bf16."""
    checkpoint = qwen3_checkpoints["qwen3_moe"]
    model, _ = load_model(checkpoint, torch.float32, "cpu", quantization="int8")
    weights = int8_weights(model)
    assert weights and all(weight.kernel for weight in weights)
    ids = [0, *range(1000, 1010)]
    want = all_logits(dequantized_reference(checkpoint, torch.float32), ids, decode=3)[-3:]
    own = all_logits(model, ids, decode=3)[-3:]
    assert use_int8_kernel(model, False) == len(weights)
    assert not any(weight.kernel for weight in int8_weights(model))
    torchs = all_logits(model, ids, decode=3)[-3:]
    own_error, torch_error = ((got - want).abs().mean(dim=-1) for got in (own, torchs))
    assert (own_error < torch_error).all(), (own_error, torch_error)
    assert use_int8_kernel(model, True) == len(weights)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_a_quantized_checkpoint_stays_closer_to_its_reference_than_bf16_does(
    qwen3_checkpoints: dict[str, Path], name: str
) -> None:
    """The int8 model's logits differ from its dequantised float32 reference (the same
    weights, dense) by less than serving that reference in bf16 moves them: the kernels'
    rounding is a bf16 row and a bf16 output per matmul, bf16 serving rounds far more."""
    checkpoint = qwen3_checkpoints[name]
    model, config = load_model(checkpoint, torch.float32, "cpu", quantization="int8")
    assert isinstance(model, NativeCausalLM) and config.tie_word_embeddings
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)  # tied: one int8 table
    assert all(m.weight is None for m in model.modules() if isinstance(m, Linear) and m.quantized)
    ids = [0, *range(1000, 1024)]  # 21 prefill rows, then 4 decode steps
    want = all_logits(dequantized_reference(checkpoint, torch.float32), ids, decode=4)
    int8_error = (all_logits(model, ids, decode=4) - want).abs().mean(dim=-1)
    in_bf16 = all_logits(dequantized_reference(checkpoint, torch.bfloat16), ids, decode=4)
    bf16_error = (in_bf16 - want).abs().mean(dim=-1)
    assert (int8_error < bf16_error).all(), (int8_error, bf16_error)


def test_greedy_through_the_scheduler_is_the_same_alone_and_batched(
    qwen3_checkpoints: dict[str, Path],
) -> None:
    """--batch-invariant with int8, on the MoE checkpoint (each expert's row count moves
    with the batch): each request's tokens are those it gets alone."""
    checkpoint = qwen3_checkpoints["qwen3_moe"]
    load: dict[str, str | bool] = {"quantization": "int8", "batch_invariant": True}
    prompts = {"a": [0, *range(500, 503)], "b": [0, *range(900, 920)], "c": [0, 77, 78]}

    def run(rids: list[str]) -> dict[str, list[int]]:
        scheduler = make_scheduler(checkpoint, kv_tokens=512, load=load)
        reqs = [make_req(r, prompts[r], temperature=0.0, max_new_tokens=5) for r in rids]
        return run_to_completion(scheduler, {0: reqs})

    together = run(sorted(prompts))
    for rid in prompts:
        assert run([rid]) == {rid: together[rid]}


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--device", "cuda"], "--quantization int8 runs on the CPU only"),
        (["--model-impl", "transformers"], "--quantization int8 needs a native model"),
    ],
    ids=["cuda", "transformers"],
)
def test_the_flag_is_refused_in_one_line_where_it_cannot_run(
    default_model_dir: Path, flags: list[str], refusal: str
) -> None:
    config = parse_args(["--model", str(default_model_dir), "--quantization", "int8", *flags])
    with pytest.raises(SystemExit) as info:
        resolve_or_exit(config)
    message = str(info.value.code)
    assert message.startswith(f"tokenline-scheduler: {refusal}") and "\n" not in message
