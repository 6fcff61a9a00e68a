"""--decode-copy: bf16 linear layers and MoE experts that keep their weights in the layout
of the engine's decode kernel (ops/csrc/bf16_blocks.cpp). With AMX the copy takes steps of up
to DECODE_COPY_MAX_ROWS rows and oneDNN's packed weights the rest; without, it takes every
step in place of the packed weights. The kernel runs where the engine's library is built at
the AVX512-BF16 level; elsewhere the flag is off with a reason. Where these tests choose
AMX or not, they do it with a FAKE of torch's CPU probe: the routing is what they show."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.scheduler.__main__ import parse_args
from services.scheduler.model_executor.models import linear
from services.scheduler.model_executor.models.linear import (
    DECODE_COPY_MAX_ROWS,
    DecodeCopy,
    Linear,
    RowShaped,
    decode_copy_bytes,
    decode_copy_unavailable,
    prepare_linears,
)
from services.scheduler.model_executor.models.loader import load_model
from services.scheduler.model_executor.models.moe import Experts
from tests.checkpoints import build_hf_model, save_checkpoint
from tests.scheduler.conftest import needs_compiler
from tests.scheduler.model_executor.models.test_moe_experts import random_experts
from tests.scheduler.parity import all_logits

CPU = torch.device("cpu")
BF16_U = torch.finfo(torch.bfloat16).eps / 2
FP32_U = torch.finfo(torch.float32).eps / 2


def fake_amx(monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """Make torch's probe say the CPU has AMX tiles, or not (a FAKE)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


@pytest.fixture
def block_kernel(kernel_model_dir: Path) -> None:
    """The engine's library loaded, and its decode kernel built for this CPU."""
    if not torch.ops.tokenline.bf16_blocks():
        pytest.skip("the kernels are not built for AVX512-BF16 on this CPU")


