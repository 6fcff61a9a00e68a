"""A weight for ``--quantization w8a8``: int8 with one float32 scale per output channel, as
``int8_weight.py`` quantizes it, packed for the engine's int8 x int8 kernel, which quantizes
each row of activations to int8 (one scale per row, its largest magnitude / 127) and
multiplies by AVX512-VNNI dot products (``ops/csrc/w8a8.cpp``).

Every matmul takes that kernel, at any row count. A prompt chunk or a large batch is bound
by multiplies, which VNNI does twice as many of an instruction in int8 as in bf16; a decode
step of a few rows is bound by the weight's bytes, which the packed layout streams
contiguously (on the Zen 4 EPYC 35-41 GB/s at 1-4 rows, as the weight-only kernel's 31-35).
The sums are exact int32, so a row's result depends on that row alone: these matmuls are
batch-invariant as they stand (``--batch-invariant`` still governs attention and routers).

The packed blocks are the only copy of the weight: the plain [N, K] int8 rows a tied
embedding looks up (``rows``) and a reference dequantises are read back out of them.

``--quantization int8`` runs here too where no AMX does (``activation_parts`` 2): each row
goes in as two int8 rows that keep ~15 bits of it, so the result is the weight-only one.
"""

from __future__ import annotations

import torch

from services.scheduler.model_executor.models.int8.int8_weight import Int8Weight
from services.scheduler.ops.cpu_kernels import is_registered

BLOCK = 64  # output channels a packed block holds
QUAD = 4  # input values a 32-bit lane holds
_FLIP = 0x80  # the packed bytes are q + 128 (q ^ 0x80 as unsigned bytes)
MM_KERNEL = "w8a8_mm"  # torch.ops.tokenline's, from the compiled library


def w8a8_available() -> bool:
    """Whether the loaded kernel library has the w8a8 kernels (built with AVX512-VNNI)."""
    return is_registered(MM_KERNEL) and bool(torch.ops.tokenline.w8a8_built())


class W8A8Weight:
    """``packed`` uint8 [..., ceil(N / 64), K / 4, 64, 4] (``w8a8_pack``'s blocks) and
    ``scales`` float32 [..., N]: the weight is the int8 ``plain()`` times ``scales``.

    ``activation_parts`` 1 (``--quantization w8a8``): each row of activations is quantized
    to int8. 2 (``--quantization int8`` where this kernel runs): each row goes in as two
    int8 rows, itself and its rounding residual, which keep ~15 bits of it: finer than the
    bf16 it arrives in, so the result is the weight-only int8 matmul's within bf16 rounding,
    for twice the multiplies and the same weight bytes."""

    __slots__ = ("activation_parts", "packed", "scales")

    def __init__(
        self, packed: torch.Tensor, scales: torch.Tensor, activation_parts: int = 1
    ) -> None:
        self.packed = packed
        self.scales = scales
        self.activation_parts = activation_parts

    @classmethod
    def pack(cls, weight: Int8Weight, activation_parts: int = 1) -> W8A8Weight:
        """``weight``'s int8 values and scales, packed (a stack of them for experts)."""
        packed: torch.Tensor = torch.ops.tokenline.w8a8_pack(weight.qweight)
        return cls(packed, weight.scales, activation_parts)

    def select(self, index: int) -> W8A8Weight:
        """Weight ``index`` of a stack (one expert's), sharing its storage."""
        return W8A8Weight(self.packed[index], self.scales[index], self.activation_parts)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for rows ``x`` [M, K], each row quantized to int8
        (``activation_parts``), in ``x``'s dtype (the rows go in as bf16)."""
        rows = x.to(torch.bfloat16)
        out: torch.Tensor = torch.ops.tokenline.w8a8_mm(
            rows, self.packed, self.scales, self.activation_parts
        )
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The int8 rows of output channels ``index`` (a tied embedding's lookup)."""
        blocks = self.packed[index // BLOCK, :, index % BLOCK, :]  # [*index, K / 4, 4]
        return (blocks ^ _FLIP).view(torch.int8).reshape(*index.shape, -1)

    def plain(self) -> torch.Tensor:
        """The int8 weight [..., N, K] the blocks hold."""
        *stack, blocks, quads, _, _ = self.packed.shape
        n = self.scales.shape[-1]
        rows = self.packed.transpose(-3, -2).reshape(*stack, blocks * BLOCK, quads * QUAD)
        return (rows[..., :n, :] ^ _FLIP).view(torch.int8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this stands for, in ``dtype`` (computed in float32)."""
        return (self.plain().float() * self.scales[..., None]).to(dtype)


QuantizedWeight = Int8Weight | W8A8Weight
