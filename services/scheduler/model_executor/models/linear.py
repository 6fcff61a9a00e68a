"""Linear layers as a serving step runs them: on CPU, packed oneDNN weights and row buckets.

torch's CPU linear goes through oneDNN for bf16/fp16 and through MKL for float32. Two
things make it faster and leaner under serving:

* **Packed weights.** ``torch.ops.mkldnn._reorder_linear_weight`` reorders a weight once,
  at load, into oneDNN's blocked layout, and ``_linear_pointwise`` multiplies by it (the
  pair inductor's CPU weight-freezing pass emits). Plain ``F.linear`` starts from the
  [out, in] layout on every call. On a 2-core AMD EPYC with AVX512_BF16, at 32 rows: the
  default model's LM head (129,280 x 256) takes 6.4 ms instead of 12.2 in bf16 (the same
  bits) and 12 ms instead of 37 in float32 (oneDNN sums in another order than MKL:
  within 3e-6); the per-layer projections are 1.1-1.9x faster. The dense weight is then
  dropped unless another module shares it (a tied LM head's embedding).
* **Row buckets.** oneDNN builds and keeps a kernel for every distinct input shape it
  sees, about 0.5 MiB each, and never frees them. A serving step's row count is its token
  count (1 to ``--max-num-batched-tokens``), so a long-running scheduler kept growing until
  it had seen every count: ~0.3 GiB over 400 counts at one layer width, measured (about
  0.5 MiB a shape stays after ``malloc_trim``). Padding each linear's rows up to a bucket
  (exact up to 16, then sixteen buckets per power of two, so at most 6.25 % extra rows)
  caps the distinct shapes at 112 per width up to 1,024 rows. Eight buckets per power of
  two (64 shapes) padded the 129 prompt rows of a 131-token chat to 144, and the linear
  layers are nine tenths of a short prefill: sixteen cut it 5-8 % (129-300 tokens, 0.5B
  shape, 2-core Zen 4 EPYC, 2026-12-06) for at most ~0.1 GiB more kept kernels. MKL caches nothing
  per shape and CUDA's cuBLAS neither: a float32 layer left unpacked, or any CUDA layer,
  does not pad.
* **Row tiles (``--batch-invariant``).** Neither row buckets nor oneDNN promise that a row's
  result is the same at every row count: a kernel may block the reduction differently for
  another M (seen on an AMX Xeon: 2 of 20 greedy chats changed from their first token when
  batched). With ``row_tile`` set, every matmul runs on exactly that many rows, so each row
  meets the same kernel and the same reduction order whatever else is in the step; the
  extra rows and calls are the switch's cost (docs/batch-invariance.md).
* **Decode copy (``--decode-copy``).** Where the engine's kernels are built at the
  AVX512-BF16 level, a bf16 ``Linear`` also keeps its weight in the layout of
  ``ops/csrc/bf16_blocks.cpp`` (a ``DecodeCopy``): AVX512-BF16 pair dot products streaming
  the weight at 20-23 GB/s where oneDNN's packed kernel read 13-14 (the 0.5B shape's layers
  and LM head at one row on the 2-core AMX Xeon, in its slower phases; 0.8-0.95 of
  oneDNN's time in its quicker ones). With AMX, above four rows the loop is bound by its
  dot products and oneDNN's tiles are faster, so the copy takes steps of up to
  ``DECODE_COPY_MAX_ROWS`` rows and the packed weight the rest; the copy is then extra
  memory, so by default (``decode_copy`` None: auto) it is kept only where it takes at most
  ``DECODE_COPY_AUTO_SHARE`` of the memory this process may use
  (``services/common/memory.py``: the machine's, capped by its cgroup's limit).
  Without AMX oneDNN multiplies by the same dot products and the copy's loop is the faster
  or level at every step size measured, prefill included, so the copy takes every step and
  *replaces* the packed weight: no second copy of the weights, hence auto keeps it whatever
  the model's size. ``--decode-copy`` keeps it whatever it takes, ``--no-decode-copy`` never.
* **int8 weights (``--quantization int8``).** A quantized layer multiplies through
  ``int8_weight.py`` instead, which neither packs nor pads (its kernels keep nothing per
  shape) and is batch-invariant by its kernel rather than by row tiles.
"""