def within_bound(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Within a float32 sum of the exact bf16 products, rounded once to bf16."""
    exact = x.double() @ weight.double().T
    bound = (BF16_U + 2 * x.shape[1] * FP32_U) * (x.double().abs() @ weight.double().abs().T)
    return bool(((got.double() - exact).abs() <= bound).all())


@needs_compiler
@pytest.mark.parametrize(
    ("rows", "outputs", "width"),
    [(1, 83, 100), (3, 130, 16), (4, 64, 4864), (5, 90, 256), (7, 7, 34), (13, 200, 896)]
    + [(32, 150, 896), (20, 70, 1000), (50, 64, 200)],
    ids=["1x83x100", "3x130x16", "4x64x4864", "5x90x256", "7x7x34", "13x200x896", "32x150x896"]
    + ["20x70x1000", "50x64x200"],
)
def test_the_block_kernel_is_the_product_at_any_shape(
    block_kernel: None, rows: int, outputs: int, width: int
) -> None:
    """Output channels that fill no 64-channel block, rows past the six kept in registers
    (more passes), K from 16 to 4,864: the first 24 rows go over K in 32-pair chunks (the
    last one short at 500 and 100 pairs), rows past 24 over whole blocks."""
    gen = torch.Generator().manual_seed(rows * width)
    weight = torch.randn(outputs, width, generator=gen).to(torch.bfloat16)
    x = torch.randn(2 * rows, width, generator=gen).to(torch.bfloat16)[::2]  # not contiguous
    packed = torch.ops.tokenline.pack_bf16_blocks(weight)
    assert packed.shape == (-(-outputs // 64), width // 2, 64, 2)
    got = torch.ops.tokenline.bf16_blocks_mm(x, packed, outputs)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    assert within_bound(got, x, weight)


@needs_compiler
def test_the_block_kernel_gives_the_same_bits_however_its_threads_share_the_blocks(
    block_kernel: None,
) -> None:
    """Threads take pieces of the blocks from a shared counter (csrc/parallel_shared.h), so
    which thread computes a block changes from call to call; each block is one thread's
    whole sum, so the output does not. 47 blocks (the last one short) in pieces of one to
    several blocks, at one, two and three threads."""
    gen = torch.Generator().manual_seed(3001)
    weight = torch.randn(3001, 640, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 640, generator=gen).to(torch.bfloat16)
    packed = torch.ops.tokenline.pack_bf16_blocks(weight)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3, 2):
            torch.set_num_threads(count)
            results.append(torch.ops.tokenline.bf16_blocks_mm(x, packed, 3001))
    finally:
        torch.set_num_threads(threads)
    assert within_bound(results[0], x, weight)
    for got in results[1:]:
        assert torch.equal(got, results[0])


@needs_compiler
def test_the_grouped_kernel_gives_each_expert_the_bits_of_its_own_call(block_kernel: None) -> None:
    """Five experts' weights stacked, rows sorted by expert: one with none, one with more
    than the 24 rows a chunked pass takes, 150 output channels (the last block short).
    Each expert's rows come out as bf16_blocks_mm gives them for that expert alone."""
    gen = torch.Generator().manual_seed(5)
    counts = [3, 0, 30, 1, 7]
    weights = torch.randn(len(counts), 150, 96, generator=gen).to(torch.bfloat16)
    x = torch.randn(sum(counts), 96, generator=gen).to(torch.bfloat16)
    pack = torch.ops.tokenline.pack_bf16_blocks
    stacked = torch.stack([pack(weight) for weight in weights])
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    got = torch.ops.tokenline.bf16_grouped_blocks_mm(x, offsets, stacked, 150)
    assert got.shape == (sum(counts), 150)
    for expert, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        alone = torch.ops.tokenline.bf16_blocks_mm(x[start:end], stacked[expert], 150)
        assert torch.equal(got[start:end], alone)
    assert within_bound(got[3:33], x[3:33], weights[2])


@needs_compiler
@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([0, 1, 2, 3], "offsets must run from 0"),
        ([0, 3, 2, 4], "must not fall"),
        ([0, 4], "[E + 1]"),
    ],
    ids=["short-of-the-rows", "falling", "wrong-length"],
)
def test_the_grouped_kernel_refuses_offsets_that_do_not_split_the_rows(
    block_kernel: None, offsets: list[int], message: str
) -> None:
    stacked = torch.zeros(3, 1, 8, 64, 2, dtype=torch.bfloat16)
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.tokenline.bf16_grouped_blocks_mm(x, torch.tensor(offsets), stacked, 64)


@needs_compiler
def test_experts_with_copies_run_grouped_with_the_sums_of_one_call_each(block_kernel: None) -> None:
    """The grouped path (a step whose experts all take their copies) gives each expert's
    rows what that expert's own MLP (two copy matmuls around the gate) gives them."""
    experts = random_experts(torch.bfloat16)
    assert experts.copy_for_decode() > 0
    experts.decode_copy_rows = DECODE_COPY_MAX_ROWS
    gen = torch.Generator().manual_seed(6)
    counts = torch.tensor([2, 0, 4, 1] + [0] * (experts.num_experts - 4))
    rows = torch.randn(int(counts.sum()), experts.gate_up_proj.shape[-1], generator=gen)
    rows = rows.to(torch.bfloat16)
    grouped = experts._grouped(rows, F.pad(counts.cumsum(0), (1, 0)))
    start = 0
    for expert, count in enumerate(counts.tolist()):
        alone = experts._expert(expert, rows[start : start + count])
        assert torch.equal(grouped[start : start + count], alone)
        start += count


