"""A weight held as int8 with one float32 scale per output channel, and its matmul.

Decode-sized batches (up to ``OWN_KERNEL_MAX_ROWS`` rows, or any with ``row_independent``)
take the engine's own kernel, ``torch.ops.tokenline.int8_rows_mm``
(``ops/csrc/int8_rows.cpp``), wherever the compiled library is loaded: it reads the plain
[N, K] int8 weight with software prefetch and streamed it at about twice the rate of torch's
kernel on the AMX Xeon (model 207), where torch's lost to oneDNN's bf16 matmul on the LM
head. It takes float32 rows as they are, any K, and is batch-invariant as torch's is.

Where oneDNN's tile kernels run (AMX), bf16 batches of more than 8 rows take its tile path:
each block of output channels is widened to bf16 once and multiplied on the tiles, which
beat dequantising the whole weight for the dense GEMM (``tiles_available``; at any row count
for large weights, prefill included, up to ``TILES_MAX_ROWS`` for small ones). That path is
not row-independent, so batch-invariant weights keep the row loop.

Where AVX512-BF16 runs without AMX, a bf16 model's int8 weights are not held here at all:
they are packed for the w8a8 kernel, which takes each row in two int8 parts
(``quantization.int8_takes_vnni_kernel``, ``w8a8_weight.py``).

Without the library, the multiply is torch's own weight-only int8 kernel,
``aten._weight_int8pack_mm(x, w_int8 [N, K], scales [N])`` (gpt-fast's), with three things
measured or read in its source (torch 2.13, ``aten/src/ATen/native/cpu/int8mm_kernel.cpp``)
deciding how it is called:

* **bf16 activations.** On x86 the kernel is vectorised (AVX2, AVX512) for bf16 inputs
  only; float32 and float16 take a scalar loop, 5-60x slower than float32 oneDNN on the
  AVX2 EPYC. So rows are rounded to bf16 on the way in (relative error 2^-9, a tenth of
  the int8 weight's own ~1 % RMS) and the kernel sums them in float32. The scales it is
  given are ones: the float32 scales multiply its bf16 output after, so no channel's gain
  is rounded to bf16.
* **Few rows.** It computes 4x4 output blocks and streams the weight once per 4 rows: at
  one row it reads a quarter of float32's bytes, which is what decode waits on, but past
  ``KERNEL_MAX_ROWS`` rows (prefill chunks, large batches) a GEMM on a dequantised copy is
  faster. That copy is made a block of output channels at a time so it stays in cache: in
  float32 for float32 rows (MKL keeps nothing per shape; oneDNN would: ``linear.py``), in
  the rows' bf16 or float16 otherwise (exact: int8 values fit either), which oneDNN
  multiplies with AMX or AVX-512 BF16 where the CPU has them.
* **No tail in K.** It reads K in steps of 16 values (8 with AVX2) with aligned loads and
  no remainder loop (a K of 12 crashes the process), so ``can_quantize`` refuses other
  widths and rows reach it in freshly aligned memory.

Each output element is one float32 dot product summed in the same order whatever the row
count (rows only share weight loads), so with ``row_independent`` every matmul takes the
kernel at any row count: a row's result does not depend on its batch (``--batch-invariant``,
checked by ``tests/.../test_quantization.py``).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from services.scheduler.ops.cpu_kernels import is_registered

KERNEL_MAX_ROWS = 8  # above this many rows, dequantise and use the dense GEMM (measured)
# The same for the engine's kernel: at 16 rows it still took 0.72-0.90 of the dense bf16
# path's time on the 0.5B shape's projections and head, at 32 1.15-1.20 (Xeon model 207).
OWN_KERNEL_MAX_ROWS = 16
# The tile path (AMX) packs x and writes the transposed output per call, work that grows
# with the rows but not with the weight: a weight of this many elements or more beat the
# dense path at every row count measured (the 0.5B shape's gate-up, down and LM head, up to
# 1,024 rows), smaller ones (qkv, o, MoE experts of ~1 M) only up to TILES_MAX_ROWS (at 64
# rows level, at 256 1.5-2.1x slower).
TILES_ANY_ROWS_FROM = 1 << 22
TILES_MAX_ROWS = 32
K_MULTIPLE = 16  # input widths the kernel takes: it has no loop for a remainder
INT8_MAX = 127  # symmetric: -127..127, so a weight and its negation round alike
_DEQUANT_BLOCK = 1 << 20  # weight elements dequantised at a time (4 MiB of float32)
_QUANTIZE_ROWS = 4096  # rows quantised at a time: bounds the float32 scratch at load
_ALIGN = 64  # bytes; the kernel's aligned loads need 32 (AVX512) of a row's start
ROWS_KERNEL = "int8_rows_mm"  # torch.ops.tokenline's, from the compiled library


@functools.cache
def tiles_available() -> bool:
    """Whether the engine's kernel multiplies many bf16 rows on oneDNN's tile kernels (AMX)
    here: a property of the CPU and the loaded library, asked once."""
    return bool(torch.ops.tokenline.int8_tiles())


def can_quantize(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this [..., N, K] weight (K a multiple of ``K_MULTIPLE``)."""
    return weight.shape[-1] % K_MULTIPLE == 0