from __future__ import annotations

import logging
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from services.common.memory import usable_memory_bytes
from services.scheduler.model_executor.models.int8.int8_weight import Int8Weight
from services.scheduler.model_executor.models.int8.w8a8_weight import QuantizedWeight
from services.scheduler.ops.cpu_kernels import is_registered
from services.scheduler.ops.isa_levels import has_amx

logger = logging.getLogger(__name__)

# The dtypes oneDNN packs on any x86 CPU torch supports (fp16 needs AVX512_FP16 or
# AVX-NE-CONVERT, so it stays on plain F.linear, still through oneDNN, with row buckets).
PACKABLE_DTYPES = (torch.bfloat16, torch.float32)
# Rows of every matmul in batch-invariant mode: enough that a decode step of up to 16
# requests is one call, few enough that a lone decode row does not pay for many.
INVARIANT_ROW_TILE = 16
# A band of row counts where oneDNN's packed bf16 kernel runs narrow projections (output
# at most twice the input wide) at half speed on the 2-core AMX Xeon: the 896 x 4,864 down
# projection at 0.94-1.01 TFLOP/s with 768-1,280 rows, against 1.81-1.98 at 512 or 1,536;
# qkv 1.4-1.5 against 1.9-2.7. A prefill chunk is up to 1,024 rows by default, so those
# calls run in 512-row slices (the wide gate/up projection does not slow there, and the
# slices' concatenation would cost it more than it gains). A 1,024-token prefill of the
# 0.5B shape: 834-848 -> 716-737 ms (its linear layers 557-564 -> 446-454 ms).
SLICE_ROWS = 512
SLOW_BAND = (SLICE_ROWS + 1, 1280)
# Row buckets between one power of two and the next (a power of two itself).
BUCKETS_PER_OCTAVE = 16
# Rows up to which a layer's decode copy takes its steps on a CPU with AMX: above them
# oneDNN's tiles beat the copy's dot products (five rows: 1.18-1.31x oneDNN's time on the
# 2-core AMX Xeon), so the packed weight stays for larger steps and prefill.
DECODE_COPY_MAX_ROWS = 4
# Without AMX oneDNN's bf16 matmul is pair dot products too, and the copy's kernel (six rows
# at a time) beats or matches it at every step size measured on the 2-core AMD EPYC with
# AVX512_BF16 (Zen 4): 0.66-0.87x its time at 5-32 rows, level at 64; whole prefill steps
# 0.91-0.97x at 48-192 tokens (0.5B shape; the tiny model 0.85-0.92x: no row padding, no
# pad copies), 0.96-1.02x at 256-4,096 (docs/scheduler.md#decode-copy). There the copy
# takes every step and replaces the packed weight.
DECODE_COPY_EVERY_STEP = sys.maxsize
# Output channels in one block of the decode copy's layout (ops/csrc/bf16_blocks.cpp).
DECODE_COPY_BLOCK = 64
# With AMX (where the copies are extra), auto keeps them when they take at most this share
# of the usable memory: the 0.5B shape's 0.95 GiB under 8 GiB (the Kubernetes scheduler's
# limit) or more, not a 7B model's 14 GiB on a 24 GiB machine, where the KV cache and the
# weights need the room.
DECODE_COPY_AUTO_SHARE = 0.25
_DECODE_COPY_OPS = ("pack_bf16_blocks", "bf16_blocks_mm", "bf16_grouped_blocks_mm")