@needs_compiler
def test_with_amx_a_layer_takes_its_copy_up_to_the_row_limit_and_the_packed_weight_above(
    block_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routing, shown with a copy of another weight (zeros, a FAKE copy): up to
    DECODE_COPY_MAX_ROWS rows the bias alone, more rows the real product (oneDNN's tiles
    win above the limit)."""
    fake_amx(monkeypatch, True)
    limit = DECODE_COPY_MAX_ROWS
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True, dtype=torch.bfloat16)
    weight = layer.weight.detach().clone()
    how = prepare_linears(layer, CPU, torch.bfloat16, decode_copy=True)
    assert how.startswith("packed, 1 with a decode copy") and layer.decode_copy is not None
    assert f"up to {limit} rows" in how and "GiB more memory" in how
    assert layer.decode_copy_rows == limit and layer.packed_weight is not None
    assert layer.decode_copy.nbytes == 2 * 64 * 96 * 2  # 80 channels fill 2 blocks of 64
    x = torch.randn(limit + 3, 96, dtype=torch.bfloat16)
    for rows in (1, limit):
        got = layer(x[:rows]) - layer.bias
        assert within_bound(got, x[:rows], weight)
    packed_rows = layer(x)
    layer.decode_copy = DecodeCopy.of(torch.zeros_like(weight))
    assert torch.equal(layer(x[:limit]), layer.bias.expand(limit, 80))
    assert torch.equal(layer(x), packed_rows)


@needs_compiler
def test_without_amx_the_copy_takes_every_step_in_place_of_the_packed_weight(
    block_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No packed weight, no dense one: a prompt step longer than any default chunk is the
    copy's product too (and with a FAKE copy of zeros, the bias alone)."""
    fake_amx(monkeypatch, False)
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=True, dtype=torch.bfloat16)
    weight = layer.weight.detach().clone()
    how = prepare_linears(layer, CPU, torch.bfloat16, decode_copy=True)
    assert how.startswith("1 on a decode copy for every step, no packed weight"), how
    assert layer.decode_copy is not None and layer.decode_copy.nbytes == 2 * 64 * 96 * 2
    assert layer.packed_weight is None and layer.weight is None and not layer.pad_rows
    x = torch.randn(2051, 96, dtype=torch.bfloat16)
    for rows in (1, 7, 2051):
        got = layer(x[:rows]) - layer.bias
        assert within_bound(got, x[:rows], weight)
    layer.decode_copy = DecodeCopy.of(torch.zeros_like(weight))
    assert torch.equal(layer(x), layer.bias.expand(2051, 80))