class Int8Weight:
    """``qweight`` int8 [..., N, K] and ``scales`` float32 [..., N]: the weight is
    ``qweight * scales[..., None]`` (a stack of them for experts: ``select``)."""

    __slots__ = ("_ones", "kernel", "qweight", "row_independent", "scales")

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        row_independent: bool = False,
        kernel: bool | None = None,
    ) -> None:
        self.qweight = qweight
        self.scales = scales
        self.row_independent = row_independent  # every row count takes the kernel
        # The engine's kernel rather than torch's (default: whenever its library is loaded).
        self.kernel = is_registered(ROWS_KERNEL) if kernel is None else kernel
        self._ones = torch.ones(scales.shape[-1], dtype=torch.bfloat16, device=scales.device)

    @classmethod
    @torch.no_grad()
    def quantize(
        cls, weight: torch.Tensor, row_independent: bool = False, kernel: bool | None = None
    ) -> Int8Weight:
        """Symmetric per-output-channel int8 of ``weight`` [..., N, K]: each row's scale is
        its largest magnitude / 127, values round to the nearest step."""
        rows = weight.detach().reshape(-1, weight.shape[-1])
        qweight = torch.empty(rows.shape, dtype=torch.int8, device=weight.device)
        scales = torch.empty(rows.shape[0], dtype=torch.float32, device=weight.device)
        for start in range(0, rows.shape[0], _QUANTIZE_ROWS):
            block = rows[start : start + _QUANTIZE_ROWS].float()
            scale = block.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
            scale /= INT8_MAX
            quantized = torch.round(block / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)
            qweight[start : start + _QUANTIZE_ROWS] = quantized.to(torch.int8)
            scales[start : start + len(block)] = scale
        shape = weight.shape
        return cls(qweight.reshape(shape), scales.reshape(shape[:-1]), row_independent, kernel)

    def select(self, index: int) -> Int8Weight:
        """Weight ``index`` of a stack (one expert's), sharing its storage."""
        return Int8Weight(
            self.qweight[index], self.scales[index], self.row_independent, self.kernel
        )

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The int8 rows of output channels ``index`` (a tied embedding's lookup)."""
        return self.qweight[index]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this stands for, in ``dtype`` (computed in float32)."""
        return (self.qweight.float() * self.scales[..., None]).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for rows ``x`` [M, K], in ``x``'s dtype."""
        few = self.row_independent or x.shape[0] <= self.kernel_max_rows(x)
        out = self._kernel(x) if few else self._dense(x)
        return out if bias is None else out + bias

    def kernel_max_rows(self, x: torch.Tensor) -> int:
        """The most rows of ``x`` a call multiplies by a kernel rather than densely."""
        if not self.kernel:
            return KERNEL_MAX_ROWS
        if x.dtype == torch.bfloat16 and tiles_available():
            if self.qweight.numel() >= TILES_ANY_ROWS_FROM:
                return sys.maxsize  # the tile path beats dequantising at every row count
            return TILES_MAX_ROWS
        return OWN_KERNEL_MAX_ROWS

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            out: torch.Tensor = torch.ops.tokenline.int8_rows_mm(
                x, self.qweight, self.scales, self.row_independent
            )
            return out
        rows = x.to(torch.bfloat16).contiguous()
        if rows.data_ptr() % _ALIGN:  # a view that starts mid-allocation
            rows = rows.clone()
        raw = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self._ones)
        return (raw * self.scales).to(x.dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
        rows = x.to(dtype)
        step = max(1, _DEQUANT_BLOCK // self.qweight.shape[-1])
        parts = [F.linear(rows, block.to(dtype)) for block in self.qweight.split(step)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        # In place: the product is computed in float32 and rounded once, as out-of-place, but
        # without a float32 copy of the output (a 1,024-row chunk's matmuls 341 -> 303 ms).
        return out.mul_(self.scales).to(x.dtype)