class DecodeCopy(NamedTuple):
    """A bf16 weight [N, K] in the decode kernel's layout, ``[N/64][K/2][64][2]``: its N
    output channels are padded up to whole blocks, so the matmul is told ``outputs``."""

    blocks: torch.Tensor
    outputs: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> DecodeCopy:
        return cls(torch.ops.tokenline.pack_bf16_blocks(weight.detach()), weight.shape[0])

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` in bf16."""
        out: torch.Tensor = torch.ops.tokenline.bf16_blocks_mm(x, self.blocks, self.outputs)
        return out


def _in_slow_band(rows: int, weight_shape: torch.Size) -> bool:
    out_width, in_width = weight_shape  # a packed weight keeps its [out, in] shape
    return SLOW_BAND[0] <= rows <= SLOW_BAND[1] and out_width <= 2 * in_width


def row_bucket(num_rows: int) -> int:
    """The padded row count: ``num_rows`` up to ``BUCKETS_PER_OCTAVE``, else rounded up to
    a ``BUCKETS_PER_OCTAVE``-th of the power of two below it (100 -> 100, 129 -> 136,
    500 -> 512)."""
    if num_rows <= BUCKETS_PER_OCTAVE:
        return num_rows
    power_below = num_rows.bit_length() - 1  # log2 of the power of two at or below
    step = 1 << (power_below - (BUCKETS_PER_OCTAVE.bit_length() - 1))
    return -(-num_rows // step) * step


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build packs ``dtype`` weights for oneDNN on ``device``: bf16
    packing needs AVX512BW/VL/DQ or AVX-NE-CONVERT, and an AVX2-only CPU refuses it."""
    return (
        device.type == "cpu"
        and dtype in PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def _matmul(
    x: torch.Tensor,
    packed: torch.Tensor | None,
    dense: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert dense is not None
    return F.linear(x, dense, bias)


class RowShaped:
    """What every module whose matmuls ``prepare_linears`` sets up shares: the row
    bucketing or row tiles of its inputs, and a ``pack`` of its weights for oneDNN (a
    ``Linear``; the experts of ``moe.py``)."""

    pad_rows: bool = False
    row_tile: int = 0  # > 0: every matmul takes exactly this many rows
    decode_copy_rows: int = 0  # steps of at most this many rows use the decode copy

    @property
    def quantized_weights(self) -> bool:
        """Whether int8 kernels (which pad and pack nothing) run this module's matmuls."""
        raise NotImplementedError

    def pack(self, keep_dense: bool) -> None:
        """Reorder the weights for oneDNN; free the dense ones unless ``keep_dense``."""
        raise NotImplementedError

    def drop_dense(self) -> None:
        """Free the dense weights (once ``pack`` or a decode copy holds them)."""
        raise NotImplementedError

    def copy_for_decode(self) -> int:
        """Keep the bf16 weights in the decode kernel's layout too (before ``pack`` or
        ``drop_dense`` frees the dense ones); returns the bytes kept: 0, and nothing kept,
        where they are not bf16 or their inner width is odd."""
        raise NotImplementedError

    def matmul_rows(
        self,
        x: torch.Tensor,
        packed: torch.Tensor | None,
        dense: torch.Tensor | None,
        bias: torch.Tensor | None = None,
        decode_copy: DecodeCopy | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` by the weight's decode copy if it has one and ``x`` is
        at most ``decode_copy_rows`` rows, else by the packed weight if there is one,
        else the dense one, with ``x``'s rows padded to their bucket or run in tiles as this
        module is set up (the padding rows are dropped after)."""
        num_rows = x.shape[0]
        if decode_copy is not None and num_rows <= self.decode_copy_rows:
            out = decode_copy.matmul(x)
            return out if bias is None else out.add_(bias)
        if self.row_tile:
            padded = -(-num_rows // self.row_tile) * self.row_tile
        else:
            padded = row_bucket(num_rows) if self.pad_rows else num_rows
        if padded != num_rows:
            x = F.pad(x, (0, 0, 0, padded - num_rows))
        if self.row_tile:
            tiles = x.split(self.row_tile)
            out = torch.cat([_matmul(tile, packed, dense, bias) for tile in tiles])
        elif packed is not None and _in_slow_band(padded, packed.shape):
            slices = x.split(SLICE_ROWS)
            out = torch.cat([_matmul(rows, packed, dense, bias) for rows in slices])
        else:
            out = _matmul(x, packed, dense, bias)
        return out if padded == num_rows else out[:num_rows]


class Linear(nn.Linear, RowShaped):
    """``nn.Linear`` (same parameters, same checkpoint names) that, once ``pack`` has run,
    multiplies by a oneDNN-packed weight, and whose input rows are padded to ``row_bucket``
    while ``pad_rows`` is on (the padding rows are dropped after), or run in tiles of exactly
    ``row_tile`` rows when that is set (batch-invariant mode)."""

    packed_weight: torch.Tensor | None = None  # opaque oneDNN tensor; a plain attribute
    quantized: QuantizedWeight | None = None  # set by ``quantize``; then ``weight`` is None
    decode_copy: DecodeCopy | None = None  # set by ``copy_for_decode``

    @property
    def quantized_weights(self) -> bool:
        return self.quantized is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.matmul(x, self.bias)
        return self.matmul_rows(x, self.packed_weight, self.weight, self.bias, self.decode_copy)

    @torch.no_grad()
    def copy_for_decode(self) -> int:
        if not can_copy_for_decode(self.weight):  # a router kept in float32
            return 0
        self.decode_copy = DecodeCopy.of(self.weight)
        return self.decode_copy.nbytes

    @torch.no_grad()
    def pack(self, keep_dense: bool) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_dense:
            self.drop_dense()

    def drop_dense(self) -> None:
        self.weight = None  # type: ignore[assignment]

    def quantize(self, row_independent: bool) -> Int8Weight:
        """Hold the weight as int8 (``int8_weight.py``) and drop the dense one from this
        module; returns the int8 weight (a tied embedding reads it too)."""
        self.quantized = Int8Weight.quantize(self.weight, row_independent)
        self.drop_dense()
        return self.quantized


def can_copy_for_decode(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.shape[-1] % 2 == 0


def decode_copy_bytes(layers: list[RowShaped]) -> int:
    """What ``copy_for_decode`` would keep for ``layers``: each copyable weight (a
    ``Linear``'s [N, K], the experts' [E, N, K] stacks) with N rounded up to whole blocks of
    ``DECODE_COPY_BLOCK`` output channels."""
    total = 0
    for layer in layers:
        assert isinstance(layer, nn.Module)
        for weight in layer.parameters(recurse=False):
            if weight.dim() >= 2 and can_copy_for_decode(weight):
                *stack, outputs, width = weight.shape
                experts = stack[0] if stack else 1
                blocks = -(-outputs // DECODE_COPY_BLOCK)
                total += experts * blocks * DECODE_COPY_BLOCK * width * weight.element_size()
    return total


def copy_replaces_packed() -> bool:
    """Whether a decode copy takes every step on this CPU, in place of oneDNN's packed
    weight (no AMX: see the module docstring)."""
    return not has_amx()


def decode_copy_max_rows() -> int:
    """The most rows a step multiplies by the decode copies on this CPU."""
    return DECODE_COPY_EVERY_STEP if copy_replaces_packed() else DECODE_COPY_MAX_ROWS


def decode_copy_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``--decode-copy`` cannot apply here, or None when it can."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"it is for bf16 on CPU, and the model runs {dtype} on {device.type}"
    if not all(is_registered(op) for op in _DECODE_COPY_OPS):
        return "the engine's CPU kernels are not loaded (make kernels, or --build-kernels)"
    if not torch.ops.tokenline.bf16_blocks():
        return "this CPU's kernels are not built for AVX512-BF16"
    return None


def prepare_linears(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    batch_invariant: bool = False,
    decode_copy: bool | None = False,
) -> str:
    """Set every ``Linear`` (and every other ``RowShaped`` module: MoE experts) of a loaded
    ``model`` up for ``device`` and ``dtype``: packed and padded where oneDNN runs them, in
    fixed row tiles when ``batch_invariant`` (see the module docstring), with a decode copy
    when ``decode_copy`` (None: where it replaces the packed weight, or else fits
    ``DECODE_COPY_AUTO_SHARE`` of the memory) and this machine can (else it says why and
    goes on without); a quantized one is left to its own kernels. Returns what was done,
    for the start-up log."""
    layers: list[RowShaped] = [
        m for m in model.modules() if isinstance(m, RowShaped) and not m.quantized_weights
    ]
    # Weights some other module holds too (a tied LM head's embedding) stay dense.
    shared = _shared_parameters(model)
    copied, to_pack = "", layers
    if copy_decode_weights(layers, device, dtype, batch_invariant, decode_copy):
        copied, to_pack = _copy_for_decode(layers, shared)
    packed = _pack_or_pad(to_pack, shared, device, dtype) if to_pack else ""
    how = ", ".join(part for part in (packed, copied) if part)
    if not batch_invariant:
        return how
    for layer in layers:
        layer.row_tile = INVARIANT_ROW_TILE
    return f"{how}, {INVARIANT_ROW_TILE}-row tiles (batch-invariant)"


def copy_decode_weights(
    layers: list[RowShaped],
    device: torch.device,
    dtype: torch.dtype,
    batch_invariant: bool,
    decode_copy: bool | None,
) -> bool:
    """Whether ``layers`` get decode copies; logs why not where they were asked for (a
    warning) or chosen against by auto (info, since nothing was asked)."""
    if decode_copy is False or not layers:
        return False
    report = logger.warning if decode_copy else logger.info
    flag = "--decode-copy" if decode_copy else "decode copy (auto)"
    if batch_invariant:
        report("%s: off under --batch-invariant (its row tiles run 16 rows)", flag)
        return False
    if (why := decode_copy_unavailable(device, dtype)) is not None:
        report("%s: off, %s", flag, why)
        return False
    if decode_copy is None and not copy_replaces_packed():
        needed, usable = decode_copy_bytes(layers), usable_memory_bytes()
        if needed > DECODE_COPY_AUTO_SHARE * usable:
            report(
                "%s: off, it would take %.2f GiB, more than %d%% of the %.1f GiB this process "
                "may use (--decode-copy keeps it anyway)",
                flag,
                needed / 2**30,
                round(100 * DECODE_COPY_AUTO_SHARE),
                usable / 2**30,
            )
            return False
    return True


def _copy_for_decode(layers: list[RowShaped], shared: set[int]) -> tuple[str, list[RowShaped]]:
    """Give each of ``layers`` its decode copy. With AMX the copy takes the steps of up to
    ``DECODE_COPY_MAX_ROWS`` rows, beside the packed weight; without, it takes every step
    and each dense weight is freed as soon as its copy is made (unless another module holds
    it), so loading never holds the weights twice over. Returns the start-up log's phrase
    and the layers still to pack (with AMX all of them; without, those left with no copy)."""
    rows, replaces = decode_copy_max_rows(), copy_replaces_packed()
    to_pack: list[RowShaped] = []
    count = size = 0
    for layer in layers:
        kept = layer.copy_for_decode()
        if kept:
            count, size = count + 1, size + kept
            layer.decode_copy_rows = rows
        if not kept or not replaces:
            to_pack.append(layer)
        elif not _holds_shared(layer, shared):
            layer.drop_dense()
    gib = size / 2**30
    if replaces:
        return f"{count} on a decode copy for every step, no packed weight ({gib:.2f} GiB)", to_pack
    return f"{count} with a decode copy for up to {rows} rows ({gib:.2f} GiB more memory)", to_pack


def _shared_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters that a module other than a ``RowShaped`` one holds too (a
    tied LM head's embedding): those stay dense."""
    return {
        id(p)
        for m in model.modules()
        if not isinstance(m, RowShaped)
        for p in m.parameters(recurse=False)
    }


def _holds_shared(layer: RowShaped, shared: set[int]) -> bool:
    assert isinstance(layer, nn.Module)
    return any(id(p) in shared for p in layer.parameters(recurse=False))


def _pack_or_pad(
    layers: list[RowShaped], shared: set[int], device: torch.device, dtype: torch.dtype
) -> str:
    if can_pack(device, dtype):
        for layer in layers:
            layer.pack(keep_dense=_holds_shared(layer, shared))
            layer.pad_rows = True
        return "packed"
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        for layer in layers:
            layer.pad_rows = True
        return "padded"
    return "plain"