@needs_compiler
def test_without_amx_a_weight_another_module_holds_stays_dense_beside_its_copy(
    block_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied LM head: the embedding still reads the weight, so only the packing goes."""
    fake_amx(monkeypatch, False)
    torch.manual_seed(0)
    head = Linear(32, 100, bias=False, dtype=torch.bfloat16)
    embedding = nn.Embedding(100, 32, dtype=torch.bfloat16)
    embedding.weight = head.weight
    prepare_linears(nn.ModuleList([embedding, head]), CPU, torch.bfloat16, decode_copy=True)
    assert head.decode_copy is not None and head.packed_weight is None
    assert head.weight is embedding.weight
    ids = torch.tensor([3, 97])
    assert within_bound(head(embedding(ids)), embedding(ids), embedding.weight.detach())


def test_the_copy_is_off_with_a_reason_where_it_cannot_apply() -> None:
    layer = Linear(64, 32, dtype=torch.float32)
    how = prepare_linears(layer, CPU, torch.float32, decode_copy=True)
    assert layer.decode_copy is None and "decode copy" not in how
    assert "bf16 on CPU" in str(decode_copy_unavailable(CPU, torch.float32))
    invariant = Linear(64, 32, dtype=torch.bfloat16)
    prepare_linears(invariant, CPU, torch.bfloat16, batch_invariant=True, decode_copy=True)
    assert invariant.decode_copy is None


def test_the_flag_and_its_environment_variable(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ["--model", str(default_model_dir)]
    assert parse_args(model).decode_copy is None  # auto
    assert parse_args([*model, "--decode-copy"]).decode_copy is True
    assert parse_args([*model, "--no-decode-copy"]).decode_copy is False
    monkeypatch.setenv("TOKENLINE_DECODE_COPY", "false")
    assert parse_args(model).decode_copy is False
    monkeypatch.setenv("TOKENLINE_DECODE_COPY", "true")
    assert parse_args(model).decode_copy is True


@needs_compiler
def test_the_estimate_is_what_the_copies_take(block_kernel: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        Linear(96, 80, dtype=torch.bfloat16),
        Linear(64, 33, dtype=torch.float32),  # kept in float32 (a router): no copy
        random_experts(torch.bfloat16),
    )
    layers = [m for m in model.modules() if isinstance(m, RowShaped)]
    estimate = decode_copy_bytes(layers)
    assert estimate == sum(layer.copy_for_decode() for layer in layers) > 0


@needs_compiler
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_auto_keeps_the_copy_only_within_its_share_of_the_memory_where_it_is_extra(
    block_kernel: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    amx: bool,
) -> None:
    """With AMX, unset, the copy is kept where it takes at most DECODE_COPY_AUTO_SHARE of
    the usable memory (a FAKE reading of it here: the layer's copy takes 24 KiB); asked for,
    it is kept past that; refused, never. Without AMX it replaces the packed weight, costs
    nothing more, and auto keeps it whatever the share."""
    fake_amx(monkeypatch, amx)
    needed = 2 * 64 * 96 * 2
    for usable, flag, kept in [
        (4 * needed, None, True),
        (4 * needed - 2, None, not amx),
        (needed, True, True),
        (2**40, False, False),
    ]:
        monkeypatch.setattr(linear, "usable_memory_bytes", lambda usable=usable: usable)
        layer = Linear(96, 80, dtype=torch.bfloat16)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=linear.__name__):
            how = prepare_linears(layer, CPU, torch.bfloat16, decode_copy=flag)
        assert (layer.decode_copy is not None) == kept, (usable, flag)
        assert ("decode copy" in how) == kept
        refused = [r.getMessage() for r in caplog.records if "auto" in r.getMessage()]
        assert bool(refused) == (flag is None and not kept)
        if refused:
            assert "more than 25% of the" in refused[0] and "--decode-copy" in refused[0]


@needs_compiler
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_a_model_with_the_copy_decodes_as_close_to_float32_as_without(
    block_kernel: None,
    tmp_path: Path,
    default_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    amx: bool,
) -> None:
    """Every projection, every expert and the tied LM head get a copy; the decode steps'
    logits (one row: the copies; without AMX over a prompt the copies ran too) differ from
    the float32 model's by about what the packed bf16 model's do."""
    checkpoint = save_checkpoint(build_hf_model(name), tmp_path, default_model_dir)
    fake_amx(monkeypatch, amx)
    copied, _ = load_model(checkpoint, torch.bfloat16, "cpu", decode_copy=True)
    monkeypatch.undo()
    linears = [m for m in copied.modules() if isinstance(m, Linear)]
    assert linears and all(m.decode_copy is not None for m in linears)
    experts = [m for m in copied.modules() if isinstance(m, Experts)]
    assert (name == "qwen3_moe") == bool(experts)
    for module in experts:
        assert module.decode_copies is not None
        assert all(len(copies.blocks) == module.num_experts for copies in module.decode_copies)
    packed, _ = load_model(checkpoint, torch.bfloat16, "cpu")
    reference, _ = load_model(checkpoint, torch.float32, "cpu")
    ids = [0, *range(1000, 1020)]
    want = all_logits(reference, ids, decode=4)[-4:]
    copy_error = (all_logits(copied, ids, decode=4)[-4:] - want).abs().mean(dim=-1)
    packed_error = (all_logits(packed, ids, decode=4)[-4:] - want).abs().mean(dim=-1)
    assert (copy_error <= 2 * packed_error).all(), (copy_error, packed_error)
